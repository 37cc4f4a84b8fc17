"""Staged is the default (issue 25), with real boxes: a plain launch, with no flag and no config key,
keeps the checkout untouched (not even the masks' placeholders show in it, at any moment of the
run), and the review lists only what the box wrote.

`--live` is today's behaviour, and one live box per checkout: a second one is refused (exit 3, the
running box named), `--shared-live` insists, staged boxes beside it are fine, and a launcher killed
with `kill -9` lets go of the checkout. Where a host cannot stage (the process tier), the default
refuses rather than quietly going live. A repo's `workdir: staged` beats the user's `workdir: live`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..conftest import Sandbox


def default_config(s: Sandbox) -> None:
    """The user config without the suite's `workdir: live` (tests/conftest.py): the real default."""
    cfg = s.home / ".config" / "hive-relay" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("workdir: live\n", ""))


def launch(s: Sandbox, script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "relay", "shell", "local", "--quiet", *args, "--prompt", script],
                            cwd=s.workdir, env=s.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_the_default_is_staged_and_the_checkout_never_sees_a_placeholder(box: Sandbox, report) -> None:
    s = box
    default_config(s)
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:  # every name the host checkout holds, for as long as the box runs
        while not stop.is_set():
            seen.update(os.listdir(s.workdir))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        proc = s.relay("shell", "local", "--prompt", "echo made > new.txt; echo edit >> README.md; ls -a; sleep 1")
    finally:
        stop.set()
        watcher.join()
    assert proc.returncode == 0, proc.stderr
    assert "(staged)" in proc.stderr and "staged:" in proc.stderr  # the banner says so, and the exit line
    assert ".envrc" in proc.stdout.split()  # the box sees its masks' targets ...
    report.attack(seen == {"README.md"})  # ... and the host checkout never did
    assert seen == {"README.md"}, seen
    assert sorted(os.listdir(s.workdir)) == ["README.md"]
    assert (s.workdir / "README.md").read_text() == "hello from the workdir\n"
    listed = json.loads(s.relay("changes", "--json").stdout)
    assert len(listed) == 1 and listed[0]["files"] == 2, listed  # new.txt and README.md, no placeholder
    applied = s.relay("apply", listed[0]["run"])
    assert applied.returncode == 0, applied.stderr
    works = (s.workdir / "new.txt").read_text() == "made\n" and "edit" in (s.workdir / "README.md").read_text()
    report.legit(works)
    assert works


def test_a_run_that_changed_nothing_leaves_no_layer(box: Sandbox) -> None:
    s = box
    default_config(s)
    proc = s.box("cat README.md >/dev/null")
    assert proc.returncode == 0, proc.stderr
    assert "changed nothing" in proc.stderr
    assert json.loads(s.relay("changes", "--json").stdout) == []
    state = s.home / ".local" / "state" / "hive-relay" / "staged"
    assert not state.exists() or list(state.iterdir()) == []


def test_one_live_box_per_checkout(box: Sandbox, report) -> None:
    s = box
    first = launch(s, "touch ready; while [ ! -e go ]; do sleep 0.05; done", "--live")
    try:
        wait_for(s.workdir / "ready", first)
        second = s.box("echo SECOND > second.txt", "shell", "--live")
        refused = second.returncode == 3 and not (s.workdir / "second.txt").exists()
        report.attack(refused)
        assert refused, (second.returncode, second.stderr)
        line = second.stderr.strip().splitlines()[-1]
        assert "another live box (run " in line and "--shared-live" in line and "fix:" in line
        # The ways past: a staged box (its own layer), or --shared-live.
        staged = s.box("echo S > staged.txt", "shell", "--staged")
        assert staged.returncode == 0, staged.stderr
        assert not (s.workdir / "staged.txt").exists()
        shared = s.box("echo SHARED > shared.txt", "shell", "--live", "--shared-live")
        assert shared.returncode == 0, shared.stderr
        assert (s.workdir / "shared.txt").read_text() == "SHARED\n"
        # The shared box joined; a plain live box is still refused while the first one runs.
        assert s.box("true", "shell", "--live").returncode == 3
    finally:
        (s.workdir / "go").touch()
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    again = s.box("echo AGAIN > again.txt", "shell", "--live")
    report.legit(again.returncode == 0)
    assert again.returncode == 0, again.stderr  # the first one ended: the checkout is free


def test_a_killed_live_launcher_lets_go_of_the_checkout(box: Sandbox, report) -> None:
    s = box
    first = launch(s, "touch ready; sleep 120", "--live")
    wait_for(s.workdir / "ready", first)
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=60)
    deadline = time.monotonic() + 120
    while True:  # the janitor tears the box down; the lock went with the launcher already
        proc = s.box("echo NEXT > next.txt", "shell", "--live")
        if proc.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    report.fault(proc.returncode == 0)
    assert proc.returncode == 0, proc.stderr
    assert (s.workdir / "next.txt").read_text() == "NEXT\n"


def test_a_host_that_cannot_stage_refuses_rather_than_going_live(box: Sandbox, report) -> None:
    s = box
    default_config(s)
    proc = s.box("echo X > x.txt", "shell", "--isolation", "process", "--profile", "default")
    refused = proc.returncode == 3 and not (s.workdir / "x.txt").exists()
    report.attack(refused)
    assert refused, (proc.returncode, proc.stderr)
    line = proc.stderr.strip().splitlines()[-1]
    live = s.box("echo X > x.txt", "shell", "--isolation", "process", "--profile", "default", "--live")
    if os.geteuid() == 0:  # root gets no process tier at all (it cannot hide root-owned secrets)
        assert "process tier cannot hide root-owned secrets" in line, line
        assert live.returncode == 3 and not (s.workdir / "x.txt").exists()
        return
    assert "staged (the default)" in line and "--live" in line and "fix:" in line
    report.legit(live.returncode == 0)
    assert live.returncode == 0, live.stderr
    assert (s.workdir / "x.txt").read_text() == "X\n"


def test_a_repo_may_force_staged_over_the_users_live(box: Sandbox, report) -> None:
    s = box  # the suite's user config says `workdir: live`
    subprocess.run(["git", "init", "-q", str(s.workdir)], check=True)
    (s.workdir / ".hive-relay.yaml").write_text("workdir: staged\n")
    proc = s.box("echo R > r.txt")
    assert proc.returncode == 0, proc.stderr
    assert not (s.workdir / "r.txt").exists()  # staged, as the repo says
    forced = s.box("echo R > r.txt", "shell", "--live")
    report.attack(forced.returncode == 3 and not (s.workdir / "r.txt").exists())
    assert forced.returncode == 3, forced.stderr
    assert ".hive-relay.yaml" in forced.stderr and "drop --live" in forced.stderr
