"""The adversarial suite's shared parts: a per-backend box runner and the summary table.

Every test records what it tried; `pytest_terminal_summary` prints attacks tried and blocked,
legitimate uses working, faults survived and load held, so the figure lands in CI's log.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from ..conftest import Sandbox, require_box

BACKENDS = ("claude", "codex", "gemini", "opencode", "shell")
RESULTS: dict[str, list[bool]] = defaultdict(list)


class Report:
    def attack(self, blocked: bool) -> None:
        RESULTS["attacks tried"].append(True)
        RESULTS["attacks blocked"].append(blocked)

    def legit(self, works: bool) -> None:
        RESULTS["legitimate uses"].append(True)
        RESULTS["legitimate uses working"].append(works)

    def fault(self, survived: bool) -> None:
        RESULTS["faults injected"].append(True)
        RESULTS["faults survived"].append(survived)

    def load(self, held: bool) -> None:
        RESULTS["load runs"].append(True)
        RESULTS["load held"].append(held)


@pytest.fixture
def report() -> Report:
    return Report()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def box(sandbox: Sandbox) -> Sandbox:
    require_box()
    return sandbox


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001, ARG001
    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("hive relay hardening summary")
    rows = [
        ("attacks tried", "attacks blocked"),
        ("legitimate uses", "legitimate uses working"),
        ("faults injected", "faults survived"),
        ("load runs", "load held"),
    ]
    for total_key, ok_key in rows:
        total = len(RESULTS[total_key])
        ok = sum(RESULTS[ok_key])
        tr.write_line(f"{ok_key:<26} {ok:>4} / {total:<4}")
