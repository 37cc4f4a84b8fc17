"""The plan's resource limits as plain data, shared by the planner and the argv builders.

A module of its own so that container_argv (which renders the limits as engine flags) need not
import the planner that imports it: data flows plan -> argv, never back.
"""

from __future__ import annotations

from relay.model.record import record
from relay.model.vocab import LimitsMethod


@record
class Limits:
    """Memory (bytes) and pids for one box, and how they are enforced (cgroup or rlimit)."""

    memory: int
    pids: int
    method: LimitsMethod


def limit_method(cgroup: str | None) -> LimitsMethod:
    """The local box's enforcement, from the probe's cgroup mode: a delegated cgroup, else rlimits."""
    if cgroup == "v2":
        return LimitsMethod.CGROUP_V2
    if cgroup == "v1":
        return LimitsMethod.CGROUP_V1
    return LimitsMethod.RLIMIT
