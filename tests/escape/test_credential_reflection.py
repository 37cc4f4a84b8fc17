"""Red-team of the credential routes: an upstream that answers with the request (TRACE, an echo or
debug endpoint, a redirect or error page that repeats the URL) must not carry the real key back
into the box. Each attack has its twin: the legitimate request on the same route still works.

Real parts: the real EgressProxy, real TLS upstreams on 127.0.0.1 under the route's name with a
throwaway CA, pinned by an `--allow-host`-style rule (fixtures from test_credential_smuggling).
"""

from __future__ import annotations

import pytest

from .conftest import Report
from .test_credential_smuggling import ANTHROPIC, GITHUB, ca2, proxy  # noqa: F401 - pytest fixtures
from .test_credential_smuggling import status as status_of
from .test_credentials import REAL, TLSUpstream, entries, exchange

H = b"Host: 127.0.0.1:3128\r\n"


def reflect(head: bytes) -> bytes:
    """What TRACE (Apache's default TraceEnable On) or a debug endpoint answers: the request itself."""
    return b"HTTP/1.1 200 OK\r\nContent-Type: message/http\r\nContent-Length: %d\r\n\r\n" % len(head) + head


@pytest.mark.parametrize("method", [b"TRACE", b"TRACK", b"DEBUG"])
@pytest.mark.parametrize("route", [ANTHROPIC, GITHUB], ids=["header", "basic-grant"])
def test_an_echoing_method_is_refused_before_the_key_is_added(ca2, proxy, method: bytes, route,  # noqa: F811
                                                              report: Report) -> None:
    upstream = TLSUpstream(ca2[1], reflect)
    port, log = proxy(upstream, route)
    answer = exchange(port, method + b" /" + route.name.encode() + b"/ HTTP/1.1\r\n" + H + b"\r\n")
    blocked = status_of(answer) == b"405" and upstream.conns == [] and REAL.encode() not in answer
    report.attack(blocked)
    assert blocked, answer
    line = entries(log)[0]
    assert line["decision"] == "deny" and line["route"] == route.name and REAL not in log.read_text()
    # twin: the same route carries the methods an API or git uses.
    twin = TLSUpstream(ca2[1])
    port, _ = proxy(twin, route)
    for verb in (b"GET", b"POST", b"HEAD", b"OPTIONS"):
        body = b"Content-Length: 0\r\n" if verb == b"POST" else b""
        assert status_of(exchange(port, verb + b" /" + route.name.encode() + b"/x HTTP/1.1\r\n" + H + body + b"\r\n")) == b"200"
    report.legit(len(twin.conns) == 4)
    assert len(twin.conns) == 4
