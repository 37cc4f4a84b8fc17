"""An unexpected error (a bug) ends with the promised exit code 70 and one line naming a crash file
that holds the traceback (owner-only, in the state dir), never a traceback on the terminal; the
twin: a RelayError still prints its own line and code."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from relay.commands.guarded import guarded
from relay.model.errors import EXIT_INTERNAL, UsageError


def _bug() -> int:
    return {}["no such key"]


def test_a_bug_is_exit_70_and_one_line_with_the_traceback_in_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert guarded(_bug) == EXIT_INTERNAL == 70
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error (a bug, not your input): KeyError" in err, err
    assert "Traceback" not in err
    path = Path(err.split("the traceback is in ")[1].split(";")[0])
    assert "Traceback" in path.read_text() and "_bug" in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.parent == tmp_path / "state" / "hive-relay" / "crashes"


def test_a_relay_error_keeps_its_line_and_code(capsys: pytest.CaptureFixture[str]) -> None:
    def bad() -> int:
        raise UsageError("unknown backend 'x'; fix: pick one of claude, codex")

    assert guarded(bad) == 2
    assert capsys.readouterr().err == "hive-relay: error: unknown backend 'x'; fix: pick one of claude, codex\n"
    assert os.environ.get("PYTEST_CURRENT_TEST")
