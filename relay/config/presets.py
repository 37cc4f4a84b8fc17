"""Egress presets: named host lists for the package ecosystems a real project needs.

`--allow-preset npm` is shorthand for the hosts `npm install` reaches, and nothing else: each
preset is a fixed list of exact names (no wildcard: `*.githubusercontent.com` would also cover
every user's Pages-style content host). Named presets can be added in the user config
(`presets: {name: [hosts]}`); a repo config cannot define any (its top level has no `presets`
key) and can only drop presets from a backend's `presets` list (config.REPO_MAY_NARROW).

Pure data and pure functions: `expand` turns names into (preset, rules) pairs for the plan,
and `origins` tells the proxy which preset a rule came from, so its decision lines name it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from relay.model.allow_rules import HostRule, parse_rule
from relay.model.errors import UsageError

# What each ecosystem's own client reaches for a read (install, fetch, resolve), checked against the
# clients' defaults: npm's registry serves metadata and tarballs from one host; pip's index is pypi.org
# and its files are on files.pythonhosted.org; cargo's sparse index is index.crates.io, downloads
# redirect from crates.io to static.crates.io; Go's module proxy and checksum database; Debian's
# default mirrors, which apt reaches over plain HTTP (port 80) unless sources say https;
# git clone/fetch over HTTPS plus archive downloads, release assets and raw files for GitHub.
BUILTIN: dict[str, tuple[str, ...]] = {
    "npm": ("registry.npmjs.org",),
    "pypi": ("pypi.org", "files.pythonhosted.org"),
    "crates": ("crates.io", "index.crates.io", "static.crates.io"),
    "go": ("proxy.golang.org", "sum.golang.org"),
    "apt": ("deb.debian.org", "deb.debian.org:80", "security.debian.org", "security.debian.org:80"),
    "github-read": ("github.com", "codeload.github.com", "objects.githubusercontent.com",
                    "raw.githubusercontent.com"),
}
NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,31}")


def known(user: Mapping[str, tuple[str, ...]] | None = None) -> dict[str, tuple[str, ...]]:
    """Every preset this caller can name: the built-in ones, then the user config's."""
    return {**BUILTIN, **(user or {})}


def check_name(name: str, flag: str = "--allow-preset") -> None:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise UsageError(f"{flag} {str(name)[:40]!r}: not a preset name; use lowercase letters, digits and '-'")


def expand(names: Iterable[str], user: Mapping[str, tuple[str, ...]] | None = None
           ) -> tuple[tuple[str, tuple[HostRule, ...]], ...]:
    """The presets named, in order and without repeats, each with its rules. An unknown name raises
    UsageError with the list of known presets (the one line `--allow-preset` prints)."""
    table = known(user)
    out: dict[str, tuple[HostRule, ...]] = {}
    for name in names:
        if name not in table:
            shown = "".join(c if c.isprintable() else "?" for c in str(name)[:40])
            raise UsageError(f"--allow-preset {shown!r}: unknown preset; known presets: {', '.join(sorted(table))} "
                             "(more can be named under `presets:` in your user config)")
        out.setdefault(name, tuple(parse_rule(entry) for entry in table[name]))
    return tuple(out.items())


def origins(expanded: Iterable[tuple[str, Iterable[HostRule]]]) -> dict[HostRule, str]:
    """Rule → the preset(s) it came from, `npm+pypi` when several list it (for the decision log)."""
    out: dict[HostRule, str] = {}
    for name, rules in expanded:
        for rule in rules:
            out[rule] = f"{out[rule]}+{name}" if rule in out else name
    return out
