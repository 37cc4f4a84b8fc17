"""TLS inspection of a CONNECT to an inspected host: the tunnel's TLS terminated on the host with the
run CA's leaf for that name (relay/host/run_ca.py), the upstream's TLS verified against the system
store as for a credential route, and the stream between them handled as HTTP/1.1, request by request.

Why: a CLI that takes no base URL sends its key, and everything else, inside TLS the proxy cannot
read. For the hosts the user names (relay/policy/inspection.py) the proxy reads it, and so:
- the Host header of every request must be the SNI and the CONNECT name (`host-mismatch`: 421, the
  connection closed), and the SNI must be the CONNECT name (the handshake is refused otherwise): one
  connection, one origin, no domain fronting;
- the rule's methods and paths apply to each request (and a route's, when one holds the host);
- each request passes the outbound secret scan (relay/egress/secret_scan.py) as the box sent it;
- on a host a credential route of this run holds, its credential headers are replaced by the real
  key (as relay/egress/routes.py does) and the answer is scrubbed of it; on any other host nothing
  is added, so a placeholder sent there stays a placeholder;
- HTTP/1.1 only: ALPN offers `http/1.1` alone (an h2-only client gets no ALPN and is refused with a
  logged reason on its preface); an Upgrade (websockets) is refused (501), never passed unread;
- keep-alive, chunked bodies both ways and SSE (answers relayed as they arrive) work; a
  close-delimited answer ends the connection after it.
A client that does not trust the run CA fails its handshake, logged; nothing falls back to a tunnel.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable, Mapping

from relay.egress.answers import policy, refuse, reply_begins, response
from relay.egress.forward import BODY_TIMEOUT, refuse_scanned, request_scan
from relay.egress.http_head import HEAD_TIMEOUT, MAX_HEAD, Body, RequestError, parse_head
from relay.egress.redact import Redactor
from relay.egress.secret_scan import FramingError, HostSecrets, SecretFound, Unchunk, Unscannable
from relay.egress.tls_stream import BATCH, TlsStream
from relay.model import http_rules
from relay.model import refusal as denial
from relay.model.allow_rules import HostRule, fmt_hostport
from relay.model.hostname import HostError, canonical_host
from relay.policy import egress
from relay.policy.egress import Decision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from relay.egress.decision_log import DecisionLog
    from relay.egress.routes import Routes

IDLE_TIMEOUT = 120.0  # a kept-alive connection may wait this long for its next request
ANSWER_TIMEOUT = 300.0  # an upstream may think this long before its answer's head (a long model turn)
HANDSHAKE_TIMEOUT = 10.0
H2_PREFACE = b"PRI * HTTP/2.0"


class Inspector:
    """One proxy's inspected hosts: a server context per (host, port) with its leaf, offering only
    http/1.1, refusing a ClientHello whose SNI is not the host."""

    def __init__(self, leaves: Mapping[tuple[str, int], tuple[str, str]]) -> None:
        self.contexts: dict[tuple[str, int], ssl.SSLContext] = {}
        for (host, port), (cert, key) in leaves.items():
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(cert, key)
            ctx.set_alpn_protocols(["http/1.1"])
            ctx.sni_callback = _sni_check(host)
            self.contexts[(host, port)] = ctx

    def __contains__(self, target: tuple[str, int]) -> bool:
        return target in self.contexts

    def __bool__(self) -> bool:
        return bool(self.contexts)


def _sni_check(host: str) -> Callable[[ssl.SSLObject, str | None, ssl.SSLContext], int | None]:
    def check(sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> int | None:
        try:
            seen = canonical_host(name) if name else None
        except HostError:
            seen = None
        sock.hive_sni = name or "-"  # type: ignore[attr-defined]
        return None if seen == host else ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME

    return check


def _host_header(head: bytes) -> list[str]:
    return [line.partition(b":")[2].strip().decode("latin-1") for line in head.split(b"\r\n")[1:]
            if line.partition(b":")[0].strip().lower() == b"host"]


def _tokens(head: bytes, field: bytes) -> set[bytes]:
    return {t.strip().lower() for line in head.split(b"\r\n")[1:] if line.partition(b":")[0].strip().lower() == field
            for t in line.partition(b":")[2].split(b",")}


def host_problem(values: list[str], host: str, port: int) -> str:
    """Why a request's Host header does not name the connection's origin ("" when it does)."""
    if len(values) != 1:
        return "the request has no Host header" if not values else "the request has more than one Host header"
    value = values[0]
    name, _, given = value.partition(":")
    if value.startswith("[") or ":" in given or (given and not given.isdigit()):
        return f"the Host header {value[:80]!r} is not {fmt_hostport(host, port)}"
    try:
        seen = canonical_host(name)
    except HostError:
        return f"the Host header {value[:80]!r} is not a host name"
    if seen != host or (given and given != str(port)) or (not given and port != 443):
        return (f"the Host header names {value[:80]!r}, not {fmt_hostport(host, port)} (the SNI and the CONNECT "
                "name): one inspected connection carries one origin")
    return ""


def serve(log: DecisionLog, inspector: Inspector, router: Routes, secrets: HostSecrets, client: socket.socket,
          upstream: socket.socket, decision: Decision, rule: HostRule, first: bytes,
          track: Callable[[socket.socket, socket.socket], int | None], untrack: Callable[[int | None], None],
          extras: dict[str, object] | None, notify: Callable[[str], None] | None = None) -> None:
    """The inspected tunnel, from its `200 Connection Established` on: both handshakes, then requests one
    by one until either end closes or a request is refused. Closes both TLS sockets it made."""
    host, port = decision.host, decision.port
    base = {**(extras or {}), "inspected": True}
    if first:  # TLS bytes sent before the tunnel was established: nothing to terminate cleanly
        log.record(Decision(False, host, port, "the client sent bytes before the tunnel was established",
                            label="inspect-handshake"), "CONNECT", base)
        return
    reply_begins()
    client.sendall(b"HTTP/1.1 200 Connection Established\r\n\r\n")
    ctx = inspector.contexts[(host, port)]
    try:  # an answer's head and body go as separate TLS records: Nagle would hold the second for an ACK
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
    tls_client: TlsStream | None = None
    tls_up: TlsStream | None = None
    tracked = None
    try:
        # The upstream's handshake runs while the client's does: a new connection waits for one, not two in series.
        upward: list = []
        shake = threading.Thread(target=lambda: upward.append(router._tls(upstream, host)), daemon=True)
        shake.start()
        shaking = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls_client = TlsStream(client, ctx.wrap_bio(*shaking, server_side=True), *shaking)
        try:
            tls_client.handshake(HANDSHAKE_TIMEOUT)
        except (OSError, ValueError) as err:
            shake.join()
            if upward and upward[0][0] is not None:
                tls_up = upward[0][0]  # closed below, unused
            sni = getattr(tls_client.obj, "hive_sni", None)
            reason = getattr(err, "reason", None) or getattr(err, "strerror", None) or type(err).__name__
            if "UNRECOGNIZED_NAME" in str(reason).upper() or "callback" in str(err).lower():
                why, label = f"the TLS server_name is not {host} (domain fronting)", "sni-mismatch"
            else:
                why, label = (f"the client did not complete TLS with the run CA's leaf for {host} ({reason}): it "
                              "does not trust the run CA, or offered nothing the proxy speaks"), "inspect-handshake"
            log.record(Decision(False, host, port, why, label=label), "CONNECT", {**base, **({"sni": sni} if sni else {})})
            if notify is not None:
                notify(f"hive-relay: refused {fmt_hostport(host, port)}: {why}")
            return
        sni = getattr(tls_client.obj, "hive_sni", "-")
        alpn = tls_client.selected_alpn_protocol()
        shake.join()
        tls_up, detail = upward[0] if upward else (None, "the upstream's TLS handshake failed")  # verified for the name
        if tls_up is None:
            log.record(Decision(False, host, port, detail, unreachable=True, cause="failed"), "CONNECT", base)
            _answer(tls_client, response("502 Bad Gateway", host, port, detail, "The upstream's TLS did not verify.",
                                         header="Unreachable"))
            return
        log.record(decision, "CONNECT", {**base, "sni": sni, "alpn": alpn or "-"})
        tracked = track(tls_client, tls_up)
        _requests(log, router, secrets, tls_client, tls_up, decision, rule, base, notify)
    except OSError:
        pass
    finally:
        untrack(tracked)
        for sock in (tls_client, tls_up):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass


def _answer(tls: TlsStream, answer: bytes) -> None:
    try:
        refuse(tls, answer)
    except OSError:
        pass


def _read_head(sock: TlsStream, buf: bytes, host: str, port: int) -> tuple[bytes | None, bytes]:
    """The next request head (without its blank line) and what followed it; None at a clean close
    between requests (or an idle keep-alive connection that timed out)."""
    sock.settimeout(IDLE_TIMEOUT if not buf else HEAD_TIMEOUT)
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_HEAD:
            raise RequestError("a request head over 32 KiB", host, port)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            if buf:
                raise RequestError("a request head stalled", host, port) from None
            return None, b""
        if not data:
            if buf:
                raise RequestError("the connection closed inside a request head", host, port)
            return None, b""
        buf += data
        sock.settimeout(HEAD_TIMEOUT)
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


def _route_for(router: Routes, host: str, port: int):  # noqa: ANN202 - CredentialRoute | None
    for route in router.routes:
        if route.upstream_host == host and route.upstream_port == port:
            return route
    return None


def _requests(log: DecisionLog, router: Routes, secrets: HostSecrets, tls: TlsStream, up: TlsStream,
              decision: Decision, rule: HostRule, base: dict[str, object],
              notify: Callable[[str], None] | None) -> None:
    host, port = decision.host, decision.port
    route = _route_for(router, host, port)
    limits = http_rules.from_rule(rule.methods, rule.paths)
    buf = b""
    while True:
        try:
            head, buf = _read_head(tls, buf, host, port)
        except RequestError as err:
            log.record(Decision(False, host, port, f"bad request: {err}"), "-", base)
            _answer(tls, response("400 Bad Request", host, port, str(err), "Send one well-formed HTTP/1.1 request at a time."))
            return
        if head is None:
            return
        if head.startswith(H2_PREFACE):
            reason = "HTTP/2 is not carried on an inspected connection (ALPN offers http/1.1 only)"
            log.record(Decision(False, host, port, reason, label="inspect-h2"), "PRI", base)
            if notify is not None:
                notify(f"hive-relay: refused {fmt_hostport(host, port)}: {reason}")
            return
        try:
            req = parse_head(head)
        except RequestError as err:
            log.record(Decision(False, host, port, f"bad request: {err}"), head.split(b" ", 1)[0][:16].decode("latin-1"), base)
            _answer(tls, response("400 Bad Request", host, port, str(err), "Send origin-form HTTP/1.1 requests."))
            return
        if not req.origin:
            reason = "a request in an inspected connection names its target as a URI, not a path"
            log.record(Decision(False, host, port, reason), req.method, base)
            _answer(tls, response("400 Bad Request", host, port, reason, "Send origin-form requests (GET /path)."))
            return
        where = {**base, "path": req.path.partition("?")[0][:200]}
        problem = host_problem(_host_header(head), host, port)
        if problem:
            log.record(Decision(False, host, port, problem, label="host-mismatch"), req.method, where)
            if notify is not None:
                notify(f"hive-relay: refused {fmt_hostport(host, port)}: {problem}")
            _answer(tls, policy("421 Misdirected Request", host, port, problem, rule.render(),
                                denial.rule_fix("open a connection of its own for each host, and allow and inspect it")))
            return
        upgrade = _tokens(head, b"upgrade") or b"upgrade" in _tokens(head, b"connection")
        if upgrade:
            reason = "an Upgrade (websocket) is not carried on an inspected connection"
            log.record(Decision(False, host, port, reason, label="inspect-upgrade"), req.method, where)
            _answer(tls, policy("501 Not Implemented", host, port, reason, rule.render(),
                                denial.rule_fix("drop --inspect for this host to tunnel its websockets as they are")))
            return
        why = http_rules.refusal(limits, req.method, req.path)
        if not why and route is not None:
            why = (f"method {req.method} is not carried where a credential is added" if req.method not in egress.ROUTE_METHODS
                   else http_rules.refusal(route.http_rules(), req.method, req.path))
        if why:
            log.record(Decision(False, host, port, why, label="http-rule"), req.method, {**where, "rule": rule.render()})
            _answer(tls, policy("403 Forbidden", host, port, why, rule.render(),
                                denial.rule_fix("widen the rule's ,method= / ,path= options (or the route's methods/paths)")))
            return
        body = Body(req)
        try:
            scanned, first = request_scan(secrets, req, head, body, body.feed(buf))
        except (SecretFound, Unscannable) as err:
            refuse_scanned(log, tls, req, host, port, err, where)
            return
        except RequestError as err:
            log.record(Decision(False, host, port, f"bad request: {err}"), req.method, where)
            _answer(tls, response("400 Bad Request", host, port, str(err), "Send a well-framed body."))
            return
        redact = None
        path, added = req.path, None
        kept = list(req.kept)
        if route is not None:  # the key added on its own pinned host, the box's placeholder dropped
            key = router.keys.get(route.name)
            try:
                if callable(key):
                    key = key()
                if key is None:
                    raise ValueError(f"no key for route {route.name} on the host")
                path, added = egress.apply_credential(route, key, req.path)
            except (ValueError, OSError) as err:
                log.record(Decision(False, host, port, str(err)), req.method, where)
                _answer(tls, response("502 Bad Gateway", host, port, str(err), "Check the key on the host."))
                return
            kept = [ln for ln in kept if ln.partition(":")[0].strip().lower().replace("_", "-")
                    not in egress.CREDENTIAL_HEADERS | {"accept-encoding"}] + ["Accept-Encoding: identity"]
            if added is not None:
                kept.append(f"{added[0]}: {added[1]}")
            redact = Redactor(egress.key_forms(route, key))
            where["route"] = route.name
        closing = b"close" in _tokens(head, b"connection") or req.version == "HTTP/1.0"
        authority = fmt_hostport(host, None if port == 443 else port)
        out = "\r\n".join([f"{req.method} {path} {req.version}", f"Host: {authority}", *kept,
                           *(["Connection: close"] if closing else []), "", ""]).encode("latin-1")
        up.sendall(out + first)
        if req.expect_continue and not body.done:
            tls.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        tls.settimeout(BODY_TIMEOUT)
        try:
            while not body.done:
                data = tls.recv(body.want())
                if not data:
                    raise RequestError("the connection closed before the request body ended", host, port)
                chunk = body.feed(data)
                up.sendall(scanned.out(chunk) if scanned is not None else chunk)
        except (SecretFound, Unscannable) as err:
            try:
                up.shutdown(socket.SHUT_RDWR)  # the upstream never sees a complete request
            except OSError:
                pass
            refuse_scanned(log, tls, req, host, port, err, where)
            return
        except (RequestError, TimeoutError) as err:
            reason = str(err) if isinstance(err, RequestError) else "request body stalled"
            log.record(Decision(False, host, port, f"bad request: {reason}"), req.method, where)
            _answer(tls, response("400 Bad Request", host, port, reason, "Send a well-framed body."))
            return
        buf, body.extra = body.extra, b""
        status, keep = relay_answer(up, tls, req.method, redact)
        where["status"] = status
        if redact is not None and redact.count:
            where["redacted"] = redact.count
        log.record(Decision(True, host, port, "inspected" + (f", credential route {route.name}" if route else ""),
                            decision.addrs), req.method, where)
        if not keep or closing or status == 0:
            return



def relay_answer(up: TlsStream, client: TlsStream, method: str, redact: Redactor | None) -> tuple[int, bool]:
    """One answer from the upstream to the client, as it arrives (SSE flows event by event): its head,
    interim 1xx heads first, then a body framed by Content-Length, chunks (followed to their end) or
    the close. With `redact` (a route's key was added) the head and body are scrubbed of the key; the
    body then goes on in place of the same length (Content-Length) or re-chunked as it decodes.
    Returns (status, whether the connection can carry another request); status 0: no valid answer."""
    buf = b""
    up.settimeout(ANSWER_TIMEOUT)
    try:
        for _ in range(8):
            while b"\r\n\r\n" not in buf and len(buf) <= MAX_HEAD:
                data = up.recv(65536)
                if not data:
                    break
                buf += data
            head, sep, buf = buf.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            parts = lines[0].split(b" ", 2)
            if (not sep or len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0")
                    or not (parts[1].isdigit() and len(parts[1]) == 3)):
                _answer(client, response("502 Bad Gateway", "-", 0, "the upstream sent no valid response head", ""))
                return 0, False
            status = int(parts[1])
            text = head + b"\r\n\r\n"
            text = redact.scrub(text, full=True) if redact is not None else text
            if 100 <= status < 200 and status != 101:
                client.sendall(text)
                continue
            break
        else:
            _answer(client, response("502 Bad Gateway", "-", 0, "too many interim responses", ""))
            return 0, False
    except OSError as err:
        timed = isinstance(err, TimeoutError)
        _answer(client, response("504 Gateway Timeout" if timed else "502 Bad Gateway", "-", 0,
                                 "the upstream sent no answer in time" if timed else "the upstream failed before answering",
                                 ""))
        return 0, False
    said = [text]  # the head goes out with the body's first bytes (one TLS record), or alone when none came with it

    def send(data: bytes) -> None:
        if said:
            data = said.pop() + data
        if data:
            client.sendall(data)

    if not buf or redact is not None:  # a scrubbed body may be held back a while: its head is not
        send(b"")
    fields = [(ln.partition(b":")[0].strip().lower(), ln.partition(b":")[2].strip()) for ln in lines[1:]]
    te = [c.strip().lower() for n, v in fields if n == b"transfer-encoding" for c in v.split(b",") if c.strip()]
    lengths = [v for n, v in fields if n == b"content-length"]
    keep = parts[0] == b"HTTP/1.1" and b"close" not in {t.strip().lower() for n, v in fields if n == b"connection"
                                                        for t in v.split(b",")}
    if status == 101:
        send(b"")
        return status, False  # no Upgrade is ever sent on: an upstream's 101 ends the connection
    if method == "HEAD" or status in (204, 304):
        send(b"")
        return status, keep
    unchunk = Unchunk() if te == [b"chunked"] else None
    left = int(lengths[0]) if unchunk is None and not te and lengths and lengths[0].isdigit() else -1
    if unchunk is None and left < 0:
        keep = False  # read to the close
    coded = [c for n, v in fields if n == b"content-encoding" for c in v.split(b",") if c.strip().lower() != b"identity"]
    if redact is not None and coded:  # asked for identity: a compressed answer cannot be scrubbed of the key
        send(b"")
        return status, False  # its head went on; the body is cut, never passed unscrubbed
    up.settimeout(None)
    try:
        if left >= 0:
            data, buf = buf[:left], b""
            while True:
                if data:
                    left -= len(data)
                    send(redact.feed(data) if redact is not None else data)
                if left <= 0:
                    break
                data = up.recv(min(left, BATCH))  # every record that has arrived (tls_stream.py)
                if not data:
                    return status, False
            if redact is not None:
                send(redact.flush())
            return status, keep
        data, buf = buf, b""
        while True:
            if data:
                if unchunk is not None:
                    payload = unchunk.feed(data)
                    if redact is not None:
                        payload = redact.feed(payload)
                        if payload:
                            send(b"%x\r\n%s\r\n" % (len(payload), payload))
                    else:  # the wire bytes as they came, to the last chunk's end: nothing after it goes on
                        send(data[:len(data) - len(unchunk.buf)] if unchunk.done else data)
                    if unchunk.done:
                        if redact is not None:
                            rest = redact.flush()
                            send((b"%x\r\n%s\r\n" % (len(rest), rest) if rest else b"") + b"0\r\n\r\n")
                        return status, keep and not unchunk.buf
                else:
                    send(redact.feed(data) if redact is not None else data)
            data = up.recv(BATCH)
            if not data:
                if redact is not None:
                    send(redact.flush())
                return status, False
    except (OSError, FramingError):
        return status, False
    finally:
        if said:  # the body failed before a byte of it: the head still goes (the client sees it cut)
            try:
                client.sendall(said.pop())
            except OSError:
                pass
