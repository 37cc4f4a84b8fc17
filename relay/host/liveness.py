"""Whose is this leftover? Owners by pid *and* start time, and whether each is still alive (the sweep itself is relay/trust/rundirs.py).

A run dir, a cgroup and a placeholder reference each name the launcher that made them. A pid alone
is not an identity: after the launcher died (with its janitor, or in a power cut) the pid can be
reused by any process, which would keep its leftovers "alive" for as long as that process runs.
So an owner is (pid, start time in clock ticks since boot from /proc/PID/stat field 22, boot id),
and it is alive only while a non-zombie process with that pid *and* that start time exists in the
same boot.

The run id carries the owner (`PID-START-BOOT-RANDOM`), so the run dir `hive-relay-RUNID` and the
cgroup `hive-relay-RUNID` name it; the placeholder registry keeps it in each reference. Records
written before start times were kept (`PID-RANDOM`, bare pids) are judged by the pid and by when
the record was made: a process that started after it cannot be its owner.
"""

from __future__ import annotations

import os

from relay.host.procs import pid_alive, stat_fields
from relay.model.record import record

_BOOT: list[str] = []


def boot_id() -> str:
    """This boot's id, 8 hex digits (a start time only means something within one boot)."""
    if not _BOOT:
        try:
            with open("/proc/sys/kernel/random/boot_id") as fh:
                _BOOT.append(fh.read(64).strip().replace("-", "")[:8] or "0")
        except OSError:
            _BOOT.append("0")
    return _BOOT[0]


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22); None when it is gone or unreadable."""
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except ValueError:
        return None


def _wall_start(pid: int) -> float | None:
    ticks = start_time(pid)
    if ticks is None:
        return None
    try:
        with open("/proc/stat") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


@record
class Owner:
    """Who owns a run dir: a pid with its start time and boot id, so a reused pid is never taken for the live owner."""

    pid: int
    start: int | None = None  # None: a record from before start times were kept
    boot: str | None = None

    def token(self) -> str:
        return f"{self.pid}-{self.start}-{self.boot}"

    def as_json(self) -> dict:
        return {"pid": self.pid, "start": self.start, "boot": self.boot}


def me(pid: int | None = None) -> Owner:
    """The owner record of a running process (default: this one)."""
    pid = os.getpid() if pid is None else pid
    return Owner(pid, start_time(pid), boot_id())


# A run id as text: `PID-START-BOOT-RANDOM`, or the older `PID-RANDOM`. One pattern for every reader
# (logs, kept state, reports).
RUN_ID_RE = r"[0-9]{1,10}(?:-[0-9]{1,20}-[0-9a-f]{8})?-[0-9a-f]{8}"


def new_run_id() -> str:
    """`PID-START-BOOT-RANDOM`: the run dir and cgroup named after it say whose they are."""
    return f"{me().token()}-{os.urandom(4).hex()}"


def parse_run_id(run_id: str) -> Owner | None:
    """The owner a run id names (any `-SUFFIX` after it, such as `-verify`, belongs to the same
    run); None for a name that is not one of ours."""
    parts = run_id.split("-")
    if len(parts) >= 4 and parts[0].isdigit() and parts[1].isdigit() and parts[2].isalnum():
        return Owner(int(parts[0]), int(parts[1]), parts[2])
    if len(parts) in (2, 3) and parts[0].isdigit() and parts[1].isalnum():
        return Owner(int(parts[0]))
    return None


def owner_from_json(value: object) -> Owner | None:
    """A registry reference: {"pid", "start", "boot"}, or a bare pid from an older registry."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Owner(value)
    if isinstance(value, dict) and isinstance(value.get("pid"), int) and not isinstance(value.get("pid"), bool):
        start, boot = value.get("start"), value.get("boot")
        return Owner(value["pid"], start if isinstance(start, int) and not isinstance(start, bool) else None,
                     boot if isinstance(boot, str) else None)
    return None


def alive(owner: Owner, made: float | None = None) -> bool:
    """True while the owner runs: same pid, same start time, same boot, not a zombie. A record with
    no start time (older format) counts as alive while its pid runs and started before `made`
    (the record's ctime), when that is known."""
    if owner.pid <= 0 or not pid_alive(owner.pid):
        return False
    fields = stat_fields(owner.pid)
    if fields is None:
        return True  # exists but /proc hides it (hidepid, another user): never sweep what may be live
    if fields[0] == b"Z":
        return False
    if owner.start is None:
        if made is None:
            return True
        started = _wall_start(owner.pid)
        return started is None or started <= made + 1
    if owner.boot is not None and owner.boot != boot_id():
        return False
    try:
        return int(fields[19]) == owner.start
    except ValueError:
        return True


def run_alive(run_id: str) -> bool:
    """Whether the launcher named by a run id still runs (pid, start time, boot)."""
    owner = parse_run_id(run_id)
    return owner is not None and alive(owner)


def running(pid: int) -> bool:
    """A process that exists and is not a zombie (whoever it is: for a pid we were told, not an owner)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != b"Z"


def gone(name: str, prefix: str, made: float | None = None) -> bool:
    """True when `name` is PREFIX + a run id whose owner is no longer alive."""
    if not name.startswith(prefix):
        return False
    owner = parse_run_id(name[len(prefix):])
    return owner is not None and not alive(owner, made)
