"""Egress allowlist entries: parsing `NAME[:PORT][=ADDR:PORT]` and matching a request against them.

Pure functions only, so the proxy, the plan and the property tests share one definition
of what "allowed" means.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

from .errors import UsageError

DEFAULT_PORT = 443
MAX_ENTRY_LEN = 300
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")


@dataclass(frozen=True)
class HostRule:
    """One allowlist entry. `wildcard` means `*.name`: subdomains only, never the apex."""

    name: str
    port: int | None
    wildcard: bool = False
    pin_addr: str | None = None
    pin_port: int | None = None

    @property
    def is_ip(self) -> bool:
        return _is_ip(self.name)

    def matches(self, host: str, port: int) -> bool:
        want_port = self.port if self.port is not None else DEFAULT_PORT
        if port != want_port:
            return False
        if self.wildcard:
            return host.endswith("." + self.name)
        return host == self.name

    def render(self) -> str:
        text = ("*." if self.wildcard else "") + _fmt_hostport(self.name, self.port)
        if self.pin_addr is not None:
            text += "=" + _fmt_hostport(self.pin_addr, self.pin_port)
        return text


def _fmt_hostport(host: str, port: int | None) -> str:
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


def _is_ip(text: str) -> bool:
    return _canonical_ip(text) is not None


def normalize_host(raw: str) -> str:
    """Lower-case, strip one trailing dot and IPv6 brackets; raise on anything not a hostname or IP."""
    host = raw.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    host = host.lower()
    if host.endswith("."):
        host = host[:-1]
    if not host or len(host) > 253:
        raise ValueError(f"invalid host {raw!r}")
    if _is_ip(host):
        return _canonical_ip(host) or host
    labels = host.split(".")
    if not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"invalid host {raw!r}")
    return host


def _parse_port(text: str, entry: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
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


def parse_rule(entry: str) -> HostRule:
    """Parse one `--allow-host` / config egress entry, raising UsageError with the fix on bad input."""
    if not isinstance(entry, str) or not entry.strip():
        raise UsageError("--allow-host: empty entry; use NAME[:PORT] or NAME[:PORT]=ADDR:PORT")
    if len(entry) > MAX_ENTRY_LEN or any(ord(c) < 33 or ord(c) > 126 for c in entry):
        raise UsageError(f"--allow-host {entry[:60]!r}: not a printable host entry; use NAME[:PORT]")
    target, _, pin = entry.partition("=")
    wildcard = target.startswith("*.")
    if wildcard:
        target = target[2:]
    name, port = split_hostport(target, entry)
    try:
        name = normalize_host(name)
    except ValueError:
        raise UsageError(
            f"--allow-host {entry!r}: {name!r} is not a host name or IP address"
        ) from None
    if wildcard and _is_ip(name):
        raise UsageError(f"--allow-host {entry!r}: a wildcard needs a domain, not an IP address")
    pin_addr = pin_port = None
    if pin:
        pin_host, pin_port = split_hostport(pin, entry)
        if pin_port is None:
            raise UsageError(f"--allow-host {entry!r}: a pin needs ADDR:PORT, e.g. {name}=127.0.0.1:8443")
        if not _is_ip(pin_host.strip("[]")):
            raise UsageError(f"--allow-host {entry!r}: the pinned address {pin_host!r} must be an IP address")
        if wildcard:
            raise UsageError(f"--allow-host {entry!r}: a wildcard entry cannot be pinned")
        pin_addr = _canonical_ip(pin_host.strip("[]"))
    return HostRule(name=name, port=port, wildcard=wildcard, pin_addr=pin_addr, pin_port=pin_port)


def find_rule(rules: tuple[HostRule, ...], host: str, port: int) -> HostRule | None:
    """The first rule that allows host:port; an exact name wins over a wildcard."""
    exact = [r for r in rules if not r.wildcard and r.matches(host, port)]
    if exact:
        return exact[0]
    for rule in rules:
        if rule.wildcard and rule.matches(host, port):
            return rule
    return None


def is_internal_address(addr: str) -> bool:
    """True for addresses a public API host must never resolve to (DNS rebinding onto the host)."""
    import ipaddress

    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (
        ip.is_loopback
        or ip.is_private
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_unspecified
        or ip.is_reserved
    )
