"""Pin symbolic links the box must not replace, then exec bubblewrap: the box's launch pre-stage.

A workdir whose `.claude` (or `.envrc`, `.vscode`, any protected path) is a symbolic link, or a
deny-list entry that is a link under a writable grant, would let the box `rm` the link and put a
real directory with hooks in its place. A directory is pinned by a bind onto itself (rename and
unlink of a mount point fail with EBUSY), but bwrap cannot do that for a link: a mount's
destination is always followed, and a directory cannot be mounted on a link. The kernel does bind
a link onto itself when both ends are named by an `O_PATH|O_NOFOLLOW` fd (`/proc/self/fd/N`), so
this stage does it, in a mount namespace of its own (private, so nothing reaches the host's),
and then execs bwrap, whose recursive binds carry the pinned links into the box.

The pin is remounted read-only, nosuid and nodev: bwrap re-applies those flags to every submount
of a bind and would follow the link doing it (and fail), unless they are already set.

Run as `python -I -S linkpin.py LINK TARGET [LINK TARGET ...] -- BWRAP ARGS...` (stdlib only, no
package import: it runs before anything else of the box). Each LINK must still be a link with the
text TARGET the plan saw; otherwise it refuses (exit 3) rather than start a box planned for
another filesystem. An unprivileged caller gets a user namespace that maps only its own ids (so a
mount namespace is allowed); root needs none.
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
REFUSED = 3


class PinError(Exception):
    pass


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise PinError(f"{what}: {os.strerror(err)}")


def _own_namespace(libc: ctypes.CDLL) -> None:
    """A mount namespace of our own whose mounts propagate nowhere."""
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        _check(libc.unshare(CLONE_NEWNS), "unshare(mount namespace)")
    else:
        _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(user and mount namespace)")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")


def _open_link(path: str, target: str) -> int:
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISLNK(os.fstat(fd).st_mode):
            raise PinError(f"{path} is no longer a symbolic link")
        if os.readlink(f"/proc/self/fd/{fd}") != path:  # a parent became a link: the plan's path is not this one
            raise PinError(f"a directory above {path} is now a symbolic link")
        if os.readlink(path) != target:
            raise PinError(f"{path} now points elsewhere")
    except BaseException:
        os.close(fd)
        raise
    return fd


def pin(libc: ctypes.CDLL, path: str, target: str) -> None:
    """Bind the link at `path` onto itself, then make that mount read-only, nosuid and nodev."""
    fd = _open_link(path, target)
    try:
        name = f"/proc/self/fd/{fd}".encode()
        _check(libc.mount(name, name, None, MS_BIND, None), f"pin {path}")
    finally:
        os.close(fd)
    fd = _open_link(path, target)  # now the mount's root: the remount must name the mount, not the link under it
    try:
        name = f"/proc/self/fd/{fd}".encode()
        _check(libc.mount(b"none", name, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None),
               f"pin {path} read-only")
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: linkpin.py LINK TARGET [LINK TARGET ...] -- COMMAND...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    pairs, command = argv[:cut], argv[cut + 1:]
    if len(pairs) % 2 or not command:
        print("usage: linkpin.py LINK TARGET [LINK TARGET ...] -- COMMAND...", file=sys.stderr)
        return 2
    libc = _libc()
    try:
        _own_namespace(libc)
        for i in range(0, len(pairs), 2):
            pin(libc, pairs[i], pairs[i + 1])
    except (PinError, OSError) as err:
        print(f"hive-relay: error: cannot pin a symbolic link the box must not replace: {err}; "
              "fix: start the box again (the link changed since it was planned), or replace the link with "
              "the directory or file it points to", file=sys.stderr)
        return REFUSED
    try:
        os.execvp(command[0], command)
    except OSError as err:
        print(f"hive-relay: error: cannot start {command[0]}: {err.strerror or err}", file=sys.stderr)
        return 127
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
