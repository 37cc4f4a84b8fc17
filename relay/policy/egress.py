"""The egress policy: which hosts a box may reach, and the one decision on each connection.

Two questions, one function each, both pure (no socket, no DNS, no clock):

- `allowed_rules(backend, profile, extra)`: the allowlist a launch gets. The plan stores its
  result (`Plan.rules`) and the proxy is handed those very `HostRule`s, so an entry is parsed
  once, by `hosts.parse_rule` (which config also uses to validate), and never rendered to text
  and parsed back on its way to the proxy.
- `decide(rules, host, port, resolved)`: allow, deny, or unreachable, for one request. The proxy
  only does the I/O around it (parse the request, resolve when asked to, connect, splice, log),
  so what "allowed" means can be read, and tested, in one place.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from relay.model.allow_rules import (
    HostRule,
    find_rule,
    is_internal_address,
    is_ip_literal,
    is_unspecified_target,
    parse_rule,
)
from relay.model.errors import RefusedError
from relay.model.record import record

if TYPE_CHECKING:
    from relay.config.profiles import Profile
    from relay.model.backend import Backend, CredentialRoute

NOT_LISTED = "not in the egress allowlist"
IP_NOT_LISTED = "IP literals are refused unless listed explicitly"


@record
class Decision:
    """`allowed` is the policy's verdict; `unreachable` marks an allowed host that could not be
    reached (no DNS answer, refused, timed out, no route), with `cause` its short name. `addrs` are
    what the proxy connects to, in order: for a pinned name its pin, never what DNS says.

    `needs_dns` is not a verdict: the rule that applies is an unpinned name, so the answer depends
    on what the name resolves to; ask again with the addresses. It exists so that a name the policy
    refuses is never looked up (a lookup alone would carry the name out through DNS)."""

    allowed: bool
    host: str
    port: int
    reason: str
    addrs: tuple[tuple[str, int], ...] = ()
    unreachable: bool = False
    cause: str = ""
    needs_dns: bool = False
    label: str = ""  # a refusal's own class in the log (`sni-mismatch`, `opaque-tunnel`, `http-rule`)

    @property
    def kind(self) -> str:
        return self.label or ("allow" if self.allowed else "unreachable" if self.unreachable else "deny")


def parse_entries(entries: Iterable[str]) -> tuple[HostRule, ...]:
    """`NAME[:PORT][=ADDR:PORT]` entries (config `egress`, `--allow-host`) as rules, in order; the
    first bad entry raises UsageError with its fix."""
    return tuple(parse_rule(entry) for entry in entries)


def allowed_rules(backend: Backend, profile: Profile, extra: Sequence[HostRule] = ()) -> tuple[HostRule, ...]:
    """Which hosts this backend may reach under this profile: the backend's `egress` entries, then
    the caller's `--allow-host` rules (`extra`, parsed by the caller so a bad entry is reported
    before anything else), duplicates dropped. A profile without network reaches nothing, and
    refuses `extra` rather than silently dropping them."""
    if not profile.network:
        if extra:
            raise RefusedError(
                f"profile {profile.name!r} has no network, so --allow-host cannot be honoured; "
                "fix: use --profile agent, or drop --allow-host"
            )
        return ()
    return tuple(dict.fromkeys(parse_entries(backend.egress) + tuple(extra)))


def as_entries(rules: Iterable[HostRule]) -> tuple[str, ...]:
    """The rules as entries, for display and for the plan's `egress` key; never parsed back."""
    return tuple(rule.render() for rule in rules)


def decide(rules: Sequence[HostRule], host: str, port: int, resolved: Sequence[str] | None = None) -> Decision:
    """The policy's verdict on a request for `host:port` (`host` normalized, as `hosts.normalize_host`
    gives it), given what `host` resolved to (`resolved`), or None when it was not looked up.

    - The most specific matching rule applies (`hosts.find_rule`); no rule: deny. A wildcard never
      matches an IP literal, and an IP literal not listed as itself is refused.
    - A pinned rule connects to its pin and an IP rule to that IP: DNS is not asked, and the
      address may be internal (listing it is the explicit consent).
    - An unpinned name needs DNS (`needs_dns` when `resolved` is None). No address at all is
      unreachable; any internal address among the answers denies the whole name (DNS rebinding).
    - 0.0.0.0/8 and `::` reach the host's own listeners: never a connect target, pinned or not.

    DNS failures and connect failures are I/O outcomes, decided by the proxy, not here."""
    if is_ip_literal(host) and not any(rule.is_ip and rule.name == host for rule in rules):
        return Decision(False, host, port, IP_NOT_LISTED)
    rule = find_rule(tuple(rules), host, port)
    if rule is None:
        return Decision(False, host, port, NOT_LISTED)
    if rule.pin_addr is not None:
        decision = Decision(True, host, port, f"pinned to {rule.pin_addr}:{rule.pin_port}",
                            ((rule.pin_addr, rule.pin_port or port),))
    elif rule.is_ip:
        decision = Decision(True, host, port, "IP listed explicitly", ((host, port),))
    elif resolved is None:
        return Decision(False, host, port, "needs DNS", needs_dns=True)
    elif not resolved:
        return Decision(False, host, port, f"{host} resolves to no address", unreachable=True, cause="no address")
    else:
        internal = [a for a in resolved if is_internal_address(a)]
        if internal:
            return Decision(False, host, port,
                            f"resolves to internal address {internal[0]}; pin it with NAME=ADDR:PORT")
        decision = Decision(True, host, port, "allowlisted", tuple((a, port) for a in resolved))
    unspecified = [a for a, _ in decision.addrs if is_unspecified_target(a)]
    if unspecified:
        return Decision(False, host, port, f"{unspecified[0]} is never a connect target (it reaches the host itself)")
    return decision


