"""The egress logs: pruned by age and count after each run, and read back by `hive-relay logs`.

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
from dataclasses import dataclass

from relay.host import liveness, safefs
from relay.host.liveness import RUN_ID_RE
from relay.host.paths import state_dir
from relay.model.errors import UsageError

KEEP_DAYS = 14
KEEP_RUNS = 100
# A log is at most 64 MiB (decision_log.MAX_LOG_BYTES); one line more for the summary of a cut log.
READ_LIMIT = (64 << 20) + (1 << 16)
NAME = re.compile(rf"^(?P<stamp>\d{{8}}-\d{{6}})-(?P<backend>[A-Za-z0-9_.-]+?)-(?P<run>{RUN_ID_RE}|dry)\.jsonl$")
LIST_FIX = "`hive-relay logs` (or `invoke logs`) lists the runs"


@dataclass(frozen=True)
class LogFile:
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

def _printable(text: object) -> str:
    """A box chose the host names and reasons: no control character reaches the user's terminal."""
    return "".join(c if c.isprintable() else "?" for c in str(text))


def find(files: list[LogFile], which: str) -> LogFile:
    """RUN: `last`, a run id, a file name, or any unique part of one."""
    if not files:
        raise UsageError(f"no egress logs yet; fix: run a box with network first ({LIST_FIX})")
    if which in ("last", "latest", "-1"):
        return files[-1]
    exact = [f for f in files if which in (f.name, f.run, f.name.removesuffix(".jsonl"))]
    if len(exact) == 1:
        return exact[0]
    part = [f for f in files if which in f.name]
    if len(part) == 1:
        return part[0]
    if not part:
        raise UsageError(f"no egress log matches {_printable(which)!r}; fix: {LIST_FIX}")
    shown = ", ".join(f.run for f in part[-3:])
    raise UsageError(f"{_printable(which)!r} matches {len(part)} runs (e.g. {shown}); fix: give more of the run id "
                     f"({LIST_FIX})")


def read_entries(directory: str, f: LogFile) -> tuple[list[dict], int]:
    """The decisions of one log, and how many lines were not valid entries."""
    with safefs.base_dir(directory) as dfd:
        try:
            data = safefs.read_beneath(dfd, f.name, READ_LIMIT)
        except safefs.UnsafePath as err:
            raise UsageError(f"{f.name}: {err.strerror}; not read; fix: remove it (`hive-relay clean`)") from None
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


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _line(entry: dict) -> str:
    try:
        when = time.strftime("%H:%M:%S", time.localtime(float(entry.get("time", 0))))
    except (TypeError, ValueError, OverflowError):
        when = "?"
    decision = _printable(entry.get("decision", "?"))
    target = f"{_printable(entry.get('host', '?'))}:{_printable(entry.get('port', '?'))}"
    return f"{when}  {decision:<11} {_printable(entry.get('method', '-')):<8} {target}  {_printable(entry.get('reason', ''))}"


def staged_runs(env: Mapping[str, str]) -> set[str]:
    """The run ids that have a staged layer (relay/trust/staged.py): a log and a layer share the run id."""
    from relay.trust import staged

    return {r.layer.run for r in staged.runs(env)}


def _staged_footer(layers: set[str], logged: set[str]) -> None:
    """Staged runs link to their changes; those that made no request have no log, so name them here."""
    from relay.model.refusal import ENTRY

    if layers & logged:
        print(f"staged: `{ENTRY} changes RUN` shows a staged run's workdir changes (the `staged` column)")
    quiet = sorted(layers - logged)
    if quiet:
        print(f"staged, with no egress log (no network request): {', '.join(quiet)}; `{ENTRY} changes RUN` "
              "reviews one")


def show(which: str | None = None, denied: bool = False, env: Mapping[str, str] | None = None) -> int:
    """`hive-relay logs [RUN] [--denied]`: with no RUN, list the runs (newest last); with RUN, print its
    decisions. `--denied` keeps only what was not allowed (denied, and allowed hosts that were
    unreachable); with no RUN it reads the newest run."""
    env = dict(os.environ if env is None else env)
    directory = logs_dir(env)
    files = scan(directory)
    if which is None and not denied:
        if not files:
            print(f"no egress logs in {directory} (a run writes one when its box uses the network)")
            _staged_footer(staged_runs(env), set())
            return 0
        layers = staged_runs(env)
        print(f"{'started':<19}  {'backend':<9} {'run':<17} {'size':>9}  staged")
        for f in files:
            print(f"{f.when:<19}  {_printable(f.backend):<9} {f.run:<17} {human_bytes(f.size):>9}  "
                  f"{'changes ' + f.run if f.run in layers else '-'}")
        total = sum(f.size for f in files)
        print(f"{len(files)} run{'s' if len(files) != 1 else ''}, {human_bytes(total)} in {directory}; "
              f"`hive-relay logs RUN` shows one (RUN: a run id, a part of it, or `last`)")
        _staged_footer(layers, {f.run for f in files})
        return 0
    f = find(files, which or "last")
    entries, bad = read_entries(directory, f)
    shown = [e for e in entries if not denied or e.get("decision") != "allow"]
    print(f"run {f.run}  {_printable(f.backend)}  started {f.when}  ({directory}/{f.name})")
    if f.run in staged_runs(env):
        from relay.model.refusal import ENTRY

        print(f"staged: its workdir changes are reviewed with `{ENTRY} changes {f.run}`")
    for entry in shown:
        print(_line(entry))
    kinds: dict[str, int] = {}
    for e in entries:
        kinds[str(e.get("decision"))] = kinds.get(str(e.get("decision")), 0) + 1
    counts = ", ".join(f"{n} {_printable(k)}" for k, n in sorted(kinds.items())) or "no decisions"
    extra = f"; {bad} unreadable line{'s' if bad != 1 else ''} skipped" if bad else ""
    filt = f"{len(shown)} not allowed of " if denied else ""
    print(f"{filt}{len(entries)} decision{'s' if len(entries) != 1 else ''}: {counts}{extra}")
    return 0
