"""Execute a Plan: the only module that starts a box (a container through container_runner).
Everything it does was decided by resolve()."""

from __future__ import annotations

import functools
import gc
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping

from relay.box import jobctl
from relay.box import resource_limits as limits
from relay.host import phase_marks, procs, safefs
from relay.host.paths import config_home, state_dir
from relay.host.phase_marks import mark
from relay.model.errors import EXIT_TIMEOUT, EXIT_UPSTREAM, RelayError
from relay.model.vocab import HostStep, LoginHold, MountKind, Tier, WorkdirMode
from relay.plan.host_steps import host_steps, needs_run_dir
from relay.plan.resolve import Plan
from relay.trust import agentstate, guard, janitor, livelock, rundirs
from relay.trust.placeholders import Registry
from relay.ui.banner import banner_lines, emit, note_lines

TYPE_CHECKING = False
if TYPE_CHECKING:  # the proxy's modules load only once a box needs them (a container: after its engine starts)
    import socket

    from relay.egress.proxy import EgressProxy
    from relay.modes.box_start import BoxProcess
    from relay.modes.container_runner import ContainerProcess
    from relay.modes.engine_gate import EngineGate



INT_GRACE = 3.0  # seconds a non-interactive box has to end on its own SIGINT before the launcher ends it


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class _Signals:
    """Interactive: Ctrl-C and Ctrl-\\ belong to the agent (same tty), the launcher only waits.
    Always: SIGTERM/SIGHUP end the box and are reported as 128+N."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive
        self.received: int | None = None
        self.at = 0.0  # when the first signal that ends the run came
        self.saved: dict[int, object] = {}

    def _handler(self, signum: int, _frame: object) -> None:
        if signum in (signal.SIGTERM, signal.SIGHUP) or (signum == signal.SIGINT and not self.interactive):
            if self.received is None:
                self.at = time.monotonic()
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
            return rc, "interrupt, killed" if forwarded and sigs.received == signal.SIGINT else None
        except subprocess.TimeoutExpired:
            pass
        # SIGTERM and SIGHUP end the box at once. A non-interactive run's SIGINT reached the box's own
        # group too when it came from the terminal, so the box gets INT_GRACE to end on it; one sent to
        # the launcher alone (or a box that cannot end: its gvisor init stopped) is ended all the same.
        ending = sigs.received in (signal.SIGTERM, signal.SIGHUP) or (
            sigs.received == signal.SIGINT and time.monotonic() - sigs.at >= INT_GRACE)
        if ending and not forwarded:
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


def _finish(outcome: str | None, rc: int, plan: Plan) -> int:
    if outcome == "timeout":
        emit([f"hive-relay: timed out after {plan.timeout} s; the box was killed"])
        return EXIT_TIMEOUT
    if outcome and outcome.startswith("upstream "):
        emit([f"hive-relay: ended the --prompt run early (exit {EXIT_UPSTREAM}): {outcome.removeprefix('upstream ')}"])
        return EXIT_UPSTREAM
    if outcome == "interrupt, killed":
        emit([f"hive-relay: stopped by SIGINT; the box did not end on it within {INT_GRACE:.0f} s and was killed"])
        return 128 + signal.SIGINT
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
    from relay.modes import process_runner

    emit(banner_lines(plan, caller_env.get("HOME", "")) + note_lines(plan.notes))
    with _Signals(plan.interactive) as sigs:
        proc = process_runner.spawn(plan, dict(caller_env), lambda: None)
        try:
            rc, outcome = _wait(proc, plan.timeout, sigs)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return _finish(outcome or (f"signal {sigs.received}" if sigs.received else None), rc, plan)


def _run_id(plan: Plan) -> str:
    """The run's id (the plan's); our pid for a plan without one."""
    return plan.run_id or str(os.getpid())


def hold_live(plan: Plan, caller_env: Mapping[str, str]) -> int | None:
    """A live plan's checkout lock (relay/trust/livelock.py), or None for a staged one; close it at the end."""
    if plan.unsandboxed or plan.workdir_mode != WorkdirMode.LIVE:
        return None
    run_id = _run_id(plan)
    return livelock.hold(state_dir(dict(caller_env)), plan.workdir, run_id, plan.shared_live)


