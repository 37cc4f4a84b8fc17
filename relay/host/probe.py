"""Host probe: what this machine can enforce, tested rather than assumed, and memoized.

The expensive part (actually starting a bwrap box) is cached per (bwrap binary, kernel,
uid) under ~/.cache/hive-relay, so repeated launches pay a stat, not a box start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from relay import __version__
from relay.host import safefs
from relay.host.paths import LIBSECCOMP_DIRS, cache_dir, which
from relay.model.host_facts import HostFacts

CACHE_VERSION = 3


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _bwrap_version(bwrap: str) -> str | None:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().split()[-1] if out.returncode == 0 and out.stdout.strip() else None


def _bwrap_smoke(bwrap: str, uid: int) -> str | None:
    """Start a real box the way the runner does; return None on success, else the reason."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--cap-drop", "ALL",
            "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    if uid == 0:
        argv += ["--uid", "1000", "--gid", "1000"]
    argv += ["--", "/bin/true" if os.path.exists("/bin/true") else "true"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bubblewrap failed to start: {err}"
    if out.returncode == 0:
        return None
    detail = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
    return f"bubblewrap cannot create a sandbox: {detail}"


def probe_landlock_abi() -> int:
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        nr = {"x86_64": 444, "aarch64": 444}.get(os.uname().machine)
        if nr is None:
            return 0
        abi = libc.syscall(nr, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
        return abi if abi > 0 else 0
    except OSError:
        return 0


def _seccomp() -> tuple[bool, str | None]:
    """Cheap availability check (the library is loaded only when a filter must be compiled)."""
    from importlib.util import find_spec

    if find_spec("pyseccomp") is None:
        return False, "pyseccomp is not installed; fix: run ./bin/contribute-hive (it installs the pinned deps)"
    if not any(os.path.exists(f"{d}/libseccomp.so.2") for d in LIBSECCOMP_DIRS):
        return False, "libseccomp is not installed; fix: apt-get install libseccomp2"
    if "Seccomp:" not in (_read("/proc/self/status") or ""):
        return False, "this kernel has no seccomp support"
    return True, None


def _cgroup_mode(uid: int) -> str | None:
    """'v2' when our own cgroup is delegated and writable, 'v1' when v1 controllers are writable."""
    root = "/sys/fs/cgroup"
    if os.path.exists(f"{root}/cgroup.controllers"):
        own = (_read("/proc/self/cgroup") or "").split("::")[-1].strip()
        parent = os.path.join(root, own.lstrip("/"))
        controllers = _read(f"{parent}/cgroup.subtree_control") or ""
        if os.access(parent, os.W_OK) and "memory" in controllers and "pids" in controllers:
            return "v2"
        return None
    if all(os.access(f"{root}/{c}", os.W_OK) for c in ("memory", "pids")):
        return "v1"
    return None


def _box_python(home: str) -> str | None:
    """An interpreter the box can see: never one under $HOME, which the box replaces."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", os.path.realpath(sys.executable)):
        real = os.path.realpath(candidate)
        if os.path.exists(real) and not (real + "/").startswith(home.rstrip("/") + "/") and not real.startswith("/root/"):
            return candidate
    return None


def _cache_key(bwrap: str | None, uid: int) -> str:
    st = os.stat(bwrap) if bwrap else None
    return json.dumps([CACHE_VERSION, __version__, bwrap, st and st.st_mtime_ns, os.uname().release, uid])


def _ensure_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return True
    except OSError:
        return False


def probe(env: dict[str, str] | os._Environ | None = None, use_cache: bool = True) -> HostFacts:
    """Probe this host; the box smoke test is memoized in the cache dir."""
    env = os.environ if env is None else env
    uid, gid = os.getuid(), os.getgid()
    home = os.path.normpath(env.get("HOME") or os.path.expanduser("~"))
    bwrap = which("bwrap", path=env.get("PATH", os.defpath))
    key = _cache_key(bwrap, uid)
    cache = cache_dir(env) / "probe.json"
    cached: dict = {}
    if use_cache:
        try:
            data = json.loads(safefs.read_owned_file(str(cache), 64 << 10) or b"{}")
            if isinstance(data, dict) and data.get("key") == key:
                cached = data
        except (OSError, ValueError):
            pass
    # The memo may only save the smoke test that *succeeded*: a forged failure would steer auto
    # towards a weaker tier, so failures are always probed again, and Landlock's ABI (one cheap
    # syscall) is never taken from the file.
    landlock_abi = probe_landlock_abi()
    if cached and cached.get("bwrap_error") is None and isinstance(cached.get("bwrap_version"), str):
        bwrap_error, version = None, cached["bwrap_version"]
    else:
        version = _bwrap_version(bwrap) if bwrap else None
        bwrap_error = _bwrap_smoke(bwrap, uid) if bwrap else "bubblewrap is not installed"
        if use_cache and bwrap_error is None:
            memo = json.dumps({"key": key, "bwrap_error": None, "bwrap_version": version}).encode()
            try:
                if _ensure_dir(cache.parent):
                    safefs.write_file(str(cache), memo, 0o600)
            except OSError:
                pass
    restricted = _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1"
    if bwrap_error and restricted:
        bwrap_error += " (AppArmor restricts unprivileged user namespaces)"
    seccomp, seccomp_error = _seccomp()
    tiocsti = _read("/proc/sys/dev/tty/legacy_tiocsti")
    return HostFacts(
        uid=uid,
        gid=gid,
        home=home,
        user=env.get("USER") or env.get("LOGNAME") or str(uid),
        shell=env.get("SHELL") or "/bin/sh",
        tty=os.isatty(0),
        bwrap=bwrap,
        bwrap_version=version,
        bwrap_error=bwrap_error,
        userns_restricted=restricted,
        seccomp=seccomp,
        seccomp_error=seccomp_error,
        landlock_abi=landlock_abi,
        cgroup=_cgroup_mode(uid),
        legacy_tiocsti=None if tiocsti is None else tiocsti == "1",
        podman=which("podman", path=env.get("PATH", os.defpath)),
        docker=which("docker", path=env.get("PATH", os.defpath)),
        box_python=_box_python(home),
        nofile=_nofile(),
    )


def _nofile() -> int:
    import resource

    return min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 20)
