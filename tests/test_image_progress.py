"""The image build's progress (issue 27.4): each engine `STEP n/m` becomes one line of ours, a quiet
stretch says what is still running at least every 5 s, and the engine's chatter is shown only when
the stage fails. A real child process stands in for a build stage's timing (the real build is
covered by tests/test_container.py's image fixture)."""

from __future__ import annotations

import io

import pytest

from relay.model.errors import RelayError
from relay.modes.image import _run

SCRIPT = ("echo 'STEP 1/3: FROM base'; echo '--> 0ec293d8db4'; sleep 0.6; echo 'npm warn chatter'; "
          "echo 'STEP 2/3: RUN npm install'; sleep 0.6; echo 'STEP 3/3: COPY x'; echo done")


def test_steps_are_one_line_each_and_a_quiet_stretch_is_never_silent() -> None:
    out = io.StringIO()
    _run(["sh", "-c", SCRIPT], "image build", "no fix", out=out, tick=0.2)
    lines = out.getvalue().splitlines()
    assert "hive-relay: image build 1/3: FROM base" in lines
    assert "hive-relay: image build 2/3: RUN npm install" in lines and "hive-relay: image build 3/3: COPY x" in lines
    assert any(line.startswith("hive-relay: image build 1/3: still running (") for line in lines)
    assert any(line.startswith("hive-relay: image build 2/3: still running (") for line in lines)
    assert not [line for line in lines if "0ec293d8db4" in line or line == "done"]  # chatter kept back


def test_a_failed_stage_shows_its_last_output_and_one_line() -> None:
    out = io.StringIO()
    with pytest.raises(RelayError) as err:
        _run(["sh", "-c", "echo 'STEP 1/1: RUN false'; echo 'E: the real reason'; exit 7"], "image build",
             "read the output above", out=out)
    assert "E: the real reason" in out.getvalue()
    assert err.value.message == "image build failed (exit 7); fix: read the output above"
