"""Which hosts a run's proxy inspects (terminates TLS for), and what the box is told to trust.

Why: a CLI that takes no base URL talks HTTPS straight to its vendor, and the proxy sees only a
tunnel: no Host header, no method or path, no place to add a key or to search what the box sends.
Inspection is the opt-in that opens it, one named host at a time: `--inspect HOST[:PORT]` for one
run, `,inspect=true` on an egress entry, `inspect: true` on a credential route or an `auth:` grant.
The proxy then terminates that host's TLS with a leaf minted for the name by a CA made for this run
on the host (relay/host/run_ca.py), and the box trusts that CA's certificate, never its key.

Pure: the plan's list of inspected targets from the request and the rules, and the variables that
point every TLS client in the box at the bundle (system roots plus the run CA).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from relay.model.allow_rules import DEFAULT_PORT, HostRule, find_rule, fmt_hostport, is_ip_literal, split_hostport
from relay.model.errors import RefusedError, UsageError
from relay.model.hostname import HostError, canonical_host

TYPE_CHECKING = False
if TYPE_CHECKING:
    from relay.model.backend import CredentialRoute

# Where the box reads the CA bundle (a read-only bind of the run dir's `ca-bundle.pem`).
BOX_CA_BUNDLE = "/run/hive-relay/ca-bundle.pem"
BUNDLE_NAME = "ca-bundle.pem"
# Every variable the usual TLS stacks read for their trust store: OpenSSL (curl, python, git through
# libcurl), node (which adds NODE_EXTRA_CA_CERTS to its own roots), requests, git, curl.
TRUST_VARIABLES = ("SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS", "REQUESTS_CA_BUNDLE", "GIT_SSL_CAINFO", "CURL_CA_BUNDLE")


def parse_target(entry: str) -> tuple[str, int]:
    """One `--inspect HOST[:PORT]`: a canonical host name and its port (443 unless given), or UsageError
    with the fix. A wildcard, an IP address, a pin or an option is no name a leaf can be minted for."""
    shown = entry[:80]
    if not isinstance(entry, str) or not entry or any(ord(c) < 33 or ord(c) > 126 for c in entry) or len(entry) > 300:
        raise UsageError(f"--inspect {shown!r}: not a host name; fix: --inspect api.example.com")
    if entry.startswith("*.") or "=" in entry or "," in entry or "/" in entry:
        raise UsageError(f"--inspect {shown!r}: name one host (no wildcard, pin, option or URL); fix: "
                         "--inspect api.example.com[:PORT], and allow it with --allow-host as usual")
    try:
        name, port = split_hostport(entry, entry)
        name = canonical_host(name)
    except (UsageError, HostError) as err:
        raise UsageError(f"--inspect {shown!r}: not a host name: {str(err).removeprefix('--allow-host ')}; "
                         "fix: --inspect api.example.com") from None
    if is_ip_literal(name):
        raise UsageError(f"--inspect {shown!r}: an IP address, not a name (the leaf and the Host check need a "
                         "name); fix: --inspect the host name the client connects to")
    return name, port or DEFAULT_PORT


def inspected_targets(requested: Sequence[str], rules: Sequence[HostRule],
                      routes: Iterable[CredentialRoute], network: bool, mode: str) -> tuple[tuple[str, int], ...]:
    """The (host, port) pairs this run inspects, in a stable order: each `--inspect`, each rule with
    `,inspect=true`, each used route or grant with `inspect: true`. A requested host the rules do not
    allow is a usage error (inspection opens no host); a run that cannot carry it is refused."""
    out: dict[tuple[str, int], None] = {}
    for entry in requested:
        name, port = parse_target(entry)
        rule = find_rule(tuple(rules), name, port)
        if rule is None:
            raise UsageError(f"--inspect {entry}: {fmt_hostport(name, port)} is not allowed in this run, and "
                             f"inspection opens no host; fix: allow it too: --allow-host {fmt_hostport(name, port)}")
        if not rule.tls:
            raise UsageError(f"--inspect {entry}: its rule {rule.render()} carries any protocol (tls=false), "
                             "not TLS; fix: drop --inspect, or the rule's tls=false")
        out[(name, port)] = None
    for rule in rules:
        if rule.inspect:
            out[(rule.name, rule.port or DEFAULT_PORT)] = None
    for route in routes:
        if route.inspect:
            out[(route.upstream_host, route.upstream_port)] = None
    if out and not network:
        raise RefusedError("inspection needs the egress proxy, and this profile has no network; fix: use "
                           "--profile agent, or drop --inspect")
    if out and mode == "kube":
        raise RefusedError("TLS inspection runs in local and container mode; kube's proxy pod has no run CA "
                           "yet; fix: drop --inspect (and inspect: true) for kube runs")
    return tuple(out)


def route_rules(routes: Iterable[CredentialRoute], rules: Sequence[HostRule]) -> tuple[HostRule, ...]:
    """A rule for each inspected route's upstream the rules do not cover yet: `inspect: true` on a route
    lets the box reach the route's own host directly (the key is added there and nowhere else)."""
    extra = []
    for route in routes:
        if route.inspect and find_rule(tuple(rules), route.upstream_host, route.upstream_port) is None:
            extra.append(HostRule(route.upstream_host, route.upstream_port, inspect=True))
    return tuple(extra)


def trust_env() -> dict[str, str]:
    """The box's trust variables, all naming the bundle."""
    return dict.fromkeys(TRUST_VARIABLES, BOX_CA_BUNDLE)


def shown(targets: Iterable[tuple[str, int]]) -> tuple[str, ...]:
    """`host:port` for each target (the plan's `inspected_hosts`)."""
    return tuple(fmt_hostport(h, p) for h, p in targets)
