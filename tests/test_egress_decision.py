"""The one egress decision (relay/policy/egress.py): a golden table of verdicts, and its invariants (hypothesis).

The table is the policy as a reader would state it; a change in any verdict or reason shows here
as a one-row diff. The properties check what must hold for every input: an IP literal never falls
under a wildcard, an internal address is reached only through a pin or an entry naming it, the
most specific rule decides, and a name the policy refuses is never looked up.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.config.load import load_matrix, load_shipped
from relay.config.profiles import resolve_profile
from relay.egress.rulebook import decide as proxy_decide
from relay.host.fs_view import HostFs
from relay.model.allow_rules import (
    HostRule,
    find_rule,
    is_internal_address,
    is_ip_literal,
    is_unspecified_target,
    normalize_host,
)
from relay.model.errors import RefusedError
from relay.model.host_facts import HostFacts
from relay.plan.resolve import Request, resolve
from relay.policy.egress import IP_NOT_LISTED, NOT_LISTED, Decision, allowed_rules, as_entries, decide, parse_entries

from .conftest import Sandbox
from .props import examples

PUBLIC = "93.184.216.34"
RULES = parse_entries((
    "api.test", "api.test:80", "*.svc.test", "deep.svc.test:8443", "web.svc.test=127.0.0.1:4443",
    "pinned.test=10.0.0.7:9000", PUBLIC, "10.0.0.5:8080", "0.0.0.0:8080",
    "zero.test:80=0.0.0.0:8080", "v6.test=[2001:db8::1]:443",
))
NEEDS_DNS = ("deny", "needs DNS", (), True)

# (host, port, resolved or None) -> (kind, reason, addrs, needs_dns)
GOLDEN: list[tuple[str, int, tuple[str, ...] | None, tuple[str, str, tuple[tuple[str, int], ...], bool]]] = [
    # An unpinned name: DNS decides, and every answer must be public.
    ("api.test", 443, None, NEEDS_DNS),
    ("api.test", 443, (PUBLIC,), ("allow", "allowlisted", ((PUBLIC, 443),), False)),
    ("api.test", 443, (PUBLIC, "2606:2800:220:1::1"),
     ("allow", "allowlisted", ((PUBLIC, 443), ("2606:2800:220:1::1", 443)), False)),
    ("api.test", 443, (PUBLIC, "10.0.0.1"),
     ("deny", "resolves to internal address 10.0.0.1; pin it with NAME=ADDR:PORT", (), False)),
    ("api.test", 443, ("::ffff:127.0.0.1",),
     ("deny", "resolves to internal address ::ffff:127.0.0.1; pin it with NAME=ADDR:PORT", (), False)),
    ("api.test", 443, ("0.0.0.0",),
     ("deny", "resolves to internal address 0.0.0.0; pin it with NAME=ADDR:PORT", (), False)),
    ("api.test", 443, (), ("unreachable", "api.test resolves to no address", (), False)),
    ("api.test", 80, (PUBLIC,), ("allow", "allowlisted", ((PUBLIC, 80),), False)),
    ("api.test", 8080, None, ("deny", NOT_LISTED, (), False)),
    ("evil.test", 443, None, ("deny", NOT_LISTED, (), False)),
    ("evil.test", 443, (PUBLIC,), ("deny", NOT_LISTED, (), False)),
    # Wildcards: subdomains only, a longer rule over the wildcard, an exact pin over both.
    ("x.svc.test", 443, None, NEEDS_DNS),
    ("a.b.svc.test", 443, (PUBLIC,), ("allow", "allowlisted", ((PUBLIC, 443),), False)),
    ("svc.test", 443, None, ("deny", NOT_LISTED, (), False)),
    ("deep.svc.test", 8443, None, NEEDS_DNS),
    ("deep.svc.test", 80, None, ("deny", NOT_LISTED, (), False)),
    ("web.svc.test", 443, (PUBLIC,), ("allow", "pinned to 127.0.0.1:4443", (("127.0.0.1", 4443),), False)),
    # Pins: the pin is what is connected to, whatever DNS says; an internal pin is allowed.
    ("pinned.test", 443, None, ("allow", "pinned to 10.0.0.7:9000", (("10.0.0.7", 9000),), False)),
    ("pinned.test", 443, ("10.9.9.9",), ("allow", "pinned to 10.0.0.7:9000", (("10.0.0.7", 9000),), False)),
    ("pinned.test", 8443, None, ("deny", NOT_LISTED, (), False)),
    ("v6.test", 443, None, ("allow", "pinned to 2001:db8::1:443", (("2001:db8::1", 443),), False)),
    # IP literals: listed as themselves or refused (`*.3.4` cannot even be written: a name that ends
    # in a number is an IPv4 spelling, relay/model/hostname.py).
    ("1.2.3.4", 443, None, ("deny", IP_NOT_LISTED, (), False)),
    ("1.2.3.4", 443, ("1.2.3.4",), ("deny", IP_NOT_LISTED, (), False)),
    ("::ffff:1.2.3.4", 443, None, ("deny", IP_NOT_LISTED, (), False)),
    (PUBLIC, 443, None, ("allow", "IP listed explicitly", ((PUBLIC, 443),), False)),
    (PUBLIC, 80, None, ("deny", NOT_LISTED, (), False)),
    ("10.0.0.5", 8080, None, ("allow", "IP listed explicitly", (("10.0.0.5", 8080),), False)),
    ("10.0.0.6", 8080, None, ("deny", IP_NOT_LISTED, (), False)),
    ("169.254.169.254", 80, None, ("deny", IP_NOT_LISTED, (), False)),
    # 0.0.0.0 and :: reach the host's own listeners: never, however listed or pinned.
    ("0.0.0.0", 8080, None, ("deny", "0.0.0.0 is never a connect target (it reaches the host itself)", (), False)),
    ("zero.test", 80, None, ("deny", "0.0.0.0 is never a connect target (it reaches the host itself)", (), False)),
]


@pytest.mark.parametrize(("host", "port", "resolved", "want"), GOLDEN,
                         ids=[f"{h}:{p}{'' if r is None else '=' + ','.join(r)}" for h, p, r, _ in GOLDEN])
def test_golden_decisions(host: str, port: int, resolved: tuple[str, ...] | None,
                          want: tuple[str, str, tuple[tuple[str, int], ...], bool]) -> None:
    d = decide(RULES, host, port, resolved)
    assert (d.kind, d.reason, d.addrs, d.needs_dns) == want
    assert (d.host, d.port) == (host, port)
    assert d.cause == ("no address" if d.unreachable else "")


def test_the_proxy_resolves_only_when_the_decision_asks() -> None:
    """The I/O wrapper: DNS for an unpinned name alone, so a refused name never leaves as a query."""
    asked: list[str] = []

    def resolver(host: str, port: int) -> list[str]:
        asked.append(host)
        return [PUBLIC]

    for host, port, resolved, want in GOLDEN:
        if resolved is not None:
            continue
        asked.clear()
        d = proxy_decide(RULES, host, port, resolver)
        assert asked == ([host] if want[3] else []), host
        assert not d.needs_dns
        if not want[3]:
            assert d == decide(RULES, host, port), host
    assert proxy_decide(RULES, "api.test", 443, resolver).addrs == ((PUBLIC, 443),)


def test_a_failed_lookup_is_an_io_outcome() -> None:
    def fails(host: str, port: int) -> list[str]:
        raise OSError(-2, "Name or service not known")

    d = proxy_decide(RULES, "api.test", 443, fails)
    assert (d.kind, d.cause, d.reason) == ("unreachable", "cannot resolve",
                                           "cannot resolve api.test: Name or service not known")


# allowed_rules: the one answer to "which hosts may this backend reach".

def test_allowed_rules_per_backend_and_profile() -> None:
    backends = load_shipped()
    agent, default = resolve_profile("agent", {}), resolve_profile("default", {})
    extra = parse_entries(("fake.test:8443=127.0.0.1:9", "api.anthropic.com"))
    claude = allowed_rules(backends["claude"], agent, extra)
    assert as_entries(claude) == tuple(dict.fromkeys(backends["claude"].egress + ("fake.test:8443=127.0.0.1:9",)))
    assert all(isinstance(r, HostRule) for r in claude)
    assert allowed_rules(backends["shell"], agent) == ()
    assert allowed_rules(backends["claude"], default) == ()
    with pytest.raises(RefusedError, match="no network, so --allow-host cannot be honoured"):
        allowed_rules(backends["claude"], default, extra)


# Properties.

_label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
_names = st.lists(_label, min_size=1, max_size=4).map(".".join).filter(lambda n: not n.split(".")[-1].isdigit())  # a numeric last label is IPv4
_v4 = st.ip_addresses(v=4).map(str)
_v6 = st.ip_addresses(v=6).map(str)
_ips = st.one_of(_v4, _v6, _v4.map(lambda a: "::ffff:" + a)).map(normalize_host)
_ports = st.sampled_from([80, 443, 8443])
_internal = st.one_of(_v4, _v6).filter(is_internal_address)


@st.composite
def _rule(draw: st.DrawFn, names: st.SearchStrategy[str] = _names, pins: bool = True) -> HostRule:
    wildcard = draw(st.booleans())
    pinned = pins and not wildcard and draw(st.booleans())
    return HostRule(name=draw(names), port=draw(st.sampled_from([None, 80, 8443])), wildcard=wildcard,
                    pin_addr=draw(st.sampled_from(["10.0.0.7", PUBLIC, "2001:db8::1"])) if pinned else None,
                    pin_port=9000 if pinned else None)


@settings(max_examples=examples(300), deadline=None)
@given(ip=_ips, cut=st.integers(1, 3), port=_ports)
def test_an_ip_literal_never_matches_a_wildcard(ip: str, cut: int, port: int) -> None:
    # The wildcard is cut from the address's own text (`*.3.4` for 1.2.3.4), the worst case.
    tail = ip.rsplit(":", 1)[-1].split(".")[-cut:] if "." in ip else [ip.rsplit(":", 1)[-1] or "0"]
    rules = (HostRule(".".join(tail), None if port == 443 else port, wildcard=True),)
    assert not rules[0].matches(ip, port)
    assert find_rule(rules, ip, port) is None
    assert decide(rules, ip, port, (PUBLIC,)) == Decision(False, ip, port, IP_NOT_LISTED)


@settings(max_examples=examples(300), deadline=None)
@given(rules=st.lists(_rule(pins=False), max_size=6), host=_names, port=_ports,
       addrs=st.lists(st.one_of(_v4, _v6), max_size=3), bad=_internal, at=st.integers(0, 3))
def test_an_internal_address_without_a_pin_is_always_denied(
        rules: list[HostRule], host: str, port: int, addrs: list[str], bad: str, at: int) -> None:
    # A name that matches some rule (or none) and resolves to at least one internal address.
    rules = [*rules, HostRule(host, None if port == 443 else port)]
    resolved = (*addrs[:at], bad, *addrs[at:])
    d = decide(tuple(rules), host, port, resolved)
    assert not d.allowed and not d.needs_dns
    assert d.reason.startswith("resolves to internal address ")


@settings(max_examples=examples(300), deadline=None)
@given(rules=st.lists(_rule(pins=False), max_size=4), ip=st.one_of(_v4, _v6).filter(is_internal_address),
       port=_ports)
def test_an_internal_ip_literal_is_reached_only_when_listed_as_itself(rules: list[HostRule], ip: str, port: int) -> None:
    # Listing it is the explicit consent, except for 0.0.0.0/8 and `::` (the host's own listeners).
    ip = normalize_host(ip)
    d = decide(tuple(rules), ip, port, (ip,))
    assert not d.allowed and d.reason == IP_NOT_LISTED
    listed = (*rules, HostRule(ip, None if port == 443 else port))
    assert decide(listed, ip, port).allowed == (not is_unspecified_target(ip))


@settings(max_examples=examples(300), deadline=None)
@given(data=st.data(), host=st.lists(_label, min_size=2, max_size=4).map(".".join).filter(lambda n: not is_ip_literal(n)),
       port=_ports)
def test_the_most_specific_rule_decides(data: st.DataObject, host: str, port: int) -> None:
    # Rules that all could cover `host`: itself, and wildcards over its parent domains.
    parents = [host.split(".", i)[-1] for i in range(1, host.count(".") + 1)]
    names = st.sampled_from([host, *parents])
    rules = tuple(data.draw(st.lists(_rule(names), min_size=1, max_size=6)))
    winner = find_rule(rules, host, port)
    matching = [r for r in rules if r.matches(host, port)]
    if winner is None:
        assert not matching and decide(rules, host, port, (PUBLIC,)).reason == NOT_LISTED
        return
    assert winner.specificity == max(r.specificity for r in matching)
    assert winner is next(r for r in matching if r.specificity == winner.specificity)  # the first of equals
    for resolved in (None, (PUBLIC,), ("10.1.2.3",)):
        assert decide(rules, host, port, resolved) == decide((winner,), host, port, resolved)


def test_the_plan_carries_the_rules_the_proxy_gets(sandbox: Sandbox) -> None:
    """`Plan.rules` is `allowed_rules`' answer as HostRules; `egress` is only their text, and the JSON
    keeps its keys (`egress`, `egress_rules`) without a new one."""
    env = {k: v for k, v in sandbox.env.items() if k != "HIVE_RELAY_CONFIG"}
    matrix = load_matrix(env, None)
    facts = HostFacts(uid=1000, gid=1000, home=str(sandbox.home), user="u", shell="/bin/bash", tty=False,
                      bwrap="/usr/bin/bwrap", bwrap_version="0.8.0", seccomp=True, box_python="/usr/bin/python3")
    pin = "fake.test:8443=127.0.0.1:9999"
    request = Request(backend="claude", workdir=str(sandbox.workdir), run_id="1-test", allow_hosts=(pin,))
    plan = resolve(matrix.backends["claude"], matrix, request, facts, env, fs=HostFs())
    want = allowed_rules(matrix.backends["claude"], resolve_profile("agent", {}), parse_entries((pin,)))
    assert plan.rules == want and plan.egress == as_entries(want)
    data = plan.to_json()
    assert "rules" not in data and json.loads(json.dumps(data))["egress"] == list(plan.egress)
    assert {e["host"] for e in data["egress_rules"]} >= {"api.anthropic.com:443", "fake.test:8443"}


def test_a_decision_recorded_after_the_log_closed_still_lands(tmp_path) -> None:  # noqa: ANN001
    """proxy.stop() closes the log while a worker may still be ending a connection: its line is
    appended (the file made if it is the first), never dropped; a special file there is an error, no block."""
    import os

    from relay.egress.decision_log import DecisionLog

    path = tmp_path / "logs" / "run.jsonl"
    log = DecisionLog(str(path), "shell")
    log.record(Decision(False, "a.example", 443, NOT_LISTED), "CONNECT")
    log.close()
    log.record(Decision(False, "b.example", 443, NOT_LISTED), "CONNECT")
    hosts = [json.loads(line)["host"] for line in path.read_text().splitlines()]
    assert hosts == ["a.example", "b.example"] and log.write_errors == 0 and log.denied["b.example:443"] == 1
    quiet = DecisionLog(str(tmp_path / "logs" / "quiet.jsonl"), "shell")
    quiet.close()
    quiet.record(Decision(False, "c.example", 443, NOT_LISTED), "CONNECT")
    assert json.loads((tmp_path / "logs" / "quiet.jsonl").read_text())["host"] == "c.example"
    os.mkfifo(tmp_path / "logs" / "fifo.jsonl")
    odd = DecisionLog(str(tmp_path / "logs" / "fifo.jsonl"), "shell")
    odd.close()
    odd.record(Decision(False, "d.example", 443, NOT_LISTED), "CONNECT")
    assert odd.write_errors == 1
