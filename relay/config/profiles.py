"""The built-in `default` and `agent` profiles, user-defined ones, and how they resolve.

A profile decides how much of the host a box gets. `None` in a spec means "inherit from
what it extends"; an explicit empty list means "nothing", so an empty list can never
widen a box by falling back to a default.
"""

from __future__ import annotations

from collections.abc import Mapping

from relay.model.backend import ProfileSpec
from relay.model.errors import UsageError
from relay.model.record import record

GIB = 1 << 30

# Read-only toolchain shims, shell rc files and git identity (never ~/.cargo as a whole).
TOOLCHAIN_GRANTS = (
    "~/.local/bin", "~/.nvm", "~/.cargo/bin", "~/.cargo/env", "~/.rustup", "~/.pyenv",
    "~/.volta", "~/.bun/bin", "~/.deno/bin", "~/go/bin",
    "~/.bashrc", "~/.bash_profile", "~/.profile", "~/.zshrc", "~/.zshenv", "~/.zprofile",
    "~/.inputrc", "~/.gitconfig", "~/.config/git",
)

# The locale variables by name (POSIX and glibc). Never a pattern such as `LC_*`: a pattern also
# matches whatever secret someone names LC_TOKEN, and the environment allowlist passes by name only.
LOCALE_ENV = (
    "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "LC_TIME", "LC_COLLATE", "LC_MONETARY", "LC_MESSAGES", "LC_PAPER",
    "LC_NAME", "LC_ADDRESS", "LC_TELEPHONE", "LC_MEASUREMENT", "LC_IDENTIFICATION",
)

BUILTIN: dict[str, ProfileSpec] = {
    "default": ProfileSpec(
        name="default", backend_home=False, toolchain=False, network=False,
        home_ro=(), home_rw=(), env=("PATH", "HOME", "LANG", "TERM", "COLORTERM"),
        memory=4 * GIB, pids=256,
    ),
    "agent": ProfileSpec(
        name="agent", extends="default", backend_home=True, toolchain=True, network=True,
        env=("PATH", "HOME", "LANG", *LOCALE_ENV, "TERM", "COLORTERM", "USER", "SHELL"),
        memory=8 * GIB, pids=512,
    ),
}


@record
class Profile:
    """A fully resolved profile: every field known, nothing inherited."""

    name: str
    backend_home: bool
    toolchain: bool
    network: bool
    home_ro: tuple[str, ...]
    home_rw: tuple[str, ...]
    env: tuple[str, ...]
    memory: int
    pids: int


def _merge(base: ProfileSpec, over: ProfileSpec) -> ProfileSpec:
    """Fields set in `over` replace those of `base`; unset (None) fields inherit."""
    values = {}
    for field in ("backend_home", "toolchain", "network", "home_ro", "home_rw", "env", "memory", "pids"):
        mine = getattr(over, field)
        values[field] = getattr(base, field) if mine is None else mine
    return ProfileSpec(name=over.name, extends=base.extends, **values)


def resolve_profile(name: str, user: Mapping[str, ProfileSpec]) -> Profile:
    """Resolve `name` through its `extends` chain; user specs override built-ins of the same name."""
    chain: list[ProfileSpec] = []
    current: str | None = name
    seen: set[str] = set()
    while current is not None:
        if current in seen:
            raise UsageError(f"profile {name!r}: 'extends' loops through {current!r}; fix the user config")
        seen.add(current)
        spec = user.get(current)
        builtin = BUILTIN.get(current)
        if spec is None and builtin is None:
            known = sorted(set(BUILTIN) | set(user))
            raise UsageError(f"unknown profile {current!r}; choose one of: {', '.join(known)}")
        if spec is not None and builtin is not None:
            spec = _merge(builtin, spec)
            spec = ProfileSpec(**{**spec.__dict__, "extends": user[current].extends or builtin.extends})
        spec = spec or builtin
        assert spec is not None
        chain.append(spec)
        current = spec.extends
    merged = ProfileSpec(name=name)
    for spec in reversed(chain):
        merged = _merge(merged, spec)
    return Profile(
        name=name,
        backend_home=bool(merged.backend_home),
        toolchain=bool(merged.toolchain),
        network=bool(merged.network),
        home_ro=merged.home_ro or (),
        home_rw=merged.home_rw or (),
        env=merged.env or (),
        memory=merged.memory or 4 * GIB,
        pids=merged.pids or 256,
    )
