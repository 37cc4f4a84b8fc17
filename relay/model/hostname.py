"""One canonical form for every host name the egress policy sees.

Why: an allowlist is only as strong as its comparison. A CONNECT authority, an absolute URI, a Host
header, an `--allow-host` entry, a preset and a config entry must all reach `egress.decide` in the
same spelling, or a second spelling of a name (a trailing dot, upper case, a numeric IPv4 form, a
NUL byte: the SOCKS5 bypass in Claude Code's allowlist) is a second, undecided, name. So every
one of them goes through `canonical_host`, which either returns the one form or raises
`HostError` with a reason (the proxy answers 400 with it, config and flags refuse with it).

The canonical form:
- a name: ASCII, lower case, no trailing dot, every label 1..63 of `[a-z0-9_-]` not starting or
  ending with `-`, at most 253 characters; a Unicode label becomes its punycode (`xn--`) form and
  an `xn--` label must decode and encode back to itself (invalid punycode refused);
- an IPv4 literal in dotted decimal, whatever spelling it came in (decimal `2130706433`, octal
  `0177.0.0.1`, hex `0x7f.1`, short forms `127.1`: what `inet_aton` and browsers accept), so an IP
  literal is always recognised as one and refused unless listed;
- an IPv6 literal in `inet_ntop` form, without brackets; a zone id (`fe80::1%eth0`) is refused.

Pure: no DNS, no sockets beyond `inet_pton`/`inet_ntop`.
"""

from __future__ import annotations

import re
import socket

MAX_NAME = 253
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
# A last label that is a number in some base: the name is an IPv4 spelling (WHATWG URL "ends in a number").
_NUMERIC = re.compile(r"(0x[0-9a-f]*|[0-9]+)")
# IDNA 2003 (the stdlib codec) and IDNA 2008/UTS 46 map these differently (ß -> ss or xn--...): one
# name, two spellings, so a label holding one is refused rather than guessed.
_DEVIATIONS = frozenset("\u00df\u03c2\u200c\u200d")


class HostError(ValueError):
    """A host that cannot be made canonical; `str()` is the reason, in words, for a 400 or a UsageError."""


def _shown(raw: str) -> str:
    return repr("".join(c if c.isprintable() and c != "\\" else "?" for c in raw[:80]))


def _ipv4_number(part: str) -> int | None:
    """One part of an IPv4 spelling as a number (decimal, 0-prefixed octal, 0x hex), or None."""
    if part.startswith("0x"):
        return int(part[2:] or "0", 16) if all(c in "0123456789abcdef" for c in part[2:]) else None
    if not part.isdigit() or not part.isascii():
        return None
    if len(part) > 1 and part.startswith("0"):
        return int(part, 8) if all(c in "01234567" for c in part) else None
    return int(part)


def ipv4_spelling(host: str) -> str | None:
    """The dotted-decimal address `host` spells (lower case, without a trailing dot), by the rules
    `inet_aton` and the WHATWG URL parser share: 1 to 4 parts, each decimal, octal or hex, the last
    filling the remaining bytes. None when `host` does not end in a numeric label (so it is a name).
    Raises HostError when it does but is no valid address (`1.2.3.4.5`, `256.1.1.1`, `08.1.1.1`):
    a name that ends in a number is never a name here."""
    parts = host.split(".")
    if not _NUMERIC.fullmatch(parts[-1]):
        return None
    numbers = [_ipv4_number(p) for p in parts]
    if len(parts) > 4 or any(n is None for n in numbers):
        raise HostError(f"{_shown(host)} ends in a number but is not a valid IPv4 address")
    *head, last = numbers
    assert last is not None
    if any(n > 255 for n in head if n is not None) or last >= 256 ** (4 - len(head)):
        raise HostError(f"{_shown(host)} is an IPv4 spelling out of range")
    value = last
    for i, n in enumerate(head):
        assert n is not None
        value |= n << (8 * (3 - i))
    return socket.inet_ntoa(value.to_bytes(4, "big"))


