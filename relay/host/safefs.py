"""The one way host-side code touches a path a box could have written.

The janitor, the guard, the sync-back, the placeholders, the registry, the logs and the caches run
with the caller's rights (root's included) on paths the box may have prepared: a symlink at any
component, a FIFO where a file is expected, a huge file, or a pre-created temporary name. Every
such touch goes through this module, which:

- resolves a path *beneath a trusted directory* with no symlink followed on any component
  (`openat2(RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` where the kernel has it,
  an `O_NOFOLLOW` walk of `openat` calls otherwise);
- opens with `O_NONBLOCK` and checks `S_ISREG` with `fstat` before reading, so a FIFO or device
  never blocks and never feeds us;
- bounds every read;
- creates with `O_EXCL` under names from `secrets`, so the box cannot pre-create them, and
  renames within one directory fd.

The trusted directory (the `base` argument) is the caller's choice: the user's `$HOME`, the run
dir we made ourselves, the workdir. Symlinks *above* it belong to the host's own layout and are
followed once, when the base is opened; nothing below it is.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager

# 16 MiB: larger than any settings file, login or session index an agent keeps in one file.
DEFAULT_LIMIT = 16 << 20
_SYS_OPENAT2 = 437  # the same number on every architecture (new syscall table)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_HAVE_OPENAT2: bool | None = None


class UnsafePath(OSError):
    """A path the box could have prepared is not what the host expected (a link, a special file,
    too large). Callers treat it as hostile: refuse, keep aside, never follow."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def _openat2(dirfd: int, rel: str, flags: int, mode: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0,
                   _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(rel), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), rel)
    return fd


def have_openat2() -> bool:
    """Probed once: ENOSYS on kernels before 5.6 (and under some seccomp profiles)."""
    global _HAVE_OPENAT2
    if _HAVE_OPENAT2 is None:
        try:
            os.close(_openat2(_AT_FDCWD, ".", os.O_RDONLY | os.O_DIRECTORY, 0))
            _HAVE_OPENAT2 = True
        except OSError as err:
            _HAVE_OPENAT2 = err.errno not in (errno.ENOSYS, errno.EPERM)
    return _HAVE_OPENAT2


_AT_FDCWD = -100


def _parts(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or rel.startswith("/"):
        raise UnsafePath(errno.EINVAL, "not a plain relative path", rel)
    return parts


def _walk(dirfd: int, parts: list[str], flags: int, mode: int) -> int:
    """The fallback: one `openat(O_NOFOLLOW)` per component, directories with O_DIRECTORY."""
    fd = os.dup(dirfd)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        os.close(fd)


def open_beneath(dirfd: int, rel: str, flags: int, mode: int = 0o600) -> int:
    """Open `rel` under the directory fd with no symlink on any component (ELOOP/ENOTDIR if one is
    there). `O_NOFOLLOW` is always added, so the last component is never followed either."""
    parts = _parts(rel)
    flags |= os.O_NOFOLLOW
    try:
        if have_openat2():
            return _openat2(dirfd, "/".join(parts), flags, mode)
        return _walk(dirfd, parts, flags, mode)
    except OSError as err:
        # ELOOP for a link on the way; ENOTDIR when O_DIRECTORY met a link at the end.
        if err.errno in (errno.ELOOP, errno.ENOTDIR) and _has_link(dirfd, parts):
            raise UnsafePath(errno.ELOOP, "a symbolic link is in the way", rel) from None
        raise


def _has_link(dirfd: int, parts: list[str]) -> bool:
    try:
        fd = os.dup(dirfd)
        try:
            for part in parts:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    return True
                if not stat.S_ISDIR(st.st_mode):
                    return False
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = nxt
        finally:
            os.close(fd)
    except OSError:
        return False
    return False


@contextmanager
def base_dir(path: str) -> Iterator[int]:
    """A directory fd on a trusted base (the host's own layout above it is followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


@contextmanager
def parent_of(dirfd: int, rel: str, create: bool = False, mode: int = 0o700) -> Iterator[tuple[int, str]]:
    """(fd of the directory that holds `rel`, its last component), opened with no link followed;
    with `create`, missing directories are made (mode `mode`) on the way."""
    parts = _parts(rel)
    if create:
        fd = os.dup(dirfd)
        try:
            for part in parts[:-1]:
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                except FileExistsError:
                    pass
                nxt = open_beneath(fd, part, os.O_RDONLY | os.O_DIRECTORY)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
    elif len(parts) == 1:
        fd = os.dup(dirfd)
    else:
        fd = open_beneath(dirfd, "/".join(parts[:-1]), os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd, parts[-1]
    finally:
        os.close(fd)


def _read_fd(fd: int, limit: int, name: str) -> bytes:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(errno.EINVAL, "not a regular file", name)
    if st.st_size > limit:
        raise UnsafePath(errno.EFBIG, f"larger than {limit} bytes", name)
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = os.read(fd, min(1 << 20, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise UnsafePath(errno.EFBIG, f"larger than {limit} bytes", name)
    return b"".join(chunks)


def read_beneath(dirfd: int, rel: str, limit: int = DEFAULT_LIMIT) -> bytes | None:
    """The bytes of a regular file under `dirfd`; None when it does not exist. Raises UnsafePath for
    a link on the way, a special file (never blocks: O_NONBLOCK) or a file over `limit`."""
    try:
        fd = open_beneath(dirfd, rel, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        return None
    try:
        return _read_fd(fd, limit, rel)
    finally:
        os.close(fd)


def _own(st: os.stat_result) -> bool:
    """Ours alone: owned by this effective uid, writable by no group or other."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _settled(real: str) -> bool:
    """Every directory above REAL (a real path) is ours or root's, and no one else may rename what is
    in it (not writable by group or others, or sticky, as /tmp): what lies below cannot be moved away
    and replaced by another user."""
    parent = os.path.dirname(real)
    while True:
        try:
            st = os.lstat(parent)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, os.geteuid()):
            return False
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


