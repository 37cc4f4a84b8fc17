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


def reap_descendants(keep: set[int], rounds: int = 500) -> int:
    """SIGKILL and reap every child of ours but `keep`, again and again as orphans of theirs arrive
    (we are a subreaper), until a scan finds none; returns how many were killed."""
    import signal
    import time

    me = os.getpid()
    killed = 0
    for _ in range(rounds):
        kids = children(me) - keep
        if not kids:
            return killed
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


def kill_pidns(pidns: str, rounds: int = 200) -> int:
    """SIGKILL every process in the pid namespace `pidns` (as /proc/PID/ns/pid reads it) until none is
    left: whatever the box forked is gone, whoever its parent ended up being."""
    import signal
    import time

    if pidns == os.readlink("/proc/self/ns/pid"):
        return 0  # never our own namespace: that would be the whole host
    killed = 0
    for _ in range(rounds):
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{name}/ns/pid") == pidns:
                    found.append(int(name))
            except OSError:
                continue
        if not found:
            return killed
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.005)
    return killed
