"""Every question the planner asks of the host's files, and the only way it asks one.

resolve() and everything it calls read the host through an FsView alone, passed in as a value: the
real host's is relay/host/fs_view.py HostFs, a test's is in memory (tests/fakefs.py MemFs), which
proves the planner pure: no other file is touched.
"""

from __future__ import annotations

from typing import Protocol


class FsView(Protocol):
    def kind(self, path: str) -> str:
        """"dir", "file" or "missing" (a link followed)."""
        ...

    def realpath(self, path: str) -> str: ...

    def is_symlink(self, path: str) -> bool: ...

    def lkind(self, path: str) -> str:
        """Like kind, but a symbolic link is "link" (not followed)."""
        ...

    def lstat(self, path: str) -> tuple[str, int] | None:
        """(kind, owner uid) of `path` itself: kind is socket, link, dir, file or other; None: absent."""
        ...

    def readlink(self, path: str) -> str | None: ...

    def which(self, name: str, path: str) -> str | None:
        """The executable `name` would run as on `path` (a PATH string), as shutil.which finds it."""
        ...

    def listdir(self, path: str) -> list[str]: ...

    def read_small(self, path: str) -> bytes | None:
        """A small regular file's bytes, read with no link followed (None: absent or not a file)."""
        ...

    def read_bounded(self, path: str, limit: int) -> bytes | None: ...
