"""The gvisor box's compiled init (relay/box/gvisor_init.c): built on first use with the host's C
compiler, kept in the cache dir, and trusted only when ours alone.

Why: in gVisor's Sentry every exec and every imported module costs; the Python init (relay/box/
gvisor_init.py) spent ~100 ms of each gvisor launch starting python3 and importing ctypes, socket
and threading, the compiled one ~20 ms for the same duties (`invoke bench`'s gvisor rows).

- **Static only** (`cc -O2 -static -pthread`): the same binary runs on the host's root (local mode)
  and inside container mode's image, whatever glibc each has. A host whose cc cannot link statically
  (no libc6-dev) gets the Python init, and `doctor` says why and the fix.
- **Where**: `CACHE/gvisor-init/KEY/gvisor-init`, KEY the sha256 of the source, the compiler's identity
  and the uid, so an edit of the source or a new compiler builds again and nothing stale runs. The
  cache dir is read-only in every box and absent from container boxes; the binary is used only when
  the cache dir, every folder down and the file are owned by us and writable by no one else
  (safefs.read_owned), and it is an ELF executable. A failed build is kept too (`failed`, with why),
  so a host without a static libc does not pay the compiler at every launch.
- **HIVE_RELAY_GVISOR_INIT=python** asks for the Python init (a fallback kept tested, and a way past
  a compiler that misbehaves).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping

from relay.host import safefs
from relay.host.paths import PACKAGE_ROOT, cache_dir
from relay.model.hashing import sha256

SOURCE = os.path.join(str(PACKAGE_ROOT), "relay", "box", "gvisor_init.c")
NAME = "gvisor-init"
BUILD_TIMEOUT = 120
MAX_BINARY = 8 << 20
FIX = "apt-get install gcc libc6-dev (a C compiler that links statically)"


SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def _compiler(env: Mapping[str, str]) -> str | None:
    """$CC as an absolute path, else `cc` (or $CC's name) on the system's PATH only: a caller's PATH may
    hold a directory a box wrote (a checkout's bin/), and what the build runs, runs on the host."""
    wanted = env.get("CC") or "cc"
    path = wanted if wanted.startswith("/") else shutil.which(wanted, path=SYSTEM_PATH)
    return path if path and os.access(path, os.X_OK) else None


def _key(source: bytes, cc: str) -> str:
    st = os.stat(cc)
    ident = f"{os.path.realpath(cc)}:{st.st_size}:{st.st_mtime_ns}:{os.getuid()}".encode()
    return sha256(b"%d:" % len(source) + source + ident).hexdigest()[:32]


def find(env: Mapping[str, str], build: bool = True) -> tuple[str | None, str]:
    """(the compiled init's path, how it was found) or (None, why the Python init runs instead)."""
    if env.get("HIVE_RELAY_GVISOR_INIT", "").strip().lower() == "python":
        return None, "HIVE_RELAY_GVISOR_INIT=python"
    cc = _compiler(env)
    if cc is None:
        return None, f"no C compiler to build the compiled init; fix: {FIX}"
    try:
        with open(SOURCE, "rb") as fh:
            source = fh.read(1 << 20)
    except OSError as err:
        return None, f"{SOURCE}: {err.strerror or err}"
    base = str(cache_dir(env))
    rel = os.path.join(NAME, _key(source, cc))
    try:
        found = _trusted(base, rel)
    except (OSError, ValueError) as err:  # a link or a special file where the build goes: not ours to use
        return None, f"the compiled init's cache entry in {base} is not a plain file of ours ({err}); remove it"
    if found is not None:
        return found
    if not build:
        return None, "not built yet (the first gvisor launch builds it)"
    return _build(base, rel, cc, env)


def _trusted(base: str, rel: str) -> tuple[str | None, str] | None:
    """What the cache holds for REL: the binary (ours alone, an ELF file), a failed build's reason, or
    None (nothing there, or nothing we can trust: built again)."""
    failed = safefs.read_owned(base, os.path.join(rel, "failed"), 4096)
    if failed is not None:
        return None, failed.decode("utf-8", "replace").strip() or "the compiled init failed to build"
    data = safefs.read_owned(base, os.path.join(rel, NAME), MAX_BINARY)
    if data is None or not data.startswith(b"\x7fELF"):
        return None
    path = os.path.join(os.path.realpath(base), rel, NAME)
    try:
        if os.stat(path).st_mode & 0o7133 != 0o100:  # executable by us, writable by no one else, no set-id
            return None
    except OSError:
        return None
    return path, f"compiled ({path})"


def _build(base: str, rel: str, cc: str, env: Mapping[str, str]) -> tuple[str | None, str]:
    """Compile into a temporary name in the key's dir, then rename into place (a concurrent launch
    builds its own and one rename wins, with the same bytes' worth)."""
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        if not safefs.owned_dir(base):
            return None, f"the cache dir {base} is not ours alone, so nothing built there is used"
        folder = os.path.join(base, rel)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".build-", dir=folder)
    except OSError as err:
        return None, f"cannot build the compiled init in {base}: {err.strerror or err}"
    try:
        out = os.path.join(tmp, NAME)
        argv = [cc, "-O2", "-static", "-pthread", "-o", out, SOURCE]
        try:
            # The compiler finds `as` and `ld` on PATH: the system's, never the caller's (see _compiler).
            done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT, cwd=tmp,
                                  stdin=subprocess.DEVNULL, env={"PATH": SYSTEM_PATH, "LC_ALL": "C"})
        except (OSError, subprocess.TimeoutExpired) as err:
            why = f"{cc} did not build the compiled init ({err}); fix: {FIX}"
            safefs.write_file(os.path.join(folder, "failed"), why.encode(), 0o600, durable=False)
            return None, why
        if done.returncode != 0:
            lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
            why = f"{cc} cannot link the compiled init statically ({lines[-1][:200] if lines else 'no output'}); fix: {FIX}"
            safefs.write_file(os.path.join(folder, "failed"), why.encode(), 0o600, durable=False)
            return None, why
        os.chmod(out, 0o500)
        os.replace(out, os.path.join(folder, NAME))
    except OSError as err:
        return None, f"cannot build the compiled init in {base}: {err.strerror or err}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _trusted(base, rel) or (None, "the compiled init was built but cannot be trusted where it is")
