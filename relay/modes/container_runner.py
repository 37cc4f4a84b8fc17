"""Start a container-mode plan: the engine runs the image attached to the caller's terminal; the
launcher opens the egress listener inside the container's network namespace, then says go.

The container's entrypoint checks the deny list and then blocks on a FIFO in a read-only control
dir; the launcher writes to it only once the proxy serves. No AF_UNIX socket crosses into the
container and no code of ours runs in it besides the POSIX entrypoint.

On runsc (`--isolation gvisor`) gVisor's network stack is not a kernel namespace the launcher could
join, so the order is local gvisor's instead: the proxy's unix socket and the agent's seccomp
program are made in the control dir, the proxy serves on the socket, and only then does the engine
start; the box's init (relay/box/gvisor_init.py, bound in) relays its loopback port to the socket.
No FIFO: the proxy already serves when the box's first request comes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Mapping

from relay.box.overlay_layer import kernel_defaults_on
from relay.host import procs, safefs
from relay.host.phase_marks import mark
from relay.model.errors import RefusedError, RelayError
from relay.modes import engine_gate
from relay.modes.engine_gate import EngineGate
from relay.plan.resolve import Plan
from relay.render import container_argv
from relay.render.container_argv import ContainerRun
from relay.render.seccomp_bpf import SeccompPolicy
from relay.trust import janitor, staged
from relay.ui.banner import emit

TYPE_CHECKING = False
if TYPE_CHECKING:
    from relay.egress.proxy import EgressProxy

START_TIMEOUT = 120.0  # a rootless engine's first run of an image re-maps its layers (seconds)


class ContainerProcess:
    """The engine client (`podman run`), Popen-like; kill() removes the container, not just the client."""

    def __init__(self, proc: subprocess.Popen, run: ContainerRun, watched: bool = False) -> None:
        self.proc = proc
        self.run = run
        self.pid = proc.pid
        self.box_pid: int | None = None  # the container's first process, once seen
        self.watched = watched  # whether `start` waits for that process (runsc's start does not)
        try:
            self.pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        # Popen.wait(timeout) polls with sleeps of up to 50 ms; the pidfd wakes us when the client exits.
        if (timeout is not None and self.pidfd is not None and self.proc.returncode is None
                and not procs.readable(self.pidfd, timeout)):
            raise subprocess.TimeoutExpired(self.proc.args, timeout)
        rc = self.proc.wait(timeout=timeout)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        return rc

    def kill(self) -> None:
        if self.proc.poll() is not None:
            return
        remove(self.run)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def left_behind(proc: ContainerProcess, outcome: str | None) -> bool:
    """Whether the engine client may have left its container: it was stopped by a signal (Ctrl-C while
    the engine created or started it: conmon and `runc init` stay, the container Created), the run
    was, or it exited before the container's first process was seen. A normal end (--rm) needs no
    removal, and pays for none."""
    code = proc.poll()
    return (code is not None and code < 0) or outcome is not None or (proc.watched and proc.box_pid is None)


def remove(run: ContainerRun) -> None:
    subprocess.run(run.rm_argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def prepare_gvisor(plan: Plan) -> socket.socket | None:
    """runsc: the agent's seccomp program and the proxy's listening unix socket in the control dir
    (owner-only: each is bound into the box on its own); returns the socket (None: no network)."""
    run = plan.container
    assert run is not None and run.ctl_dir and run.seccomp_bpf and plan.seccomp_policy is not None
    from relay.modes.gvisor_runner import listen_unix, write_private
    from relay.render.seccomp_bpf import compile_bpf

    os.makedirs(run.ctl_dir, mode=0o700)
    write_private(run.seccomp_bpf, compile_bpf(plan.seccomp_policy))
    return listen_unix(run.proxy_socket) if run.proxy_socket else None


def gated(plan: Plan) -> bool:
    """Whether the plan's engine starts behind the FIFO gate (relay/modes/engine_gate.py): podman,
    on its default runtime, with our seccomp profile. (runsc is not: its proxy serves first.)"""
    run = plan.container
    return (run is not None and run.kind == "podman" and not run.runtime and plan.run_dir is not None
            and run.seccomp_profile == os.path.join(plan.run_dir, engine_gate.PROFILE_NAME))


def open_gate(plan: Plan, caller_env: Mapping[str, str]) -> EngineGate:
    """Before any host step: the run dir with the engine's start gate in it, and the engine started
    behind the gate: the one `begin` prestarted when the plan is exactly its argv, else the plan's
    own. The engine then reads containers.conf, its storage and the image while the host steps run;
    it goes on only at `release` (in `start`), when everything it mounts exists."""
    from relay.modes import container_prestart

    assert plan.run_dir is not None
    gate = container_prestart.take(plan.run_dir)
    if gate is None:
        try:
            os.mkdir(plan.run_dir, 0o700)
        except OSError as err:
            raise RelayError(f"cannot make the run dir {plan.run_dir}: {err.strerror or err}") from None
        try:
            gate = engine_gate.make(plan.run_dir)
        except OSError as err:
            os.rmdir(plan.run_dir)
            raise RelayError(str(err)) from None
    try:
        if gate.start(plan.command, caller_env, plan.workdir):
            mark("prestart_taken")
    except OSError as err:
        gate.cancel()
        raise RelayError(f"cannot start {plan.command[0]}: {err.strerror or err}") from None
    mark("spawned")
    return gate


def prepare(plan: Plan, env: Mapping[str, str] | None = None, gate: EngineGate | None = None) -> int:
    """Write the seccomp profile (unless the gate delivers it) and create the go FIFO; returns the
    FIFO's fd (held open by us, read-write so that neither side's open blocks). ENV names the memo's
    cache dir."""
    run = plan.container
    assert run is not None and run.ctl_dir and plan.seccomp_policy is not None
    os.makedirs(run.ctl_dir, mode=0o755)
    if run.seccomp_profile and gate is None:
        with open(run.seccomp_profile, "wb") as fh:
            fh.write(seccomp_profile(plan.seccomp_policy, env))
    fifo = os.path.join(run.ctl_dir, "go")
    os.mkfifo(fifo, 0o644)
    return os.open(fifo, os.O_RDWR | os.O_CLOEXEC)


MAX_PROFILE_BYTES = 1 << 20


def seccomp_profile(policy: SeccompPolicy, env: Mapping[str, str] | None) -> bytes:
    """The OCI profile for POLICY as JSON bytes. Rendering deep-copies and narrows the engine's
    default profile (~5 ms of every container launch, before the engine may start), so the result
    is memoized in the cache dir (relay/host/memo.py: read-only in every box, absent from
    containers), named by the sha256 of the policy, of the identity of each default profile file
    it may start from and of the renderer's modules: an edited profile, another policy or another
    version of ours is a new name. A memo that is not a JSON
    object with a syscall list is rendered again."""
    from relay.host import memo
    from relay.render import seccomp_bpf, seccomp_oci
    from relay.render.seccomp_oci import DEFAULT_PROFILES, default_profile, render

    # The renderer's own identity too (and the policy's constants'): an upgrade that changes what a
    # policy becomes never serves the old profile.
    key = memo.key_of("seccomp-oci", repr(policy), *(memo.file_identity(p) or "-" for p in DEFAULT_PROFILES),
                      *(memo.file_identity(m.__file__) or "-" for m in (seccomp_oci, seccomp_bpf)))
    if env is not None:
        cached = memo.get(env, memo.MemoKind.SECCOMP_OCI, key, MAX_PROFILE_BYTES)
        if cached:
            try:
                shape = json.loads(cached)
                if isinstance(shape, dict) and isinstance(shape.get("syscalls"), list):
                    return cached
            except ValueError:
                pass
    data = json.dumps(render(policy, default_profile())).encode()
    if env is not None:
        memo.put(env, memo.MemoKind.SECCOMP_OCI, key, data)
    return data


def _container_pid(plan: Plan, proc: subprocess.Popen) -> int | None:
    """Wait until the container's first process exists; None if the engine exited first."""
    run = plan.container
    assert run is not None
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None
        if run.pidfile:
            try:
                with open(run.pidfile) as fh:
                    text = fh.read().strip()
                if text.isdigit() and int(text) > 0:
                    return int(text)
            except OSError:
                pass
        else:
            out = subprocess.run([run.engine, "inspect", "-f", "{{.State.Pid}}", run.name], capture_output=True,
                                 text=True, stdin=subprocess.DEVNULL).stdout.strip()
            if out.isdigit() and int(out) > 0:
                return int(out)
        time.sleep(0.002 if run.pidfile else 0.01)  # a pidfile read is cheap; an `inspect` is not
    raise RelayError(f"the container did not start within {START_TIMEOUT:.0f} s; see `{run.engine} logs {run.name}`")


