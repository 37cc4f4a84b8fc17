"""Noticing an agent stuck reconnecting to an allowed host that does not answer.

Its own module because the proxy's workers report into it from every thread (each connect that
worked or failed) while the runner's wait loop asks it whether the run as a whole is cut off
(`gave_up`): a small object with its own lock, and the one table of what a failure likely means.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from relay.model.allow_rules import fmt_hostport

# An allowed host that keeps failing: FAIL_COUNT failures within FAIL_WINDOW seconds, none answered.
FAIL_COUNT = 5
FAIL_WINDOW = 30.0
MAX_WATCHED = 4096  # host:port keys the watch remembers at once
# What a failure most likely means, by its short cause (the summary and the stuck line use these).
LIKELY = {
    "cannot resolve": "DNS does not answer for it: is this machine offline, or the name misspelt?",
    "no address": "DNS has no address for it: is the name misspelt?",
    "refused": "nothing listens there: is the service (or the pinned address) up?",
    "timed out": "no answer at all: is this machine offline, or a firewall dropping the traffic?",
    "no route": "no route to it: is this machine offline?",
    "failed": "the connection failed",
}


class UpstreamWatch:
    """Notices an agent stuck reconnecting: an allowed host that failed `count` times within `window`
    seconds with no connection to it answered in that time. Each such host is announced once per run
    (`notify`); `gave_up()` says whether the run as a whole is cut off: some host is stuck and no
    allowed connection at all has succeeded for `window` seconds."""

    def __init__(self, notify: Callable[[str], None] | None, count: int = FAIL_COUNT, window: float = FAIL_WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.notify = notify
        self.count = count
        self.window = window
        self.clock = clock
        self.lock = threading.Lock()
        self.failures: dict[str, deque[float]] = {}
        self.last_ok: dict[str, float] = {}
        self.any_ok: float | None = None
        self.stuck: dict[str, str] = {}  # host:port -> its cause, once announced
        self.event = threading.Event()
        self.started = clock()  # "no allowed host answered for N s" must not claim more than the run lasted

    def ok(self, host: str, port: int) -> None:
        now = self.clock()
        with self.lock:
            self.last_ok[_key(host, port)] = now
            self.any_ok = now

    def failed(self, host: str, port: int, cause: str) -> None:
        key, now = _key(host, port), self.clock()
        with self.lock:
            if key not in self.failures and len(self.failures) >= MAX_WATCHED:
                self.failures.clear()  # a box inventing names (under a wildcard) must not grow this without bound
            times = self.failures.setdefault(key, deque(maxlen=self.count))
            times.append(now)
            if key in self.stuck or len(times) < self.count or now - times[0] > self.window:
                return
            if self.last_ok.get(key, -1e18) >= times[0]:
                return
            line = (f"hive-relay: {key} is allowed but failed {len(times)} times in {now - times[0]:.1f} s "
                    f"({cause}): {LIKELY.get(cause, LIKELY['failed'])} The agent may be stuck reconnecting.")
            self.stuck[key] = cause
        if self.notify is not None:
            self.notify(line)
        self.event.set()

    def gave_up(self) -> str | None:
        """`HOST:PORT keeps failing (CAUSE)` for the first stuck host when no allowed connection has
        answered for `window` s, else None."""
        if not self.event.is_set():
            return None
        with self.lock:
            if self.any_ok is not None and self.clock() - self.any_ok < self.window:
                return None
            key, cause = next(iter(self.stuck.items()))
            if self.any_ok is None:
                return (f"{key} keeps failing ({cause}) and no allowed host has answered in the "
                        f"{self.clock() - self.started:.1f} s since the box started")
            return f"{key} keeps failing ({cause}) and no allowed host answered for {self.window:g} s"


def _key(host: str, port: int) -> str:
    return f"{fmt_hostport(host, None)}:{port}"