# Credential routes (config.CredentialRoute): the box's CLI talks plain HTTP to the proxy at
# `/<route>/...`; the proxy sends the request to the route's one upstream with the real key.
# Every header that can carry an API key is dropped from what the client sent, whatever the route.
# What the box holds instead of a key (or login token) the proxy injects: fixed, public, one for all.
CREDENTIAL_PLACEHOLDER = "hive-relay-placeholder"
CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key", "x-goog-api-key", "api-key", "proxy-authorization"})
# The methods a credential route carries. Anything else is refused before the key is added: TRACE
# and TRACK answer with the request itself (its credential header included, straight back into the
# box), and an unknown method is an unknown answer.
ROUTE_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_KEY_VALUE = re.compile(r"[\x21-\x7e]{1,4096}")


@record
class RouteMatch:
    """Which route an origin-form target names, and the path to request upstream; or why none."""

    route: CredentialRoute | None
    path: str = ""
    reason: str = ""


def match_route(routes: Sequence[CredentialRoute], target: str) -> RouteMatch:
    """`/<route>/rest?q` → (the route named, `/rest?q`). The first path segment is the route name,
    exactly; anything else (no such route, a target that is not a path) matches none."""
    if not target.startswith("/"):
        return RouteMatch(None, reason="not a path")
    name, slash, rest = target[1:].partition("/")
    name, q, query = name.partition("?")
    for route in routes:
        if route.name == name:
            path = "/" + rest if slash else "/"
            return RouteMatch(route, path + (q + query if q else ""))
    known = ", ".join("/" + r.name for r in routes) or "none"
    return RouteMatch(None, reason=f"no credential route /{name[:40]} (this box has: {known})")


def credential_header(route: CredentialRoute, key: str) -> tuple[str, str]:
    """The header that carries `key` on `route`. A key that is not one printable token (a newline in
    it would start a second header, or a second request) raises ValueError, which never names it."""
    if not _KEY_VALUE.fullmatch(key):
        raise ValueError(f"the key for route {route.name} is not a single printable token")
    if route.send == "authorization-bearer":
        return "Authorization", f"Bearer {key}"
    if route.send == "authorization-basic":
        import base64

        return "Authorization", "Basic " + base64.b64encode(f"{route.basic_user}:{key}".encode()).decode("ascii")
    return route.send, key


def apply_credential(route: CredentialRoute, key: str, path: str) -> tuple[str, tuple[str, str] | None]:
    """(the path to request upstream, the header to add or None): `query:NAME` puts the key in the
    query as NAME (every value of NAME the client sent removed, however it spelt it), the other ways
    in a header (`credential_header`). Raises ValueError, never naming the key, for a key that is
    not one printable token."""
    header = credential_header(route, key)  # validates the key for every way
    if not route.send.startswith("query:"):
        return path, header
    from urllib.parse import quote, unquote

    name = route.send.removeprefix("query:")
    base, _, query = path.partition("?")
    kept = [p for p in query.split("&") if p and unquote(p.partition("=")[0].replace("+", " ")) != name]
    kept.append(f"{name}={quote(key, safe='')}")
    return f"{base}?{'&'.join(kept)}", None


def key_forms(route: CredentialRoute, key: str) -> tuple[str, ...]:
    """Every spelling in which `apply_credential` sends `key` upstream (as is, URL-quoted, inside
    Basic's base64), longest first: what the proxy scrubs from the answer if the upstream echoes it."""
    import base64
    from urllib.parse import quote

    forms = {key, quote(key, safe="")}
    if route.send == "authorization-basic":
        forms.add(base64.b64encode(f"{route.basic_user}:{key}".encode()).decode("ascii"))
    return tuple(sorted(forms, key=len, reverse=True))


def route_rules(rules: Sequence[HostRule], route: CredentialRoute) -> tuple[HostRule, ...]:
    """The rules a route's upstream is decided by. A backend's route goes through the egress policy as
    it is (its host is in the backend's egress). A grant names its host itself, in the user's own
    config: it is allowed for the proxy's connection (pinned if `--allow-host` pins it), without
    letting the box CONNECT to that host on its own."""
    rules = tuple(rules)
    if not route.grant or find_rule(rules, route.upstream_host, route.upstream_port) is not None:
        return rules
    return (*rules, parse_rule(f"{route.upstream_host}:{route.upstream_port}"))


def route_key(route: CredentialRoute, env: Mapping[str, str]) -> str | None:
    """The route's key from the launcher's environment: the first of its variables that is set."""
    return next((env[n] for n in route.secret_env if env.get(n)), None)
