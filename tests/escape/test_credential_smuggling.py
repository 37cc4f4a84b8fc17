"""Request smuggling against credential routes and grants, end to end through a real proxy and a real
TLS upstream under the pinned name (beside tests/escape/test_credentials.py, whose upstream and
helpers these reuse; the parser's properties are in tests/test_proxy_parser_props.py).

Each attack is refused (or its smuggled part dropped) and the key reaches only the pinned upstream,
at most once per client request; each twin (the well-formed request) still gets its answer."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from relay.egress.decision_log import DecisionLog
from relay.egress.proxy import EgressProxy
from relay.model.allow_rules import parse_rule
from relay.model.backend import CredentialRoute

from ..servers import make_ca
from .conftest import Report
from .test_credentials import NAMES, REAL, TLSUpstream, entries, exchange

ANTHROPIC = CredentialRoute("anthropic", ("ANTHROPIC_API_KEY",), "api.anthropic.com", 443, "x-api-key")
GITHUB = CredentialRoute("github", (), "github.com", 443, "authorization-basic", grant=True)
MAPS = CredentialRoute("maps", (), "maps.example", 443, "query:key", grant=True)
BASIC = b"Authorization: Basic eC1hY2Nlc3MtdG9rZW46" + b"c2stYW50LVJFQUwtS0VZLU9OLVRIRS1IT1NULU9OTFk="


@pytest.fixture(scope="module")
def ca2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ssl.SSLContext]:
    return make_ca(tmp_path_factory.mktemp("ca2"), (*NAMES, "github.com", "maps.example"))


@pytest.fixture
def proxy(ca2, tmp_path: Path) -> Iterator[Callable[..., tuple[int, Path]]]:
    """proxy(upstream, route=ANTHROPIC, cafile=the test CA, head_timeout=30): a real EgressProxy with
    `route` pinned to `upstream` by an --allow-host rule. Returns (port, log)."""
    started: list[EgressProxy] = []

    def make(upstream: TLSUpstream, route: CredentialRoute = ANTHROPIC, cafile: Path | None = None,
             head_timeout: float = 30.0) -> tuple[int, Path]:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        log = tmp_path / f"log-{len(started)}.jsonl"
        rules = (parse_rule(f"{route.upstream_host}:443=127.0.0.1:{upstream.port}"),)
        proxy = EgressProxy(listener, rules, DecisionLog(str(log), "test"), routes=(route,), keys={route.name: REAL},
                            tls=ssl.create_default_context(cafile=str(cafile or ca2[0])), notify=None,
                            head_timeout=head_timeout)
        proxy.start()
        started.append(proxy)
        return listener.getsockname()[1], log

    yield make
    for p in started:
        p.stop()


def status(answer: bytes) -> bytes:
    return answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/1.1 ") else b""


CHUNKED = b"POST /anthropic/v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("attack, why", [
    (b"POST /anthropic/v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n"
     b"0\r\n\r\n", b"only one 'Transfer-Encoding: chunked'"),
    (b"POST /anthropic/v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
     b"only one 'Transfer-Encoding: chunked'"),
    (b"POST /anthropic/v1/x HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
     b"only one 'Transfer-Encoding: chunked'"),
    (b"POST /anthropic/v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}x",
     b"duplicate Content-Length"),
    (b"POST /anthropic/v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: +2\r\n\r\n{}", b"invalid Content-Length"),
    (b"POST /anthropic/v1/x HTTP/1.1\r\nHost: x\r\nContent-Length : 2\r\n\r\n{}", b"malformed header line"),
    (b"GET /anthropic/v1/x HTTP/1.1\nHost: x\r\n\r\n", b"malformed request line"),
    (b"GET /anthropic/v1/x HTTP/1.1\r\nHost: x\nX-Evil: 1\r\n\r\n", b"bare CR or LF"),
    (b"GET /anthropic/v1/x HTTP/1.1\r\nHost: x\r\n\tX-Evil: 1\r\n\r\n", b"obsolete line folding"),
    (b"GET http://x@api.anthropic.com:443/anthropic/v1 HTTP/1.1\r\nHost: x\r\n\r\n", b"credentials in the URI"),
])
def test_framing_attacks_are_refused_before_the_upstream_is_reached(ca2, proxy, attack: bytes, why: bytes,
                                                                    report: Report) -> None:
    upstream = TLSUpstream(ca2[1])
    port, log = proxy(upstream)
    answer = exchange(port, attack)
    time.sleep(0.1)
    blocked = status(answer) == b"400" and why in answer and upstream.conns == []
    report.attack(blocked)
    assert blocked, answer
    assert REAL not in log.read_text()


@pytest.mark.parametrize("body, why", [
    (b"2\n{}\r\n0\r\n\r\n", b"bare CR or LF in the chunked body"),
    (b"fffffffffffffffff\r\n", b"invalid chunk size line"),
    (b"0x2\r\n{}\r\n0\r\n\r\n", b"invalid chunk size line"),
    (b"2\r\n{}XX0\r\n\r\n", b"chunk data not followed by CRLF"),
    (b"0\r\nX y\r\n\r\n", b"invalid chunked trailer"),
])
def test_a_bad_chunked_body_aborts_the_one_request(ca2, proxy, body: bytes, why: bytes, report: Report) -> None:
    """The head goes upstream first (to the pinned host only); a body that breaks its framing resets
    that connection, so the upstream never reads a complete request, let alone a second one."""
    upstream = TLSUpstream(ca2[1])
    port, _ = proxy(upstream)
    answer = exchange(port, CHUNKED + body + b"GET /anthropic/steal HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.3)
    got = upstream.received()
    blocked = status(answer) == b"400" and why in answer and b"/steal" not in got and b"0\r\n\r\n" not in got
    report.attack(blocked)
    assert blocked, (answer, got)
    assert len(upstream.conns) <= 1 and got.count(REAL.encode()) <= 1


def test_a_request_smuggled_after_a_chunked_body_is_never_sent(ca2, proxy, report: Report) -> None:
    upstream = TLSUpstream(ca2[1])
    port, log = proxy(upstream)
    answer = exchange(port, CHUNKED + b"2\r\n{}\r\n0\r\nX-T: 1\r\n\r\n"
                      + b"GET /anthropic/steal HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    time.sleep(0.3)
    got = upstream.received()
    # legit: the first request went through, its body canonical and its trailer dropped.
    report.legit(status(answer) == b"200" and got.endswith(b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n"))
    blocked = b"/steal" not in got and got.count(REAL.encode()) == 1 and len(upstream.conns) == 1
    report.attack(blocked)
    assert blocked and status(answer) == b"200"
    assert any("pipelined request" in e["reason"] for e in entries(log, 2))


def test_an_oversized_head_is_refused(ca2, proxy, report: Report) -> None:
    upstream = TLSUpstream(ca2[1])
    port, _ = proxy(upstream)
    answer = exchange(port, b"GET /anthropic/v1 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n")
    blocked = status(answer) == b"400" and b"request head too large" in answer and upstream.conns == []
    report.attack(blocked)
    assert blocked, answer[:300]


def test_a_slow_head_times_out_and_the_upstream_is_never_reached(ca2, proxy, report: Report) -> None:
    upstream = TLSUpstream(ca2[1])
    port, _ = proxy(upstream, head_timeout=1.0)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /anthropic/v1 HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):  # a byte every half second, never the blank line
            time.sleep(0.5)
            try:
                sock.sendall(b"X")
            except OSError:
                break
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            pass
        took = time.monotonic() - start
    blocked = status(answer) == b"408" and upstream.conns == [] and took < 5
    report.attack(blocked)
    assert blocked, (answer, took)


def test_an_absolute_uri_naming_the_api_gets_no_key(ca2, proxy, report: Report) -> None:
    """`http://api.anthropic.com/anthropic/...` is plain egress, not the route: no key is added (and
    port 80 is not allowed here)."""
    upstream = TLSUpstream(ca2[1])
    port, log = proxy(upstream)
    answer = exchange(port, b"GET http://api.anthropic.com/anthropic/v1 HTTP/1.1\r\nHost: api.anthropic.com\r\n\r\n")
    blocked = status(answer) == b"403" and upstream.conns == [] and REAL not in log.read_text()
    report.attack(blocked)
    assert blocked, answer


# Grants: the same route machinery, a host of the user's choosing, and the new ways to send.

def test_a_grant_sends_basic_to_its_pinned_host_only(ca2, proxy, report: Report) -> None:
    upstream = TLSUpstream(ca2[1])
    port, log = proxy(upstream, GITHUB)
    answer = exchange(port, b"GET /github/o/r.git/info/refs?service=git-upload-pack HTTP/1.1\r\nHost: 127.0.0.1:3128\r\n"
                      b"Authorization: Basic cGxhY2Vob2xkZXI=\r\n\r\n")
    head = upstream.received().split(b"\r\n\r\n")[0]
    works = status(answer) == b"200" and head.startswith(b"GET /o/r.git/info/refs?service=git-upload-pack HTTP/1.1\r\n"
                                                          b"Host: github.com\r\n")
    report.legit(works)
    assert works and head.count(b"Authorization:") == 1 and BASIC in head
    line = entries(log)[0]
    assert (line["route"], line["grant"], line["method"], line["path"], line["status"]) == (
        "github", True, "GET", "/o/r.git/info/refs", 200)
    assert REAL not in log.read_text() and "cGxhY2Vob2xkZXI" not in log.read_text()


def test_query_mode_replaces_the_client_value_and_never_logs_the_query(ca2, proxy, report: Report) -> None:
    upstream = TLSUpstream(ca2[1])
    port, log = proxy(upstream, MAPS)
    answer = exchange(port, b"GET /maps/geo?key=evil&q=1&k%65y=evil2 HTTP/1.1\r\nHost: x\r\nx-api-key: no\r\n\r\n")
    head = upstream.received().split(b"\r\n\r\n")[0]
    sent = head.split(b"\r\n")[0]
    blocked = b"evil" not in head and b"x-api-key" not in head.lower()
    report.attack(blocked)
    report.legit(status(answer) == b"200" and sent == b"GET /geo?q=1&key=" + REAL.encode() + b" HTTP/1.1")
    assert blocked and sent == b"GET /geo?q=1&key=" + REAL.encode() + b" HTTP/1.1"
    assert entries(log)[0]["path"] == "/geo" and REAL not in log.read_text()


def test_a_grant_upstream_outside_ssl_cert_file_never_sees_the_key(ca2, proxy, tmp_path: Path, report: Report) -> None:
    """Pinned to the right address under the right name, but signed by a CA the proxy was not told to
    trust (no SSL_CERT_FILE for it): 502, and the key never leaves."""
    _, other = make_ca(tmp_path, ("github.com",))
    upstream = TLSUpstream(other)
    port, log = proxy(upstream, GITHUB)
    answer = exchange(port, b"GET /github/o/r.git/info/refs HTTP/1.1\r\nHost: x\r\n\r\n")
    blocked = status(answer) == b"502" and b"certificate" in answer.lower() and b"Basic" not in upstream.received()
    report.attack(blocked)
    assert blocked, answer
    assert entries(log)[0]["decision"] == "unreachable"