def run(plan: Plan, caller_env: Mapping[str, str], quiet: bool = False, live_lock: int | None = None) -> int:
    """Launch the box, serve its proxy, wait, tear down. Returns the exit code to use. A caller
    that holds the checkout's live lock already (the launcher, across its verify probe) passes it."""
    if plan.unsandboxed:
        return run_unsandboxed(plan, caller_env)
    mark("run")
    if not quiet:
        emit(banner_lines(plan, caller_env.get("HOME", "")))
    emit(note_lines(plan.notes))
    if plan.credentials:  # a grant's secret that cannot be read ends the run here, before anything exists
        from relay.egress import secret_source

        secret_source.read_keys(plan.credentials, caller_env)
    own_lock = hold_live(plan, caller_env) if live_lock is None else None  # one live box per checkout
    try:
        return _run(plan, caller_env)
    finally:
        janitor.wait_all()  # the run dir's removal, overlapped with the closing lines (janitor.LAST_QUIET)
        if own_lock is not None:
            os.close(own_lock)


def _run(plan: Plan, caller_env: Mapping[str, str]) -> int:
    gate = _open_gate(plan, caller_env)
    try:
        state = _prepare(plan, caller_env, run_dir_made=gate is not None)
        box = _Box(plan, caller_env, state, gate)
    except BaseException:
        if gate is not None:  # the engine never got its go: killed where it waits, its run dir gone
            gate.cancel()
            if plan.run_dir and os.path.lexists(plan.run_dir):
                rundirs.remove_run_dir(plan.run_dir)
        raise
    try:
        box.launch_and_wait()
    finally:
        messages = box.tear_down()
    summary = box.proxy.log.summary_lines() if box.proxy is not None else []
    if box.proxy is not None and box.proxy.log.write_errors:
        summary.append(f"the egress log could not be fully written ({box.proxy.log.write_errors} errors): {plan.log_path}")
    if plan.staged is not None and plan.container is not None and plan.container.rootless:
        from relay.trust.staged import (
            drop_engine_work,  # the rootless engine's scratch dir (subuid-owned), ours to drop
        )

        drop_engine_work(plan.staged.root, plan.container.engine, caller_env)
    emit([f"hive-relay: {line}" for line in summary + messages])
    if plan.staged is not None:  # the box is gone and the terminal back: the layer's lines, or its prompt
        from relay.ui.staged_exit import finish

        emit([f"hive-relay: {line}" for line in finish(plan.staged, plan.interactive and box.outcome is None, caller_env)])
    return _finish(box.outcome, box.rc, plan)


def _open_gate(plan: Plan, caller_env: Mapping[str, str]) -> EngineGate | None:
    """A podman plan's engine, started behind its start gate before the host steps (relay/modes/
    engine_gate.py); None for every other plan. Either way, a prestarted engine this plan does not
    use is killed here (relay/modes/container_prestart.py)."""
    if plan.container is not None:  # only then: a local launch does not import the container runner
        from relay.modes import container_runner

        if container_runner.gated(plan):
            return container_runner.open_gate(plan, caller_env)
    from relay.modes import container_prestart

    container_prestart.abandon()
    return None


