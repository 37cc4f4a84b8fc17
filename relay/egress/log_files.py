"""The egress logs: pruned by age and count after each run, and read back for `logs` (relay/commands/logs.py).

Each run that made at least one proxy decision leaves one JSON-lines file in
`<state dir>/logs/STAMP-BACKEND-RUNID.jsonl` (relay/egress/decision_log.py opens it on the first decision, so a run
with no network traffic writes none). The logs dir is readable by the box only as a read-only bind,
but it is still treated as untrusted: every entry is reached through relay/safefs (no link followed,
O_NONBLOCK + S_ISREG, bounded reads), and only regular files owned by the caller, with our own name
shape, are ever removed.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Mapping

from relay.host import liveness, safefs
from relay.host.liveness import RUN_ID_RE
from relay.host.paths import state_dir
from relay.model.errors import UsageError
from relay.model.record import record
from relay.model.refusal import ENTRY

KEEP_DAYS = 14
KEEP_RUNS = 100
# A log is at most 64 MiB (decision_log.MAX_LOG_BYTES); one line more for the summary of a cut log.
READ_LIMIT = (64 << 20) + (1 << 16)
NAME = re.compile(rf"^(?P<stamp>\d{{8}}-\d{{6}})-(?P<backend>[A-Za-z0-9_.-]+?)-(?P<run>{RUN_ID_RE}|dry)\.jsonl$")
LIST_FIX = f"`{ENTRY} logs` lists the runs"


@record
class LogFile:
    """One decision log on disk, named by stamp, backend and run, so `logs` can list and prune without opening it."""

    name: str
    stamp: str
    backend: str
    run: str
    size: int
    mtime: float

    @property
    def when(self) -> str:
        s = self.stamp
        return f"{s[0:4]}-{s[4:6]}-{s[6:8]} {s[9:11]}:{s[11:13]}:{s[13:15]}"


def logs_dir(env: Mapping[str, str]) -> str:
    return os.path.join(state_dir(env), "logs")


def run_alive(run: str) -> bool:
    """Whether the run that writes this log still runs (its launcher's pid and start time)."""
    return liveness.run_alive(run)


def scan(directory: str) -> list[LogFile]:
    """Our log files in `directory`, oldest first: regular files (lstat, never followed) owned by the
    caller whose name has our shape. Anything else there is left alone and not listed."""
    found: list[LogFile] = []
    try:
        with safefs.base_dir(directory) as dfd:
            for name in os.listdir(dfd):
                m = NAME.match(name)
                if not m:
                    continue
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                    continue
                found.append(LogFile(name, m["stamp"], m["backend"], m["run"], st.st_size, st.st_mtime))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(found, key=lambda f: (f.stamp, f.name))


def prune(directory: str, *, keep_days: float = KEEP_DAYS, keep_runs: int = KEEP_RUNS,
          now: float | None = None, live: str | None = None) -> list[tuple[str, int]]:
    """Remove empty logs, logs older than `keep_days` and all but the newest `keep_runs`; never the log
    of a run whose launcher is still alive, nor `live`. Returns (name, bytes) of what was removed."""
    now = time.time() if now is None else now
    files = scan(directory)
    doomed: list[LogFile] = []
    kept: list[LogFile] = []
    for f in files:
        if f.name == live or run_alive(f.run):
            continue
        if f.size == 0 or now - f.mtime > keep_days * 86400:
            doomed.append(f)
        else:
            kept.append(f)
    if len(kept) > keep_runs:
        doomed += kept[:len(kept) - keep_runs]
    removed: list[tuple[str, int]] = []
    if not doomed:
        return removed
    try:
        with safefs.base_dir(directory) as dfd:
            for f in doomed:
                def same(st: os.stat_result, f: LogFile = f) -> bool:
                    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_size == f.size
                try:
                    if safefs.unlink_beneath(dfd, f.name, only_if=same):
                        removed.append((f.name, f.size))
                except OSError:
                    continue
    except OSError:
        pass
    return removed


def prune_after_run(log_path: str | None) -> None:
    """The runner's hook: after a run, keep the logs dir bounded. Never fails the run."""
    if not log_path:
        return
    try:
        prune(os.path.dirname(log_path), live=None)
    except OSError:
        pass


# Reading -------------------------------------------------------------------------------------------------

def read_entries(directory: str, f: LogFile) -> tuple[list[dict], int]:
    """The decisions of one log, and how many lines were not valid entries."""
    with safefs.base_dir(directory) as dfd:
        try:
            data = safefs.read_beneath(dfd, f.name, READ_LIMIT)
        except safefs.UnsafePath as err:
            raise UsageError(f"{f.name}: {err.strerror}; not read; fix: remove it (`{ENTRY} clean`)") from None
    if data is None:
        raise UsageError(f"{f.name} is gone; fix: {LIST_FIX}")
    entries: list[dict] = []
    bad = 0
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(entry, dict):
            entries.append(entry)
        else:
            bad += 1
    return entries, bad
