"""What a launch makes on the host before its box starts, as an ordered list of steps, each with its
undo, the way bubblewrap keeps its SetupOp list for mounts.

The runner makes the steps in this order (relay/modes/runner.py) and the janitor undoes the ones made
in reverse (relay/trust/janitor.py), also after a `kill -9` of the launcher; a step that fails undoes
the ones before it at once. The order is what the undos need: the cgroup is removed first, the guarded
settings are put back and the placeholders released before the run dir's copies are judged and synced
back, and a live run's exit report looks at the workdir last, when nothing else of the run is left.
Pure: a function of the plan, shown by `--dry-run --json` as `host_steps`.
"""

from __future__ import annotations

from relay.model.record import record
from relay.model.vocab import HostStep, Tier
from relay.policy import passwd


@record
class Step:
    """One step the host takes before the box starts, with what it does and how it is undone (listed in --dry-run
    --json)."""

    step: HostStep
    does: str
    undo: str


WORDS = {
    HostStep.EXIT_WATCH: ("snapshot what in the workdir runs on the host later",
                          "report what the box left there that host tools would run; move new agent config aside"),
    HostStep.RUN_DIR: ("make the private run dir (its tmp, the box's git excludes, the control socket's place)",
                       "remove it, with everything left in it"),
    HostStep.GIT_DIR: ("make the private git dir: mount points, copies of the git state files",
                       "sync back the allowlisted git state (a staged run's into its layer); keep the rest aside"),
    HostStep.AGENT_STATE: ("copy the agent's state dirs in (logins masked)",
                           "sync back the data keys; keep the rest aside for review"),
    HostStep.SYNC_FILES: ("copy the synced files in", "sync back what the box changed in them"),
    HostStep.PASSWD: ("write the box user's passwd and group files", "nothing of its own (they go with the run dir)"),
    HostStep.PLACEHOLDERS: ("claim placeholder files for missing protected paths (shared by the boxes on them)",
                            "release them: remove the ones no other box holds"),
    HostStep.GUARD: ("snapshot the guarded settings files", "put back what the box changed in them"),
    HostStep.CGROUP: ("create the run's cgroup (memory and pids limits)", "remove it"),
}


def needs_run_dir(plan) -> bool:  # noqa: ANN001 - a plan.Plan (this module is below it)
    """Whether the launch needs its private run dir on the host."""
    return (bool(plan.sync_files) or bool(plan.state_dirs) or plan.tier == Tier.PROCESS or bool(plan.git_excludes)
            or plan.proxy_listen is not None  # the `invoke allow` socket (relay/egress/control.py)
            or plan.container is not None or getattr(plan, "gvisor", None) is not None or plan.git is not None
            or owns_passwd(plan))


def owns_passwd(plan) -> bool:  # noqa: ANN001
    """A root caller's box user gets a passwd file of its own in the run dir."""
    return plan.box_uid is not None and passwd.needed(plan.mounts)


def host_steps(plan) -> tuple[Step, ...]:  # noqa: ANN001
    """The steps of one launch, in the order they are made (an unsandboxed run makes none)."""
    if plan.unsandboxed:
        return ()
    wanted = [
        (HostStep.EXIT_WATCH, plan.staged is None and bool(plan.workdir)),  # staged: the checkout does not change
        (HostStep.RUN_DIR, needs_run_dir(plan)),
        # Made in this order, undone in the reverse: the synced files go back first, then the agent's
        # state, then the git state, and the run dir is removed last. The three copy disjoint places.
        (HostStep.GIT_DIR, needs_run_dir(plan) and plan.git is not None),
        (HostStep.AGENT_STATE, needs_run_dir(plan) and bool(plan.state_dirs or plan.sync_files)),
        (HostStep.SYNC_FILES, needs_run_dir(plan) and bool(plan.sync_files)),
        (HostStep.PASSWD, needs_run_dir(plan) and owns_passwd(plan)),
        (HostStep.PLACEHOLDERS, bool(plan.placeholders or plan.protected or plan.denied)),
        (HostStep.GUARD, bool(plan.guarded_files)),
        (HostStep.CGROUP, plan.container is None and plan.limits.method.startswith("cgroup")),
    ]
    return tuple(Step(step, *WORDS[step]) for step, on in wanted if on)
