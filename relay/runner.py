"""Execute a Plan: the only module that starts a box (a container through container_runner).
Everything it does was decided by resolve()."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping

from . import agentstate, exitreport, guard, janitor, jobctl, limits, procs, safefs
from .banner import banner_lines, emit, note_lines
from .errors import EXIT_TIMEOUT, EXIT_UPSTREAM, RelayError
from .netns import listen_in
from .paths import config_home, state_dir
from .placeholders import Registry
from .plan import BLOCK_FD, INFO_FD, SECCOMP_FD, Plan
from .proxy import DecisionLog, EgressProxy
from .seccomp_policy import build_filter, compile_to_memfd, policy_for

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .container_runner import ContainerProcess

HANDSHAKE_TIMEOUT = 30.0
# Benchmark phase marks (perf_counter), written as JSON to $HIVE_RELAY_TRACE when set.
TRACE: dict[str, float] = {}


def mark(name: str) -> None:
    TRACE[name] = time.perf_counter()


def _dump_trace(env: Mapping[str, str]) -> None:
    path = env.get("HIVE_RELAY_TRACE")
    if path:
        try:
            with open(path, "w") as fh:
                json.dump(TRACE, fh)
        except OSError:
            pass
HINT = "To allow it: --allow-host {host}:{port} (or add it to your user config)."


def box_env(plan: Plan, caller_env: Mapping[str, str]) -> dict[str, str]:
    """The box's whole environment: fixed values plus allowlisted names copied from the caller."""
    env = dict(plan.env_set)
    for name in plan.env_pass:
        if name in caller_env:
            env[name] = caller_env[name]
    return env


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class _Signals:
    """Interactive: Ctrl-C and Ctrl-\\ belong to the agent (same tty), the launcher only waits.
    Always: SIGTERM/SIGHUP end the box and are reported as 128+N."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive
        self.received: int | None = None
        self.saved: dict[int, object] = {}

    def _handler(self, signum: int, _frame: object) -> None:
        if signum in (signal.SIGTERM, signal.SIGHUP) or (signum == signal.SIGINT and not self.interactive):
            self.received = self.received or signum

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP):
            self.saved[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def _wait(proc: subprocess.Popen | BoxProcess | ContainerProcess, timeout: int | None, sigs: _Signals,
          give_up: Callable[[], str | None] | None = None) -> tuple[int, str | None]:
    deadline = None if timeout is None else time.monotonic() + timeout
    forwarded = False
    while True:
        try:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            rc = proc.wait(timeout=0.2 if remaining is None else min(0.2, remaining))
            return rc, None
        except subprocess.TimeoutExpired:
            pass
        if sigs.received in (signal.SIGTERM, signal.SIGHUP) and not forwarded:
            proc.kill()
            forwarded = True
        if deadline is not None and time.monotonic() >= deadline:
            proc.kill()
            proc.wait()
            return -1, "timeout"
        why = give_up() if give_up is not None else None
        if why:
            proc.kill()
            proc.wait()
            return -1, f"upstream {why}"


def _spawn(plan: Plan, env: dict[str, str], setup: Callable[[], None], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    try:
        return subprocess.Popen(list(plan.command), env=env, cwd=plan.workdir, pass_fds=pass_fds,
                                preexec_fn=setup, close_fds=True)
    except FileNotFoundError:
        raise RelayError(f"cannot start {plan.command[0]}: not found") from None
    except subprocess.SubprocessError as err:
        raise RelayError(f"cannot start the box: {err}") from None


def _finish(outcome: str | None, rc: int, plan: Plan) -> int:
    if outcome == "timeout":
        emit([f"hive-relay: timed out after {plan.timeout} s; the box was killed"])
        return EXIT_TIMEOUT
    if outcome and outcome.startswith("upstream "):
        emit([f"hive-relay: ended the --prompt run early (exit {EXIT_UPSTREAM}): {outcome.removeprefix('upstream ')}"])
        return EXIT_UPSTREAM
    if outcome and outcome.startswith("signal"):
        signum = int(outcome.split()[1])
        if signum != signal.SIGINT:
            emit([f"hive-relay: stopped by {signal.Signals(signum).name}; the box was killed"])
            return 128 + signum
    code = _exit_code(rc)
    if 128 < code < 128 + 65 and not plan.interactive:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = None
        if name and name not in ("SIGINT", "SIGPIPE"):
            emit([f"hive-relay: the agent exited with {code}: it was killed by {name}"])
    return code


def run_unsandboxed(plan: Plan, caller_env: Mapping[str, str]) -> int:
    """The opt-in path: the CLI alone under its own native sandbox, with a loud banner."""
    emit(banner_lines(plan, caller_env.get("HOME", "")) + note_lines(plan.notes))
    with _Signals(plan.interactive) as sigs:
        proc = _spawn(plan, dict(caller_env), lambda: None)
        try:
            rc, outcome = _wait(proc, plan.timeout, sigs)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return _finish(outcome or (f"signal {sigs.received}" if sigs.received else None), rc, plan)


def run(plan: Plan, caller_env: Mapping[str, str], quiet: bool = False) -> int:
    """Launch the box, serve its proxy, wait, tear down. Returns the exit code to use."""
    if plan.unsandboxed:
        return run_unsandboxed(plan, caller_env)
    mark("run")
    if not quiet:
        emit(banner_lines(plan, caller_env.get("HOME", "")))
    emit(note_lines(plan.notes))
    process_tier = plan.tier == "process"
    container = plan.container
    # Our own cgroups are for local boxes; a container's limits belong to its engine.
    own_cgroup = container is None and plan.limits.method.startswith("cgroup")
    from . import passwd

    own_passwd = plan.box_uid is not None and passwd.needed(plan.mounts)
    needs_run_dir = (bool(plan.sync_files) or bool(plan.state_dirs) or process_tier or bool(plan.git_excludes)
                     or container is not None or plan.git is not None or own_passwd)
    state = janitor.RunState(run_dir=plan.run_dir if needs_run_dir else None, home=caller_env.get("HOME", "/"),
                             placeholders=plan.placeholders, owner=os.getpid(), git=plan.git, workdir=plan.workdir)
    if plan.placeholders or plan.protected or plan.denied:
        state.registry = Registry(state_dir(dict(caller_env)))
        try:
            kinds = {m.dst: m.kind for m in plan.mounts}
            missing = [(p, kinds.get(p) == "mask-dir") for p in plan.placeholders]
            state.registry.claim(os.getpid(), missing, plan.protected + plan.denied,
                                 bases=(plan.workdir, state.home))
        except OSError as err:
            raise RelayError(f"cannot prepare placeholder files: {err.strerror or err}") from None
    state.guarded = {path: guard.snapshot(path, state.home) for path in plan.guarded_files}
    state.lock_dir = state_dir(dict(caller_env))
    if state.run_dir and (plan.state_dirs or plan.sync_files):
        state.agent = agentstate.new(state.home, plan.state_dirs, plan.home_keep, plan.guarded_files, state.lock_dir,
                                     os.path.basename(state.run_dir).removeprefix("hive-relay-"), plan.state_exclude)
    try:
        janitor.prepare(state, plan.sync_files, with_tmp=process_tier,
                        git_excludes=_git_excludes(plan, caller_env) if plan.git_excludes else None)
        if own_passwd and plan.run_dir and plan.box_uid is not None:
            passwd.write(plan.run_dir, plan.box_uid, plan.box_uid, dict(plan.env_set).get("HOME", "/"), caller_env)
    except OSError as err:
        raise RelayError(f"cannot prepare the run dir {plan.run_dir}: {err.strerror or err}") from None
    if state.agent is not None:
        mark("state_copied")
        emit(note_lines(tuple(state.agent.notes)))
    go_fd = None
    if container is not None:
        from . import container_runner

        state.container_rm = container.rm_argv()
        try:
            go_fd = container_runner.prepare(plan)
        except OSError as err:
            raise RelayError(f"cannot prepare the run dir {plan.run_dir}: {err.strerror or err}") from None
    run_id = os.path.basename(plan.run_dir or "").removeprefix("hive-relay-") or str(os.getpid())
    state.cgroup = limits.create(plan.limits.method, run_id, plan.limits.memory, plan.limits.pids) if own_cgroup else None
    use_rlimits = state.cgroup is None
    nofile = limits.raise_nofile()
    watch = exitreport.begin(plan)
    jpid, lifeline = janitor.spawn(state)
    # Local boxes: everything they fork is ours to reap before the janitor judges what they left.
    # (Not for containers: the engine's conmon daemonizes on purpose and cleans up after the client.)
    reaping = container is None and procs.become_subreaper()
    keep = procs.children(os.getpid()) if reaping else set()
    # The caller's terminal as it is now: the box gets it as a job, and its modes come back at the end.
    job = jobctl.Job()
    proc = None
    proxy = None
    outcome: str | None = None
    rc = 0
    try:
        with _Signals(plan.interactive) as sigs:
            if process_tier:
                popen = _spawn(plan, box_env(plan, caller_env), _process_setup(plan, state, use_rlimits, nofile))
                try:
                    os.setpgid(popen.pid, popen.pid)
                except OSError:
                    pass  # the child did it first, or has already exec'd
                job.give(popen.pid)
                proc = BoxProcess(popen.pid, job, popen)
            elif container is not None and go_fd is not None:
                proc, proxy = container_runner.start(plan, caller_env, go_fd, lifeline)
            else:
                proc, proxy = _start_supervised(plan, caller_env, state, use_rlimits, nofile, lifeline, job)
            rc, outcome = _wait(proc, plan.timeout, sigs, None if plan.interactive or proxy is None else proxy.gave_up)
            mark("agent_exited")
            if outcome is None and sigs.received:
                outcome = f"signal {sigs.received}"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if reaping:
            # A process-tier daemon (no pid namespace) or bwrap's init must be gone before the guard
            # and the sync-back look at what the box left, or it could write after them.
            procs.reap_descendants(keep)
        job.end()
        if proxy is not None:
            proxy.stop()
        if go_fd is not None:
            os.close(go_fd)
        messages = janitor.finish(jpid, lifeline)
        mark("torn_down")
        from .logs import prune_after_run

        prune_after_run(plan.log_path)
        _dump_trace(caller_env)
    summary = proxy.log.summary_lines() if proxy is not None else []
    if proxy is not None and proxy.log.write_errors:
        summary.append(f"the egress log could not be fully written ({proxy.log.write_errors} errors): {plan.log_path}")
    messages += exitreport.end(watch, plan, caller_env, run_id)
    emit([f"hive-relay: {line}" for line in summary + messages])
    return _finish(outcome, rc, plan)


def _git_excludes(plan: Plan, caller_env: Mapping[str, str]) -> str:
    """The user's own global git excludes (XDG default location) plus the box's placeholders."""
    try:
        data = safefs.read_file(os.path.join(config_home(caller_env), "git", "ignore"), 1 << 20)
        own = data.decode("utf-8", errors="replace") if data else ""
    except OSError:
        own = ""  # a link, special or huge file there is not the user's excludes file
    ours = "# hive relay: placeholders that keep protected paths from being created\n" + "\n".join(plan.git_excludes)
    return (own.rstrip("\n") + "\n" if own else "") + ours + "\n"


class BoxProcess:
    """A Popen-like handle on the bwrap process started with posix_spawn (fixed fds, no fork of us)."""

    def __init__(self, pid: int, job: jobctl.Job | None = None, popen: subprocess.Popen | None = None) -> None:
        self.pid = pid
        self.job = job
        self.popen = popen  # the process tier's Popen, told the status we reaped
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG | os.WUNTRACED)
            if pid and os.WIFSTOPPED(status):
                if self.job is not None:
                    self.job.suspend()  # Ctrl-Z in the box: the caller's shell sees the job stop
                return None
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                if self.popen is not None:
                    self.popen.returncode = self.returncode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("bwrap", timeout or 0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _read_child_pid(info: int, proc: BoxProcess) -> int | None:
    """bwrap writes {"child-pid": N} on --info-fd once the namespaces exist."""
    data = b""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT
    while time.monotonic() < deadline:
        ready, _, _ = select.select([info], [], [], 0.05)
        if ready:
            chunk = os.read(info, 4096)
            data += chunk
            try:
                return int(json.loads(data)["child-pid"])
            except (ValueError, KeyError):
                if not chunk:
                    return None
                continue
        if proc.poll() is not None:
            return None
    raise RelayError("the box did not start within 30 s")


def start_proxy(plan: Plan, listener: socket.socket) -> EgressProxy:
    """The host-side proxy on a listener that lives in the box's network namespace."""
    proxy = EgressProxy(listener, plan.rules, DecisionLog(plan.log_path, plan.backend), hint=HINT)
    proxy.start()
    return proxy