def create_layer(plan: Plan) -> None:
    """--staged: the run's layer, made as local mode makes it (relay/trust/staged.py), before the engine
    mounts it. A rootful engine's overlay takes the kernel's defaults: refused when they would put
    what the box wrote outside the upper layer (rootless mounts in a user namespace never do)."""
    run = plan.container
    assert run is not None and plan.staged is not None
    on = [] if run.rootless else kernel_defaults_on()
    if on:
        raise RefusedError(f"--staged: this kernel's overlayfs turns on {' and '.join(on)} by default, which "
                           f"{run.engine}'s overlay volume cannot turn off, and the review reads the upper layer "
                           "alone; fix: boot with overlay.metacopy=N overlay.redirect_dir=N, use --mode local, or "
                           "drop --staged")
    staged.create(plan.staged, plan.workdir, staged.launch_meta(plan))
    for i, m in enumerate(container_argv.staged_binds(plan.mounts, plan.workdir)):
        # Each writable bind's upper dir at its place in the upper layer (a dir there is a merged
        # dir, as a copy-up makes), and its own scratch dir beside the workdir's.
        rel = os.path.relpath(m.dst, plan.workdir)
        with safefs.base_dir(plan.staged.upper) as ufd, safefs.parent_of(ufd, rel, create=True) as (pfd, name):
            try:
                os.mkdir(name, 0o755, dir_fd=pfd)
            except FileExistsError:
                pass
        os.mkdir(container_argv.staged_work(plan.staged.work, i), 0o700)


