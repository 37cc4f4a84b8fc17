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
    """Memoized probes and verified plans, peer installs for the bench (never an enforcement artefact
    that is loaded as is: see safefs and the probe's memo rules)."""
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


# The parts of hive relay's checkout that the host executes or reads as policy at the next launch.
CHECKOUT_PARTS = (".venv", "relay", "bin", "config", "tasks.py", ".ci", ".cache", "node_modules", "pyproject.toml",
                  "requirements.txt", "requirements-dev.txt", "Dockerfile.contributor")


def own_paths(env: Mapping[str, str]) -> list[str]:
    """hive relay's own files, read-only in every box even where a writable grant or the workdir covers
    them: what the host runs or trusts at the next launch (its checkout's code and venv, the agent
    CLIs, the user config that may widen a box, the state and cache it reads back)."""
    paths = [os.path.join(str(PACKAGE_ROOT), part) for part in CHECKOUT_PARTS]
    paths += [tool_dir(env), os.path.join(config_home(env), "hive-relay"), state_dir(env), str(cache_dir(env))]
    if env.get("HIVE_RELAY_CONFIG"):
        paths.append(env["HIVE_RELAY_CONFIG"])
    return list(dict.fromkeys(os.path.normpath(p) for p in paths))
