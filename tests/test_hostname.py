"""One canonical name, one decision (relay/model/hostname.py): every spelling of an allowed name is refused
or decided exactly like the canonical name, through the rules' parser and the request parser alike."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.egress.http_head import RequestError, parse_head
from relay.model.allow_rules import parse_rule
from relay.model.errors import UsageError
from relay.model.hostname import HostError, canonical_host, ipv4_spelling
from relay.policy.egress import IP_NOT_LISTED, decide, parse_entries

from .props import examples

RULES = parse_entries(("api.example.com", "*.svc.example.org", "pinned.example.net=10.0.0.7:9000",
                       "xn--bcher-kva.example", "93.184.216.34"))
ALLOWED = ("api.example.com", "a.svc.example.org", "pinned.example.net", "xn--bcher-kva.example")


def _decide(host: str, port: int = 443) -> tuple[object, ...]:
    d = decide(RULES, host, port, ("93.184.216.34",))
    return d.kind, d.reason, d.addrs


def _connect(spelling: str) -> str:
    """What the proxy's parser makes of a CONNECT to `spelling`:443 (RequestError: refused, a 400)."""
    return parse_head(f"CONNECT {spelling}:443 HTTP/1.1".encode("latin-1")).host


@pytest.mark.parametrize(("spelling", "canonical"), [
    ("API.Example.COM", "api.example.com"), ("api.example.com.", "api.example.com"),
    ("b\u00fccher.example", "xn--bcher-kva.example"), ("XN--BCHER-KVA.example", "xn--bcher-kva.example"),
    ("2130706433", "127.0.0.1"), ("0177.0.0.1", "127.0.0.1"), ("0x7f.0.0.1", "127.0.0.1"), ("0x7f000001", "127.0.0.1"),
    ("127.1", "127.0.0.1"), ("127.0.1", "127.0.0.1"), ("[::FFFF:7f00:1]", "::ffff:127.0.0.1"), ("1.2.3.4.", "1.2.3.4"),
])
def test_spellings_become_the_canonical_form(spelling: str, canonical: str) -> None:
    assert canonical_host(spelling) == canonical


@pytest.mark.parametrize("bad", [
    "api.example.com\x00.evil.test", "api.example.com ", " api.example.com", "api\t.example.com", "a@api.example.com",
    "user:pw@api.example.com", "api%2eexample.com", "api.example.com..", ".api.example.com", "api..example.com",
    "fe80::1%eth0", "[fe80::1%25eth0]", "xn--zz.example", "xn--.example", "stra\u00dfe.example", "-api.example.com",
    "1.2.3.4.5", "256.1.1.1", "08.1.1.1", "0x1g.1.1.1", "example.123", "a" * 64 + ".example", "x." * 127 + "example",
    "api.example.com/evil", "api.example.com\\evil", "", "\u0430pi.example.com\u200d",
])
def test_what_cannot_be_made_canonical_is_refused(bad: str) -> None:
    with pytest.raises(HostError):
        canonical_host(bad)
    with pytest.raises((UsageError, ValueError)):
        parse_rule(bad)


@pytest.mark.parametrize("bad", ["api.example.com%00", "api.example.com%2f", "a@api.example.com", "2130706433",
                                 "api.example.com..", "[fe80::1%25eth0]"])
def test_the_proxy_refuses_or_canonicalises_a_connect_target(bad: str) -> None:
    try:
        host = _connect(bad)
    except RequestError:
        return
    assert host == canonical_host(bad)
    assert _decide(host)[0] == "deny"


def test_ports_outside_1_to_65535_and_odd_digits_are_refused() -> None:
    for port in ("0", "65536", "+443", "0x1bb", "\u0664\u0664\u0663", "443 ", "-1", "99999999999"):
        with pytest.raises(RequestError):
            parse_head(f"CONNECT api.example.com:{port} HTTP/1.1".encode())
        with pytest.raises(UsageError):
            parse_rule(f"api.example.com:{port}")


def test_numeric_ipv4_spellings_are_ip_literals_and_refused_unless_listed() -> None:
    for spelling in ("2130706433", "0177.0.0.1", "0x7f.1", "127.1", "3232235777", "0xa9fea9fe"):
        host = _connect(spelling)
        assert host in ("127.0.0.1", "192.168.1.1", "169.254.169.254")
        assert _decide(host)[:2] == ("deny", IP_NOT_LISTED)
    # The twin: the listed address, in any spelling, is that listed rule.
    assert _decide(_connect("1572395042"))[0] == "allow"  # 93.184.216.34


def test_the_ipv4_parser_agrees_with_inet_aton() -> None:
    for spelling in ("1", "0x1", "010", "1.2", "1.0x2.3", "0377.0377.0377.0377", "4294967295", "1.16777215"):
        assert ipv4_spelling(spelling) == socket.inet_ntoa(socket.inet_aton(spelling))


_case = st.lists(st.booleans(), min_size=80, max_size=80)


@st.composite
def _spelling(draw: st.DrawFn) -> tuple[str, str]:
    """(a canonical allowed name, one spelling of it: case, trailing dots, inserted odd characters,
    userinfo, percent-encoding, Unicode forms of its punycode label)."""
    name = draw(st.sampled_from(ALLOWED))
    text = name.replace("xn--bcher-kva", draw(st.sampled_from(["xn--bcher-kva", "b\u00fccher", "B\u00dcCHER"])))
    flips = draw(_case)
    text = "".join(c.upper() if flips[i % len(flips)] else c for i, c in enumerate(text))
    text += draw(st.sampled_from(["", ".", ".."]))
    if draw(st.booleans()):
        at = draw(st.integers(0, len(text)))
        junk = draw(st.sampled_from(["\x00", "%00", "%2e", " ", "\t", "@", "user@", "\u200b", "\\", "/", ":", "..", "\x7f"]))
        text = text[:at] + junk + text[at:]
    return name, text


@settings(max_examples=examples(600), deadline=None)
@given(_spelling())
def test_a_spelling_of_an_allowed_name_is_refused_or_decided_like_the_name(pair: tuple[str, str]) -> None:
    name, spelling = pair
    want = _decide(name)
    try:
        canonical = canonical_host(spelling)
    except HostError:
        canonical = None
    if canonical is not None:
        assert canonical == name or _decide(canonical)[0] == "deny", (spelling, canonical)
        if canonical == name:
            assert _decide(canonical) == want
    # The request parser: the same verdict, or a 400.
    try:
        host = parse_head(f"CONNECT {spelling}:443 HTTP/1.1".encode()).host
    except (RequestError, UnicodeError):
        return
    assert host == canonical
    assert _decide(host) == want or _decide(host)[0] == "deny"


@settings(max_examples=examples(400), deadline=None)
@given(value=st.integers(0, 2**32 - 1), parts=st.integers(1, 4), bases=st.lists(st.sampled_from("dox"), min_size=4,
                                                                                max_size=4))
def test_every_ipv4_spelling_is_recognised_as_that_address(value: int, parts: int, bases: list[str]) -> None:
    octets = list(value.to_bytes(4, "big"))
    numbers = octets[:parts - 1] + [int.from_bytes(bytes(octets[parts - 1:]), "big")]
    fmt = {"d": str, "o": lambda n: "0" + format(n, "o"), "x": lambda n: hex(n)}
    spelling = ".".join(fmt[b](n) for b, n in zip(bases[:parts], numbers, strict=True))
    address = socket.inet_ntoa(value.to_bytes(4, "big"))
    assert canonical_host(spelling) == address
    assert _connect(spelling) == address
    listed = address == "93.184.216.34"
    assert _decide(address)[0] == ("allow" if listed else "deny")
