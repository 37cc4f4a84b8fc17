"""The host-side egress proxy: CONNECT and absolute-URI HTTP, pinned to an allowlist.

It accepts on a listening socket that lives in the box's network namespace (handed over by
the in-box init), so the box reaches exactly this proxy and nothing else. Allowed streams
are spliced byte for byte, unbuffered, so SSE and websockets flow as they are produced.
Every decision is one JSON line in the run's log.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from .errors import UsageError
from .hosts import HostRule, _is_ip, find_rule, is_internal_address, normalize_host, split_hostport

MAX_HEAD = 32 * 1024
HEAD_TIMEOUT = 30.0
CONNECT_TIMEOUT = 15.0
CHUNK = 1 << 20
F_SETPIPE_SZ = 1031
Resolver = Callable[[str, int], list[str]]


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


@dataclass(frozen=True)
class Decision:
    allowed: bool
    host: str
    port: int
    reason: str
    addrs: tuple[tuple[str, int], ...] = ()


class RequestError(Exception):
    """The client sent something that is not a proxy request we understand (answered 400)."""


def parse_head(head: bytes) -> tuple[str, str, int, bytes | None]:
    """Parse a request head into (method, host, port, rewritten head or None for CONNECT)."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes everything
        raise RequestError("undecodable request") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise RequestError("malformed request line")
    method, target, version = parts
    if not method.isalpha() or not method.isupper() or len(method) > 16:
        raise RequestError("malformed method")
    if method == "CONNECT":
        try:
            host, port = split_hostport(target, target)
        except UsageError:
            raise RequestError("bad CONNECT target") from None
        if port is None:
            raise RequestError("CONNECT target needs host:port")
        return method, _norm(host), port, None
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() != "http":
        raise RequestError("only absolute http:// URIs (or CONNECT) are proxied")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        raise RequestError("credentials in the URI are not allowed")
    try:
        host, port = split_hostport(authority, authority)
    except UsageError:
        raise RequestError("bad host in URI") from None
    port = port or 80
    headers = [
        line for line in lines[1:]
        if line and not line.lower().startswith(("proxy-", "connection:", "keep-alive:"))
    ]
    rewritten = "\r\n".join([f"{method} /{path if slash else ''} {version}", *headers, "Connection: close", "", ""])
    return method, _norm(host), port, rewritten.encode("latin-1")


def _norm(host: str) -> str:
    try:
        return normalize_host(host)
    except ValueError:
        raise RequestError(f"invalid host {host[:80]!r}") from None


def decide(rules: tuple[HostRule, ...], host: str, port: int, resolver: Resolver) -> Decision:
    """Apply the matching rules: allowlist, IP literals, and names resolving to internal addresses."""
    rule = find_rule(rules, host, port)
    if rule is None:
        return Decision(False, host, port, "not in the egress allowlist")
    if rule.pin_addr is not None:
        return Decision(True, host, port, f"pinned to {rule.pin_addr}:{rule.pin_port}",
                        ((rule.pin_addr, rule.pin_port or port),))
    if rule.is_ip:
        return Decision(True, host, port, "IP listed explicitly", ((host, port),))
    try:
        addrs = resolver(host, port)
    except (OSError, UnicodeError) as err:
        return Decision(False, host, port, f"cannot resolve: {err}")
    if not addrs:
        return Decision(False, host, port, "resolves to no address")
    internal = [a for a in addrs if is_internal_address(a)]
    if internal:
        return Decision(False, host, port, f"resolves to internal address {internal[0]}; pin it with NAME=ADDR:PORT")
    return Decision(True, host, port, "allowlisted", tuple((a, port) for a in addrs))


def _is_ip_literal(host: str) -> bool:
    return _is_ip(host)


