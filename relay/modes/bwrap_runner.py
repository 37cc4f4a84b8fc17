"""The supervised tier: bubblewrap started blocked (posix_spawn's contract: fixed fds, its own process
group), in its cgroup from before its exec (relay/box/fork_spawn.py) or under rlimits, the proxy
listener opened in its network namespace, then released, so the agent's first request finds the
proxy serving."""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Mapping

from relay.box import fork_spawn, jobctl
from relay.box import resource_limits as limits
from relay.egress.proxy import EgressProxy
from relay.host import procs
from relay.host.netns import listen_in
from relay.host.phase_marks import mark
from relay.model.errors import RefusedError, RelayError
from relay.modes.box_start import BoxProcess, box_env, read_child_pid, release, start_proxy
from relay.plan.resolve import BLOCK_FD, INFO_FD, SECCOMP_FD, SOCKET_FD, Plan
from relay.render.seccomp_bpf import compile_to_memfd
from relay.trust import janitor, staged


def start(
    plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState, use_rlimits: bool, nofile: tuple[int, int],
    lifeline: int, job: jobctl.Job,
) -> tuple[BoxProcess, EgressProxy | None]:
    """Spawn bwrap blocked, put it in its cgroup (or rlimits), open the proxy listener in its network
    namespace, start the proxy, then unblock it: the agent's first request finds the proxy serving."""
    # Never a silent default: a plan for this tier always carries its filter.
    assert plan.seccomp_policy is not None, "a supervised plan without its seccomp policy"
    socket_fds = open_sockets(plan)
    seccomp_fd = compile_to_memfd(plan.seccomp_policy, env=caller_env)
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    mark("seccomp_compiled")
    high = [(target, fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10))
            for target, fd in ((SECCOMP_FD, seccomp_fd), (INFO_FD, info_w), (BLOCK_FD, block_r), *socket_fds)]
    targets = {target for target, _ in high}
    # Only 0, 1, 2 and bwrap's own fds reach the box: a directory fd the caller's shell left open
    # would be a key to the host's filesystem.
    closes = [(os.POSIX_SPAWN_CLOSE, fd) for fd in procs.inheritable_fds() if fd not in targets]
    # The same spawn, with the cgroup joined and the staged overlay mounted between fork and exec.
    layer = staged.create(plan.staged, plan.workdir, staged.launch_meta(plan)) if plan.staged is not None else None
    spawn = fork_spawn.spawner(state.cgroup.self_join_files() if state.cgroup is not None else (), layer)
    try:
        pid = spawn(plan.command[0], list(plan.command), box_env(plan, caller_env),
                    file_actions=[(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in high] + closes, setpgroup=0)
    except OSError as err:
        raise RelayError(f"cannot start {plan.command[0]}: {err.strerror or err}") from None
    finally:
        for fd in [seccomp_fd, info_w, block_r] + [fd for _, fd in socket_fds] + [fd for _, fd in high]:
            os.close(fd)
    janitor.tell(lifeline, pid)  # first: should we die from here on, the janitor knows the box's group
    proc = BoxProcess(pid, job)
    job.give(pid)  # before the box is released: its first read of the terminal finds it its own
    proxy = None
    try:
        mark("spawned")
        child = read_child_pid(info_r, proc)
        if child is None:
            return proc, None  # bwrap failed and said why on stderr; its exit code is passed on
        janitor.tell(lifeline, child)
        try:
            proc.pidns_fd = os.open(f"/proc/{child}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            proc.pidns = os.readlink(f"/proc/self/fd/{proc.pidns_fd}")
        except OSError:
            pass
        limits.apply_to(child, plan.limits.memory, plan.limits.pids, use_rlimits, nofile)
        if plan.proxy_listen:
            try:
                listener = listen_in(child, plan.proxy_listen, join_userns=os.getuid() != 0)
            except OSError as err:
                if proc.poll() is not None:
                    return proc, None
                raise RelayError(str(err)) from None
            mark("box_ready")
            proxy = start_proxy(plan, listener, caller_env)
        mark("proxy_started")
        release(block_w, b"x")
    finally:
        os.close(block_w)
        os.close(info_r)
    return proc, proxy


def open_sockets(plan: Plan) -> list[tuple[int, int]]:
    """Each `--allow-socket` socket as (bwrap's fd number, an O_PATH fd on it), checked again here.

    bwrap follows links when it binds a path, and the planner's lstat was earlier: a process that
    can write the socket's directory (another box whose workdir holds it) could swap the socket for
    a link to docker.sock in between. The fd is opened without following the last component, must
    still be a socket of the caller's, and must sit at the planned path (so no directory on the way
    was swapped either); bwrap then binds that very inode (`--ro-bind-fd`)."""
    out: list[tuple[int, int]] = []
    try:
        for i, sock in enumerate(plan.sockets):
            fd = os.open(sock.host, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            out.append((SOCKET_FD + i, fd))
            st = os.fstat(fd)
            where = os.readlink(f"/proc/self/fd/{fd}")
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid() or where != sock.host:
                raise RefusedError(f"--allow-socket {sock.name}: {sock.host} changed since it was checked (it is no "
                                   "longer your socket at that path); nothing was bound; fix: check who writes "
                                   f"{os.path.dirname(sock.host)}")
    except OSError as err:
        for _, fd in out:
            os.close(fd)
        raise RefusedError(f"--allow-socket: {err.filename}: {err.strerror}; the socket went away since it was "
                           "checked; fix: check the agent is still running") from None
    except RefusedError:
        for _, fd in out:
            os.close(fd)
        raise
    return out
