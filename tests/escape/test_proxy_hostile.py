"""The host-side egress proxy against a hostile box, each attack beside its legitimate twin.

The proxy runs on the host with the caller's rights and serves a box that may lie in every byte.
These tests drive the real EgressProxy on a real listener on 127.0.0.1, in front of a real
upstream on 127.0.0.1 that records every byte it receives: virtual-host confusion, request
smuggling (conflicting framing, obs-fold, bare LF, bad chunks, pipelining), internal address
ranges, 0.0.0.0 reaching the host's own listeners, connection floods and slow heads.
"""

from __future__ import annotations

import json
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from relay.egress.http_head import MAX_HEAD
from relay.egress.proxy import EgressProxy
from relay.egress.reactor import MAX_CONNECTIONS
from relay.egress.rulebook import decide
from relay.model.allow_rules import is_internal_address, parse_rule

from ..servers import start_tcp

PUBLIC = "93.184.216.34"  # judged only: nothing in this file ever connects to it


class Upstream:
    """A raw HTTP/1.1 server on 127.0.0.1 that records what arrives on each connection, answers one
    request (framed by Content-Length or chunked) with what it saw, and keeps recording until EOF."""

    def __init__(self) -> None:
        self.conns: list[bytearray] = []
        self.sock, self.port = start_tcp(self._handle)

    def _handle(self, conn: socket.socket, _n: int) -> None:
        raw = bytearray()
        self.conns.append(raw)
        conn.settimeout(3)
        try:
            while not self._complete(bytes(raw)):
                chunk = conn.recv(65536)
                if not chunk:
                    return
                raw += chunk
            line = bytes(raw).split(b"\r\n", 1)[0].decode("latin-1")
            host = re.search(rb"\r\nHost: ([^\r]*)", bytes(raw))
            body = f"saw {line} host={host.group(1).decode() if host else None}\n".encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            conn.settimeout(0.5)
            while chunk := conn.recv(65536):  # anything smuggled after the request is recorded too
                raw += chunk
        except OSError:
            pass
        finally:
            conn.close()

    @staticmethod
    def _complete(raw: bytes) -> bool:
        head, sep, body = raw.partition(b"\r\n\r\n")
        if not sep:
            return False
        length = re.search(rb"\r\ncontent-length: *(\d+)", head, re.I)
        if length:
            return len(body) >= int(length.group(1))
        if re.search(rb"\r\ntransfer-encoding: *chunked", head, re.I):
            return body.endswith(b"0\r\n\r\n")
        return True

    def seen(self) -> bytes:
        time.sleep(0.1)
        return b"\n---\n".join(bytes(c) for c in self.conns)

    def requests(self) -> list[bytes]:
        """Every request line the upstream received, on any connection."""
        return re.findall(rb"(?:^|\n)([A-Z]+ \S+ HTTP/1\.[01])\r\n", self.seen())

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    yield up
    up.close()


Proxy = Callable[..., tuple[EgressProxy, int]]


@pytest.fixture
def make_proxy(proxies, upstream: Upstream) -> Proxy:  # noqa: ANN001 - tests/fixtures.py Proxies
    """A real EgressProxy on 127.0.0.1 with `allowed.test` pinned to the upstream (plus any rules)."""
    def make(*entries: str, resolver=None, **kw) -> tuple[EgressProxy, int]:  # noqa: ANN001
        extra = {"resolver": resolver} if resolver else {}
        return proxies(f"allowed.test:80=127.0.0.1:{upstream.port}", *entries, backlog=1024, **extra, **kw)

    return make


