"""The proxy's decision log: one JSON line per decision, counted for the run's exit summary.

Its own module because every part of the proxy writes to it from its own thread (the reactor, the
workers, the control thread): it is the one object they all share, so it takes its own lock and
never fails its caller (a full disk is counted, not raised). Reading the logs back and pruning old
ones is relay/egress/log_files.py.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Mapping

from relay.host import safefs
from relay.model.allow_rules import fmt_hostport
from relay.policy.egress import Decision

# One run's decision log; a box that floods refusals is summarized, not logged line by line.
MAX_LOG_BYTES = 64 << 20


def _open_log(path: str):  # noqa: ANN202 - a text file object
    """Create the run's log beneath the logs dir with no link followed and never blocking; the name
    carries the run id, so an existing entry there is not ours and is refused (O_EXCL)."""
    logs = os.path.dirname(path)
    os.makedirs(logs, mode=0o700, exist_ok=True)
    with safefs.base_dir(logs) as dfd:
        fd = safefs.open_beneath(dfd, os.path.basename(path),
                                 os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NONBLOCK, 0o600)
    return os.fdopen(fd, "a", buffering=1, encoding="utf-8")


class DecisionLog:
    """Append-only JSON-lines log; a write failure (full disk) is counted, never fatal."""

    def __init__(self, path: str | None, backend: str) -> None:
        self.path = path
        self.backend = backend
        self.lock = threading.Lock()
        self.denied: Counter[str] = Counter()
        self.unreachable: Counter[str] = Counter()
        self.causes: dict[str, Counter[str]] = {}
        self.allowed = 0
        self.write_errors = 0
        self._fh = None
        self.written = 0
        self.truncated = 0
        self._opened = False  # opened on the first decision: a run without traffic leaves no empty log
        self._closed = False  # after close(), a worker that finishes late still gets its line in (_write)

    def record(self, decision: Decision, method: str, extra: Mapping[str, object] | None = None) -> None:
        """One line; `extra` (a credential route's name, path and status) is added to it. Never a key."""
        entry = {
            "time": round(time.time(), 3), "backend": self.backend, "host": decision.host,
            "port": decision.port, "method": method,
            "decision": decision.kind, "reason": decision.reason,
        }
        if extra:
            entry.update(extra)
        if decision.unreachable:
            entry["cause"] = decision.cause
        with self.lock:
            key = f"{fmt_hostport(decision.host, None)}:{decision.port}"
            if decision.allowed:
                self.allowed += 1
            elif decision.unreachable:
                self.unreachable[key] += 1
                self.causes.setdefault(key, Counter())[decision.cause] += 1
            else:
                self.denied[f"{decision.host}:{decision.port}"] += 1
            self._write(entry)

    def event(self, entry: dict[str, object]) -> None:
        """A line that is not a proxy decision (a live allow or deny): written, never counted."""
        with self.lock:
            self._write({"time": round(time.time(), 3), "backend": self.backend, **entry})

    def _write(self, entry: dict[str, object]) -> None:
        """Append one line (the caller holds the lock); the file is opened on the first line."""
        if self._closed:
            self._write_late(entry)
            return
        if not self._opened and self.path:
            self._opened = True
            try:
                self._fh = _open_log(self.path)
            except OSError:
                self.write_errors += 1
        if self._fh is not None:
            line = json.dumps(entry) + "\n"
            if self.written + len(line) > MAX_LOG_BYTES:
                self.truncated += 1  # a flood of refusals must not fill the disk
                return
            try:
                self._fh.write(line)
                self.written += len(line)
            except OSError:
                self.write_errors += 1

    def _write_late(self, entry: dict[str, object]) -> None:
        """A line after close(): a connection the proxy was still serving when it stopped ends and is
        recorded. The log is opened for that one line (created if it is the first), never left open."""
        if not self.path:
            return
        line = json.dumps(entry) + "\n"
        if self.written + len(line) > MAX_LOG_BYTES:
            self.truncated += 1
            return
        try:
            logs = os.path.dirname(self.path)
            with safefs.base_dir(logs) as dfd:
                fd = safefs.open_beneath(dfd, os.path.basename(self.path),
                                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o600)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError("the egress log is not a regular file")
                os.write(fd, line.encode("utf-8"))
            finally:
                os.close(fd)
            self.written += len(line)
        except OSError:
            self.write_errors += 1

    def close(self) -> None:
        with self.lock:
            self._closed = True
            if self._fh is not None:
                try:
                    self._fh.close()
                except OSError:
                    self.write_errors += 1
                self._fh = None

    def summary(self) -> str | None:
        """The refusals' line (hosts the policy denied), or None."""
        if not self.denied:
            return None
        top = ", ".join(f"{h} ×{n}" for h, n in self.denied.most_common(5))
        more = len(self.denied) - 5
        cut = f"; the log stopped at {MAX_LOG_BYTES >> 20} MiB ({self.truncated} lines not written)" if self.truncated else ""
        return f"egress denied: {top}" + (f" and {more} more" if more > 0 else "") + cut

    def unreachable_summary(self) -> str | None:
        """Allowed hosts that could not be reached, each with its most frequent cause, or None."""
        if not self.unreachable:
            return None
        top = ", ".join(f"{h} ×{n} ({self.causes[h].most_common(1)[0][0]})" for h, n in self.unreachable.most_common(5))
        more = len(self.unreachable) - 5
        return f"unreachable (allowed, but failed): {top}" + (f" and {more} more" if more > 0 else "")

    def summary_lines(self) -> list[str]:
        """Every summary line for the end of a run: unreachable first (it is what broke the run), then denied."""
        return [line for line in (self.unreachable_summary(), self.summary()) if line]
