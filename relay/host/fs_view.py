"""The planner's view of the host's files (relay/model/fs_view.py), answered by the real host: the one
place planning reads the filesystem. Tests hand resolve() an in-memory view instead (tests/fakefs.py)."""

from __future__ import annotations

import os
import stat

from relay.model.fs_view import FsView
from relay.model.record import record


@record(frozen=False)
class HostFs(FsView):
    """The real host, asked on demand."""

    def kind(self, path: str) -> str:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return "missing"
        if stat.S_ISDIR(mode):
            return "dir"
        return "file"

    def realpath(self, path: str) -> str:
        return os.path.realpath(path)

    def is_symlink(self, path: str) -> bool:
        return os.path.islink(path)

    def lkind(self, path: str) -> str:
        """Like kind, but a symbolic link is "link" (not followed)."""
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return "missing"
        if stat.S_ISLNK(mode):
            return "link"
        return "dir" if stat.S_ISDIR(mode) else "file"

    def lstat(self, path: str) -> tuple[str, int] | None:
        """(kind, owner uid) of `path` itself, a link not followed: kind is socket, link, dir, file
        or other; None when it does not exist (relay/policy/sockets.py checks `--allow-socket` with it)."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        mode = st.st_mode
        kind = ("socket" if stat.S_ISSOCK(mode) else "link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode)
                else "file" if stat.S_ISREG(mode) else "other")
        return kind, st.st_uid

    def readlink(self, path: str) -> str | None:
        try:
            return os.readlink(path)
        except OSError:
            return None

    def which(self, name: str, path: str) -> str | None:
        """The executable `name` would run as on `path` (a PATH string), as shutil.which finds it."""
        from relay.host.paths import which

        return which(name, path)

    def listdir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except OSError:
            return []

    def read_small(self, path: str) -> bytes | None:
        """A small regular file's bytes, read with no link followed (None: absent or not a file)."""
        return self.read_bounded(path, 4096)

    def read_bounded(self, path: str, limit: int) -> bytes | None:
        from relay.host import safefs

        try:
            return safefs.read_file(path, limit)
        except OSError:
            return None