def read_owned(base: str, rel: str, limit: int = DEFAULT_LIMIT) -> bytes | None:
    """`read_beneath`, for a file only we can have written: BASE, every directory down to the file and
    the file itself owned by this effective uid and writable by no one else (checked on the opened
    fds: nothing can be swapped in between), and every directory above BASE ours or root's, where no
    one else can move BASE away (`_settled`); None when absent or not ours alone. Why: an answer kept
    in a directory another user owns (root launched with that user's $HOME or $XDG_CACHE_HOME) could
    be that user's, renamed or written to steer root's next launch."""
    real = os.path.realpath(base)
    if not _settled(real):
        return None
    try:
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not _own(os.fstat(fd)):
            return None
        parts = _parts(rel)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY if last else os.O_RDONLY | os.O_DIRECTORY
            try:
                nxt = open_beneath(fd, part, flags)
            except (FileNotFoundError, NotADirectoryError):
                return None
            os.close(fd)
            fd = nxt
            if not _own(os.fstat(fd)):
                return None
        return _read_fd(fd, limit, rel)
    finally:
        os.close(fd)


def owned_dir(path: str) -> bool:
    """Whether PATH is a directory owned by this effective uid and writable by no one else, in
    directories no one else can move it out of (`read_owned` would trust what is in it)."""
    real = os.path.realpath(path)
    try:
        st = os.lstat(real)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and _own(st) and _settled(real)


def read_owned_file(path: str, limit: int = DEFAULT_LIMIT) -> bytes | None:
    """`read_owned` of a file directly in its directory (a cache file: probe.json, verified.json, ...)."""
    return read_owned(os.path.dirname(path), os.path.basename(path), limit)


def read_file(path: str, limit: int = DEFAULT_LIMIT, base: str | None = None) -> bytes | None:
    """`read_beneath` for an absolute path: beneath `base` when given, else beneath its parent."""
    base, rel = _split(path, base)
    try:
        with base_dir(base) as dfd:
            return read_beneath(dfd, rel, limit)
    except (FileNotFoundError, NotADirectoryError):
        return None


def beneath(path: str, base: str) -> bool:
    """True when `path` lies strictly below `base` (lexically; both absolute)."""
    rel = os.path.relpath(os.path.normpath(path), os.path.normpath(base))
    return rel != "." and rel != ".." and not rel.startswith("../")


def _split(path: str, base: str | None) -> tuple[str, str]:
    path = os.path.normpath(path)
    if base is None:
        return os.path.dirname(path) or "/", os.path.basename(path)
    base = os.path.normpath(base)
    rel = os.path.relpath(path, base)
    if not beneath(path, base):
        raise UnsafePath(errno.EINVAL, f"not beneath {base}", path)
    return base, rel


def unique_name(stem: str, tag: str) -> str:
    """A name the box cannot guess: `stem.hive-relay-TAG-TIME-RANDOM`."""
    return f"{stem}.hive-relay-{tag}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(6).hex()}"


