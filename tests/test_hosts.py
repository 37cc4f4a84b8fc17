"""Allowlist entries and the proxy's request parser: exact rules plus hostile input (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.errors import UsageError
from relay.hosts import find_rule, is_internal_address, parse_rule
from relay.proxy import RequestError, decide, parse_head


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


def test_internal_addresses() -> None:
    for addr in ("127.0.0.1", "10.1.2.3", "192.168.0.1", "169.254.169.254", "::1", "fe80::1", "::ffff:127.0.0.1", "224.0.0.1"):
        assert is_internal_address(addr), addr
    assert not is_internal_address("93.184.216.34")


def test_decide_pins_and_rebinding() -> None:
    r = rules("api.test", "pinned.test=127.0.0.1:1")
    assert decide(r, "pinned.test", 443, lambda h, p: []).allowed
    rebinding = decide(r, "api.test", 443, lambda h, p: ["10.0.0.5"])
    assert not rebinding.allowed and "internal address 10.0.0.5" in rebinding.reason
    public = decide(r, "api.test", 443, lambda h, p: ["93.184.216.34"])
    assert public.allowed and public.addrs == (("93.184.216.34", 443),)


def test_parse_head_forms() -> None:
    assert parse_head(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test") == ("CONNECT", "api.test", 443, None)
    method, host, port, rewritten = parse_head(b"GET http://a.test:8080/x?y HTTP/1.1\r\nHost: a.test\r\nProxy-Authorization: z")
    assert (method, host, port) == ("GET", "a.test", 8080)
    assert rewritten.startswith(b"GET /x?y HTTP/1.1\r\n") and b"Proxy-Authorization" not in rewritten
    for bad in (b"GET /relative HTTP/1.1", b"CONNECT a.test HTTP/1.1", b"GET ftp://a/ HTTP/1.1", b"garbage",
                b"GET http://user:pw@a.test/ HTTP/1.1"):
        with pytest.raises(RequestError):
            parse_head(bad)


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=300))
def test_allow_host_parser_never_crashes(entry: str) -> None:
    try:
        rule = parse_rule(entry)
    except UsageError as err:
        assert "\n" not in str(err)
        return
    assert rule.name and rule.name == rule.name.lower()
    assert find_rule((rule,), "unrelated-host-name.invalid", 443) is None or rule.wildcard


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2000))
def test_request_parser_never_crashes(head: bytes) -> None:
    try:
        method, host, port, _ = parse_head(head)
    except RequestError:
        return
    assert 0 < port < 65536 and host
