"""`--allow-host` that cannot be misused silently: loopback entries refused with the pinned form as the
fix, the most specific rule wins (a pin over the backend's own unpinned entry), public-suffix
wildcards refused (the bundled Public Suffix List, no download), and `--dry-run` shows the rule per host."""

from __future__ import annotations

import json
import socket

import pytest

from relay.model import allow_rules as hosts
from relay.model.allow_rules import explain, find_rule, parse_rule
from relay.model.errors import UsageError

from .conftest import Sandbox


def rules(*entries: str):
    return tuple(parse_rule(e) for e in entries)


@pytest.mark.parametrize("entry", ["localhost", "localhost:8080", "LocalHost.:8080", "api.localhost:9",
                                   "127.0.0.1:8080", "127.1.2.3", "[::1]", "[::1]:8080", "::1",
                                   "[::ffff:127.0.0.1]:80", "localhost:8080=127.0.0.1:8080"])
def test_loopback_entries_are_refused_with_the_pinned_form(entry: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_rule(entry)
    assert "NO_PROXY" in err.value.message and "=127.0.0.1:" in err.value.message and "; fix:" in err.value.message


def test_a_pinned_name_reaching_a_host_service_still_parses() -> None:
    (rule,) = rules("hostsvc.test:8080=127.0.0.1:8080")
    assert (rule.pin_addr, rule.pin_port) == ("127.0.0.1", 8080)


@pytest.mark.parametrize("entry", ["localhost:8080", "127.0.0.1:8080", "[::1]"])
def test_cli_refuses_loopback_with_exit_2(sandbox: Sandbox, entry: str) -> None:
    proc = sandbox.relay("shell", "local", "--dry-run", "--allow-host", entry)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("hive-relay: error: --allow-host") and "=127.0.0.1:" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("entry", ["*.com", "*.co.uk", "*.github.io", "*.uk", "*.googleapis.com", "*.test"])
def test_public_suffix_wildcards_are_refused(sandbox: Sandbox, entry: str) -> None:
    with pytest.raises(UsageError, match="public suffix"):
        parse_rule(entry)
    proc = sandbox.relay("shell", "local", "--dry-run", "--allow-host", entry)
    assert proc.returncode == 2 and "is a public suffix" in proc.stderr, proc.stderr


@pytest.mark.parametrize("entry", ["*.example.com", "*.example.co.uk", "*.me.github.io", "*.wild.test"])
def test_wildcards_under_a_registrable_domain_work(sandbox: Sandbox, entry: str) -> None:
    parse_rule(entry)
    proc = sandbox.relay("shell", "local", "--dry-run", "--json", "--allow-host", entry)
    assert proc.returncode == 0, proc.stderr
    assert entry in json.loads(proc.stdout)["egress"]


def test_the_public_suffix_list_is_bundled_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*a, **k):  # noqa: ANN002, ANN003
        raise AssertionError("the public suffix check touched the network")

    monkeypatch.setattr(hosts, "_PSL", None)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(UsageError):
        parse_rule("*.co.uk")
    assert parse_rule("*.example.co.uk").wildcard


def test_the_most_specific_rule_wins_whatever_the_order() -> None:
    backend_first = rules("api.anthropic.com", "api.anthropic.com:443=127.0.0.1:8443")
    user_first = rules("api.anthropic.com:443=127.0.0.1:8443", "api.anthropic.com")
    for r in (backend_first, user_first):
        assert find_rule(r, "api.anthropic.com", 443).pin_addr == "127.0.0.1"
    r = rules("*.example.com", "*.api.example.com", "x.api.example.com:443")
    assert find_rule(r, "x.api.example.com", 443).render() == "x.api.example.com:443"
    assert find_rule(r, "y.api.example.com", 443).render() == "*.api.example.com"
    assert find_rule(r, "z.example.com", 443).render() == "*.example.com"
    assert find_rule(r, "x.api.example.com", 80) is None


def test_explain_names_the_winner_and_what_it_overrides() -> None:
    r = rules("api.anthropic.com", "claude.ai", "api.anthropic.com:443=127.0.0.1:8443", "*.example.com")
    table = {e["host"]: e for e in explain(r)}
    assert table["api.anthropic.com:443"] == {"host": "api.anthropic.com:443", "rule": "api.anthropic.com:443=127.0.0.1:8443",
                                              "action": "pinned to 127.0.0.1:8443", "overrides": ["api.anthropic.com"],
                                              "tunnel": "TLS only, SNI api.anthropic.com"}
    assert table["claude.ai:443"]["overrides"] == [] and "DNS" in table["claude.ai:443"]["action"]
    assert table["*.example.com:443"]["rule"] == "*.example.com"


def test_dry_run_shows_the_rule_per_host(sandbox: Sandbox) -> None:
    pin = "api.anthropic.com:443=127.0.0.1:8443"
    proc = sandbox.relay("claude", "local", "--dry-run", "--json", "--allow-host", pin)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert "api.anthropic.com" in data["egress"] and pin in data["egress"]  # the existing key is unchanged
    table = {e["host"]: e for e in data["egress_rules"]}
    assert table["api.anthropic.com:443"]["rule"] == pin
    assert table["api.anthropic.com:443"]["overrides"] == ["api.anthropic.com"]
    assert set(table) == {"api.anthropic.com:443", "claude.ai:443", "platform.claude.com:443"}
    text = sandbox.relay("claude", "local", "--dry-run", "--allow-host", pin)
    assert (f"api.anthropic.com:443 ← {pin} (pinned to 127.0.0.1:8443; overrides api.anthropic.com; "
            "TLS only, SNI api.anthropic.com)") in text.stdout