def _prepare(plan: Plan, caller_env: Mapping[str, str], run_dir_made: bool = False) -> janitor.RunState:
    """Everything on the host before the box exists, made step by step as the plan lists them
    (relay/plan/host_steps.py); each step made is recorded in the state, so that the janitor undoes
    exactly those, in reverse. A step that fails undoes the ones before it at once, then the run
    stops with its one line. (The container's control dir comes once the janitor exists: see _Box.)"""
    state = janitor.RunState(run_dir=plan.run_dir if needs_run_dir(plan) else None, home=caller_env.get("HOME", "/"),
                             placeholders=plan.placeholders, owner=os.getpid(), git=plan.git, workdir=plan.workdir,
                             staged_root=plan.staged.root if plan.staged else None)
    state.lock_dir = state_dir(dict(caller_env))
    state.run_dir_made = run_dir_made
    try:
        for step in host_steps(plan):
            _MAKE[step.step](plan, caller_env, state)
            state.done.append(step.step)
    except BaseException:
        try:
            janitor.teardown(state)  # what was made so far, undone in reverse
        except Exception:  # noqa: BLE001 - the first error is the one to report; the sweep takes what is left
            pass
        raise
    if state.agent is not None:
        emit(note_lines(tuple(state.agent.notes)))
    if plan.container is not None:
        state.container_rm = plan.container.rm_argv()
    return state


def _make_exit_watch(plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState) -> None:
    """A live run's exit report: the workdir's watched places now, judged by the janitor at the end."""
    from relay.trust import exit_report

    watch = exit_report.begin(plan, caller_env)
    if watch is not None:
        state.exit_report = functools.partial(exit_report.end, watch, plan, dict(caller_env), _run_id(plan))


def _in_run_dir(what: str, plan: Plan, make: Callable[[], None]) -> None:
    """One run-dir step; an OSError is the run's one line."""
    try:
        make()
    except OSError as err:
        raise RelayError(f"cannot prepare {what} in the run dir {plan.run_dir}: {err.strerror or err}") from None


def _make_run_dir(plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState) -> None:
    excludes = _git_excludes(plan, caller_env) if plan.git_excludes else None
    _in_run_dir("the run dir itself", plan,
                lambda: janitor.make_run_dir(state, with_tmp=plan.tier == Tier.PROCESS, git_excludes=excludes))
    if plan.inspected_hosts:  # the run CA (its key unlinked once the leaves are minted) and the box's bundle
        from relay.host import run_ca
        from relay.policy.inspection import BUNDLE_NAME

        assert plan.run_dir is not None
        run_dir = plan.run_dir
        _in_run_dir("the run CA for TLS inspection", plan, lambda: run_ca.make(
            run_dir, [t.rpartition(":")[0] for t in plan.inspected_hosts], BUNDLE_NAME, plan.run_id))


def _make_git_dir(plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState) -> None:
    _in_run_dir("the private git dir", plan, lambda: janitor.make_git_dir(state))


def _make_agent_state(plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState) -> None:
    state.agent = agentstate.new(state.home, plan.state_dirs, plan.home_keep, plan.guarded_files, state.lock_dir,
                                 plan.run_id or rundirs.run_id_of(plan.run_dir or ""), plan.state_exclude)
    state.agent.logins = tuple((os.path.relpath(r.login.file, state.home), r.login)
                               for r in plan.credentials if r.login is not None)
    state.agent.secret_files = tuple((os.path.relpath(u.file, state.home), u.paths) for u in plan.login_files
                                     if u.held == LoginHold.MASKED)
    state.agent.secrets = _host_secrets(plan, caller_env)
    state.agent.memo_env = dict(caller_env)
    _in_run_dir("the agent's state", plan, lambda: janitor.copy_agent_state(state))
    mark("state_copied")


