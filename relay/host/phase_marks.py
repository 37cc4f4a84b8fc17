"""Launch phase marks for `invoke bench`: perf_counter stamps, written as JSON to $HIVE_RELAY_TRACE."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

TRACE: dict[str, float] = {}


def mark(name: str) -> None:
    TRACE[name] = time.perf_counter()


def dump(env: Mapping[str, str]) -> None:
    path = env.get("HIVE_RELAY_TRACE")
    if path:
        try:
            with open(path, "w") as fh:
                json.dump(TRACE, fh)
        except OSError:
            pass