def start_gvisor(plan: Plan, caller_env: Mapping[str, str], listener: socket.socket | None,
                 lifeline: int) -> tuple[ContainerProcess, EgressProxy | None]:
    """runsc: the proxy first, on the unix socket bound into the box, then the engine (see above)."""
    run = plan.container
    assert run is not None
    if plan.staged is not None:
        create_layer(plan)
    from relay.modes.box_start import start_proxy

    proxy = start_proxy(plan, listener, caller_env) if listener is not None else None
    mark("proxy_started")
    try:
        popen = subprocess.Popen(list(plan.command), env=dict(caller_env), cwd=plan.workdir, close_fds=True)
    except OSError as err:
        if proxy is not None:
            proxy.stop()
        raise RelayError(f"cannot start {plan.command[0]}: {err.strerror or err}") from None
    janitor.tell(lifeline, "client", popen.pid)
    mark("spawned")
    return ContainerProcess(popen, run), proxy


def start(plan: Plan, caller_env: Mapping[str, str], go_fd: int, lifeline: int,
          gate: EngineGate | None = None) -> tuple[ContainerProcess, EgressProxy | None]:
    run = plan.container
    assert run is not None
    if plan.staged is not None:
        create_layer(plan)  # a failure here leaves the gate shut: tear_down kills the waiting engine
    if gate is not None:
        # The engine is waiting at its gate since before the host steps; everything it mounts now exists.
        assert gate.proc is not None and plan.seccomp_policy is not None
        popen = gate.proc
        janitor.tell(lifeline, "client", popen.pid)
        try:
            gate.release(seccomp_profile(plan.seccomp_policy, caller_env), START_TIMEOUT)
        except engine_gate.GateError as err:
            raise RelayError(str(err)) from None
        mark("released")
    else:
        try:
            # The engine client gets the caller's environment: `--env NAME` copies values by name from it.
            popen = subprocess.Popen(list(plan.command), env=dict(caller_env), cwd=plan.workdir, close_fds=True)
        except OSError as err:
            raise RelayError(f"cannot start {plan.command[0]}: {err.strerror or err}") from None
        janitor.tell(lifeline, "client", popen.pid)
        mark("spawned")
    proc = ContainerProcess(popen, run, watched=True)
    parts = None
    try:
        # Loaded while the engine creates the container (~250 ms), off the launch's critical path.
        from relay.host.netns import listen_in
        from relay.modes.box_start import ProxyParts, release, start_proxy

        parts = ProxyParts(plan, caller_env) if plan.proxy_listen else None  # in the window, too
        pid = _container_pid(plan, popen)
        proc.box_pid = pid
        mark("box_ready")
        if pid is not None and gate is not None:
            from relay.modes import container_prestart

            container_prestart.started(plan.run_id)
        if pid is None:
            from relay.modes.image import forget_if_gone

            if parts is not None:
                parts.close()
            gone = forget_if_gone(run, caller_env)
            if gone:
                emit([f"hive-relay: {gone}"])
            return proc, None  # the engine failed (and said why on stderr); its exit code is passed on
        proxy = None
        if parts is not None:
            try:
                listener = listen_in(pid, plan.proxy_listen, join_userns=run.rootless)
            except OSError as err:
                if run.kind == "docker" and os.getuid() != 0:
                    raise RefusedError(f"{err}: a docker container's network namespace belongs to the daemon's "
                                       "root; fix: use podman (rootless works), or run as root") from None
                raise RelayError(str(err)) from None
            proxy = start_proxy(plan, listener, caller_env, parts)
    except BaseException:
        # The caller never gets `proc`, so it cannot remove the container: do it here.
        if parts is not None:
            parts.close()
        proc.kill()
        raise
    mark("proxy_started")
    release(go_fd, b"go\n")
    return proc, proxy
