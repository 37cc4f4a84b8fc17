"""How many examples a property test tries: all of them in CI (and with HIVE_RELAY_FULL_PROPS=1), a
tenth on a developer's `-m "not box"` loop, where the pure tests must answer in seconds. The same
properties either way: a smaller count finds less, never something else."""

from __future__ import annotations

import os

FULL = os.environ.get("CI") == "true" or os.environ.get("HIVE_RELAY_FULL_PROPS") == "1"


def examples(n: int) -> int:
    return n if FULL else max(25, n // 10)
