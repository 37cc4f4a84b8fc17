"""Allowlist entries and the proxy's request parser: exact rules plus hostile input (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.egress.http_head import Body, RequestError, parse_head
from relay.egress.rulebook import decide
from relay.model.allow_rules import find_rule, is_internal_address, is_unspecified_target, parse_rule
from relay.model.errors import UsageError

from .props import examples


def rules(*entries: str):
    return tuple(parse_rule(e) for e in entries)


def test_case_and_trailing_dot_are_normalised() -> None:
    r = rules("API.Anthropic.COM.")
    assert find_rule(r, "api.anthropic.com", 443)
    assert r[0].render() == "api.anthropic.com"


def test_wildcard_is_subdomains_only() -> None:
    r = rules("*.example.com")
    assert find_rule(r, "a.example.com", 443) and find_rule(r, "a.b.example.com", 443)
    assert not find_rule(r, "example.com", 443)
    assert not find_rule(r, "badexample.com", 443)


def test_port_defaults_to_443_and_is_exact() -> None:
    r = rules("a.test", "b.test:8443")
    assert find_rule(r, "a.test", 443) and not find_rule(r, "a.test", 80)
    assert find_rule(r, "b.test", 8443) and not find_rule(r, "b.test", 443)


def test_pin_parsing() -> None:
    (rule,) = rules("fake.test:8443=127.0.0.1:9999")
    assert (rule.name, rule.port, rule.pin_addr, rule.pin_port) == ("fake.test", 8443, "127.0.0.1", 9999)
    (v6,) = rules("v6.test=[::1]:9")
    assert v6.pin_addr == "::1"


@pytest.mark.parametrize("entry", ["", "a b", "*.1.2.3.4", "x.test:0", "x.test:70000", "x.test=foo:1",
                                   "x.test=1.2.3.4", "*.x.test=1.2.3.4:5", "-bad-.test", "a..b", "x" * 400])
def test_bad_entries_are_usage_errors(entry: str) -> None:
    with pytest.raises(UsageError):
        parse_rule(entry)


INTERNAL = [
    "0.0.0.0", "0.1.2.3", "10.1.2.3", "100.64.0.1", "100.127.255.254", "127.0.0.1", "127.255.255.255",
    "169.254.169.254", "172.16.0.1", "172.31.255.255", "192.0.0.8", "192.0.2.1", "192.88.99.1", "192.168.0.1",
    "198.18.0.1", "198.19.255.255", "198.51.100.7", "203.0.113.9", "224.0.0.1", "239.255.255.250",
    "240.0.0.1", "255.255.255.255",
    "::", "::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1", "::127.0.0.1",
    "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "64:ff9b:1::5db8:d822", "100::1", "2001::1", "2001:1ff::1",
    "2001:db8::1", "2002:7f00:1::1", "2002:a9fe:a9fe::", "2002:a00:1::", "3fff::1", "5f00::1",
    "fc00::1", "fd00:ec2::254", "fe80::1", "fe80::1%lo", "fec0::1", "ff02::1", "not-an-ip",
]
PUBLIC = ["93.184.216.34", "1.1.1.1", "8.8.8.8", "100.128.0.1", "172.32.0.1", "192.0.3.1", "198.20.0.1",
          "223.255.255.255", "2606:4700::1111", "2001:4860:4860::8888", "2001:200::1", "::ffff:93.184.216.34",
          "64:ff9b::5db8:d822", "2002:5db8:d822::1", "2a00:1450::1"]


@pytest.mark.parametrize("addr", INTERNAL)
def test_iana_special_purpose_addresses_are_internal(addr: str) -> None:
    assert is_internal_address(addr)


@pytest.mark.parametrize("addr", PUBLIC)
def test_public_addresses_are_not_internal(addr: str) -> None:
    assert not is_internal_address(addr)


@settings(max_examples=examples(500), deadline=None)
@given(st.ip_addresses())
def test_internal_agrees_with_the_stdlib_where_it_is_sure(ip) -> None:  # noqa: ANN001 - IPv4Address | IPv6Address
    """Everything the stdlib calls loopback/private/link-local/multicast/unspecified is internal; IPv6 outside
    global unicast (2000::/3) is internal; mapped, NAT64 and 6to4 addresses are judged by their IPv4."""
    import ipaddress

    def stdlib_internal(x) -> bool:  # noqa: ANN001
        return x.is_loopback or x.is_private or x.is_link_local or x.is_multicast or x.is_unspecified

    if isinstance(ip, ipaddress.IPv6Address):
        packed = int(ip)
        if ip in ipaddress.ip_network("::ffff:0:0/96") or ip in ipaddress.ip_network("64:ff9b::/96"):
            embedded = ipaddress.IPv4Address(packed & 0xFFFFFFFF)
        elif ip in ipaddress.ip_network("2002::/16"):
            embedded = ipaddress.IPv4Address((packed >> 80) & 0xFFFFFFFF)
        else:
            embedded = None
        if embedded is not None:
            assert is_internal_address(str(ip)) == is_internal_address(str(embedded))
            ip = embedded
        elif ip not in ipaddress.ip_network("2000::/3"):
            assert is_internal_address(str(ip))
    if stdlib_internal(ip):
        assert is_internal_address(str(ip))


def test_unspecified_targets() -> None:
    for addr in ("0.0.0.0", "0.1.2.3", "::", "::ffff:0.0.0.0"):
        assert is_unspecified_target(addr), addr
    for addr in ("127.0.0.1", "::1", "10.0.0.1", "93.184.216.34"):
        assert not is_unspecified_target(addr), addr


def test_zero_address_is_refused_even_listed_or_pinned() -> None:
    r = rules("0.0.0.0:8080", "zero.test:80=0.0.0.0:8080", "v6zero.test:80=[::]:8080", "loop.test:80=127.0.0.1:8080")
    for host, port in (("0.0.0.0", 8080), ("zero.test", 80), ("v6zero.test", 80)):
        decision = decide(r, host, port, lambda h, p: [])
        assert not decision.allowed and "never a connect target" in decision.reason, host
    assert decide(r, "loop.test", 80, lambda h, p: []).allowed  # an explicit pin to loopback stays allowed
    assert not decide(rules("zero.test:80"), "zero.test", 80, lambda h, p: ["0.0.0.0"]).allowed


def test_decide_pins_and_rebinding() -> None:
    r = rules("api.test", "pinned.test=127.0.0.1:1")
    assert decide(r, "pinned.test", 443, lambda h, p: []).allowed
    rebinding = decide(r, "api.test", 443, lambda h, p: ["10.0.0.5"])
    assert not rebinding.allowed and "internal address 10.0.0.5" in rebinding.reason
    public = decide(r, "api.test", 443, lambda h, p: ["93.184.216.34"])
    assert public.allowed and public.addrs == (("93.184.216.34", 443),)


def test_parse_head_forms() -> None:
    connect = parse_head(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test")
    assert (connect.method, connect.host, connect.port, connect.head) == ("CONNECT", "api.test", 443, None)
    req = parse_head(b"GET http://a.test:8080/x?y HTTP/1.1\r\nHost: a.test\r\nProxy-Authorization: z")
    assert (req.method, req.host, req.port, req.framing) == ("GET", "a.test", 8080, "none")
    assert req.head.startswith(b"GET /x?y HTTP/1.1\r\nHost: a.test:8080\r\n") and b"Proxy-Authorization" not in req.head
    assert parse_head(b"GET http://a.test?q HTTP/1.1").head.startswith(b"GET /?q HTTP/1.1\r\nHost: a.test\r\n")
    # Origin form is a box's CLI talking to a credential route: no head until the route is known.
    origin = parse_head(b"POST /anthropic/v1?q HTTP/1.1\r\nHost: 127.0.0.1:3128\r\nx-api-key: p\r\nContent-Length: 2")
    assert (origin.origin, origin.path, origin.head, origin.framing) == (True, "/anthropic/v1?q", None, "length")
    assert origin.kept == ("x-api-key: p", "Content-Length: 2")
    for bad in (b"CONNECT a.test HTTP/1.1", b"GET ftp://a/ HTTP/1.1", b"garbage",
                b"GET http://user:pw@a.test/ HTTP/1.1", b"GET http://a.test/ HTTP/2.0", b"GET http://a.test/\x00 HTTP/1.1"):
        with pytest.raises(RequestError):
            parse_head(bad)


def test_parse_head_rewrites_host_and_drops_hop_by_hop_headers() -> None:
    req = parse_head(b"POST http://a.test/p HTTP/1.1\r\nHost: evil.test\r\nhost: evil2.test\r\nConnection: x-secret, keep-alive\r\n"
                     b"X-Secret: 1\r\nKeep-Alive: 5\r\nProxy-Connection: keep-alive\r\nProxy-Authorization: Basic eA==\r\n"
                     b"TE: trailers\r\nUpgrade: h2c\r\nX-Kept: yes\r\nContent-Length: 3")
    lines = req.head.decode().split("\r\n")
    assert lines[:2] == ["POST /p HTTP/1.1", "Host: a.test"]
    assert [line for line in lines if line.lower().startswith("host")] == ["Host: a.test"]
    assert "X-Kept: yes" in lines and "Content-Length: 3" in lines and lines[-3] == "Connection: close"
    for gone in ("evil", "X-Secret", "Keep-Alive", "Proxy-", "TE:", "Upgrade"):
        assert gone not in req.head.decode(), gone
    assert (req.framing, req.length) == ("length", 3)
    assert parse_head(b"GET http://[::1]:81/ HTTP/1.1").head.split(b"\r\n")[1] == b"Host: [::1]:81"


@pytest.mark.parametrize(("head", "why"), [
    (b"POST http://a.test/ HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked", "both"),
    (b"POST http://a.test/ HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4", "duplicate"),
    (b"POST http://a.test/ HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3", "duplicate"),
    (b"POST http://a.test/ HTTP/1.1\r\nContent-Length: +3", "invalid Content-Length"),
    (b"POST http://a.test/ HTTP/1.1\r\nContent-Length: 3, 3", "invalid Content-Length"),
    (b"POST http://a.test/ HTTP/1.1\r\nContent-Length: \xb2", "invalid Content-Length"),
    (b"POST http://a.test/ HTTP/1.1\r\nTransfer-Encoding: gzip, chunked", "chunked"),
    (b"POST http://a.test/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked", "chunked"),
    (b"POST http://a.test/ HTTP/1.0\r\nTransfer-Encoding: chunked", "chunked"),
    (b"POST http://a.test/ HTTP/1.1\r\nTransfer-Encoding : chunked", "malformed header"),
    (b"POST http://a.test/ HTTP/1.1\r\nX: a\r\n Transfer-Encoding: chunked", "folding"),
    (b"POST http://a.test/ HTTP/1.1\nTransfer-Encoding: chunked", "malformed request line"),
    (b"POST http://a.test/ HTTP/1.1\r\nX: a\rTransfer-Encoding: chunked", "bare CR or LF"),
    (b"POST http://a.test/ HTTP/1.1\r\nExpect: something-else", "Expect"),
])
def test_parse_head_refuses_ambiguous_framing(head: bytes, why: str) -> None:
    with pytest.raises(RequestError, match=why):
        parse_head(head)


def chunked(*pieces: bytes) -> tuple[bytes, Body]:
    body = Body(parse_head(b"POST http://a.test/ HTTP/1.1\r\nTransfer-Encoding: chunked"))
    return b"".join(body.feed(p) for p in pieces), body


def test_chunked_body_is_reframed_byte_by_byte() -> None:
    wire = b"5;ext=1\r\nhello\r\nA\r\n0123456789\r\n0\r\nX-Trailer: t\r\n\r\n"
    whole, body = chunked(wire)
    assert whole == b"5\r\nhello\r\na\r\n0123456789\r\n0\r\n\r\n" and body.done and not body.extra
    split, body = chunked(*(wire[i:i + 1] for i in range(len(wire))))
    assert split == whole and body.done
    _, body = chunked(wire + b"GET http://evil.test/ HTTP/1.1\r\n\r\n")
    assert body.done and body.extra.startswith(b"GET http://evil.test/")


@pytest.mark.parametrize("wire", [b"x\r\n", b"0x5\r\nhello\r\n", b" 5\r\nhello\r\n", b"5\nhello\r\n",
                                  b"5\r\nhelloXX", b"5\r\nhello\n", b"-1\r\n", b"1" * 17 + b"\r\n",
                                  b"0\r\nbad trailer\r\n\r\n", b"5\r\nhello\r\n0\r\n\n"])
def test_invalid_chunked_bodies_are_refused(wire: bytes) -> None:
    with pytest.raises(RequestError):
        chunked(wire)


def test_content_length_body_stops_at_its_end() -> None:
    body = Body(parse_head(b"POST http://a.test/ HTTP/1.1\r\nContent-Length: 5"))
    assert body.want() == 5 and body.feed(b"hel") == b"hel" and not body.done and body.want() == 2
    assert body.feed(b"loGET /2 HTTP/1.1") == b"lo" and body.done and body.extra == b"GET /2 HTTP/1.1"


@settings(max_examples=examples(400), deadline=None)
@given(st.text(max_size=300))
def test_allow_host_parser_never_crashes(entry: str) -> None:
    try:
        rule = parse_rule(entry)
    except UsageError as err:
        assert "\n" not in str(err)
        return
    assert rule.name and rule.name == rule.name.lower()
    assert find_rule((rule,), "unrelated-host-name.invalid", 443) is None or rule.wildcard


@settings(max_examples=examples(400), deadline=None)
@given(st.binary(max_size=2000))
def test_request_parser_never_crashes(head: bytes) -> None:
    try:
        req = parse_head(head)
    except RequestError:
        return
    assert 0 < req.port < 65536 and req.host
    if req.head is not None:  # what goes upstream is one clean head: CRLF lines, one Host, no smuggled framing
        lines = req.head.split(b"\r\n")
        assert lines[-2:] == [b"", b""] and all(b"\n" not in x and b"\r" not in x for x in lines)
        assert sum(x.lower().startswith(b"host:") for x in lines) == 1


def test_a_url_where_a_host_belongs_says_give_a_host(sandbox) -> None:  # noqa: ANN001 - conftest Sandbox
    from relay.model.allow_rules import parse_rule
    from relay.model.errors import UsageError

    for entry, fix in (("https://example.com/x", "example.com"), ("example.com/x", "example.com"),
                       ("http://example.com/x", "--allow-host example.com:80")):
        with pytest.raises(UsageError) as err:
            parse_rule(entry)
        assert "give a host, not a URL" in err.value.message and fix in err.value.message
    assert parse_rule("example.com,path=/v1/").render() == "example.com,path=/v1/"  # a path option is no URL
    proc = sandbox.relay("shell", "--allow-host", "https://example.com/x", "--prompt", "true")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "give a host, not a URL: example.com" in proc.stderr
    assert sorted(p.name for p in sandbox.workdir.iterdir()) == ["README.md"]
