"""The process tier: the agent forked with limits, Landlock and seccomp applied in the child just
before exec (no namespaces), in its own process group with the terminal, as a shell does for a job."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping

from relay.box import jobctl
from relay.box import resource_limits as limits
from relay.model.errors import RelayError
from relay.modes.box_start import BoxProcess, box_env
from relay.plan.resolve import Plan
from relay.render.seccomp_bpf import build_filter
from relay.trust import janitor


def spawn(plan: Plan, env: dict[str, str], setup: Callable[[], None], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    try:
        return subprocess.Popen(list(plan.command), env=env, cwd=plan.workdir, pass_fds=pass_fds,
                                preexec_fn=setup, close_fds=True)
    except FileNotFoundError:
        raise RelayError(f"cannot start {plan.command[0]}: not found") from None
    except subprocess.SubprocessError as err:
        raise RelayError(f"cannot start the box: {err}") from None


def start(plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState, use_rlimits: bool,
          nofile: tuple[int, int], job: jobctl.Job) -> BoxProcess:
    popen = spawn(plan, box_env(plan, caller_env), _setup(plan, state, use_rlimits, nofile))
    try:
        os.setpgid(popen.pid, popen.pid)
    except OSError:
        pass  # the child did it first, or has already exec'd
    job.give(popen.pid)
    return BoxProcess(popen.pid, job, popen)


def _setup(plan: Plan, state: janitor.RunState, use_rlimits: bool, nofile: tuple[int, int]) -> Callable[[], None]:
    """The process tier's in-child setup: limits, then Landlock, then seccomp, then exec."""
    from relay.box import landlock
    from relay.host.probe import probe_landlock_abi

    abi = probe_landlock_abi()
    read = [p for p, mode in plan.fs_rules if mode == "ro"]
    write = [p for p, mode in plan.fs_rules if mode == "rw"]
    assert plan.seccomp_policy is not None and plan.seccomp_policy.deny_network, "a process-tier plan without its filter"
    flt = build_filter(plan.seccomp_policy)

    def setup() -> None:
        jobctl.child_takes_terminal()
        limits.child_setup(state.cgroup, plan.limits.memory, plan.limits.pids, use_rlimits, nofile)
        landlock.die_with_parent()
        landlock.apply(read, write, abi, deny_network=True)
        flt.load()

    return setup