def _ipv6(text: str) -> str | None:
    try:
        return socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, text))
    except (OSError, ValueError):
        return None


def _label(label: str, raw: str) -> str:
    """One label in canonical ASCII (punycode for Unicode), or HostError."""
    if label.isascii():
        if label.startswith("xn--"):
            try:
                decoded = label.encode("ascii").decode("idna")
                again = decoded.encode("idna").decode("ascii").lower()
            except UnicodeError:
                raise HostError(f"{_shown(raw)}: {label[:63]!r} is not valid punycode") from None
            if again != label or any(c in _DEVIATIONS for c in decoded):
                raise HostError(f"{_shown(raw)}: {label[:63]!r} is not the canonical punycode of a label")
        if not _LABEL.fullmatch(label):
            raise HostError(f"{_shown(raw)}: {label[:63]!r} is not a valid host name label")
        return label
    if any(c in _DEVIATIONS for c in label):
        raise HostError(f"{_shown(raw)}: the label holds a character IDNA versions map differently (ß, ς, ZWJ, ZWNJ); "
                        "write its xn-- form")
    try:
        from encodings.idna import nameprep

        if nameprep(label) != label:  # a mapping beyond lower case (full-width letters, ligatures)
            raise HostError(f"{_shown(raw)}: the label is not in its normalised form; write its xn-- form")
        ascii_label = label.encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise HostError(f"{_shown(raw)}: the label is not a valid internationalised name") from None
    if not _LABEL.fullmatch(ascii_label):
        raise HostError(f"{_shown(raw)}: the label is not a valid internationalised name")
    return ascii_label


def canonical_host(raw: str) -> str:
    """The one canonical form of a host (see the module doc), or HostError with the reason.

    Refused outright: empty, longer than 253, any NUL, control character, space, `@` (userinfo),
    `%` (percent-encoding, an IPv6 zone id), `/`, `\\`; more than one trailing dot; an empty label."""
    if not isinstance(raw, str):
        raise HostError("the host is not text")
    host = raw
    if host.startswith("[") and host.endswith("]"):
        inner = host[1:-1]
        if "%" in inner:
            raise HostError(f"{_shown(raw)}: IPv6 zone ids are refused")
        v6 = _ipv6(inner)
        if v6 is None:
            raise HostError(f"{_shown(raw)} is not an IPv6 address")
        return v6
    bad = next((c for c in host if ord(c) < 0x21 or ord(c) == 0x7f or c in "@%/\\[]?#"), None)
    if bad is not None:
        what = {"@": "'@' (userinfo)", "%": "'%' (percent-encoding or an IPv6 zone id)"}.get(bad, f"{bad!r}")
        raise HostError(f"{_shown(raw)}: a host may not contain {what}")
    if ":" in host:
        v6 = _ipv6(host)
        if v6 is None:
            raise HostError(f"{_shown(raw)} is not an IPv6 address")
        return v6
    host = host.lower()
    if host.endswith("."):
        host = host[:-1]
    if not host or len(host) > MAX_NAME or host.endswith(".") or host.startswith("."):
        raise HostError(f"{_shown(raw)} is not a host name")
    labels = host.split(".")
    if any(not label for label in labels):
        raise HostError(f"{_shown(raw)}: a host name has no empty labels")
    v4 = ipv4_spelling(host) if host.isascii() else None
    if v4 is not None:
        return v4
    name = ".".join(_label(label, raw) for label in labels)
    if len(name) > MAX_NAME:
        raise HostError(f"{_shown(raw)} is longer than {MAX_NAME} characters")
    return name


def is_ip(host: str) -> bool:
    """Whether a canonical host is an IP literal."""
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return True
    except (OSError, ValueError):
        return False


def canonical_port(text: str) -> int:
    """A port `1..65535` written in plain decimal digits (no sign, space or base prefix), or HostError."""
    if not text.isascii() or not text.isdigit() or len(text) > 5 or not 0 < int(text) < 65536:
        raise HostError(f"port {text[:12]!r} must be a number from 1 to 65535")
    return int(text)