def _host_secrets(plan: Plan, caller_env: Mapping[str, str]) -> tuple:
    """The host's real secrets as the proxy's scan holds them (relay/egress/secret_source.host_secrets:
    the routes' and grants' values, the masked login files' tokens, the deny-listed SSH keys' private
    lines), and beyond this run: every backend's credential variables that are set and its credential
    and login files (Plan.scan_env, Plan.scan_files). What no file of the box's state copy may hold
    (relay/trust/state_scan.py). Read once here; the keys were read (and checked) before the host steps."""
    from relay.egress import secret_source
    from relay.egress.secret_scan import secret_forms

    keys = dict(secret_source.read_keys(plan.credentials, caller_env)) if plan.credentials else {}
    extra = [secret_forms(f"${name} (a credential variable of the host's)", value) for name in plan.scan_env
             if (value := caller_env.get(name)) and value not in keys.values()]
    files = [(u.file, u.paths) for u in plan.login_files if u.held == LoginHold.MASKED]
    files += [(r.login.file, tuple(p for p in (r.login.token, r.login.refresh_token, r.login.id_token) if p))
              for r in plan.credentials if r.login is not None]
    in_box = {u.file for u in plan.login_files if u.held != LoginHold.MASKED}  # taken in as it is, by opt-in
    found = secret_source.host_secrets(keys, files, plan.denied, caller_env.get("HOME", "/"))
    out = list(found.fixed) + [x for x in extra if x is not None]
    named = in_box | {f for f, _ in files}  # this run's own (read above) and those taken in as they are
    for path, paths in plan.scan_files:
        if path not in named:
            out += _file_secrets(path, paths, caller_env.get("HOME", "/"))
    for source in found.sources:
        try:
            out += source()
        except (OSError, ValueError):
            continue  # a login file that cannot be read now (or is not JSON): nothing of it to look for
    # What the box gets anyway is no secret of the host's to look for: a variable passed into it (a key
    # you pointed at your own base URL), a value the plan sets; and any part of one (claude keeps the
    # last 20 characters of an approved key in ~/.claude.json).
    given = [v for n in plan.env_pass if (v := caller_env.get(n))] + [v for _, v in plan.env_set if v]
    seen: set[tuple] = set()
    unique = []
    for secret in out:  # one file may be named twice (this run's login and every backend's table)
        if secret.forms in seen or any(secret.forms[0] in v for v in given):
            continue
        seen.add(secret.forms)
        unique.append(secret)
    return tuple(unique)


MAX_TABLE_FILE = 32 << 20  # another backend's credential file read for its secrets (~/.claude.json grows)


def _file_secrets(path: str, paths: tuple[str, ...], home: str) -> list:
    """The secrets of one backend's credential or login file, for the state search only: a link the user
    made (a dotfile manager's) is followed to the file it names, and a file over the masks' 1 MiB bound
    (a long-used ~/.claude.json) is read to MAX_TABLE_FILE (red team round 3: both were skipped, so their
    keys reached another backend's box). Nothing is copied from here: values become needles only."""
    from relay.egress.secret_scan import secret_forms
    from relay.host import safefs
    from relay.model import credential_files

    real = os.path.realpath(path) if os.path.islink(path) else path
    try:
        raw = safefs.read_file(real, MAX_TABLE_FILE)
        found = credential_files.values(raw, paths, credential_files.is_dotenv(path), limit=MAX_TABLE_FILE)
    except (OSError, ValueError):
        return []  # absent, unreadable, not JSON: no value of it is known
    shown = "~/" + os.path.relpath(path, home) if path.startswith(home.rstrip("/") + "/") else path
    return [s for at, value in found if (s := secret_forms(f"{shown} {at}", value)) is not None]


def _make_sync_files(plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState) -> None:
    _in_run_dir("the synced files", plan, lambda: janitor.copy_sync_files(state, plan.sync_files))


def _make_passwd(plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState) -> None:
    from relay.policy import passwd

    assert plan.run_dir is not None and plan.box_uid is not None
    run_dir, uid = plan.run_dir, plan.box_uid
    _in_run_dir("the box user's passwd", plan,
                lambda: passwd.write(run_dir, uid, uid, dict(plan.env_set).get("HOME", "/"), caller_env))


