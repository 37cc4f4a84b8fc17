"""posix_spawn's contract with work between fork and exec: the box's cgroup joined from inside, the
staged layer entered.

Why not posix_spawn and a join from outside: on cgroup v1, writing another process's pid into a
controller's `cgroup.procs` takes the kernel's global threadgroup lock for writing, and that waits for
an RCU grace period: about 7 ms a controller here, 15 ms of every launch for memory and pids. A
single-threaded process that writes "0" (itself) into `tasks` takes no such lock (the kernel's
"migrating a single thread, current" case): about 0.2 ms for both. The forked child is single
threaded, so moving its one thread moves the process, and bwrap (exec'd in place, same pid) and all
it forks inherit the cgroup before the box runs anything.

The caller's file actions and process group are applied here exactly as posix_spawn would, then
`execve` replaces the child (same pid). A failure before exec is one line on stderr and exit 3
(refused): the box never starts outside its cgroup or on the live checkout instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from relay.box import overlay
from relay.model.refusal import ENTRY


def spawn(path: str, argv: Sequence[str], env: Mapping[str, str], file_actions: Sequence[tuple],
          setpgroup: int | None, *, join: Sequence[str] = (), layer: overlay.Layer | None = None) -> int:
    """Fork; in the child join the cgroup files in JOIN (each gets "0"), enter LAYER, apply the file
    actions, exec. Returns the child's pid, as posix_spawn does."""
    fixes = {"join the box's cgroup": f"`{ENTRY} doctor` shows the cgroup limits; `{ENTRY} clean` removes stale runs",
             "start the staged workdir": f"run with --live, or `{ENTRY} doctor` shows what the overlay needs"}
    pid = os.fork()
    if pid:
        return pid
    what = "join the box's cgroup"
    try:  # pragma: no cover - the forked child
        if setpgroup is not None:
            os.setpgid(0, setpgroup)
        for file in join:  # before any namespace: the write is checked against our own credentials
            _write_self(file)
        if layer is not None:
            what = "start the staged workdir"
            overlay.enter(layer)
        for action in file_actions:
            if action[0] == os.POSIX_SPAWN_DUP2:
                os.dup2(action[1], action[2], inheritable=True)
            elif action[0] == os.POSIX_SPAWN_CLOSE:
                try:
                    os.close(action[1])
                except OSError:
                    pass
        os.execve(path, list(argv), dict(env))
    except OSError as err:
        fix = fixes[what]
        try:
            os.write(2, f"hive-relay: cannot {what} ({err.strerror or err}); the box did not start; fix: {fix}\n"
                     .encode())
        except OSError:
            pass
    finally:
        os._exit(3)
    return -1  # unreachable


def _write_self(file: str) -> None:
    fd = os.open(file, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)


def spawner(join: Sequence[str], layer: overlay.Layer | None) -> Callable[..., int]:
    """posix_spawn itself when there is nothing to do between fork and exec (vfork: no copy of the
    launcher), else `spawn` with JOIN and LAYER bound."""
    if not join and layer is None:
        return os.posix_spawn

    def _spawn(path: str, argv: Sequence[str], env: Mapping[str, str], *, file_actions: Sequence[tuple],
               setpgroup: int | None) -> int:
        return spawn(path, argv, env, file_actions, setpgroup, join=join, layer=layer)

    return _spawn
