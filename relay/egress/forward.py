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

from relay.egress.answers import discard_pending, refuse, reply_begins, response, unanswered
from relay.egress.http_head import HEAD_TIMEOUT, MAX_HEAD, Body, Request, RequestError
from relay.egress.redact import Redactor
from relay.model.allow_rules import fmt_hostport
from relay.policy.egress import Decision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from relay.egress.decision_log import DecisionLog

BODY_TIMEOUT = 60.0  # a request body may pause this long between reads
CONNECT_TIMEOUT = 15.0
CHUNK = 1 << 20
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


def forward(log: DecisionLog, client: socket.socket, upstream: socket.socket, req: Request, body: Body,
            first: bytes, relay: Callable[[socket.socket, socket.socket], int] | None = None) -> int:
    """Send the one request upstream (its body re-framed as it arrives), then relay the response and
    close. Whatever the client sent after the body (a pipelined request) is never forwarded: the
    upstream gets exactly one request, and a pipelining client retries the rest after our close."""
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


def relay_response(upstream: socket.socket, client: socket.socket, redact: Redactor | None = None) -> int:
    """Relay one response from a TLS upstream (splice cannot see through TLS): its head read boundedly
    and sent with `Connection: close` (one request per connection), interim 1xx heads passed on, then
    the body as it arrives, in small reads, so an SSE stream flows. Redirects are the client's to
    follow, through the proxy, without the key. Every byte passes `redact` (the key scrubbed) first.
    Returns the status (0: no valid answer, 502 sent; an upstream that reset or stalled before its head
    gets the client a 502 or 504 too, never an empty reply)."""
    buf, status, headed = b"", 0, False
    red = redact or Redactor(())
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
            red.full = not 200 <= status < 300  # a 2xx body: the ends of each spelling only (see Redactor)
            headed = True
            client.sendall(red.scrub(b"\r\n".join([lines[0], *kept, b"Connection: close", b"", b""]), full=True)
                           + red.feed(buf))
            break
        else:
            refuse(client, response("502 Bad Gateway", "-", 0, "too many interim responses", ""))
            return 0
        upstream.settimeout(None)
        while True:
            data = upstream.recv(65536)
            if not data:
                break
            data = red.feed(data)
            if data:
                client.sendall(data)
        client.sendall(red.flush())
    except OSError as err:
        if not headed:
            timed_out = isinstance(err, TimeoutError)
            reason = (f"the upstream sent no response head within {HEAD_TIMEOUT:g} s" if timed_out
                      else f"the upstream failed before answering: {err.strerror or type(err).__name__}")
            try:
                refuse(client, response("504 Gateway Timeout" if timed_out else "502 Bad Gateway", "-", 0, reason, ""))
            except OSError:
                pass
            return 0
    try:
        client.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    return status
