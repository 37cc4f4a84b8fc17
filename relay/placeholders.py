"""Placeholder files that keep a missing protected path (e.g. `.vscode`, `.git/hooks`) from being
created, shared safely between boxes that run in the same workdir at the same time.

bwrap needs a mount point to mask a missing path, so an empty file appears on the host for the
box's lifetime. Two boxes in one workdir must not race on creating it, and one box's teardown
must not unlink it while another box still masks it (unlinking a mount point detaches the mount
in every namespace). So each placeholder is reference-counted by launcher pid in a registry
under the state dir, guarded by flock; the last live user removes it.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from .procs import pid_alive


class Registry:
    def __init__(self, state_dir: str) -> None:
        self.path = Path(state_dir) / "placeholders.json"
        self.lock_path = Path(state_dir) / "placeholders.lock"

    @contextmanager
    def _locked(self):  # noqa: ANN202
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                data = json.loads(self.path.read_text())
                if not isinstance(data, dict):
                    data = {}
            except (OSError, ValueError):
                data = {}
            yield data
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)

    def claim(self, pid: int, missing: Iterable[tuple[str, bool]], existing: Iterable[str]) -> None:
        """Create the missing placeholders (empty files, or empty dirs where `is_dir`) and take a
        reference on them, plus on any existing path that is a registered placeholder of another box."""
        with self._locked() as data:
            _prune(data)
            for path, is_dir in missing:
                try:
                    if is_dir:
                        os.mkdir(path, 0o755)
                    else:
                        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o444)
                        os.close(fd)
                except FileExistsError:
                    if path not in data:
                        continue  # a real file appeared meanwhile: bwrap binds /dev/null over it
                except OSError:
                    continue  # bwrap will report what is wrong
                data.setdefault(path, [])
                data[path].append(pid)
            for path in existing:
                if path in data and pid not in data[path]:
                    data[path].append(pid)

    def release(self, pid: int) -> None:
        """Drop this pid's references; remove placeholders nobody alive uses any more."""
        with self._locked() as data:
            for path in list(data):
                data[path] = [p for p in data[path] if p != pid]
            _prune(data)


def _prune(data: dict[str, list[int]]) -> None:
    for path in list(data):
        data[path] = [p for p in data[path] if isinstance(p, int) and pid_alive(p)]
        if data[path]:
            continue
        del data[path]
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_size == 0:
                os.unlink(path)
            elif stat.S_ISDIR(st.st_mode):
                os.rmdir(path)  # only succeeds when empty
        except OSError:
            pass