class DecisionLog:
    """Append-only JSON-lines log; a write failure (full disk) is counted, never fatal."""

    def __init__(self, path: str | None, backend: str) -> None:
        self.path = path
        self.backend = backend
        self.lock = threading.Lock()
        self.denied: Counter[str] = Counter()
        self.allowed = 0
        self.write_errors = 0
        self._fh = None
        if path:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self._fh = open(path, "a", buffering=1, encoding="utf-8")
            except OSError:
                self.write_errors += 1

    def record(self, decision: Decision, method: str) -> None:
        entry = {
            "time": round(time.time(), 3), "backend": self.backend, "host": decision.host,
            "port": decision.port, "method": method,
            "decision": "allow" if decision.allowed else "deny", "reason": decision.reason,
        }
        with self.lock:
            if decision.allowed:
                self.allowed += 1
            else:
                self.denied[f"{decision.host}:{decision.port}"] += 1
            if self._fh is not None:
                try:
                    self._fh.write(json.dumps(entry) + "\n")
                except OSError:
                    self.write_errors += 1

    def close(self) -> None:
        with self.lock:
            if self._fh is not None:
                try:
                    self._fh.close()
                except OSError:
                    self.write_errors += 1
                self._fh = None

    def summary(self) -> str | None:
        if not self.denied:
            return None
        top = ", ".join(f"{h} ×{n}" for h, n in self.denied.most_common(5))
        more = len(self.denied) - 5
        return f"egress denied: {top}" + (f" and {more} more" if more > 0 else "")


def _response(status: str, host: str, port: int, reason: str, hint: str) -> bytes:
    body = f"hive-relay: {status.split(' ', 1)[1].lower()} {host}:{port}: {reason}. {hint}\n".encode()
    head = (
        f"HTTP/1.1 {status}\r\nX-Hive-Relay-Denied: {host}:{port}; {reason}\r\n"
        f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1", "replace") + body


def pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy src → dst until EOF, then half-close dst; splice keeps the bytes out of Python."""
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
                while n:
                    n -= os.splice(r, dfd, n)
        else:  # pragma: no cover - every supported Linux has splice
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                dst.sendall(view[:n])
    except OSError:
        pass
    finally:
        if r >= 0:
            os.close(r)
            os.close(w)
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class EgressProxy:
    """Serve one box: accept on its listener, decide, connect, splice. Lives as long as the launcher."""

    def __init__(
        self,
        listener: socket.socket,
        rules: tuple[HostRule, ...],
        log: DecisionLog,
        resolver: Resolver = system_resolver,
        hint: str = "",
    ) -> None:
        self.listener = listener
        self.rules = rules
        self.log = log
        self.resolver = resolver
        self.hint = hint
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept_loop, name="hive-relay-proxy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self.log.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.01)
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _read_head(self, client: socket.socket) -> tuple[bytes, bytes]:
        client.settimeout(HEAD_TIMEOUT)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = client.recv(4096)
            if not chunk:
                raise RequestError("connection closed before the request head ended")
            data += chunk
            if len(data) > MAX_HEAD:
                raise RequestError("request head too large")
        head, _, rest = data.partition(b"\r\n\r\n")
        client.settimeout(None)
        return head + b"\r\n\r\n", rest

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        try:
            try:
                head, rest = self._read_head(client)
                method, host, port, rewritten = parse_head(head[:-4])
            except (RequestError, OSError) as err:
                if isinstance(err, RequestError):
                    client.sendall(_response("400 Bad Request", "-", 0, str(err), "Use CONNECT host:port or http:// URIs."))
                return
            if _is_ip_literal(host) and not any(r.is_ip and r.name == host for r in self.rules):
                decision = Decision(False, host, port, "IP literals are refused unless listed explicitly")
            else:
                decision = decide(self.rules, host, port, self.resolver)
            if decision.allowed:
                upstream, failure = self._connect(decision)
                if upstream is None:
                    decision = Decision(False, host, port, f"upstream connect failed: {failure}")
                    self.log.record(decision, method)
                    client.sendall(_response("502 Bad Gateway", host, port, decision.reason, "The host is allowed but unreachable."))
                    return
            self.log.record(decision, method)
            if not decision.allowed:
                client.sendall(_response("403 Forbidden", host, port, decision.reason, self.hint.format(host=host, port=port)))
                return
            assert upstream is not None
            if rewritten is None:
                client.sendall(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            else:
                upstream.sendall(rewritten)
            if rest:
                upstream.sendall(rest)
            back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
            back.start()
            pump(client, upstream)
            back.join()
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    try:
                        sock.close()
                    except OSError:
                        pass

    def _connect(self, decision: Decision) -> tuple[socket.socket | None, str]:
        failure = "no address"
        for addr, port in decision.addrs:
            try:
                sock = socket.create_connection((addr, port), timeout=CONNECT_TIMEOUT)
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock, ""
            except OSError as err:
                failure = err.strerror or str(err)
        return None, failure
