"""A warm container launch asks the engine nothing before its `run` (issue 27): the image this user's
engine had is remembered in the cache dir, and a memo that lies costs no protection: the run's
`--pull=never` fails at once (nothing is fetched for the image's name), the memo entry is dropped,
and the user is told to run again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import Sandbox

pytestmark = pytest.mark.container


def _memo(s: Sandbox) -> list[str]:
    path = s.home / ".cache" / "hive-relay" / "images-ready.json"
    return json.loads(path.read_text()) if path.exists() else []


def _key(s: Sandbox, extra_env: dict[str, str] | None = None) -> str:
    """The memo key of the run the sandbox would start (its plan's engine and image)."""
    code = ("import os; from relay.config.load import get_backend, load_matrix; from relay.modes import image_tag; "
            "from relay.modes.image_tag import with_image; from relay.plan.resolve import Request, resolve; from relay.host.probe import probe; "
            "from relay.host.fs_view import HostFs; "
            "env = dict(os.environ); m = load_matrix(env, workdir=None); "
            "req = Request('shell', mode='container', workdir=os.getcwd(), prompt='true'); "
            "p = resolve(get_backend(m, 'shell'), m, req, with_image(probe(env), m, req, env), env, fs=HostFs()); "
            "print(image_tag._ready_key(p.container))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=s.workdir, env={**s.env, **(extra_env or {})},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_a_warm_launch_remembers_the_image_and_a_stale_memo_fails_closed_without_a_pull(csandbox: Sandbox) -> None:
    s = csandbox
    # Twin: the first launch checks the image and remembers it; the next one skips the check and works.
    first = s.relay("shell", "container", "--quiet", "--prompt", "echo one")
    assert first.returncode == 0 and first.stdout.strip() == "one", first.stderr[-3000:]
    assert _key(s) in _memo(s)
    again = s.relay("shell", "container", "--quiet", "--prompt", "echo two")
    assert again.returncode == 0 and again.stdout.strip() == "two", again.stderr[-3000:]
    # Attack: a memo naming an image this engine does not have (another base, so another tag).
    gone = {"HIVE_RELAY_BASE_IMAGE": f"localhost/hive-relay-gone-{os.getpid()}:1"}
    key = _key(s, gone)
    path = s.home / ".cache" / "hive-relay" / "images-ready.json"
    path.write_text(json.dumps([*_memo(s), key]))
    proc = s.relay("shell", "container", "--quiet", "--prompt", "echo SHOULD-NOT-RUN", extra_env=gone)
    assert proc.returncode != 0 and "SHOULD-NOT-RUN" not in proc.stdout
    assert "Trying to pull" not in proc.stderr  # --pull=never: nothing fetched for a missing local image
    assert "is gone" in proc.stderr and "run again" in proc.stderr, proc.stderr[-2000:]
    assert key not in _memo(s) and _key(s) in _memo(s)


def test_a_warm_launch_leaves_the_image_build_unimported(csandbox: Sandbox) -> None:
    """The build's module (shutil, the npm staging, the engine's `info`) costs ~8 ms of every launch
    when imported; a warm launch needs only the tag and the memo (relay/modes/image_tag.py)."""
    s = csandbox
    first = s.relay("shell", "container", "--quiet", "--prompt", "echo one")
    assert first.returncode == 0 and first.stdout.strip() == "one", first.stderr[-3000:]
    warm = s.relay("shell", "container", "--quiet", "--prompt", "echo two", extra_env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert warm.returncode == 0 and warm.stdout.strip() == "two", warm.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in warm.stderr.splitlines() if line.startswith("import time:")}
    assert "relay.modes.image_tag" in imported  # the probe sees the launch's imports at all
    assert "relay.modes.image" not in imported and "relay.modes.install" not in imported