def create_new(dirfd: int, name: str, data: bytes, mode: int = 0o600, durable: bool = True) -> None:
    """Write a new file that did not exist (O_EXCL, no link followed). `durable`: fsync it (the
    user's files); off for scratch state that a run deletes or rebuilds (its run dir, the registry)."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dirfd)
    try:
        _write_all(fd, data, durable)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(name, dir_fd=dirfd)
        except OSError:
            pass
        raise
    os.close(fd)


def _write_all(fd: int, data: bytes, durable: bool = True) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    if durable:
        os.fsync(fd)


def replace_in(dirfd: int, name: str, data: bytes, mode: int = 0o600, durable: bool = True) -> None:
    """Atomically replace `name` in the directory fd: a fresh temporary under an unguessable name,
    then rename within the same directory. A link at `name` is replaced, never followed; a
    directory there makes the rename fail."""
    tmp = unique_name(name, "tmp")
    create_new(dirfd, tmp, data, mode, durable)
    try:
        os.rename(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dirfd)
        except OSError:
            pass
        raise


def write_file(path: str, data: bytes, mode: int = 0o600, base: str | None = None, make_dirs: bool = False,
               durable: bool = True) -> None:
    """`replace_in` for an absolute path, resolved beneath `base` (default: its parent)."""
    base, rel = _split(path, base)
    with base_dir(base) as dfd, parent_of(dfd, rel, create=make_dirs) as (pfd, name):
        replace_in(pfd, name, data, mode, durable)


def keep_aside(path: str, data: bytes, tag: str, base: str | None = None) -> str:
    """Write `data` next to `path` under a new unguessable name; returns that path."""
    base, rel = _split(path, base)
    with base_dir(base) as dfd, parent_of(dfd, rel) as (pfd, name):
        aside = unique_name(name, tag)
        create_new(pfd, aside, data)
    return os.path.join(os.path.dirname(path), aside)


_RENAME_NOREPLACE = 1


def rename_noreplace(dirfd: int, src: str, dst: str) -> None:
    """Rename within one directory fd, failing with EEXIST rather than replacing anything at `dst`
    (renameat2; the entry itself moves, whatever it is, and nothing is followed)."""
    if _libc.renameat2(dirfd, os.fsencode(src), dirfd, os.fsencode(dst), _RENAME_NOREPLACE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), dst)


def lstat_beneath(dirfd: int, rel: str) -> os.stat_result | None:
    """lstat of the last component, reached with no link followed; None when absent."""
    try:
        with parent_of(dirfd, rel) as (pfd, name):
            return os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None


def unlink_beneath(dirfd: int, rel: str, only_if=None) -> bool:  # noqa: ANN001 - predicate on stat_result
    """Remove a file (or an empty dir) reached with no link followed; `only_if(st)` must hold.
    Returns True when something was removed."""
    try:
        with parent_of(dirfd, rel) as (pfd, name):
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if only_if is not None and not only_if(st):
                return False
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(name, dir_fd=pfd)
            else:
                os.unlink(name, dir_fd=pfd)
            return True
    except (FileNotFoundError, NotADirectoryError):
        return False


def bind_unix(dirfd: int, name: str, backlog: int):  # -> socket.socket
    """A listening AF_UNIX socket at NAME in the directory fd: bound through /proc/self/fd, so no
    component of the directory's path is resolved again (a link swapped in on the way is not
    followed); closed again if the bind or listen fails."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(f"/proc/self/fd/{dirfd}/{name}")
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


MAX_OPEN_LEVELS = 64  # remove_tree's open directories at most; deeper subtrees are moved up first


def remove_tree(pfd: int, name: str) -> None:
    """Remove `name` under the dir fd and all below it, no link followed. Each directory is made
    ours to read first: overlayfs leaves its `work/work` at mode 000, and a box can chmod 000 its own.
    The box may have made the tree (its git dir is in the run dir), so no shape of it may stop us:
    - deep: no recursion, and at most MAX_OPEN_LEVELS directories open; a subtree below that is
      renamed up into the top directory (same filesystem, still inside the tree, a name no one
      chose) and removed from there;
    - wide: each directory is listed once (listing again after each child made it quadratic).
    Raises OSError when something cannot be removed.
    (The staged layers', the kube stage's and the run dirs' removal: relay/trust/rundirs.py remove_run_dir.)"""
    opened: list[tuple[int, str, int, list[str]]] = []  # (its parent's fd, its name, its fd, entries left)
    relists = 0

    def enter(parent: int, child: str) -> None:
        try:
            os.chmod(child, 0o700, dir_fd=parent, follow_symlinks=False)
        except (OSError, ValueError):  # ValueError: a link swapped in (Python cannot chmod one by fd)
            pass
        fd = os.open(child, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            opened.append((parent, child, fd, os.listdir(fd)))
        except BaseException:
            os.close(fd)
            raise

    enter(pfd, name)
    try:
        while opened:
            parent, child, fd, left = opened[-1]
            if left:
                entry = left.pop()
                try:
                    st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(entry, dir_fd=fd)
                elif len(opened) < MAX_OPEN_LEVELS:
                    enter(fd, entry)
                else:
                    top = opened[0]
                    moved = f".hive-relay-deep-{os.urandom(8).hex()}"
                    os.rename(entry, moved, src_dir_fd=fd, dst_dir_fd=top[2])
                    top[3].append(moved)
                continue
            opened.pop()
            os.close(fd)
            try:
                os.rmdir(child, dir_fd=parent)
            except OSError as err:
                if err.errno != errno.ENOTEMPTY or relists >= 1000:
                    raise
                relists += 1  # something appeared after the listing: list it again (bounded)
                enter(parent, child)
    finally:
        for _, _, fd, _ in opened:
            os.close(fd)
