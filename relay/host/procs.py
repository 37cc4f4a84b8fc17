"""Process liveness, shared by everything that cleans up after launchers that died."""

from __future__ import annotations

import functools
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


def stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat from field 3 (state) on, so [0] is the state, [1] the ppid, [2] the process
    group, [19] the start time; the command name may hold spaces and parentheses. Bounded read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read(4096)
    except OSError:
        return None
    fields = data.rsplit(b")", 1)[-1].split()
    return fields if len(fields) > 19 else None


def processes_where(index: int, value: int) -> set[int]:
    """Pids whose stat field `index` (see stat_fields) equals `value`: children of a parent (1), the
    members of a process group (2)."""
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = stat_fields(int(name))
        try:
            if fields is not None and int(fields[index]) == value:
                found.add(int(name))
        except ValueError:
            continue
    return found


def children(parent: int) -> set[int]:
    """Live (not yet reaped) children of `parent`: the `children` list of each of its threads (one
    small read a thread, where the kernel has CONFIG_PROC_CHILDREN), else a scan of every process's
    stat (a read per process on the machine: milliseconds on a busy one, three times a launch)."""
    if not _children_lists():
        return processes_where(1, parent)
    found: set[int] = set()
    try:
        tids = os.listdir(f"/proc/{parent}/task")
    except OSError:
        return found  # no such process: no children
    for tid in tids:
        try:
            with open(f"/proc/{parent}/task/{tid}/children", "rb") as fh:
                found.update(int(pid) for pid in fh.read().split())
        except OSError:
            continue  # that thread ended meanwhile; its children went to a sibling thread, read below or above
    return found


@functools.cache
def _children_lists() -> bool:
    """Whether this kernel lists a thread's children (CONFIG_PROC_CHILDREN): asked once a process."""
    return os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _kill_until_none(find, reap: bool, rounds: int, pause: float) -> int:  # noqa: ANN001 - () -> set[int]
    """SIGKILL what `find()` returns, again and again (new orphans arrive, a namespace empties
    asynchronously), until a scan finds none; reaps them when they are our children."""
    import signal
    import time

    killed = 0
    for _ in range(rounds):
        pids = find()
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        if reap:
            for pid in pids:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
        time.sleep(pause)
    return killed


def reap_descendants(keep: set[int], rounds: int = 500) -> int:
    """SIGKILL and reap every child of ours but `keep`, again and again as orphans of theirs arrive
    (we are a subreaper), until a scan finds none; returns how many were killed."""
    me = os.getpid()
    return _kill_until_none(lambda: children(me) - keep, reap=True, rounds=rounds, pause=0.001)


def kill_pidns(pidns: str, rounds: int = 200) -> int:
    """SIGKILL every process in the pid namespace `pidns` (as /proc/PID/ns/pid reads it) until none is
    left: whatever the box forked is gone, whoever its parent ended up being."""
    if pidns == os.readlink("/proc/self/ns/pid"):
        return 0  # never our own namespace: that would be the whole host

    def members() -> set[int]:
        found = set()
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.readlink(f"/proc/{name}/ns/pid") == pidns:
                        found.add(int(name))
                except OSError:
                    continue
        return found

    return _kill_until_none(members, reap=False, rounds=rounds, pause=0.005)


def readable(fd: int, timeout: float) -> bool:
    """Whether FD becomes readable (or hung up) within TIMEOUT seconds. poll, not select: a launcher
    that inherited many fds gets new ones numbered past 1024, which select cannot watch (ValueError)."""
    import select

    waiter = select.poll()
    waiter.register(fd, select.POLLIN)
    return bool(waiter.poll(max(0, int(timeout * 1000 + 0.999))))
