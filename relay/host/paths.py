"""Where hive relay keeps things on the host, derived from the caller's environment (XDG first).

One place for these, so the launcher, the config cache, the probe, the bench and the tests all
agree on the same directories.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # relay/, above this layer's folder


def _package_root() -> tuple[Path, bool]:
    """Where config/backends.yaml, Dockerfile.contributor and bin/ live, and whether that is a checkout.
    A checkout (or an editable install) has them beside relay/; `pip install .`/`pipx install .` puts
    them in <prefix>/share/hive-relay (pyproject.toml, data-files)."""
    checkout = PACKAGE_DIR.parent
    if (checkout / "config" / "backends.yaml").is_file():
        return checkout, True
    import site

    for prefix in (sys.prefix, site.getuserbase()):
        data = Path(prefix) / "share" / "hive-relay"
        if (data / "config" / "backends.yaml").is_file():
            return data, False
    return checkout, True


PACKAGE_ROOT, IN_CHECKOUT = _package_root()


# Where the distributions put libseccomp (the probe's check, the filter memo's key).
LIBSECCOMP_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64",
                   "/usr/lib", "/lib64")


def gvisor_init_script() -> str:
    """The host path of the gvisor tier's in-box init (relay/box/gvisor_init.py), bound into its boxes.
    Read at call time, so a plan for another checkout's root (the golden tests') names that root."""
    return os.path.join(str(PACKAGE_ROOT), "relay", "box", "gvisor_init.py")


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


def tool_dir(env: Mapping[str, str], realpath: Callable[[str], str] = os.path.realpath) -> str:
    """Project-local npm installs of the agent CLIs (never `npm -g`), bound read-only into boxes.
    $HIVE_RELAY_TOOLS overrides it, e.g. to share one install between checkouts. `realpath` is the
    planner's FsView's, so that planning touches the host only through its view."""
    default = os.path.join(PACKAGE_ROOT, ".cache", "npm") if IN_CHECKOUT else os.path.join(cache_dir(env), "npm")
    return realpath(env.get("HIVE_RELAY_TOOLS") or default)


# The parts of hive relay's checkout that the host executes or reads as policy at the next launch.
CHECKOUT_PARTS = (".venv", "relay", "bin", "config", "tasks.py", ".ci", ".cache", "node_modules", "pyproject.toml",
                  "requirements.txt", "requirements-dev.txt", "Dockerfile.contributor")


def own_paths(env: Mapping[str, str], realpath: Callable[[str], str] = os.path.realpath) -> list[str]:
    """hive relay's own files, read-only in every box even where a writable grant or the workdir covers
    them: what the host runs or trusts at the next launch (its checkout's code and venv, the agent
    CLIs, the user config that may widen a box, the state and cache it reads back)."""
    paths = [os.path.join(str(PACKAGE_ROOT), part) for part in CHECKOUT_PARTS]
    if not IN_CHECKOUT:  # installed: the code itself, and the venv (pipx) it runs from
        paths.append(str(PACKAGE_DIR))
        if sys.prefix != sys.base_prefix:
            paths.append(sys.prefix)
    paths += [tool_dir(env, realpath), os.path.join(config_home(env), "hive-relay"), state_dir(env), str(cache_dir(env))]
    if env.get("HIVE_RELAY_CONFIG"):
        paths.append(env["HIVE_RELAY_CONFIG"])
    return list(dict.fromkeys(os.path.normpath(p) for p in paths))


def which(name: str, path: str | None = None) -> str | None:
    """The executable NAME would run as on PATH (a PATH string; os.defpath when None), found as
    shutil.which finds it on POSIX, minus the entries that are not absolute: an empty entry or `.`
    or `bin` means the current directory, which for a launch is the workdir, and the box writes
    there; a `bwrap` or a grant's helper planted in it must never run on the host. An empty PATH
    finds nothing (as shutil's). A NAME with a slash is checked as it is. Here so that a launch need
    not import shutil (with bz2, lzma and fnmatch: ~2.5 ms under -X importtime) to find bwrap."""
    def runnable(candidate: str) -> bool:
        return os.access(candidate, os.F_OK | os.X_OK) and not os.path.isdir(candidate)

    if os.path.dirname(name):
        return name if runnable(name) else None
    path = os.defpath if path is None else path
    if not path:
        return None
    seen = set()
    for entry in path.split(os.pathsep):
        if not os.path.isabs(entry) or entry in seen:
            continue  # relative: see above
        seen.add(entry)
        candidate = os.path.join(entry, name)
        if runnable(candidate):
            return candidate
    return None


def drop_relative_path_entries(environ: MutableMapping[str, str]) -> None:
    """Remove the PATH entries that are not absolute from ENVIRON (os.environ, at every command's
    start): an empty entry, `.` or `bin` names the current directory, and a launch's is the workdir,
    which the box writes. Every host-side tool we start by name (git, podman, npm, a grant's helper)
    would otherwise be looked up there first, and run on the host. An unset PATH stays unset; one left
    empty becomes os.defpath's absolute entries (an empty PATH means the current directory to execvp)."""
    path = environ.get("PATH")
    if path is None:
        return
    kept = [entry for entry in path.split(os.pathsep) if os.path.isabs(entry)]
    if not kept:
        kept = [entry for entry in os.defpath.split(os.pathsep) if os.path.isabs(entry)]
    cleaned = os.pathsep.join(kept)
    if cleaned != path:
        environ["PATH"] = cleaned
