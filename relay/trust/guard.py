"""Guarded settings: the agent may edit its own settings in the box, but not plant what runs on the
host later. At exit, if the box changed anything but the data keys of a guarded file's inventory
(relay/config/settings_keys.py: hooks, MCP servers, helpers, endpoints, permissions, env, trust, unknown keys),
the original is restored and the box's version is kept aside with a note. Data edits (theme, model)
are kept.
"""

from __future__ import annotations

import os
import stat

from relay.config import settings_keys
from relay.host import safefs
from relay.model.record import record

# Settings files are small; anything larger is not a settings file the host should parse.
MAX_SETTINGS = 4 << 20


@record
class Snapshot:
    """What a guarded path was before the box ran: its bytes (None: absent), or the target of a
    link the user keeps there (dotfile managers do), plus the entry's identity to spot a swap."""

    data: bytes | None
    link: str | None = None
    ident: tuple[int, ...] | None = None


def _ident(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns)


def snapshot(path: str, base: str | None = None) -> Snapshot:
    """Read a guarded file before the run, with no link followed below `base` (the user's home).
    The key inventories are read now too, before any box runs (relay/config/settings_keys.py)."""
    settings_keys.inventory()
    base, rel = safefs._split(path, base if base and safefs.beneath(path, base) else None)
    try:
        with safefs.base_dir(base) as dfd:
            st = safefs.lstat_beneath(dfd, rel)
            if st is None:
                return Snapshot(None)
            if stat.S_ISLNK(st.st_mode):
                with safefs.parent_of(dfd, rel) as (pfd, name):
                    return Snapshot(None, link=os.readlink(name, dir_fd=pfd), ident=_ident(st))
            return Snapshot(safefs.read_beneath(dfd, rel, MAX_SETTINGS), ident=_ident(st))
    except OSError:
        return Snapshot(None, ident=(-1,))  # unreadable before the run: anything after it is a change



def changed_keys(before: bytes | None, after: bytes | None, rel: str) -> list[str]:
    """What the box changed that is not a data key of the file's inventory (config/settings/): any
    command, endpoint, grant, env, trust, code or steering key, and any key the inventory does not
    know. An unparsable new file, or a file with no inventory, counts as a change to review."""
    return settings_keys.review_keys(rel, before, after)


def enforce(path: str, before: Snapshot | bytes | None, base: str | None = None) -> str | None:
    """Revert exec-key changes to `path`; returns a message for the user, or None.

    The box may have left anything at `path`: a link, a FIFO, a directory, a huge file. Whatever it
    is, it is never followed or read beyond a bound; anything we cannot judge counts as a change of
    every key. A change is moved aside whole (a rename within the directory, under a name the box
    cannot guess) and the original is restored; if that fails, the message says so loudly and the
    box's version is not left live: it is moved aside even when the original cannot come back.
    """
    if not isinstance(before, Snapshot):
        before = Snapshot(before)
    base, rel = safefs._split(path, base if base and safefs.beneath(path, base) else None)
    try:
        with safefs.base_dir(base) as dfd, safefs.parent_of(dfd, rel) as (pfd, name):
            return _enforce_in(pfd, name, path, before, rel)
    except FileNotFoundError:
        return None  # the directory itself is gone: nothing of the box's can run from there
    except OSError as err:
        return (f"could not check {path} after the box ran: {err.strerror or err}; "
                f"fix: inspect it before starting the agent on the host")


def _enforce_in(pfd: int, name: str, path: str, before: Snapshot, rel: str) -> str | None:
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is None and before.data is None and before.link is None:
        return None
    # No shortcut on (inode, size, mtime): the box owns the file and can rewrite it in place and set
    # its mtime back. The bytes are always compared.
    if st is not None and stat.S_ISREG(st.st_mode):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            try:
                after: bytes | None = safefs._read_fd(fd, MAX_SETTINGS, name)
            finally:
                os.close(fd)
        except OSError:
            after, keys = None, ["(unreadable or oversized file)"]
        else:
            if after == before.data:
                return None
            keys = changed_keys(before.data, after, rel)
            if not keys:
                return None
    elif st is None:
        keys = changed_keys(before.data, None, rel) if before.link is None else []
        if not keys:
            return None  # a deleted settings file runs nothing later
    elif stat.S_ISLNK(st.st_mode) and before.link is not None and _readlink(pfd, name) == before.link:
        return None  # the user's own link, as it was
    else:
        keys = ["(not a regular file)"]
    aside = safefs.unique_name(name, "rejected")
    moved = False
    if st is not None:
        try:
            safefs.rename_noreplace(pfd, name, aside)
            moved = True
        except OSError as err:
            return (f"could not revert {path} ({', '.join(keys)} changed in the box): {err.strerror or err}; "
                    f"fix: remove it by hand before starting the agent on the host")
    try:
        if before.link is not None:
            tmp = safefs.unique_name(name, "tmp")
            os.symlink(before.link, tmp, dir_fd=pfd)
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        elif before.data is not None:
            safefs.replace_in(pfd, name, before.data, 0o600 if st is None else stat.S_IMODE(st.st_mode) & 0o777)
    except OSError as err:
        where = f"; the box's version is kept at {os.path.join(os.path.dirname(path), aside)}" if moved else ""
        return (f"could not restore {path} ({', '.join(keys)} changed in the box): {err.strerror or err}{where}; "
                f"fix: restore it from your backup")
    if not moved:
        return f"restored {path}: the box removed it while it held {', '.join(keys)}"
    return (f"reverted {path}: the box changed {', '.join(keys)}, which would run on the host later; "
            f"its version is kept at {os.path.join(os.path.dirname(path), aside)}")


def _readlink(pfd: int, name: str) -> str | None:
    try:
        return os.readlink(name, dir_fd=pfd)
    except OSError:
        return None
