"""Egress allowlist entries: parsing `NAME[:PORT][=ADDR:PORT]` and matching a request against them.

Pure functions only: the vocabulary (rules, their matching and specificity, the special-purpose
address tables) that `egress.decide` and `egress.allowed_rules` build the one policy from.
"""

from __future__ import annotations

import socket

from relay.model.errors import RelayError, UsageError
from relay.model.hostname import HostError, canonical_host
from relay.model.record import record

DEFAULT_PORT = 443
MAX_ENTRY_LEN = 300


@record
class HostRule:
    """One allowlist entry. `wildcard` means `*.name`: subdomains only, never the apex.

    `tls`: a CONNECT tunnel under this rule must open with a TLS ClientHello naming the host
    (relay/egress/tlspeek.py); False (`,tls=false`, and every `--allow-ssh` rule) lets any protocol through.
    `methods`/`paths`: the HTTP methods and paths (relay/model/http_rules.py) a plain-HTTP request under
    this rule may use; empty allows any. The proxy cannot see them inside TLS, so a CONNECT under a
    rule that limits them is refused, unless the rule is inspected.
    `inspect` (`,inspect=true`): a CONNECT to this one named host is TLS-terminated on the host with a
    leaf of the run's own CA (relay/egress/inspect.py), so its HTTP is seen and judged per request."""

    name: str
    port: int | None
    wildcard: bool = False
    pin_addr: str | None = None
    pin_port: int | None = None
    tls: bool = True
    methods: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    inspect: bool = False

    @property
    def is_ip(self) -> bool:
        return is_ip_literal(self.name)

    def matches(self, host: str, port: int) -> bool:
        want_port = self.port if self.port is not None else DEFAULT_PORT
        if port != want_port:
            return False
        if self.wildcard:  # subdomains are names: `1.2.3.4` or `::ffff:1.2.3.4` is never under `*.2.3.4`
            return host.endswith("." + self.name) and not is_ip_literal(host)
        return host == self.name

    @property
    def specificity(self) -> tuple[int, int, int, int]:
        """How specific the rule is; when several match, the highest wins: an exact name over a
        wildcard, a longer wildcard suffix over a shorter one, a pinned entry over an unpinned one,
        an explicit port over the implied 443."""
        return (0 if self.wildcard else 1, len(self.name) if self.wildcard else 0,
                self.pin_addr is not None, self.port is not None)

    @property
    def target(self) -> str:
        """What the rule covers, with the port made explicit: `name:443`, `*.domain:443`."""
        return ("*." if self.wildcard else "") + fmt_hostport(self.name, self.port or DEFAULT_PORT)

    def action(self) -> str:
        if self.pin_addr is not None:
            return f"pinned to {fmt_hostport(self.pin_addr, self.pin_port)}"
        if self.is_ip:
            return "this IP address, listed explicitly"
        return "DNS, public addresses only"

    def tunnel(self) -> str:
        """What a CONNECT under this rule must carry (relay/egress/tlspeek.py), in words."""
        if self.inspect:
            return f"TLS inspected: terminated with the run CA's leaf for {self.name}, its HTTP judged per request"
        if self.methods or self.paths:
            return "plain HTTP only (its methods/paths cannot be seen in a tunnel)"
        if not self.tls:
            return "any protocol (tls=false)"
        return "TLS only, its SNI absent (an IP)" if self.is_ip else f"TLS only, SNI {self.name if not self.wildcard else 'the CONNECT host'}"

    def render(self) -> str:
        text = ("*." if self.wildcard else "") + fmt_hostport(self.name, self.port)
        if self.pin_addr is not None:
            text += "=" + fmt_hostport(self.pin_addr, self.pin_port)
        return text + self.options()

    def options(self) -> str:
        """The rule's options as its entry spells them: `,tls=false`, `,method=GET`, `,path=/v1/`."""
        return ("" if self.tls else ",tls=false") + (",inspect=true" if self.inspect else "") + "".join(f",method={m}" for m in self.methods) + "".join(
            f",path={p}" for p in self.paths)


