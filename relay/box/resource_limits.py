"""Resource limits for the box: a cgroup where we can create one, rlimits otherwise.

The launcher moves the blocked box into its cgroup before it runs anything, so nothing the box
forks escapes it. rlimits are the fallback: RLIMIT_DATA per process and RLIMIT_NPROC per uid,
which is weaker (and root is exempt from NPROC), and the plan says so. RLIMIT_DATA, not
RLIMIT_AS: node reserves ~10 GiB of PROT_NONE address space per WebAssembly instance (gemini's
HTTP parser), which RLIMIT_AS counts and RLIMIT_DATA, like real memory use, does not.
"""

from __future__ import annotations

import os
import resource
import signal
import time

from relay.host.liveness import gone
from relay.model.record import record
from relay.model.vocab import LimitsMethod

CGROUP_ROOT = "/sys/fs/cgroup"
PREFIX = "hive-relay-"


@record(frozen=False)
class Cgroup:
    """The directories of one box's cgroup (one per v1 controller, or one v2 dir)."""

    dirs: list[str]
    v1: bool = False

    def self_join_files(self) -> list[str]:
        """Where a single-threaded process writes "0" to move itself in: `tasks` on v1 (the kernel's
        cheap path, no global lock; see relay/box/fork_spawn.py), `cgroup.procs` on v2."""
        return [os.path.join(d, "tasks" if self.v1 else "cgroup.procs") for d in self.dirs]

    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.procs_files():
            try:
                with open(path) as fh:
                    found |= {int(x) for x in fh.read().split()}
            except OSError:
                pass
        return found

    def kill_all(self) -> None:
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.02)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs:
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def _own_v2_parent() -> str:
    with open("/proc/self/cgroup") as fh:
        rel = fh.read().split("::")[-1].strip()
    return os.path.join(CGROUP_ROOT, rel.lstrip("/"))


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def create(method: str, run_id: str, memory: int, pids: int) -> Cgroup | None:
    """Create and configure the cgroup; None when the method is rlimit or creation fails."""
    name = PREFIX + run_id
    try:
        if method == LimitsMethod.CGROUP_V1:
            mem, pid = os.path.join(CGROUP_ROOT, "memory", name), os.path.join(CGROUP_ROOT, "pids", name)
            os.mkdir(mem)
            group = Cgroup([mem], v1=True)
            os.mkdir(pid)
            group.dirs.append(pid)
            _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory))
            try:
                _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory))
            except OSError:
                pass
            _write(os.path.join(pid, "pids.max"), str(pids))
            return group
        if method == LimitsMethod.CGROUP_V2:
            d = os.path.join(_own_v2_parent(), name)
            os.mkdir(d)
            group = Cgroup([d])
            _write(os.path.join(d, "memory.max"), str(memory))
            _write(os.path.join(d, "memory.swap.max"), "0")
            _write(os.path.join(d, "pids.max"), str(pids))
            return group
    except OSError:
        if "group" in locals():
            group.remove()
        return None
    return None


def sweep_stale() -> int:
    """Remove empty cgroups left by launchers that were killed with SIGKILL."""
    removed = 0
    for controller in ("memory", "pids", ""):
        base = os.path.join(CGROUP_ROOT, controller) if controller else None
        if base is None:
            try:
                base = _own_v2_parent()
            except OSError:
                continue
        try:
            names = [n for n in os.listdir(base) if n.startswith(PREFIX)]
        except OSError:
            continue
        for name in names:
            path = os.path.join(base, name)
            try:
                if not gone(name, PREFIX, os.stat(path, follow_symlinks=False).st_ctime):
                    continue
                os.rmdir(path)
                removed += 1
            except OSError:
                pass
    return removed


def raise_nofile() -> tuple[int, int]:
    """Lift the launcher's soft fd limit to the hard one: each tunnel holds six fds (two
    sockets, two splice pipes), and 200 tunnels exceed the common soft limit of 1024.
    Returns the original limits, which the box gets back (see child_setup)."""
    original = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft, hard = original
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    return original


def apply_to(pid: int, memory: int, pids: int, use_rlimits: bool, nofile: tuple[int, int]) -> None:
    """Set the box's rlimits from outside (prlimit), before it forks anything: the fallback when no
    cgroup is writable. The fd limit goes back to what the caller had (the launcher raised its own)."""
    resource.prlimit(pid, resource.RLIMIT_NOFILE, nofile)
    if use_rlimits:
        resource.prlimit(pid, resource.RLIMIT_DATA, (memory, memory))
        resource.prlimit(pid, resource.RLIMIT_NPROC, (pids, pids))


def child_setup(group: Cgroup | None, memory: int, pids: int, use_rlimits: bool,
                nofile: tuple[int, int] | None = None) -> None:
    """Run in the forked child before exec: join the cgroup, or fall back to rlimits."""
    if nofile is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
    if group is not None:
        for path in group.self_join_files():
            _write(path, "0")
    if use_rlimits:
        resource.setrlimit(resource.RLIMIT_DATA, (memory, memory))
        resource.setrlimit(resource.RLIMIT_NPROC, (pids, pids))
