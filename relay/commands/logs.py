"""`logs`: the egress logs of past runs, listed or shown one at a time (reading them is
relay/egress/log_files.py's; this module only prints).

Every field a box chose (host names, reasons, methods, backend names) is printed with its control
characters replaced, so a log cannot move the user's cursor or forge a line.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from relay.egress.log_files import LIST_FIX, LogFile, logs_dir, read_entries, scan
from relay.model.errors import UsageError
from relay.model.refusal import ENTRY


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
              f"`{ENTRY} logs RUN` shows one (RUN: a run id, a part of it, or `last`)")
        _staged_footer(layers, {f.run for f in files})
        return 0
    f = find(files, which or "last")
    entries, bad = read_entries(directory, f)
    shown = [e for e in entries if not denied or e.get("decision") != "allow"]
    print(f"run {f.run}  {_printable(f.backend)}  started {f.when}  ({directory}/{f.name})")
    if f.run in staged_runs(env):
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
