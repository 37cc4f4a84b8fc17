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