def _make_placeholders(plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState) -> None:
    state.registry = Registry(state_dir(dict(caller_env)))
    try:
        kinds = {m.dst: m.kind for m in plan.mounts}
        missing = [(p, kinds.get(p) == MountKind.MASK_DIR) for p in plan.placeholders]
        # A staged run's mask targets in the workdir are made in its layer (by bwrap), never here.
        in_layer = frozenset(plan.staged.placeholders) if plan.staged else frozenset()
        state.registry.claim(os.getpid(), missing, [p for p in plan.protected + plan.denied if p not in in_layer],
                             bases=(plan.workdir, state.home),
                             dirs=frozenset(p for p, kind in kinds.items() if kind == MountKind.MASK_DIR),
                             mounted=frozenset(kinds))
    except OSError as err:
        raise RelayError(f"cannot prepare placeholder files: {err.strerror or err}") from None


def _make_guard(plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState) -> None:
    state.guarded = {path: guard.snapshot(path, state.home) for path in plan.guarded_files}


def _make_cgroup(plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState) -> None:
    """None when no cgroup can be made here: the box then runs under rlimits (the plan says which)."""
    state.cgroup = limits.create(plan.limits.method, _run_id(plan), plan.limits.memory, plan.limits.pids)


_MAKE: dict[HostStep, Callable[[Plan, Mapping[str, str], janitor.RunState], None]] = {
    HostStep.EXIT_WATCH: _make_exit_watch,
    HostStep.RUN_DIR: _make_run_dir,
    HostStep.GIT_DIR: _make_git_dir,
    HostStep.AGENT_STATE: _make_agent_state,
    HostStep.SYNC_FILES: _make_sync_files,
    HostStep.PASSWD: _make_passwd,
    HostStep.PLACEHOLDERS: _make_placeholders,
    HostStep.GUARD: _make_guard,
    HostStep.CGROUP: _make_cgroup,
}


