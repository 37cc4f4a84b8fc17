"""Execute a Plan: the only module that starts processes. Everything it does was decided by resolve()."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Mapping

from . import janitor, limits
from .banner import banner_lines, emit, note_lines
from .errors import EXIT_TIMEOUT, RelayError
from .plan import CTRL_FD, SECCOMP_FD, Plan
from .proxy import DecisionLog, EgressProxy
from .seccomp_policy import compile_to_memfd, policy_for

HANDSHAKE_TIMEOUT = 30.0
HINT = "To allow it: --allow-host {host}:{port} (or add it to your user config)."


def box_env(plan: Plan, caller_env: Mapping[str, str]) -> dict[str, str]:
    """The box's whole environment: fixed values plus allowlisted names copied from the caller."""
    env = dict(plan.env_set)
    for name in plan.env_pass:
        if name in caller_env:
            env[name] = caller_env[name]
    return env


def _handshake(ctrl: socket.socket, proc: subprocess.Popen) -> socket.socket | None:
    """Receive the box's listening socket (or 'no network'); fail if the box dies first."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT
    while time.monotonic() < deadline:
        ready, _, _ = select.select([ctrl], [], [], 0.05)
        if ready:
            msg, fds, _, _ = socket.recv_fds(ctrl, 16, 1)
            if not msg:
                return None
            if fds:
                return socket.socket(fileno=fds[0])
            return None
        if proc.poll() is not None:
            return None
    raise RelayError("the box did not start within 30 s")


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


def _wait(proc: subprocess.Popen, plan: Plan, sigs: _Signals) -> tuple[int, str | None]:
    deadline = None if plan.timeout is None else time.monotonic() + plan.timeout
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


def run(plan: Plan, caller_env: Mapping[str, str], quiet: bool = False) -> int:
    """Launch the box, serve its proxy, wait, tear down. Returns the exit code to use."""
    if not quiet:
        emit(banner_lines(plan, caller_env.get("HOME", "")))
    emit(note_lines(plan.notes))
    base = os.path.dirname(plan.run_dir) if plan.run_dir else None
    if base:
        janitor.sweep_stale_run_dirs(base)
    if plan.limits.method.startswith("cgroup"):
        limits.sweep_stale()
    state = janitor.RunState(run_dir=plan.run_dir if plan.sync_files else None, home=caller_env.get("HOME", "/"),
                             placeholders=plan.placeholders)
    if plan.run_dir and not plan.sync_files:
        state.run_dir = None
    janitor.prepare(state, plan.sync_files)
    run_id = os.path.basename(plan.run_dir or "").removeprefix("hive-relay-") or str(os.getpid())
    state.cgroup = limits.create(plan.limits.method, run_id, plan.limits.memory, plan.limits.pids)
    use_rlimits = state.cgroup is None
    nofile = limits.raise_nofile()
    jpid, lifeline = janitor.spawn(state)
    proc = None
    proxy = None
    outcome: str | None = None
    rc = 0
    try:
        seccomp_fd = compile_to_memfd(policy_for(nested_userns=False))
        ctrl, ctrl_child = socket.socketpair()
        fds = (seccomp_fd, ctrl_child.fileno())

        def child_setup() -> None:
            high = [os.dup(fd) for fd in fds]
            for target, fd in zip((SECCOMP_FD, CTRL_FD), high, strict=True):
                os.dup2(fd, target)
            limits.child_setup(state.cgroup, plan.limits.memory, plan.limits.pids, use_rlimits, nofile)

        with _Signals(plan.interactive) as sigs:
            try:
                proc = subprocess.Popen(
                    list(plan.command), env=box_env(plan, caller_env), pass_fds=(SECCOMP_FD, CTRL_FD),
                    preexec_fn=child_setup, close_fds=True,
                )
            except FileNotFoundError:
                raise RelayError(f"cannot start {plan.command[0]}: not found") from None
            finally:
                os.close(seccomp_fd)
                ctrl_child.close()
            listener = _handshake(ctrl, proc)
            if listener is not None:
                log = DecisionLog(plan.log_path, plan.backend)
                proxy = EgressProxy(listener, plan.rules, log, hint=HINT)
                proxy.start()
            try:
                ctrl.sendall(b"G")
            except OSError:
                pass
            ctrl.close()
            rc, outcome = _wait(proc, plan, sigs)
            if outcome is None and sigs.received:
                outcome = f"signal {sigs.received}"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proxy is not None:
            proxy.stop()
        messages = janitor.finish(jpid, lifeline)
    summary = [proxy.log.summary()] if proxy is not None and proxy.log.summary() else []
    if proxy is not None and proxy.log.write_errors:
        summary.append(f"the egress log could not be fully written ({proxy.log.write_errors} errors): {plan.log_path}")
    emit([f"hive-relay: {line}" for line in summary + messages])
    if outcome == "timeout":
        emit([f"hive-relay: timed out after {plan.timeout} s; the box was killed"])
        return EXIT_TIMEOUT
    if outcome and outcome.startswith("signal"):
        signum = int(outcome.split()[1])
        if signum != signal.SIGINT:
            emit([f"hive-relay: stopped by {signal.Signals(signum).name}; the box was killed"])
            return 128 + signum
    return _exit_code(rc)