def release(fd: int, word: bytes) -> None:
    """Let the waiting box go (bwrap's --block-fd, the container entrypoint's FIFO); a box that
    already died has closed its end, which is not our error."""
    try:
        os.write(fd, word)
    except OSError:
        pass


def _start_supervised(
    plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState, use_rlimits: bool, nofile: tuple[int, int],
    lifeline: int, job: jobctl.Job,
) -> tuple[BoxProcess, EgressProxy | None]:
    """Spawn bwrap blocked, put it in its cgroup (or rlimits), open the proxy listener in its network
    namespace, start the proxy, then unblock it: the agent's first request finds the proxy serving."""
    policy = plan.seccomp_policy or policy_for(nested_userns=False)
    seccomp_fd = compile_to_memfd(policy)
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    mark("seccomp_compiled")
    high = [(target, fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10))
            for target, fd in ((SECCOMP_FD, seccomp_fd), (INFO_FD, info_w), (BLOCK_FD, block_r))]
    targets = {target for target, _ in high}
    # Only 0, 1, 2 and bwrap's own fds reach the box: a directory fd the caller's shell left open
    # would be a key to the host's filesystem.
    closes = [(os.POSIX_SPAWN_CLOSE, fd) for fd in procs.inheritable_fds() if fd not in targets]
    try:
        pid = os.posix_spawn(plan.command[0], list(plan.command), box_env(plan, caller_env),
                             file_actions=[(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in high] + closes,
                             setpgroup=0)
    except OSError as err:
        raise RelayError(f"cannot start {plan.command[0]}: {err.strerror or err}") from None
    finally:
        for fd in [seccomp_fd, info_w, block_r] + [fd for _, fd in high]:
            os.close(fd)
    proc = BoxProcess(pid, job)
    job.give(pid)  # before the box is released: its first read of the terminal finds it its own
    janitor.tell(lifeline, pid)
    proxy = None
    try:
        mark("spawned")
        child = _read_child_pid(info_r, proc)
        if child is None:
            return proc, None  # bwrap failed and said why on stderr; its exit code is passed on
        janitor.tell(lifeline, child)
        if state.cgroup is not None:
            # The box's init only: all the box will ever run descends from it, still blocked. bwrap's
            # monitor outside stays where we are (each cgroup-v1 move costs milliseconds of launch).
            try:
                limits.join(state.cgroup, child)
            except ProcessLookupError:
                if proc.poll() is not None:
                    return proc, None  # bwrap failed and said why on stderr; its exit code is passed on
                raise
        limits.apply_to(child, plan.limits.memory, plan.limits.pids, use_rlimits, nofile)
        if plan.proxy_listen:
            try:
                listener = listen_in(child, plan.proxy_listen, join_userns=os.getuid() != 0)
            except OSError as err:
                if proc.poll() is not None:
                    return proc, None
                raise RelayError(str(err)) from None
            mark("box_ready")
            proxy = start_proxy(plan, listener)
        mark("proxy_started")
        release(block_w, b"x")
    finally:
        os.close(block_w)
        os.close(info_r)
    return proc, proxy


def _process_setup(plan: Plan, state: janitor.RunState, use_rlimits: bool, nofile: tuple[int, int]) -> Callable[[], None]:
    """The process tier's in-child setup: limits, then Landlock, then seccomp, then exec."""
    from . import landlock
    from .probe import _landlock_abi

    abi = _landlock_abi()
    read = [p for p, mode in plan.fs_rules if mode == "ro"]
    write = [p for p, mode in plan.fs_rules if mode == "rw"]
    flt = build_filter(plan.seccomp_policy or policy_for(nested_userns=False, deny_network=True))

    def setup() -> None:
        jobctl.child_takes_terminal()
        limits.child_setup(state.cgroup, plan.limits.memory, plan.limits.pids, use_rlimits, nofile)
        landlock.die_with_parent()
        landlock.apply(read, write, abi, deny_network=True)
        flt.load()

    return setup
