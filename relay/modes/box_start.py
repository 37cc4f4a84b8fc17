"""The box-start handshake shared by every runner: the handle on a box process, bwrap's child pid
from --info-fd, the release of a blocked box, the box's environment and the host-side proxy on a
listener that lives in the box's network namespace. The bwrap, process-tier and container runners
use these; none of them imports another runner."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Mapping

from relay.box import jobctl
from relay.config.presets import origins
from relay.egress import secret_source
from relay.egress.decision_log import DecisionLog
from relay.egress.proxy import EgressProxy
from relay.host import procs
from relay.host.paths import state_dir
from relay.model.errors import RelayError
from relay.model.refusal import ENTRY
from relay.model.vocab import LoginHold
from relay.plan.resolve import Plan

HANDSHAKE_TIMEOUT = 30.0
# The 403 body's one sentence for the agent: a policy, not an outage, and what the user can do about it.
HINT = ("This is the sandbox's egress policy, not an outage: the user can allow it while this box runs with "
        "`" + ENTRY.replace("{", "{{").replace("}", "}}") + " allow {target} --run {run}`, or for later runs with --allow-host {target}.")


def box_env(plan: Plan, caller_env: Mapping[str, str]) -> dict[str, str]:
    """The box's whole environment: fixed values plus allowlisted names copied from the caller."""
    env = dict(plan.env_set)
    for name in plan.env_pass:
        if name in caller_env:
            env[name] = caller_env[name]
    return env