class _Box:
    """One box's life from the janitor's fork to its report: launch by tier, wait, and tear down in
    the order that makes the host's judgement safe (every box process reaped, then the terminal
    back, the proxy stopped, and only then the janitor's revert, sync-back and removal)."""

    def __init__(self, plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState,
                 gate: EngineGate | None = None) -> None:
        self.plan, self.caller_env, self.state, self.go_fd, self.gate = plan, caller_env, state, None, gate
        self.listener: socket.socket | None = None  # a gvisor container's proxy socket, made before the box
        self.use_rlimits = state.cgroup is None
        self.nofile = limits.raise_nofile()
        self.jpid, self.lifeline = janitor.spawn(state)
        if plan.container is not None:
            # The container's control dir (its seccomp profile, the go fifo) only once the janitor
            # exists: a launcher killed from here on leaves nothing the janitor does not remove.
            from relay.modes import container_runner

            try:
                if plan.container.runtime:
                    self.listener = container_runner.prepare_gvisor(plan)
                else:
                    self.go_fd = container_runner.prepare(plan, caller_env, gate)
            except OSError as err:
                janitor.finish(self.jpid, self.lifeline)
                raise RelayError(f"cannot prepare the run dir {plan.run_dir}: {err.strerror or err}") from None
        # Local boxes: everything they fork is ours to reap before the janitor judges what they left.
        # (Not for containers: the engine's conmon daemonizes on purpose and cleans up after the client.)
        self.reaping = plan.container is None and procs.become_subreaper()
        self.keep = procs.children(os.getpid()) if self.reaping else set()
        # The caller's terminal as it is now: the box gets it as a job, and its modes come back at the end.
        self.job = jobctl.Job()
        self.proc: BoxProcess | ContainerProcess | subprocess.Popen | None = None
        self.proxy: EgressProxy | None = None
        self.outcome: str | None = None
        self.rc = 0

    def launch_and_wait(self) -> None:
        plan = self.plan
        with _Signals(plan.interactive) as sigs:
            if plan.tier == Tier.PROCESS:
                from relay.modes import process_runner  # each tier imports only its own runner (launch time)

                self.proc = process_runner.start(plan, self.caller_env, self.state, self.use_rlimits, self.nofile,
                                                 self.job)
            elif plan.gvisor is not None:
                from relay.modes import gvisor_runner

                self.proc, self.proxy = gvisor_runner.start(plan, self.caller_env, self.state, self.nofile,
                                                            self.lifeline, self.job)
            elif plan.vm is not None:
                from relay.modes import vm_runner

                self.proc, self.proxy = vm_runner.start(plan, self.caller_env, self.state, self.nofile,
                                                        self.lifeline, self.job)
            elif plan.container is not None and plan.container.runtime:
                from relay.modes import container_runner

                self.proc, self.proxy = container_runner.start_gvisor(plan, self.caller_env, self.listener,
                                                                      self.lifeline)
            elif plan.container is not None and self.go_fd is not None:
                from relay.modes import container_runner

                self.proc, self.proxy = container_runner.start(plan, self.caller_env, self.go_fd, self.lifeline,
                                                               self.gate)
            else:
                from relay.modes import bwrap_runner

                self.proc, self.proxy = bwrap_runner.start(plan, self.caller_env, self.state, self.use_rlimits,
                                                           self.nofile, self.lifeline, self.job)
            give_up = None if plan.interactive or self.proxy is None else self.proxy.gave_up
            gc.enable()  # off for the startup only (relay/__main__.py): the launcher now serves the box's proxy
            self.rc, self.outcome = _wait(self.proc, plan.timeout, sigs, give_up)
            mark("agent_exited")
            if self.outcome is None and sigs.received:
                self.outcome = f"signal {sigs.received}"

    def tear_down(self) -> list[str]:
        if self.gate is not None and not self.gate.released:
            self.gate.cancel()  # the launch failed before the engine's go: it waits there, and is killed there
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        from relay.modes.container_runner import ContainerProcess, left_behind, remove

        if isinstance(self.proc, ContainerProcess) and left_behind(self.proc, self.outcome):
            remove(self.proc.run)  # before the janitor judges the run: a Created container still mounts it
        if self.reaping:
            # A process-tier daemon (no pid namespace) or bwrap's init must be gone before the guard
            # and the sync-back look at what the box left, or it could write after them.
            procs.reap_descendants(self.keep)
        from relay.modes.box_start import BoxProcess

        # The namespace's fd is held since spawn, so its name is still this box's alone.
        if isinstance(self.proc, BoxProcess) and self.proc.pidns and self.proc.pidns_fd is not None:
            procs.kill_pidns(self.proc.pidns)  # and nothing else of the box's namespace, whoever reaps it
            os.close(self.proc.pidns_fd)
            self.proc.pidns_fd = None
        self.job.end()
        if self.proxy is not None:
            self.proxy.stop()
        if self.go_fd is not None:
            os.close(self.go_fd)
        if self.listener is not None and self.proxy is None:  # the proxy closes its own
            self.listener.close()
        messages = janitor.finish(self.jpid, self.lifeline)
        mark("torn_down")
        if self.plan.log_path and os.path.lexists(self.plan.log_path):  # a run that logged nothing adds nothing
            from relay.egress.log_files import prune_after_run

            prune_after_run(self.plan.log_path)
        phase_marks.dump(self.caller_env)
        return messages


def _git_excludes(plan: Plan, caller_env: Mapping[str, str]) -> str:
    """The user's own global git excludes (XDG default location) plus the box's placeholders."""
    try:
        data = safefs.read_file(os.path.join(config_home(caller_env), "git", "ignore"), 1 << 20)
        own = data.decode("utf-8", errors="replace") if data else ""
    except OSError:
        own = ""  # a link, special or huge file there is not the user's excludes file
    ours = "# hive relay: placeholders that keep protected paths from being created\n" + "\n".join(plan.git_excludes)
    return (own.rstrip("\n") + "\n" if own else "") + ours + "\n"


