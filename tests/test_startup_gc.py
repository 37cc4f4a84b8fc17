"""The entries turn the cyclic collector off for a launch's startup (relay/__main__.py says why) and
the launcher turns it back on once the box runs: the proxy it serves for hours must collect."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO, Sandbox

pytestmark = pytest.mark.box


def _after_main(s: Sandbox, *argv: str) -> str:
    code = ("import gc, sys; gc.disable(); from relay.commands.cli import main; "
            f"rc = main({list(argv)!r}); print('RESULT', rc, gc.isenabled())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=s.workdir, env={**s.env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), "")
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    return line


def test_a_launch_turns_the_collector_back_on_once_the_box_runs(box_sandbox: Sandbox) -> None:
    assert _after_main(box_sandbox, "shell", "local", "--quiet", "--prompt", "true") == "RESULT 0 True"


def test_a_task_runs_with_the_collector_on(sandbox: Sandbox) -> None:
    assert _after_main(sandbox, "completion", "bash") == "RESULT 0 True"


@pytest.mark.parametrize("entry", ["bin/contribute-hive", "relay/__main__.py"])
def test_both_entries_turn_it_off_before_the_launcher_is_imported(entry: str) -> None:
    text = (REPO / entry).read_text()
    assert text.index("gc.disable()") < text.index("from relay.commands.entry import")