def fmt_hostport(host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"


def _canonical_ip(text: str) -> str | None:
    """The canonical form of an IPv4/IPv6 literal, or None (inet_pton: no ipaddress import at launch)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            return socket.inet_ntop(family, socket.inet_pton(family, text))
        except (OSError, ValueError):
            continue
    return None


def is_ip_literal(text: str) -> bool:
    return _canonical_ip(text) is not None


def normalize_host(raw: str) -> str:
    """The canonical host (`hostname.canonical_host`: the one parser every target and rule goes
    through); raises ValueError (a `HostError`, its text the reason) on anything not a host name or IP."""
    return canonical_host(raw)


def _parse_port(text: str, entry: str) -> int:
    if not text.isascii() or not text.isdigit() or len(text) > 5 or not 0 < int(text) < 65536:
        raise UsageError(f"--allow-host {entry!r}: port {text!r} must be a number from 1 to 65535")
    return int(text)


def split_hostport(text: str, entry: str) -> tuple[str, int | None]:
    """Split `host`, `host:port`, `[v6]:port` or `v6` into parts, without validating the host."""
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise UsageError(f"--allow-host {entry!r}: unclosed '[' in IPv6 address")
        host, rest = text[1:close], text[close + 1 :]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise UsageError(f"--allow-host {entry!r}: expected ':PORT' after ']'")
        return host, _parse_port(rest[1:], entry)
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, _parse_port(port, entry)
    return text, None


def is_loopback(name: str) -> bool:
    """`localhost`, `*.localhost` (RFC 6761), 127.0.0.0/8 and ::1, in the forms NO_PROXY keeps inside the box."""
    if name == "localhost" or name.endswith(".localhost") or name == "::1":
        return True
    value = _ip_value(name)
    if value is None:
        return False
    version, number = value
    if version == 6 and _in(number, _V6_MAPPED):
        version, number = 4, number & 0xFFFFFFFF
    return version == 4 and number >> 24 == 127


def _refuse_loopback(entry: str, name: str, port: int | None) -> None:
    shown = port or DEFAULT_PORT
    raise UsageError(
        f"--allow-host {entry!r}: {name} never reaches the proxy (the box's NO_PROXY keeps localhost, 127.0.0.1 "
        f"and ::1 inside the box, where nothing listens); fix: to reach a service on this host, give it a name "
        f"and pin it, e.g. --allow-host hostsvc.test:{shown}=127.0.0.1:{shown}, and use hostsvc.test:{shown} "
        "in the box"
    )


_PSL = None


def is_public_suffix(domain: str) -> bool:
    """True when `domain` is a public suffix (`com`, `co.uk`, `github.io`, an unknown TLD), judged by the
    Public Suffix List bundled with the `publicsuffixlist` package (ICANN and private sections; no
    download). Imported on first use: only a wildcard entry pays for it."""
    global _PSL
    if _PSL is None:
        try:
            from publicsuffixlist import PublicSuffixList
        except ImportError:
            raise RelayError("the publicsuffixlist package is missing, so wildcard entries cannot be checked; "
                             "fix: pip install -r requirements.txt (bin/contribute-hive does it)") from None
        _PSL = PublicSuffixList()
    return bool(_PSL.is_public(domain))


def url_host(entry: str) -> str:
    """The host part of a URL given where a host belongs (`https://example.com/x` -> `example.com`)."""
    rest = entry.split("://", 1)[-1]
    host = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0].rsplit("@", 1)[-1]
    return host or "NAME"


def url_port_hint(entry: str) -> str:
    """What the URL's scheme means for the port: `http://` needs `:80` (a bare name means 443)."""
    host = url_host(entry)
    if entry.lower().startswith("http://") and ":" not in host.lstrip("["):
        return f":80 (plain HTTP needs its port: --allow-host {host}:80)"
    return ""


def parse_rule(entry: str) -> HostRule:
    """Parse one `--allow-host` / config egress entry, raising UsageError with the fix on bad input."""
    if not isinstance(entry, str) or not entry.strip():
        raise UsageError("--allow-host: empty entry; use NAME[:PORT] or NAME[:PORT]=ADDR:PORT")
    if len(entry) > MAX_ENTRY_LEN or any(ord(c) < 33 or ord(c) > 126 for c in entry):
        raise UsageError(f"--allow-host {entry[:60]!r}: not a printable host entry; use NAME[:PORT]")
    if "/" in entry.split(",", 1)[0]:  # `https://example.com/x`, `example.com/path`: a URL, not a host
        raise UsageError(f"--allow-host {entry!r}: give a host, not a URL: {url_host(entry)}"
                         f"{url_port_hint(entry)}")
    entry_text, *opts = entry.split(",")
    tls, methods, paths, inspect = _rule_options(entry, opts)
    target, _, pin = entry_text.partition("=")
    wildcard = target.startswith("*.")
    if wildcard:
        target = target[2:]
    name, port = split_hostport(target, entry)
    try:
        name = normalize_host(name)
    except HostError as err:
        raise UsageError(f"--allow-host {entry!r}: not a host name or IP address: {err}") from None
    if wildcard and is_ip_literal(name):
        raise UsageError(f"--allow-host {entry!r}: a wildcard needs a domain, not an IP address")
    if is_loopback(name):
        _refuse_loopback(entry, name, port)
    if wildcard and is_public_suffix(name):
        raise UsageError(
            f"--allow-host {entry!r}: {name} is a public suffix (Public Suffix List), so *.{name} would allow "
            f"every site registered under it; fix: list the hosts you need, or a wildcard under a domain, "
            f"e.g. *.example.{name}")
    if inspect and (wildcard or is_ip_literal(name) or not tls):
        raise UsageError(f"--allow-host {entry!r}: inspect=true needs one host name with TLS (a leaf is minted "
                         "for that name), not a wildcard, an IP address or tls=false")
    pin_addr = pin_port = None
    if pin:
        pin_host, pin_port = split_hostport(pin, entry)
        if pin_port is None:
            raise UsageError(f"--allow-host {entry!r}: a pin needs ADDR:PORT, e.g. {name}=127.0.0.1:8443")
        try:
            pin_canon = canonical_host(pin_host)
        except HostError:
            pin_canon = ""
        if not is_ip_literal(pin_canon):
            raise UsageError(f"--allow-host {entry!r}: the pinned address {pin_host!r} must be an IP address")
        if wildcard:
            raise UsageError(f"--allow-host {entry!r}: a wildcard entry cannot be pinned")
        pin_addr = pin_canon
    return HostRule(name=name, port=port, wildcard=wildcard, pin_addr=pin_addr, pin_port=pin_port,
                    tls=tls, methods=methods, paths=paths, inspect=inspect)


def _rule_options(entry: str, opts: list[str]) -> tuple[bool, tuple[str, ...], tuple[str, ...], bool]:
    """`,tls=false`, `,inspect=true`, `,method=M` and `,path=P` (each repeatable but tls and inspect) after an entry."""
    from relay.model.http_rules import check_method, check_path_rule

    tls, methods, paths, inspect = True, [], [], False
    for opt in opts:
        key, eq, value = opt.partition("=")
        try:
            if key == "tls" and eq and value in ("false", "true"):
                tls = value == "true"
            elif key == "inspect" and eq and value in ("false", "true"):
                inspect = value == "true"
            elif key == "method" and eq:
                methods.append(check_method(value))
            elif key == "path" and eq:
                paths.append(check_path_rule(value))
            else:
                raise ValueError(f"unknown option {opt[:40]!r}; options are ,tls=false ,inspect=true ,method=M ,path=/P")
        except ValueError as err:
            raise UsageError(f"--allow-host {entry!r}: {err}") from None
    return tls, tuple(dict.fromkeys(methods)), tuple(dict.fromkeys(paths)), inspect


def find_rule(rules: tuple[HostRule, ...], host: str, port: int) -> HostRule | None:
    """The most specific rule that allows host:port (see HostRule.specificity); the first of equals."""
    best = None
    for rule in rules:
        if rule.matches(host, port) and (best is None or rule.specificity > best.specificity):
            best = rule
    return best


def explain(rules: tuple[HostRule, ...]) -> list[dict[str, object]]:
    """Per host the allowlist covers: the rule that applies and the entries it overrides (the same
    host and port, less specific). `--dry-run` shows it; `egress.decide` uses the same find_rule."""
    out: dict[str, dict[str, object]] = {}
    for rule in rules:
        target = rule.target
        if target in out:
            continue
        name = rule.name if not rule.wildcard else "x." + rule.name
        port = rule.port or DEFAULT_PORT
        winner = find_rule(rules, name, port) if not rule.wildcard else max(
            (r for r in rules if r.target == target), key=lambda r: r.specificity)
        assert winner is not None
        overrides = [r.render() for r in rules if r.target == target and r is not winner
                     and r.render() != winner.render()]
        out[target] = {"host": target, "rule": winner.render(), "action": winner.action(),
                       "overrides": list(dict.fromkeys(overrides)), "tunnel": winner.tunnel()}
    return list(out.values())


def render_rules(rules: tuple[HostRule, ...]) -> list[str]:
    """`explain` as text lines: `host:port ← entry (action; overrides ...)`."""
    lines = []
    for item in explain(rules):
        over = f"; overrides {', '.join(item['overrides'])}" if item["overrides"] else ""  # type: ignore[arg-type]
        lines.append(f"{item['host']} ← {item['rule']} ({item['action']}{over}; {item['tunnel']})")
    return lines


def _ip_value(addr: str) -> tuple[int, int] | None:
    """(4 or 6, the address as an integer) for an IP literal (an IPv6 zone `%eth0` is ignored), else None."""
    text = addr.split("%", 1)[0] if ":" in addr else addr
    for family, version in ((socket.AF_INET, 4), (socket.AF_INET6, 6)):
        try:
            return version, int.from_bytes(socket.inet_pton(family, text), "big")
        except (OSError, ValueError):
            continue
    return None


def _net(text: str, bits: int, version: int) -> tuple[int, int]:
    value = _ip_value(text)
    assert value is not None and value[0] == version
    width = 32 if version == 4 else 128
    mask = ((1 << bits) - 1) << (width - bits)
    return value[1] & mask, mask


# IANA IPv4 Special-Purpose Address Registry, plus multicast and the reserved 240/4 (with broadcast).
_V4_INTERNAL = tuple(_net(a, b, 4) for a, b in (
    ("0.0.0.0", 8), ("10.0.0.0", 8), ("100.64.0.0", 10), ("127.0.0.0", 8), ("169.254.0.0", 16),
    ("172.16.0.0", 12), ("192.0.0.0", 24), ("192.0.2.0", 24), ("192.88.99.0", 24), ("192.168.0.0", 16),
    ("198.18.0.0", 15), ("198.51.100.0", 24), ("203.0.113.0", 24), ("224.0.0.0", 4), ("240.0.0.0", 4),
))
# IPv6 prefixes whose low bits carry an IPv4 address that decides instead: IPv4-mapped and the
# well-known NAT64 prefix (the last 32 bits), 6to4 (bits 16..47).
_V6_MAPPED = _net("::ffff:0:0", 96, 6)
_V6_NAT64 = _net("64:ff9b::", 96, 6)
_V6_6TO4 = _net("2002::", 16, 6)
# Only 2000::/3 is global unicast: everything outside it (::/128, ::1, ::/8, 64:ff9b:1::/48, 100::/64,
# 5f00::/16, fc00::/7 with the cloud metadata fd00:ec2::254, fe80::/10, fec0::/10, ff00::/8) is internal.
_V6_GLOBAL = _net("2000::", 3, 6)
# Inside 2000::/3: the IETF protocol block (Teredo, benchmarking, ORCHID, ...) and documentation.
_V6_INTERNAL = tuple(_net(a, b, 6) for a, b in (("2001::", 23), ("2001:db8::", 32), ("3fff::", 20)))


def _in(value: int, net: tuple[int, int]) -> bool:
    return value & net[1] == net[0]


def is_internal_address(addr: str) -> bool:
    """True for addresses a public API host must never resolve to (DNS rebinding onto the host or its
    networks): the IANA special-purpose ranges for IPv4 and IPv6, with the IPv4 inside IPv4-mapped,
    NAT64 and 6to4 addresses judged as IPv4. Anything that is not an IP address is internal (fail closed)."""
    parsed = _ip_value(addr)
    if parsed is None:
        return True
    version, value = parsed
    if version == 6:
        if _in(value, _V6_MAPPED) or _in(value, _V6_NAT64):
            version, value = 4, value & 0xFFFFFFFF
        elif _in(value, _V6_6TO4):
            version, value = 4, (value >> 80) & 0xFFFFFFFF
        else:
            return not _in(value, _V6_GLOBAL) or any(_in(value, net) for net in _V6_INTERNAL)
    return any(_in(value, net) for net in _V4_INTERNAL)


def is_unspecified_target(addr: str) -> bool:
    """True for 0.0.0.0/8 and `::` (also IPv4-mapped): connecting there reaches the host's own
    listeners, so they are never a connect target, however explicitly listed or pinned."""
    parsed = _ip_value(addr)
    if parsed is None:
        return True
    version, value = parsed
    if version == 6:
        if value == 0:
            return True
        if not _in(value, _V6_MAPPED):
            return False
        value &= 0xFFFFFFFF
    return value >> 24 == 0
