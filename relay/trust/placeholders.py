"""Placeholder files that keep a missing protected path (e.g. `.vscode`, `.git/hooks`) from being
created, shared safely between boxes that run in the same workdir at the same time.

bwrap needs a mount point to mask a missing path, so an empty file appears on the host for the
box's lifetime. Two boxes in one workdir must not race on creating it, and one box's teardown
must not unlink it while another box still masks it (unlinking a mount point detaches the mount
in every namespace). So each placeholder is reference-counted by launcher pid in a registry
under the state dir, guarded by flock; the last live user removes it. A reference is an owner
(pid, start time, boot: see sweep), so a pid reused after its launcher died keeps nothing alive.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from relay.host import safefs
from relay.host.liveness import Owner, alive, me, owner_from_json

# The registry lists placeholder paths and pids; a few hundred entries at most.
MAX_REGISTRY = 1 << 20


def _base_for(path: str, bases: Iterable[str]) -> str:
    """The most specific trusted base (workdir, home) that holds `path`; else its parent directory."""
    held = [b for b in bases if safefs.beneath(path, b)]
    return max(held, key=len) if held else os.path.dirname(path)


class Registry:
    def __init__(self, state_dir: str) -> None:
        self.dir = state_dir
        self.path = Path(state_dir) / "placeholders.json"
        self.lock_path = Path(state_dir) / "placeholders.lock"

    @contextmanager
    def _locked(self):  # noqa: ANN202
        """The registry, read and rewritten under an exclusive lock; every file is opened beneath our
        state dir with no link followed, and an unreadable registry starts empty."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        with safefs.base_dir(self.dir) as dfd:
            lock = safefs.open_beneath(dfd, "placeholders.lock", os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o600)
            try:
                if not stat.S_ISREG(os.fstat(lock).st_mode):
                    raise safefs.UnsafePath(errno.EINVAL, "not a regular file", str(self.lock_path))
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    data = json.loads(safefs.read_beneath(dfd, "placeholders.json", MAX_REGISTRY) or b"{}")
                except (OSError, ValueError):
                    data = {}
                data = {k: _entry(v) for k, v in data.items()} if isinstance(data, dict) else {}
                yield data
                # Not fsynced: atomic against a crash of ours (rename), and after a power loss every
                # pid in it is dead anyway; an fsync here would sit on every launch's critical path.
                safefs.replace_in(dfd, "placeholders.json", json.dumps(data).encode(), 0o600, durable=False)
            finally:
                os.close(lock)

    def claim(self, pid: int, missing: Iterable[tuple[str, bool]], existing: Iterable[str],
              bases: tuple[str, ...] = (), dirs: frozenset[str] = frozenset(),
              mounted: frozenset[str] = frozenset()) -> None:
        """Create the missing placeholders (empty files, or empty dirs where `is_dir`) and take a
        reference on them, plus on any existing path that is a registered placeholder of another box.
        Each is created beneath its trusted base (the workdir, the home) with no link followed.

        An `existing` path can be gone by now: the plan saw another box's placeholder, whose last
        user removed it before we took the lock. bwrap would then fail on a missing mount point
        ("Can't find source path"; measured: 1 in 60 of ten boxes started at once in one workdir), so
        it is created again as our placeholder: an empty dir where the plan masks it with a tmpfs
        (`dirs`), an empty file otherwise (a read-only bind of it onto itself works either way).
        Only paths the plan mounts something at (`mounted`): a protected or denied path that was
        already missing when the plan was made has no mount point to lose, and making one there
        would plant a file the next box's plan mistakes for a real one."""
        owner = me(pid)
        with self._locked() as data:
            _prune(data)
            vanished = [(p, p in dirs) for p in existing if p in mounted and p not in data and _gone(p)]
            for path, is_dir in [*missing, *vanished]:
                base = _base_for(path, bases)
                try:
                    _create(base, path, is_dir)
                except FileExistsError:
                    if path not in data:
                        continue  # a real file appeared meanwhile: bwrap binds /dev/null over it
                except OSError:
                    continue  # bwrap will report what is wrong
                entry = data.setdefault(path, {"base": base, "pids": []})
                entry["pids"].append(owner.as_json())
            for path in existing:
                if path in data and not any(_pid(o) == pid for o in data[path]["pids"]):
                    data[path]["pids"].append(owner.as_json())

    def release(self, pid: int) -> None:
        """Drop this pid's references; remove placeholders nobody alive uses any more."""
        with self._locked() as data:
            for entry in data.values():
                entry["pids"] = [p for p in entry["pids"] if _pid(p) != pid]
            _prune(data)

    def sweep(self) -> None:
        """Every launch: drop references whose owner is gone (a launcher killed with its janitor, a
        power cut) and remove the placeholders nobody alive uses. No registry, nothing to do."""
        try:
            os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return
        with self._locked() as data:
            _prune(data)


def _gone(path: str) -> bool:
    try:
        os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def _owners(values: object) -> list[dict]:
    owners = [owner_from_json(v) for v in values] if isinstance(values, list) else []
    return [o.as_json() for o in owners if o is not None]


def _pid(ref: dict) -> int:
    return ref["pid"]


def _entry(value: object) -> dict:
    """Registry entries: {"base": DIR, "pids": [{"pid", "start", "boot"}, ...]}; older registries
    held bare pids, or the pid list alone."""
    if isinstance(value, list):
        return {"base": None, "pids": _owners(value)}
    if isinstance(value, dict):
        base = value.get("base")
        return {"base": base if isinstance(base, str) else None, "pids": _owners(value.get("pids"))}
    return {"base": None, "pids": []}


def _create(base: str, path: str, is_dir: bool) -> None:
    rel = os.path.relpath(path, base)
    with safefs.base_dir(base) as dfd, safefs.parent_of(dfd, rel) as (pfd, name):
        if is_dir:
            os.mkdir(name, 0o755, dir_fd=pfd)
        else:
            os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444,
                             dir_fd=pfd))


def _is_placeholder(st: os.stat_result) -> bool:
    return (stat.S_ISREG(st.st_mode) and st.st_size == 0) or stat.S_ISDIR(st.st_mode)


def _prune(data: dict[str, dict]) -> None:
    # Deepest first: a placeholder dir (`.claude`) holding other placeholders (`.claude/commands`,
    # made by a box whose plan saw the dir) is only empty, so removable, once they are gone.
    for path in sorted(data, key=lambda p: p.count("/"), reverse=True):
        entry = data[path]
        entry["pids"] = [p for p in entry["pids"] if alive(Owner(p["pid"], p["start"], p["boot"]))]
        if entry["pids"]:
            continue
        del data[path]
        base = entry.get("base") or os.path.dirname(path)
        try:
            with safefs.base_dir(base) as dfd:
                # an empty file, or a dir (rmdir only succeeds when it is empty)
                safefs.unlink_beneath(dfd, os.path.relpath(path, base), only_if=_is_placeholder)
        except OSError:
            pass
