"""The gvisor tier: the plan's box under runsc (gVisor's user-space kernel), started as a job of the
caller's terminal, in the run's cgroup, on the staged overlay when there is one, with the proxy
already serving on the unix socket the box's init relays to.

Order: the bundle (config.json, rendered by relay/render/gvisor_oci.py from the plan and the
caller's allowlisted environment), the agent's seccomp program and the proxy's socket are made in
the run dir (owner-only); the proxy starts; then runsc is forked, and between fork and exec the
child takes its own process group, joins the cgroup, gets its fd limit, dies with the launcher,
enters the staged overlay's mount namespace (relay/box/overlay.py) and keeps only fds 0, 1 and 2.
runsc's sandbox and gofer die with runsc (it starts them attached), and the janitor knows runsc's
process group from the first moment.

The terminal: an interactive run on a tty gets `terminal: true`, so runsc hands its own terminal
to the Sentry, which emulates the session on it: job control, Ctrl-C (runsc forwards the signal to
the box's foreground group), resize (SIGWINCH, then the host's window size) work, and TIOCSTI is
not implemented there (ENOTTY) besides being refused by the filter (EPERM).
"""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import Mapping

from relay.box import jobctl, overlay
from relay.box import resource_limits as limits
from relay.box.landlock import die_with_parent
from relay.egress.proxy import EgressProxy
from relay.host import procs, safefs
from relay.host.phase_marks import mark
from relay.model.errors import RelayError
from relay.model.vocab import MountKind
from relay.modes.box_start import BoxProcess, box_env, start_proxy
from relay.plan.resolve import Plan
from relay.render import gvisor_oci
from relay.render.seccomp_bpf import compile_bpf
from relay.trust import janitor, staged


def write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def listen_unix(path: str) -> socket.socket:
    """The proxy's unix socket at `path` (its dir reached by fd: a long run dir path would not fit the
    108 bytes of a socket address)."""
    fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        sock = safefs.bind_unix(fd, os.path.basename(path), 1024)
    finally:
        os.close(fd)
    return sock


def moot_masks(plan: Plan) -> frozenset[str]:
    """Rootless: the masks over targets the caller cannot open (see gvisor_oci.oci_mounts). A target
    that does not exist is kept (its placeholder is made), and root can open everything."""
    if plan.gvisor is None or not plan.gvisor.rootless:
        return frozenset()
    out = set()
    for m in plan.mounts:
        if m.kind not in (MountKind.MASK_FILE, MountKind.MASK_DIR):
            continue
        try:
            st = os.lstat(m.dst)
        except PermissionError:
            out.add(m.dst)  # a parent we cannot search: the box cannot reach it either
            continue
        except OSError:
            continue
        modes = (os.R_OK, os.W_OK, os.X_OK) if stat.S_ISDIR(st.st_mode) else (os.R_OK, os.W_OK)
        if not any(os.access(m.dst, mode, follow_symlinks=False) for mode in modes):
            out.add(m.dst)
    return frozenset(out)


def prepare(plan: Plan, caller_env: Mapping[str, str], nofile: tuple[int, int], terminal: bool) -> socket.socket | None:
    """The bundle, the seccomp program and the proxy socket in the run dir; returns the socket's listener."""
    run = plan.gvisor
    assert run is not None and plan.seccomp_policy is not None, "a gvisor plan without its run or its filter"
    os.mkdir(run.bundle, 0o700)
    os.mkdir(run.state_root, 0o700)
    write_private(run.seccomp_file, compile_bpf(plan.seccomp_policy))
    head = len(run.argv())
    spec = gvisor_oci.spec(run, mounts=plan.mounts, home=dict(plan.env_set).get("HOME", "/"),
                           args=plan.command[head:], env=box_env(plan, caller_env), cwd=plan.workdir,
                           terminal=terminal, limits=plan.limits, nofile=min(nofile[1], 1 << 20),
                           moot=moot_masks(plan))
    write_private(os.path.join(run.bundle, "config.json"), json.dumps(spec).encode())
    debug = caller_env.get("HIVE_RELAY_RUNSC_DEBUG")
    if debug:  # the spec as rendered, beside runsc's logs (it holds the box's environment: a debug aid only)
        with open(os.path.join(debug, f"{run.container_id}.json"), "w") as fh:
            json.dump(spec, fh, indent=1)
    return listen_unix(run.socket) if run.socket else None


def start(
    plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState, nofile: tuple[int, int], lifeline: int,
    job: jobctl.Job,
) -> tuple[BoxProcess, EgressProxy | None]:
    """Make the bundle, start the proxy, fork runsc (as described above); the agent's first request finds
    the proxy serving."""
    run = plan.gvisor
    assert run is not None
    terminal = plan.interactive and job.fd is not None and os.isatty(0)
    try:
        listener = prepare(plan, caller_env, nofile, terminal)
    except OSError as err:
        raise RelayError(f"cannot prepare the gvisor bundle in {run.bundle}: {err.strerror or err}") from None
    mark("box_ready")
    proxy = start_proxy(plan, listener, caller_env) if listener is not None else None
    mark("proxy_started")
    layer = staged.create(plan.staged, plan.workdir, staged.launch_meta(plan)) if plan.staged is not None else None
    head = len(run.argv())
    argv = list(plan.command[:head])
    debug = caller_env.get("HIVE_RELAY_RUNSC_DEBUG")
    if debug:  # runsc's own debug logs (and the spec, as rendered) for a box that will not start: DIR/
        argv[1:1] = ["--debug", f"--debug-log={debug.rstrip('/')}/"]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": caller_env.get("HOME", "/")}
    if caller_env.get("XDG_RUNTIME_DIR"):
        env["XDG_RUNTIME_DIR"] = caller_env["XDG_RUNTIME_DIR"]
    keep = {0, 1, 2}
    closes = [fd for fd in procs.inheritable_fds() if fd not in keep]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the forked child, until exec
        code = 3
        try:
            os.setpgid(0, 0)
            limits.child_setup(state.cgroup, plan.limits.memory, plan.limits.pids, False, nofile)
            die_with_parent()
            if layer is not None:
                overlay.enter(layer)
            for fd in closes:
                try:
                    os.close(fd)
                except OSError:
                    pass
            os.execve(argv[0], argv, env)
        except OSError as err:
            try:
                os.write(2, f"hive-relay: cannot start {argv[0]}: {err.strerror or err}; the box did not start\n"
                         .encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    janitor.tell(lifeline, pid)  # first: should we die from here on, the janitor knows the box's group
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass  # the child did it first, or has already exec'd
    proc = BoxProcess(pid, job)
    job.give(pid)
    mark("spawned")
    return proc, proxy
