"""Process liveness, shared by everything that cleans up after launchers that died."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def inheritable_fds() -> list[int]:
    """Our open fds above 2 that an exec would pass on (no FD_CLOEXEC)."""
    import fcntl

    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2:
            continue
        try:
            if not fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC:
                fds.append(fd)
        except OSError:
            continue  # the listing's own fd, closed by now
    return fds


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphans of our descendants come back to us instead of to init, so that nothing the box forked
    (a double-forked daemon in the process tier, bwrap's init after its monitor) outlives the run."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def children(parent: int) -> set[int]:
    """Live (not yet reaped) children of `parent`, from /proc."""
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.add(int(name))
    return found


def has_children() -> bool:
    """Whether we have any child at all, live or zombie (one waitid, no scan)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def reap_descendants(keep: set[int], rounds: int = 500) -> int:
    """SIGKILL and reap every child of ours but `keep`, again and again as orphans of theirs arrive
    (we are a subreaper), until a scan finds none; returns how many were killed. With nothing to
    keep, "none left" is waitpid() saying we have no child at all, and /proc is only scanned
    while some child lives."""
    import signal
    import time

    me = os.getpid()
    killed = 0
    for _ in range(rounds):
        if not keep:
            try:
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass  # reap what has exited already
                # Some child lives: find it below.
            except ChildProcessError:
                return killed
        kids = children(me) - keep
        if not kids:
            if keep:
                return killed
            time.sleep(0.001)  # it exited meanwhile: waitpid() above reaps it next round
            continue
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        for pid in kids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        time.sleep(0.001)
    return killed