class BoxProcess:
    """A Popen-like handle on the bwrap process started with posix_spawn (fixed fds, no fork of us)."""

    def __init__(self, pid: int, job: jobctl.Job | None = None, popen: subprocess.Popen | None = None) -> None:
        self.pid = pid
        self.job = job
        self.popen = popen  # the process tier's Popen, told the status we reaped
        self.returncode: int | None = None
        self.pidns: str | None = None  # the box's pid namespace ("pid:[INODE]"), once bwrap reported its init
        # An fd on that namespace, held until teardown: a namespace's inode number is freed with it and
        # handed to the next one made (lowest free first), so without this hold a box that ended could
        # name another box's fresh namespace, and its teardown would SIGKILL that box (exit 137).
        self.pidns_fd: int | None = None
        self._exit_fd: int | None = None  # a pidfd: readable once the process has exited (wait's wake-up)

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
        """Reap the process, noticing a stop (Ctrl-Z) within 5 ms: its exit wakes the wait at once
        through a pidfd (a stop does not make one readable, hence the 5 ms ticks), else each tick."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while self.poll() is None:
                if deadline is not None and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired("bwrap", timeout or 0)
                self._tick()
        finally:
            if self.returncode is not None and self._exit_fd is not None:
                if self._exit_fd >= 0:
                    os.close(self._exit_fd)
                self._exit_fd = None
        assert self.returncode is not None
        return self.returncode

    def _tick(self) -> None:
        if self._exit_fd is None:
            try:
                self._exit_fd = os.pidfd_open(self.pid)
            except (AttributeError, OSError):  # no pidfd on this kernel, or the process is reaped already
                self._exit_fd = -1
        if self._exit_fd < 0:
            time.sleep(0.005)
        else:
            procs.readable(self._exit_fd, 0.005)

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def read_child_pid(info: int, proc: BoxProcess) -> int | None:
    """bwrap writes {"child-pid": N} on --info-fd once the namespaces exist."""
    data = b""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT
    while time.monotonic() < deadline:
        if procs.readable(info, 0.05):
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


class ProxyParts:
    """Everything the run's proxy needs but its listener: the keys read and checked, the TLS context
    (the system store's load is ~10 ms), the host's secrets to scan for, the `allow` socket. Made
    while the engine still creates the container, so that only the listener, which needs the box's
    network namespace, lies between the box's first process and its go."""

    def __init__(self, plan: Plan, caller_env: Mapping[str, str]) -> None:
        self.keys = secret_source.read_keys(plan.credentials, caller_env)  # read (and checked) once, before the box: runner.run
        self.tls = None
        if plan.credentials or plan.inspected_hosts:
            import ssl  # here, not at the top: only a run with a credential route pays for it

            # The system store, or the launcher's SSL_CERT_FILE (a corporate CA, a test CA): never unverified.
            self.tls = ssl.create_default_context(cafile=caller_env.get("SSL_CERT_FILE") or None)
        # The host's real secrets, searched for in what the box sends in clear (relay/egress/secret_scan.py).
        self.secrets = secret_source.host_secrets(
            self.keys, [(u.file, u.paths) for u in plan.login_files if u.held == LoginHold.MASKED],
            plan.denied, caller_env.get("HOME", "/"))
        self.log = DecisionLog(plan.log_path, plan.backend)
        self.origins = origins(plan.presets)
        self.leaves = _leaves(plan)
        self.control = _control(plan)

    def close(self) -> None:
        """The run ended before its proxy started: the `allow` socket goes (the proxy closes its own)."""
        if self.control is not None:
            self.control.close()
            self.control = None


def start_proxy(plan: Plan, listener: socket.socket, caller_env: Mapping[str, str],
                parts: ProxyParts | None = None) -> EgressProxy:
    """The host-side proxy on a listener that lives in the box's network namespace. The plan's
    credential routes get their keys from the caller's environment here, and only here: a key is
    held by the proxy, never in the plan, the box's environment, an argv or a log."""
    if parts is None:
        parts = ProxyParts(plan, caller_env)
    proxy = EgressProxy(listener, plan.rules, parts.log, hint=HINT,
                        routes=plan.credentials, keys=parts.keys, tls=parts.tls, origins=parts.origins,
                        run_id=run_id(plan), control=parts.control, ask=plan.ask, secrets=parts.secrets,
                        inspect=parts.leaves)
    parts.control = None  # the proxy's now
    try:
        for route in plan.credentials:
            if route.login is not None:  # the file's token, read (and refreshed) on the host per request
                from relay.trust.logins import LoginStore

                proxy.keys[route.name] = LoginStore(route.login.file, route.login, caller_env.get("HOME", "/"),
                                                    proxy.open_tls, lock_dir=state_dir(dict(caller_env)))
        proxy.start()
    except BaseException:
        proxy.stop()  # its listener and the `allow` socket go with it (safe before start)
        raise
    return proxy


def _leaves(plan: Plan) -> dict[tuple[str, int], tuple[str, str]] | None:
    """The run CA's leaf (cert, key) for each inspected host, minted in the run dir (relay/host/run_ca.py)."""
    if not plan.inspected_hosts or not plan.run_dir:
        return None
    from relay.host.run_ca import leaf_paths

    out = {}
    for i, target in enumerate(plan.inspected_hosts):
        host, _, port = target.rpartition(":")
        leaf = leaf_paths(plan.run_dir, i, host)
        out[(host, int(port))] = (leaf.cert, leaf.key)
    return out


def _control(plan: Plan) -> socket.socket | None:
    """The run's `invoke allow|deny` socket (relay/egress/control.py); a run without it still runs, unapprovable."""
    from relay.egress import control
    from relay.host.liveness import RUN_ID_RE

    # The verification run (`RUN-verify`, relay/modes/trial_run.py) is over in a moment: nothing to approve there.
    if not plan.run_dir or not re.fullmatch(RUN_ID_RE, run_id(plan)) or not os.path.isdir(plan.run_dir):
        return None

    try:
        return control.listen(plan.run_dir)
    except (OSError, RelayError) as err:
        from relay.ui.banner import emit

        emit([f"hive-relay: note: `allow` cannot reach this run: {getattr(err, 'message', None) or err}"])
        return None


def run_id(plan: Plan) -> str:
    """The run's id (the plan's, which names its run dir `hive-relay-RUNID`)."""
    return plan.run_id


def release(fd: int, word: bytes) -> None:
    """Let the waiting box go (bwrap's --block-fd, the container entrypoint's FIFO); a box that
    already died has closed its end, which is not our error."""
    try:
        os.write(fd, word)
    except OSError:
        pass