def exchange(port: int, *parts: bytes, pause: float = 0.0, timeout: float = 5.0) -> bytes:
    """Send parts (with a pause between them) to the proxy and read until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        for i, part in enumerate(parts):
            if i and pause:
                time.sleep(pause)
            try:
                s.sendall(part)
            except OSError:
                break
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
        return out


def log_entries(tmp_path: Path) -> list[dict]:
    path = tmp_path / "egress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def get(path: str = "/legit") -> bytes:
    return f"GET http://allowed.test{path} HTTP/1.1\r\nHost: allowed.test\r\n\r\n".encode()


# 1. Virtual-host confusion and hop-by-hop headers.

def test_host_header_is_rewritten_to_the_uri_authority(make_proxy: Proxy, upstream: Upstream, report) -> None:
    _, port = make_proxy()
    legit = exchange(port, get())
    works = legit.startswith(b"HTTP/1.1 200") and b"saw GET /legit HTTP/1.1 host=allowed.test" in legit
    report.legit(works)
    out = exchange(port, b"GET http://allowed.test/confused HTTP/1.1\r\nHost: evil.test\r\nhost: internal.corp\r\n"
                         b"Proxy-Authorization: Basic c2VjcmV0\r\nProxy-Connection: keep-alive\r\n"
                         b"Connection: X-Box-Secret, keep-alive\r\nX-Box-Secret: token\r\nKeep-Alive: 300\r\n\r\n")
    seen = upstream.seen()
    confused = seen.split(b"GET /confused", 1)[1]
    blocked = (out.startswith(b"HTTP/1.1 200") and b"host=allowed.test\n" in out
               and confused.count(b"\r\nHost: ") == 1 and b"\r\nHost: allowed.test\r\n" in confused
               and not any(w in seen for w in (b"evil.test", b"internal.corp", b"Proxy-", b"X-Box-Secret",
                                               b"Keep-Alive", b"keep-alive")))
    report.attack(blocked)
    assert works, legit
    assert blocked, seen


# 2. Request smuggling: framing an upstream could read differently from the proxy.

SMUGGLE = b"GET /smuggled HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
SHAPES = {
    "CL+TE": b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLE,
    "TE+CL": b"Transfer-Encoding: chunked\r\nContent-Length: 60\r\n\r\n0\r\n\r\n" + SMUGGLE,
    "duplicate CL": b"Content-Length: 0\r\nContent-Length: 47\r\n\r\n" + SMUGGLE,
    "CL list": b"Content-Length: 47, 0\r\n\r\n" + SMUGGLE,
    "TE not chunked": b"Transfer-Encoding: gzip\r\n\r\n" + SMUGGLE,
    "TE chunked twice": b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n0\r\n\r\n" + SMUGGLE,
    "space before colon": b"Transfer-Encoding : chunked\r\nContent-Length: 47\r\n\r\n" + SMUGGLE,
    "obs-fold": b"X-Pad: a\r\n Transfer-Encoding: chunked\r\nContent-Length: 47\r\n\r\n" + SMUGGLE,
    "bare LF": b"X-Pad: a\nTransfer-Encoding: chunked\r\nContent-Length: 47\r\n\r\n" + SMUGGLE,
    "bad chunk size": b"Transfer-Encoding: chunked\r\n\r\n0x2f\r\n" + SMUGGLE,
    "chunk without CRLF": b"Transfer-Encoding: chunked\r\n\r\n1\r\nAB\r\n0\r\n\r\n" + SMUGGLE,
    "bare LF in chunk": b"Transfer-Encoding: chunked\r\n\r\n1\nA\r\n0\r\n\r\n" + SMUGGLE,
    "NUL in header": b"X-Pad: a\x00b\r\nContent-Length: 47\r\n\r\n" + SMUGGLE,
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_smuggling_shapes_are_refused_with_400(make_proxy: Proxy, upstream: Upstream, tmp_path: Path,
                                               shape: str, report) -> None:
    _, port = make_proxy()
    out = exchange(port, b"POST http://allowed.test/first HTTP/1.1\r\nHost: allowed.test\r\n" + SHAPES[shape])
    reason = re.search(rb"X-Hive-Relay-Denied: allowed\.test:80; ([^\r]+)", out)
    logged = [e for e in log_entries(tmp_path) if e["reason"].startswith("bad request")]
    blocked = out.startswith(b"HTTP/1.1 400 ") and reason is not None and not upstream.requests() and bool(logged)
    report.attack(blocked)
    assert blocked, (out, upstream.seen())


def test_a_bad_chunk_mid_body_aborts_the_upstream_request(make_proxy: Proxy, upstream: Upstream, report) -> None:
    _, port = make_proxy()
    out = exchange(port, b"POST http://allowed.test/upload HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
                   b"zz\r\n" + SMUGGLE, pause=0.3)
    seen = upstream.seen()
    # The upstream got a well-framed prefix and then a reset: never a finished request, never the smuggled one.
    blocked = out.startswith(b"HTTP/1.1 400 ") and b"/smuggled" not in seen and b"0\r\n\r\n" not in seen
    report.attack(blocked)
    assert blocked, (out, seen)


def test_legit_bodies_pass_framed_exactly(make_proxy: Proxy, upstream: Upstream, report) -> None:
    _, port = make_proxy()
    with_length = exchange(port, b"POST http://allowed.test/cl HTTP/1.1\r\nContent-Length: 11\r\n\r\nhello", b" world",
                           pause=0.2)
    chunked = exchange(port, b"POST http://allowed.test/te HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n",
                       b"6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n", pause=0.2)
    expect = exchange(port, b"POST http://allowed.test/expect HTTP/1.1\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n",
                      b"ok", pause=0.2)
    big = b"x" * (3 << 20)
    large = exchange(port, b"PUT http://allowed.test/big HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(big), big)
    seen = upstream.seen()
    works = {
        "content-length": with_length.startswith(b"HTTP/1.1 200") and b"\r\nContent-Length: 11\r\n" in seen
        and b"\r\n\r\nhello world\n---\n" in seen,
        "chunked": chunked.startswith(b"HTTP/1.1 200") and b"\r\nTransfer-Encoding: chunked\r\n" in seen
        and b"\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n\n---\n" in seen,
        "expect": expect.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200") and b"Expect" not in seen,
        "3 MiB": large.startswith(b"HTTP/1.1 200") and seen.count(b"x" * 4096) >= 3 * 256,
    }
    for ok in works.values():
        report.legit(ok)
    assert all(works.values()), works


def test_pipelined_second_request_is_never_forwarded(make_proxy: Proxy, upstream: Upstream, tmp_path: Path,
                                                     report) -> None:
    _, port = make_proxy()
    pipelined = exchange(port, get("/first") + b"GET http://evil.test/second HTTP/1.1\r\nHost: evil.test\r\n\r\n"
                         + SMUGGLE)
    after_body = exchange(port, b"POST http://allowed.test/body HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello" + SMUGGLE)
    late = exchange(port, get("/early"), SMUGGLE, pause=0.2)  # arrives while the first is being answered
    lines = upstream.requests()
    blocked = (set(lines) == {b"GET /first HTTP/1.1", b"POST /body HTTP/1.1", b"GET /early HTTP/1.1"} and len(lines) == 3
               and not any(w in upstream.seen() for w in (b"evil.test", b"/second", b"/smuggled"))
               and not any(e["host"] == "evil.test" for e in log_entries(tmp_path))
               and any("pipelined" in e["reason"] for e in log_entries(tmp_path)))
    report.attack(blocked)
    # The first request of each connection is answered; a pipelining client retries the rest after the close.
    works = all(r.startswith(b"HTTP/1.1 200") for r in (pipelined, after_body, late)) and b"saw POST /body" in after_body
    report.legit(works)
    assert blocked, (lines, log_entries(tmp_path))
    assert works


# 3. Internal addresses: the IANA special-purpose registries, judged on what a name resolves to.

INTERNAL = ["0.0.0.0", "10.0.0.1", "100.64.0.1", "127.0.0.1", "169.254.169.254", "172.16.0.1", "192.0.0.170",
            "192.0.2.1", "192.88.99.1", "192.168.1.1", "198.18.0.1", "198.51.100.1", "203.0.113.1", "224.0.0.251",
            "240.0.0.1", "255.255.255.255", "::", "::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe", "64:ff9b:1::1", "100::1", "2001::1", "2001:db8::1", "2002:7f00:1::",
            "2002:a9fe:a9fe::", "fc00::1", "fd00:ec2::254", "fe80::1", "ff02::1"]


@pytest.mark.parametrize("addr", INTERNAL)
def test_allowed_name_resolving_to_an_internal_address_is_refused(make_proxy: Proxy, upstream: Upstream,
                                                                  addr: str, report) -> None:
    _, port = make_proxy("rebind.test:80", resolver=lambda host, p: [addr])
    out = exchange(port, b"GET http://rebind.test/ HTTP/1.1\r\nHost: rebind.test\r\n\r\n")
    blocked = (is_internal_address(addr) and out.startswith(b"HTTP/1.1 403 ")
               and b"resolves to internal address" in out and not upstream.conns)
    report.attack(blocked)
    assert blocked, out


def test_a_public_address_is_judged_allowed(report) -> None:
    # Judged only, never connected: the decision for a public address, and for a name resolving to it.
    rules = (parse_rule("api.test"),)
    decision = decide(rules, "api.test", 443, lambda host, port: [PUBLIC])
    works = not is_internal_address(PUBLIC) and decision.allowed and decision.addrs == ((PUBLIC, 443),)
    report.legit(works)
    assert works, decision


# 4. 0.0.0.0 and :: reach the host's own listeners: refused however they are listed.

def test_zero_address_is_refused_even_when_listed(make_proxy: Proxy, upstream: Upstream, tmp_path: Path,
                                                  report) -> None:
    p = upstream.port
    _, port = make_proxy(f"0.0.0.0:{p}", f"zero.test:{p}=0.0.0.0:{p}", f"v6zero.test:{p}=[::]:{p}",
                         f"mapped.test:{p}=[::ffff:0.0.0.0]:{p}", f"zero.test:{p + 1 if p < 65535 else 1}",
                         f"pinned.test:{p}=127.0.0.1:{p}", resolver=lambda host, _p: ["0.0.0.0"])
    tries = [f"CONNECT 0.0.0.0:{p} HTTP/1.1\r\n\r\n", f"CONNECT zero.test:{p} HTTP/1.1\r\n\r\n",
             f"GET http://v6zero.test:{p}/ HTTP/1.1\r\n\r\n", f"GET http://mapped.test:{p}/ HTTP/1.1\r\n\r\n",
             f"CONNECT zero.test:{p + 1 if p < 65535 else 1} HTTP/1.1\r\n\r\n"]
    outs = [exchange(port, t.encode()) for t in tries]
    blocked = all(o.startswith(b"HTTP/1.1 403 ") for o in outs) and not upstream.conns
    report.attack(blocked)
    legit = exchange(port, f"GET http://pinned.test:{p}/ok HTTP/1.1\r\n\r\n".encode())
    works = legit.startswith(b"HTTP/1.1 200") and b"host=pinned.test:" in legit
    report.legit(works)
    assert blocked, outs
    assert works, legit
    assert sum("never a connect target" in e["reason"] for e in log_entries(tmp_path)) == 4


# 5. Connection floods and slow heads.

def open_idle(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(s)
    return socks


def refusal(s: socket.socket) -> bytes:
    """What the proxy said on an idle connection within 0.5 s (b"" if it said nothing and kept it)."""
    s.settimeout(0.5)
    try:
        return s.recv(4096)
    except TimeoutError:
        return b""


@pytest.mark.parametrize("cap, extra", [(16, 8), (MAX_CONNECTIONS, 44)])
def test_connection_cap_refuses_past_the_cap_without_a_thread_per_connection(
        make_proxy: Proxy, tmp_path: Path, cap: int, extra: int, report) -> None:
    proxy, port = make_proxy(**({} if cap == MAX_CONNECTIONS else {"max_connections": cap}))
    assert proxy.max_connections == cap
    threads_before = threading.active_count()
    socks = open_idle(port, cap + extra)
    try:
        deadline = time.monotonic() + 5
        while proxy.open_connections < cap and time.monotonic() < deadline:
            time.sleep(0.02)
        threads = threading.active_count()
        answers = [refusal(s) for s in socks[cap:]]
        kept = [refusal(s) for s in socks[:4]]  # a few of the held ones: still open, nothing said
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503 ") and b"X-Hive-Relay-Denied: " in a
                   and b"connection cap reached" in a]
        logged = sum("connection cap reached" in e["reason"] for e in log_entries(tmp_path))
        held = (len(refused) == extra and kept == [b""] * 4 and proxy.open_connections == cap
                and threads - threads_before <= 2 and logged == extra)
        report.load(held)
        report.attack(held)
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 5
    while proxy.open_connections and time.monotonic() < deadline:
        time.sleep(0.02)
    drained = proxy.open_connections == 0  # every slot given back once its connection closed
    legit = exchange(port, get())
    works = drained and legit.startswith(b"HTTP/1.1 200")
    report.legit(works)
    assert held, (len(refused), extra, kept, proxy.open_connections, threads, threads_before, logged)
    assert works, legit


def test_busy_tunnels_under_the_cap_all_work(make_proxy: Proxy, report) -> None:
    echo, echo_port = start_tcp(lambda c, _n: (c.sendall(c.recv(65536)), c.close()))
    proxy, port = make_proxy(f"echo.test:{echo_port}=127.0.0.1:{echo_port},tls=false", max_connections=32)
    try:
        socks = open_idle(port, 32)
        for s in socks:
            s.sendall(f"CONNECT echo.test:{echo_port} HTTP/1.1\r\n\r\n".encode())
        ok = 0
        for i, s in enumerate(socks):
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            s.sendall(f"ping {i}".encode())
            ok += s.recv(4096) == f"ping {i}".encode()
        over = refusal(socket.create_connection(("127.0.0.1", port)))
        for s in socks:
            s.close()
    finally:
        echo.close()
    works = ok == 32 and over.startswith(b"HTTP/1.1 503 ")
    report.legit(works)
    assert works, (ok, over)


def test_slow_head_is_cut_at_the_total_head_timeout(make_proxy: Proxy, report) -> None:
    proxy, port = make_proxy(head_timeout=1.0)
    head = get()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        start, answer = time.monotonic(), b""
        for byte in head:  # one byte every 0.1 s: each recv is quick, the head as a whole is not
            if select.select([s], [], [], 0.1)[0] or time.monotonic() - start > 3:
                break  # the proxy answered (or gave up on us): stop sending
            s.sendall(bytes([byte]))
        s.settimeout(2)
        try:
            while chunk := s.recv(4096):
                answer += chunk
        except OSError:
            pass
        cut_after = time.monotonic() - start
    deadline = time.monotonic() + 2
    while proxy.open_connections and time.monotonic() < deadline:
        time.sleep(0.01)
    blocked = answer.startswith(b"HTTP/1.1 408 ") and cut_after < 2.5 and proxy.open_connections == 0
    report.attack(blocked)
    legit = exchange(port, head[:10], head[10:30], head[30:], pause=0.2)  # a head in pieces, well within time
    works = legit.startswith(b"HTTP/1.1 200")
    report.legit(works)
    assert blocked, (answer, cut_after)
    assert works, legit


def test_oversized_head_is_refused(make_proxy: Proxy, upstream: Upstream, report) -> None:
    _, port = make_proxy()
    huge = b"GET http://allowed.test/huge HTTP/1.1\r\nX-Pad: " + b"a" * MAX_HEAD + b"\r\n\r\n"
    out = exchange(port, huge)
    blocked = out.startswith(b"HTTP/1.1 400 ") and b"request head too large" in out and not upstream.conns
    report.attack(blocked)
    big_ok = exchange(port, b"GET http://allowed.test/cookies HTTP/1.1\r\nCookie: " + b"c" * (MAX_HEAD - 200) + b"\r\n\r\n")
    works = big_ok.startswith(b"HTTP/1.1 200")
    report.legit(works)
    assert blocked, out
    assert works, big_ok
