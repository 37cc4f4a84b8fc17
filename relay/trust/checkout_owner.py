"""Landing files in the user's checkout: what exists of a path's parents, and handing what a root apply made to the checkout's owner (no link followed: everything goes through safefs)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from relay.host import safefs


def checkout_owner(wfd: int) -> tuple[int, int] | None:
    """(uid, gid) that what root lands in a checkout takes: the checkout's own owner. None when the
    caller is not root (what it writes is its own) or the checkout is root's."""
    if os.geteuid() != 0:
        return None
    st = os.fstat(wfd)
    return None if (st.st_uid, st.st_gid) == (0, 0) else (st.st_uid, st.st_gid)


def missing_parents(fd: int, rel: str) -> list[str]:
    """The parent dirs of rel under the dir fd that do not exist yet (what a create=True makes)."""
    parts = rel.strip("/").split("/")[:-1]
    out = []
    for i in range(1, len(parts) + 1):
        sub = "/".join(parts[:i])
        try:
            if safefs.lstat_beneath(fd, sub) is None:
                out.append(sub)
        except OSError:
            break
    return out


def give(fd: int, rels: Sequence[str], owner: tuple[int, int] | None) -> None:
    """chown what we just made under the dir fd to `owner`, no link followed (a root apply into a
    user's checkout leaves the user's files, as the user's own edit would)."""
    if owner is None:
        return
    for rel in rels:
        with safefs.parent_of(fd, rel) as (pfd, name):
            os.chown(name, *owner, dir_fd=pfd, follow_symlinks=False)
