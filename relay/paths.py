"""Where hive relay keeps things on the host, derived from the caller's environment (XDG first).

One place for these, so the launcher, the config cache, the probe, the bench and the tests all
agree on the same directories.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def config_home(env: Mapping[str, str]) -> str:
    return env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME", "/"), ".config")


def cache_dir(env: Mapping[str, str]) -> Path:
    """Memoized probes, parsed config, compiled seccomp filters, peer installs for the bench."""
    base = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME", "/tmp"), ".cache")
    return Path(base) / "hive-relay"


def state_dir(env: Mapping[str, str]) -> str:
    """Egress logs and the placeholder registry: kept across runs."""
    base = env.get("XDG_STATE_HOME") or os.path.join(env.get("HOME", "/tmp"), ".local", "state")
    return os.path.join(base, "hive-relay")


def tool_dir(env: Mapping[str, str]) -> str:
    """Project-local npm installs of the agent CLIs (never `npm -g`), bound read-only into boxes.
    $HIVE_RELAY_TOOLS overrides it, e.g. to share one install between checkouts."""
    return os.path.realpath(env.get("HIVE_RELAY_TOOLS") or os.path.join(PACKAGE_ROOT, ".cache", "npm"))
