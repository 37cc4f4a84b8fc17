"""Carrying an allowed request to its upstream: connect, then splice a CONNECT tunnel, or send one
absolute-URI request and relay its answer.

The I/O of an allowed connection only: what is allowed was decided before any of this runs (the
rule book), and what a credential route adds is relay/egress/routes.py's. Bytes are spliced in the
kernel where they can be (a tunnel, a plain-HTTP answer), so SSE and websockets flow as produced;
a TLS upstream's answer is read and relayed in small pieces (`relay_response`), through a redactor.
No state of its own: every function works on the sockets it is given.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable

from relay.egress.answers import discard_pending, policy, refuse, reply_begins, response, unanswered
from relay.egress.http_head import HEAD_TIMEOUT, MAX_HEAD, Body, Request, RequestError, parse_head
from relay.egress.redact import Redactor
from relay.egress.secret_scan import (
    DECODABLE,
    FramingError,
    HostSecrets,
    Inflate,
    RequestScan,
    SecretFound,
    Unchunk,
    Unscannable,
    codings,
)
from relay.model.allow_rules import fmt_hostport
from relay.policy.egress import Decision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from relay.egress.decision_log import DecisionLog

BODY_TIMEOUT = 60.0  # a request body may pause this long between reads
CONNECT_TIMEOUT = 15.0
CHUNK = 1 << 20
READ_BATCH = 1 << 18  # a TLS upstream's read: every record that has arrived, up to this (relay/egress/tls_stream.py)
F_SETPIPE_SZ = 1031


def connect(decision: Decision) -> tuple[socket.socket | None, str, str]:
        """(the upstream socket, "", "") or (None, short cause, reason): every address tried in turn."""
        cause, detail = "no address", f"{decision.host} has no address to connect to"
        for addr, port in decision.addrs:
            try:
                sock = socket.create_connection((addr, port), timeout=CONNECT_TIMEOUT)
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock, "", ""
            except OSError as err:
                cause = _cause(err)
                where = fmt_hostport(addr, port)
                detail = {"refused": f"upstream refused the connection ({where})",
                          "timed out": f"upstream timed out after {CONNECT_TIMEOUT:g} s ({where})",
                          "no route": f"no route to the upstream ({where})"}.get(
                    cause, f"upstream connect failed ({where}): {err.strerror or err}")
        return None, cause, detail


def _cause(err: OSError) -> str:
    if isinstance(err, TimeoutError) or err.errno == errno.ETIMEDOUT:
        return "timed out"
    if err.errno == errno.ECONNREFUSED:
        return "refused"
    if err.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN, errno.EADDRNOTAVAIL):
        return "no route"
    return "failed"


def pump(src: socket.socket, dst: socket.socket, close: bool = True) -> tuple[int, OSError | None]:
    """Copy src → dst until EOF, then half-close dst (unless `close` is False); splice keeps the bytes
    out of Python. Returns the bytes copied and the error that ended the copy (None: a clean EOF), so
    that a forward whose upstream said nothing can still be answered (a 502, not an empty reply)."""
    copied, failure = 0, None
    try:
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, CHUNK)
        except OSError:
            pass
    except OSError:
        r = w = -1
    try:
        if r >= 0 and hasattr(os, "splice"):
            sfd, dfd = src.fileno(), dst.fileno()
            while True:
                n = os.splice(sfd, w, CHUNK)
                if n == 0:
                    break
                copied += n
                while n:
                    n -= os.splice(r, dfd, n)
        else:  # pragma: no cover - every supported Linux has splice
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                copied += n
                dst.sendall(view[:n])
    except OSError as err:
        failure = err
    finally:
        if r >= 0:
            os.close(r)
            os.close(w)
        if close:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
    return copied, failure


def splice(client: socket.socket, upstream: socket.socket) -> None:
    """A CONNECT tunnel, both ways at once, until both ends closed (the caller closes the sockets)."""
    back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    back.start()
    pump(client, upstream)
    back.join()


MAX_HELD = 8 << 20  # a compressed request body is held (and its decoded stream scanned) up to this before it goes on
HELD_BUDGET = 32 << 20  # all compressed bodies held at once, across the proxy's connections
_held = [0]
_held_lock = threading.Lock()


class ScannedBody:
    """A request body on its way upstream through the secret scan (relay/egress/secret_scan.py): the
    payload searched as the upstream will read it, and only what is cleared sent on. Identity bodies
    stream, all but a tail that could begin a secret (a Content-Length body keeps its length; a chunked
    one is re-chunked as it clears). A compressed body cannot be cut at a decoded offset, so it is held
    whole (up to MAX_HELD, and HELD_BUDGET across all connections) while its decoded stream is
    searched, and sent once it ended clean."""

    def __init__(self, scan: RequestScan, req: Request, body: Body) -> None:
        self.scan, self.body = scan, body
        self.chunked = req.framing == "chunked"
        self.held: list[bytes] = []
        self.size = 0  # held bytes counted in the budget

    def release(self) -> None:
        """Give the held bytes back to the budget (sent on, refused, or the request ended otherwise:
        also when the object goes, so no early return of a caller can leak the budget)."""
        if self.size:
            with _held_lock:
                _held[0] -= self.size
        self.held, self.size = [], 0

    __del__ = release

    def out(self, wire: bytes) -> bytes:
        try:
            return self._out(wire)
        except FramingError as err:  # a corrupt gzip body: refused, never passed unread
            raise Unscannable(f"the request body cannot be decoded to scan it for host secrets: {err}",
                              "send a well-formed body", "400 Bad Request") from None

    def _out(self, wire: bytes) -> bytes:
        payload = self.body.take()
        if self.scan.inflate is not None:
            self.scan.body(payload)
            with _held_lock:
                over = self.size + len(wire) > MAX_HELD or _held[0] + len(wire) > HELD_BUDGET
                if not over:
                    _held[0] += len(wire)
            if over:
                self.release()
                raise Unscannable(f"a compressed request body over {MAX_HELD >> 20} MiB (or over {HELD_BUDGET >> 20} MiB "
                                  "held across connections) cannot be scanned for host secrets", "send it uncompressed",
                                  "413 Content Too Large")
            self.held.append(wire)
            self.size += len(wire)
            if not self.body.done:
                return b""
            out = b"".join(self.held)
            self.release()
            return out
        cleared = self.scan.body(payload)
        if self.body.done:
            cleared += self.scan.end()
        if not self.chunked:
            return cleared
        return (b"%x\r\n%s\r\n" % (len(cleared), cleared) if cleared else b"") + (b"0\r\n\r\n" if self.body.done else b"")


def request_scan(secrets: HostSecrets | None, req: Request, said: bytes, body: Body,
                 first: bytes) -> tuple[ScannedBody | None, bytes]:
    """The scan of one request the box sent (None: no host secret to look for), and what of the body's
    first bytes may go on. Its head (`said`: the request line and headers as the box sent them, before
    any placeholder is swapped) and what came of the body with it are searched at once, before the
    upstream is connected or a key read: SecretFound, or Unscannable for a body in an encoding the
    proxy cannot decode."""
    if not secrets:
        return None, first
    coded = [c for line in said.decode("latin-1").split("\r\n")[1:]
             if line.partition(":")[0].strip().lower() == "content-encoding" for c in codings(line.partition(":")[2])]
    try:
        scan = RequestScan(secrets, coded if req.framing != "none" else ())
    except FramingError as err:
        raise Unscannable(f"a request body in an encoding the proxy cannot scan for host secrets: {err}",
                          "send it uncompressed, or gzip/deflate", "415 Unsupported Media Type") from None
    scan.head(said)
    scanned = ScannedBody(scan, req, body)
    return scanned, scanned.out(first)


def refuse_scanned(log: DecisionLog, client: socket.socket, req: Request, host: str, port: int,
                   err: SecretFound | Unscannable, extra: dict[str, object] | None = None) -> int:
    """The one answer to a request the secret scan stopped: a decision line naming the secret (never
    its value), and the agent told why in one line."""
    if isinstance(err, SecretFound):
        reason = f"the request carries a secret of the host ({err.name})"
        status, label = "403 Forbidden", "secret"
        fix = ("the box holds a placeholder for it: send that, and the proxy adds the real value on its pinned "
               "upstream only; a live `allow` does not lift this")
    else:
        reason, status, fix, label = err.reason, err.status, f"to send it: {err.fix}", "unscannable"
    log.record(Decision(False, host, port, reason, label=label), req.method, {**(extra or {}), "secret_scan": True})
    refuse(client, policy(status, host, port, reason, "secret-scan", fix))
    return int(status.split(" ", 1)[0])


def scanned_splice(log: DecisionLog, client: socket.socket, upstream: socket.socket, secrets: HostSecrets,
                   host: str, port: int, first: bytes, notify: Callable[[str], None] | None = None) -> None:
    """A CONNECT tunnel that carries plain HTTP (Node's fetch tunnels http:// so, relay/box/nodeproxy.py):
    the answers spliced as in `splice`, the box's requests read one by one, each head and body through
    the secret scan as on an absolute-URI request, then sent on (the head as the box sent it, the body
    re-framed as `ScannedBody` clears it). After a request that asks for an Upgrade, the rest is searched
    as one stream. A secret, or HTTP the strict parser refuses, ends the tunnel: the upstream is reset,
    the box told why (a 403 where it waits for an answer) and the decision logged."""
    refusing = threading.Event()

    def answers() -> None:  # the upstream's answers, as `splice` passes them; the client's close is ours to send
        pump(upstream, client, close=False)
        if not refusing.is_set():  # the upstream is done: so is the tunnel, as with `splice`
            try:
                client.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    back = threading.Thread(target=answers, daemon=True)
    back.start()
    buf, raw = first, None
    try:
        while True:
            if raw is not None:
                data = buf or client.recv(65536)
                buf = b""
                if not data:
                    upstream.sendall(raw.end())
                    break
                upstream.sendall(raw.body(data))
                continue
            while b"\r\n\r\n" not in buf:
                if len(buf) > MAX_HEAD:
                    raise RequestError("a request head over 32 KiB in the tunnel", host, port)
                data = client.recv(65536)
                if not data:
                    if buf:
                        raise RequestError("the tunnel closed inside a request head", host, port)
                    return
                buf += data
            head, _, rest = buf.partition(b"\r\n\r\n")
            req = parse_head(head)
            if not req.origin:
                raise RequestError("a request in a tunnel names its target as a path", host, port)
            req = Request(req.method, host, port, b"", req.framing, req.length, req.expect_continue, True, req.path,
                          req.version, req.kept)
            body = Body(req)
            scanned, out = request_scan(secrets, req, head, body, body.feed(rest))
            upstream.sendall(head + b"\r\n\r\n" + out)
            while not body.done:
                data = client.recv(body.want())
                if not data:
                    raise RequestError("the tunnel closed inside a request body", host, port)
                out = body.feed(data)
                upstream.sendall(scanned.out(out) if scanned is not None else out)
            buf, body.extra = body.extra, b""
            if any(k.partition(":")[0].strip().lower() == "upgrade" for k in req.kept) or \
                    b"\r\nupgrade:" in head.lower():
                raw = RequestScan(secrets)  # a websocket's frames: searched as one stream from here on
    except (SecretFound, Unscannable, RequestError) as err:
        refusing.set()
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        try:
            upstream.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        back.join(5)
        stop = Request("CONNECT", host, port, b"")
        if isinstance(err, RequestError):
            err = Unscannable(f"the tunnel's plain HTTP cannot be read to scan it: {err}", "send one well-formed "
                              "request at a time", "400 Bad Request")
        if notify is not None:
            notify(f"hive-relay: refused {fmt_hostport(host, port)}: "
                   f"{err.reason if isinstance(err, Unscannable) else 'a request carried a secret of the host'}")
        try:
            refuse_scanned(log, client, stop, host, port, err, {"tunnel": True})
        except OSError:
            pass
        return
    except OSError:
        pass
    finally:
        try:
            upstream.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    back.join()


def forward(log: DecisionLog, client: socket.socket, upstream: socket.socket, req: Request, body: Body,
            first: bytes, relay: Callable[[socket.socket, socket.socket], int] | None = None,
            scanned: ScannedBody | None = None) -> int:
    """Send the one request upstream (its body re-framed as it arrives), then relay the response and
    close. Whatever the client sent after the body (a pipelined request) is never forwarded: the
    upstream gets exactly one request, and a pipelining client retries the rest after our close.
    With `scanned` (`request_scan`, which already cleared `first`), the rest of the body passes the
    secret scan: a host secret in it stops the request (the upstream reset, so it never sees a
    complete request; the box told why)."""
    assert req.head is not None
    reply_begins()  # from here on the answer is the upstream's (or a 400/502 sent below)
    try:
        upstream.sendall(req.head + first)
    except OSError:
        body.done = True  # the upstream stopped listening: relay whatever it answered
    if req.expect_continue and not body.done:
        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    client.settimeout(BODY_TIMEOUT)
    while not body.done:
        try:
            data = client.recv(body.want())
            if not data:
                raise RequestError("the connection closed before the request body ended", req.host, req.port)
            out = body.feed(data)
            if scanned is not None:
                out = scanned.out(out)
        except (SecretFound, Unscannable) as err:
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return refuse_scanned(log, client, req, req.host, req.port, err)
        except (RequestError, TimeoutError) as err:
            # Abort upstream with a reset: it never sees a complete request.
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            reason = str(err) if isinstance(err, RequestError) else "request body stalled"
            log.record(Decision(False, req.host, req.port, f"bad request: {reason}"), req.method)
            refuse(client, response("400 Bad Request", req.host, req.port, reason,
                                    "Send a well-framed body (Content-Length or chunked)."))
            return 400
        try:
            upstream.sendall(out)
        except OSError:
            break
    if body.extra:
        log.record(Decision(False, req.host, req.port, "a pipelined request after the first was dropped "
                            "(one request per connection)"), req.method)
    client.settimeout(None)
    status = 0
    if relay is None:
        copied, failure = pump(upstream, client, close=False)
        if copied == 0:  # the upstream said nothing: the client hears why, not an empty reply
            unanswered(log, client, req.host, req.port, req.method,
                       "the upstream reset the connection before answering" if failure is not None
                       else "the upstream closed the connection without answering")
            return 502
        try:
            client.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    else:
        status = relay(upstream, client)
    discard_pending(client)
    return status


_RESPONSE_DROPPED = frozenset({b"connection", b"keep-alive", b"proxy-connection"})
_REFRAMED = frozenset({b"content-length", b"transfer-encoding", b"content-encoding", b"trailer"})


class _Answer:
    """How a response body is read and how it is passed on, from its head: the redactor must see the
    body as the box will read it (a key in 7-byte chunks, or gzipped, is whole only there).

    - Content-Length, no encoding (what a route asks for, `Accept-Encoding: identity`): scrubbed in
      place, same length, forwarded with its own Content-Length. The common case stays the cheapest.
    - chunked, or a Content-Encoding (gzip, deflate) the upstream sent anyway: de-chunked and decoded,
      scrubbed, and forwarded as identity, chunk by chunk as it arrives (`Transfer-Encoding: chunked`;
      close-delimited to an HTTP/1.0 client), with Content-Encoding and Content-Length dropped. Not
      re-encoded: a scrubbed gzip stream would have to be compressed again, for nothing the box asked
      for (identity is always acceptable), and chunked keeps SSE flowing event by event.
    - close-delimited: scrubbed as it flows. No body (HEAD, 1xx, 204, 304): nothing to read.
    - any other encoding (br, zstd: no decoder in the standard library) or transfer coding: refused,
      502, before a byte of the body is passed."""

    def __init__(self, lines: list[bytes], status: int, method: str, version: str) -> None:
        fields = [(ln.partition(b":")[0].strip().lower(), ln.partition(b":")[2].strip()) for ln in lines]
        te = [c.strip().lower() for n, v in fields if n == b"transfer-encoding" for c in v.split(b",") if c.strip()]
        ce = [c for n, v in fields if n == b"content-encoding" for c in codings(v.decode("latin-1"))]
        lengths = [v for n, v in fields if n == b"content-length"]
        self.problem = ""
        self.inflate = None
        self.unchunk = None
        self.left = -1  # bytes of a Content-Length body still to come; -1: read to EOF
        self.none = method == "HEAD" or status in (204, 304) or 100 <= status < 200 and status != 101
        if te and te != [b"chunked"]:
            self.problem = f"the upstream's answer has a transfer coding the proxy cannot read ({b', '.join(te).decode('latin-1')})"
        elif ce and not set(ce) <= DECODABLE:
            self.problem = (f"the upstream answered in an encoding the proxy cannot decode to scrub it ({', '.join(ce)}), "
                            "though asked for identity")
        self.reframe = not self.none and (bool(te) or bool(ce))
        if self.none or self.problem:
            self.reframe = False
            return
        if te:
            self.unchunk = Unchunk()
        elif lengths and lengths[0].isdigit():
            self.left = int(lengths[0])
        if ce:
            self.inflate = Inflate(ce)
        self.chunked_out = self.reframe and version == "HTTP/1.1"

    def head_lines(self, kept: list[bytes]) -> list[bytes]:
        if not self.reframe:
            return kept
        out = [ln for ln in kept if ln.partition(b":")[0].strip().lower() not in _REFRAMED]
        return out + ([b"Transfer-Encoding: chunked"] if self.chunked_out else [])

    def decode(self, data: bytes) -> list[bytes]:
        """The payload in `data` (wire bytes), decoded."""
        if self.left >= 0:
            data = data[:self.left]
            self.left -= len(data)
        if self.unchunk is not None:
            data = self.unchunk.feed(data)
        if self.inflate is not None:
            return list(self.inflate.pieces(data))
        return [data]

    @property
    def ended(self) -> bool:
        return self.none or self.left == 0 or (self.unchunk is not None and self.unchunk.done)

    def frame(self, data: bytes) -> bytes:
        if not data or not self.reframe or not self.chunked_out:
            return data
        return b"%x\r\n%s\r\n" % (len(data), data)

    def last(self) -> bytes:
        return b"0\r\n\r\n" if self.reframe and self.chunked_out else b""


def relay_response(upstream: socket.socket, client: socket.socket, redact: Redactor | None = None,
                   method: str = "GET", version: str = "HTTP/1.1") -> int:
    """Relay one response from a TLS upstream (splice cannot see through TLS): its head read boundedly
    and sent with `Connection: close` (one request per connection), interim 1xx heads passed on, then
    the body as it arrives, in small reads, so an SSE stream flows. Redirects are the client's to
    follow, through the proxy, without the key. The body passes `redact` (the key scrubbed) decoded,
    as the box will read it (`_Answer`: chunks and gzip undone, then re-framed). Returns the status
    (0: no valid answer, 502 sent; an upstream that reset or stalled before its head gets the client a
    502 or 504 too, never an empty reply)."""
    buf, status, headed = b"", 0, False
    red = redact or Redactor(())
    answer: _Answer | None = None
    try:
        upstream.settimeout(HEAD_TIMEOUT)
        for _ in range(8):
            while b"\r\n\r\n" not in buf and len(buf) <= MAX_HEAD:
                data = upstream.recv(65536)
                if not data:
                    break
                buf += data
            head, sep, buf = buf.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            parts = lines[0].split(b" ", 2)
            if (not sep or len(head) > MAX_HEAD or len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0")
                    or not (parts[1].isdigit() and len(parts[1]) == 3)):
                refuse(client, response("502 Bad Gateway", "-", 0, "the upstream sent no valid response head", ""))
                return 0
            status = int(parts[1])
            if 100 <= status < 200 and status != 101:
                client.sendall(red.scrub(head + b"\r\n\r\n", full=True))
                continue
            listed = {t.strip().lower() for line in lines[1:] if line.partition(b":")[0].strip().lower() == b"connection"
                      for t in line.partition(b":")[2].split(b",")}
            kept = [line for line in lines[1:]
                    if line.partition(b":")[0].strip().lower() not in _RESPONSE_DROPPED | listed]
            answer = _Answer(kept, status, method, version)
            if answer.problem:
                refuse(client, response("502 Bad Gateway", "-", 0, answer.problem,
                                        "The route asks for identity; an upstream that compresses anyway is not carried."))
                return 0
            red.full = not 200 <= status < 300  # a 2xx body: the ends and middle pieces (see Redactor)
            headed = True
            client.sendall(red.scrub(b"\r\n".join([lines[0], *answer.head_lines(kept), b"Connection: close", b"", b""]),
                                     full=True))
            client.sendall(_pass(answer, red, buf))
            break
        else:
            refuse(client, response("502 Bad Gateway", "-", 0, "too many interim responses", ""))
            return 0
        upstream.settimeout(None)
        while not answer.ended:
            data = upstream.recv(READ_BATCH)
            if not data:
                break
            data = _pass(answer, red, data)
            if data:
                client.sendall(data)
        client.sendall(answer.frame(red.flush()) + (answer.last() if answer.ended else b""))
    except (OSError, FramingError) as err:
        if not headed:
            timed_out = isinstance(err, TimeoutError)
            reason = (f"the upstream sent no response head within {HEAD_TIMEOUT:g} s" if timed_out
                      else f"the upstream failed before answering: {getattr(err, 'strerror', None) or type(err).__name__}")
            try:
                refuse(client, response("504 Gateway Timeout" if timed_out else "502 Bad Gateway", "-", 0, reason, ""))
            except OSError:
                pass
            return 0
        # A body whose framing or encoding broke mid-way is cut there (the box sees it short), never passed unread.
    try:
        client.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    return status


def _pass(answer: _Answer, red: Redactor, data: bytes) -> bytes:
    """Wire bytes of the body in, what the box gets out: decoded, scrubbed, re-framed."""
    if answer.none:
        return b""
    if not answer.reframe:
        if answer.left >= 0:
            data = data[:answer.left]
            answer.left -= len(data)
        return red.feed(data)
    return b"".join(answer.frame(red.feed(piece)) for piece in answer.decode(data))
