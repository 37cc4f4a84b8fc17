"""The staged workdir in container mode (issue 25, item 7), with the real engine and image: podman's
overlay volume with our own upper dir, reviewed and applied from the host with the same commands
as local mode.

Attacks: the box plants a package.json script and a .husky hook, tries the protected paths and the
.git hooks; proof FROM THE HOST: the checkout is unchanged before apply, and after
`apply --skip-flagged` plain `npm run` and `git commit` run nothing planted. Twins: a source edit,
an added file and a deletion apply; a commit in the box moves the host branch on apply. Fault:
`kill -9` of the launcher leaves the layer reviewable, and `discard` removes it all (the rootless
engine's scratch dirs too).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import Sandbox, have
from .escape.test_staged import by_path, receipt, runs, snapshot, two_boxes_saw_only_their_own
from .test_container import containers

pytestmark = pytest.mark.container

GIT = ["-c", "user.email=t@t", "-c", "user.name=t", "-c", "init.defaultBranch=main"]


def _git(s: Sandbox, *args: str, **kw) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(s.home)}
    return subprocess.run(["git", "-C", str(s.workdir), *GIT, *args], capture_output=True, text=True, env=env, **kw)


def _layer(s: Sandbox, run: str) -> Path:
    return s.home / ".local" / "state" / "hive-relay" / "staged" / run


def cstaged(s: Sandbox, script: str, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    before = {r["run"] for r in runs(s)}
    r = s.relay("shell", "container", "--quiet", "--staged", "--prompt", script, *args, timeout=600)
    new = [x["run"] for x in runs(s) if x["run"] not in before]
    assert len(new) == 1, (r.stdout, r.stderr[-3000:])
    return r, new[0]


@pytest.fixture
def repo(csandbox: Sandbox) -> Sandbox:
    s = csandbox
    w = s.workdir
    (w / "src").mkdir()
    (w / "src" / "app.py").write_text('print("v1")\n')
    (w / "src" / "old.py").write_text("old\n")
    (w / "package.json").write_text('{"name":"p","version":"1.0.0","scripts":{"test":"echo ok"}}\n')
    assert _git(s, "init", "-q").returncode == 0
    assert _git(s, "add", "-A").returncode == 0 and _git(s, "commit", "-qm", "init").returncode == 0
    return s


PLANT = r"""
printf '%s\n' '{"name":"p","version":"1.0.0","scripts":{"test":"touch MARK/npm-ran","pretest":"touch MARK/npm-ran"}}' > package.json
mkdir -p .husky && printf '#!/bin/sh\ntouch MARK/husky-ran\n' > .husky/pre-commit && chmod +x .husky/pre-commit
printf '#!/bin/sh\ntouch MARK/hook-ran\n' > .git/hooks/pre-commit 2>/dev/null && echo HOOK-PLANTED
chmod +x .git/hooks/pre-commit 2>/dev/null
printf '[core]\n\thooksPath = .husky\n' >> .git/config 2>/dev/null && echo CONFIG-PLANTED
echo x > .envrc; echo envrc=$(wc -c < .envrc)
printf 'print("v2")\n' > src/app.py
printf 'new module\n' > src/new.py
rm src/old.py
echo done
"""


def test_planted_files_stay_staged_and_source_edits_apply(repo: Sandbox) -> None:
    s = repo
    mark = s.root / "marks"
    mark.mkdir()
    mark.chmod(0o777)
    before = snapshot(s.workdir)
    r, run = cstaged(s, PLANT.replace("MARK", str(mark)))
    assert r.returncode == 0 and "done" in r.stdout, r.stderr[-3000:]
    assert "HOOK-PLANTED" not in r.stdout and "CONFIG-PLANTED" not in r.stdout  # protected, staged or not
    assert "envrc=0" in r.stdout  # a placeholder over the overlay, as over the live checkout
    assert snapshot(s.workdir) == before  # nothing of the box's is live before apply
    rec = receipt(s, run)
    assert rec["workdir"] == str(s.workdir)
    changes = by_path(rec)
    assert changes["src/app.py"]["kind"] == "modified" and not changes["src/app.py"].get("flags")
    assert changes["src/new.py"]["kind"] == "added" and changes["src/old.py"]["kind"] == "deleted"
    for planted in ("package.json", ".husky/pre-commit"):
        assert changes[planted]["flags"], planted
    assert not any(p.startswith((".git/", ".envrc")) for p in changes)
    applied = s.relay("apply", run, "--skip-flagged")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert (s.workdir / "src" / "app.py").read_text() == 'print("v2")\n'
    assert (s.workdir / "src" / "new.py").read_text() == "new module\n"
    assert not (s.workdir / "src" / "old.py").exists()
    owner = os.stat(s.workdir)
    for p in ("src/app.py", "src/new.py"):  # the checkout's owner's files, whoever ran the box
        st = os.stat(s.workdir / p)
        assert (st.st_uid, st.st_gid) == (owner.st_uid, owner.st_gid)
    # From the host: npm run and git commit run nothing planted.
    if have("npm"):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(s.home)}
        subprocess.run(["npm", "run", "test", "--silent"], cwd=s.workdir, env=env, capture_output=True, timeout=120)
    assert _git(s, "add", "-A").returncode == 0
    assert _git(s, "commit", "-qm", "host").returncode == 0
    assert sorted(os.listdir(mark)) == []
    assert not (s.workdir / ".husky").exists()
    assert json.loads((s.workdir / "package.json").read_text())["scripts"] == {"test": "echo ok"}
    # The flagged entries are still staged; discard removes the whole layer, as the user.
    assert set(by_path(receipt(s, run))) == {"package.json", ".husky/pre-commit"}
    assert s.relay("discard", run).returncode == 0
    assert not _layer(s, run).exists()


def test_git_commit_in_the_box_moves_the_host_branch_on_apply(repo: Sandbox) -> None:
    s = repo
    head = _git(s, "rev-parse", "HEAD").stdout
    git_before = snapshot(s.workdir / ".git")
    r, run = cstaged(s, "echo more >> src/app.py && git add -A && git -c user.email=b@b -c user.name=b commit -qm box "
                        "&& git log --oneline | wc -l")
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr[-3000:]
    assert snapshot(s.workdir / ".git") == git_before  # objects, refs and logs went to the layer
    assert _git(s, "rev-parse", "HEAD").stdout == head
    rec = receipt(s, run)
    assert rec["git_entries"] > 0 and set(by_path(rec)) == {"src/app.py"}
    applied = s.relay("apply", run)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert _git(s, "log", "--format=%s").stdout == "box\ninit\n"
    assert _git(s, "status", "--short").stdout == ""
    assert _git(s, "fsck", "--no-dangling").returncode == 0
    owner = os.stat(s.workdir)
    for dirpath, _, files in os.walk(s.workdir / ".git"):
        for name in files:
            assert os.lstat(os.path.join(dirpath, name)).st_uid == owner.st_uid, name
    # The layer is the user's to remove by hand too: a rootless engine's scratch dirs (a subordinate
    # uid's, mode 000) were dropped at exit; the mount points the runtime made are empty.
    shutil.rmtree(_layer(s, run))


def test_kill_9_of_the_launcher_leaves_the_layer_reviewable(csandbox: Sandbox) -> None:
    s = csandbox
    before_c = containers(workdir=s.workdir)
    known = {r["run"] for r in runs(s)}
    proc = subprocess.Popen([sys.executable, "-m", "relay", "shell", "container", "--quiet", "--staged", "--prompt",
                             "echo work > kept.txt; sleep 600"], cwd=s.workdir, env=s.env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = s.home / ".local" / "state" / "hive-relay" / "staged"
    deadline = time.monotonic() + 600
    run = None
    while run is None:
        found = [p.name for p in root.glob("*") if p.name not in known and (p / "upper" / "kept.txt").exists()] \
            if root.exists() else []
        run = found[0] if found else None
        assert run or time.monotonic() < deadline, "the box never wrote into its layer"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=120)
    deadline = time.monotonic() + 240  # the janitor's bounded patience with the engine
    while containers(workdir=s.workdir) != before_c and time.monotonic() < deadline:
        time.sleep(0.2)
    assert containers(workdir=s.workdir) == before_c, "the container outlived its launcher"
    assert not (s.workdir / "kept.txt").exists()
    assert s.relay("shell", "--prompt", "true", "--quiet").returncode == 0  # the next launch's sweep
    rec = receipt(s, run)
    assert set(by_path(rec)) == {"kept.txt"} and rec["running"] is False
    assert s.relay("apply", run).returncode == 0 and (s.workdir / "kept.txt").read_text() == "work\n"
    assert s.relay("discard", run).returncode == 0
    assert not _layer(s, run).exists()  # the engine's scratch dirs too, with no launcher to drop them


def test_dry_run_shows_the_staged_layer_and_the_overlay_volume(csandbox: Sandbox) -> None:
    s = csandbox
    r = s.relay("shell", "container", "--staged", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["workdir_mode"] == "staged" and plan["staged"]["root"].endswith("/staged/" + plan["staged"]["run"])
    volumes = [a for a in plan["command"] if ":O," in a]
    assert volumes[0] == (f"{s.workdir}:{s.workdir}:O,upperdir={plan['staged']['root']}/upper,"
                          f"workdir={plan['staged']['root']}/work")


def test_whiteouts_opaque_dirs_and_renamed_dirs_are_read_right(csandbox: Sandbox) -> None:
    """The engine's overlay as the review reads it: a deleted file and dir (whiteouts), a dir
    removed and made again (opaque), a renamed dir (copied: no redirect), then apply gives the
    tree the box saw."""
    s = csandbox
    w = s.workdir
    for d, files in {"gone": ["a", "b"], "again": ["x", "y"], "old": ["m", "n"]}.items():
        (w / d).mkdir()
        for f in files:
            (w / d / f).write_text(f"{d}/{f}\n")
    (w / "del.txt").write_text("bye\n")
    r, run = cstaged(s, "rm del.txt; rm -rf gone; rm -rf again && mkdir again && echo new > again/z; mv old new; "
                        "find README.md again new old gone del.txt -type f 2>/dev/null | sort")
    assert r.returncode == 0, r.stderr[-3000:]
    seen = r.stdout.split()
    upper = _layer(s, run) / "upper"
    for name in ("del.txt", "gone", "old"):  # whiteouts: 0/0 character devices
        st = os.lstat(upper / name)
        assert (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == 0, name
    kinds = {p: c["kind"] for p, c in by_path(receipt(s, run)).items()}
    assert kinds == {"del.txt": "deleted", "gone": "deleted", "again/x": "deleted", "again/y": "deleted",
                     "again/z": "added", "old": "deleted", "new/m": "added", "new/n": "added"}
    applied = s.relay("apply", run)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    host = sorted(str(p.relative_to(w)) for p in w.rglob("*") if p.is_file())
    assert host == seen == ["README.md", "again/z", "new/m", "new/n"]
    assert by_path(receipt(s, run)) == {}  # all applied: nothing left staged


WAIT_GO = "read -r _go || true"


def _cstart(s: Sandbox, script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "relay", "shell", "container", "--quiet", "--staged", "--prompt",
                             script], cwd=s.workdir, env=s.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _go(proc: subprocess.Popen) -> None:
    """Release a box waiting at WAIT_GO through its stdin (a file the host makes in the checkout
    during a staged run may stay unseen: the overlay caches the name's absence)."""
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def _wait_upper(s: Sandbox, known: set[str], name: str, proc: subprocess.Popen, timeout: float = 300) -> str:
    """The new run whose upper layer has `name`: the box got that far and is waiting."""
    root = s.home / ".local" / "state" / "hive-relay" / "staged"
    deadline = time.monotonic() + timeout
    while True:
        for p in root.glob("*") if root.exists() else []:
            if p.name not in known and not p.name.endswith("-verify") and (p / "upper" / name).exists():
                return p.name
        if proc.poll() is not None:
            raise AssertionError(f"the box ended before it wrote {name}: {proc.communicate()}")
        assert time.monotonic() < deadline, f"no staged run wrote {name}"
        time.sleep(0.1)


def test_a_host_edit_during_a_container_run_is_a_conflict_and_survives_apply(csandbox: Sandbox) -> None:
    s = csandbox
    (s.workdir / "a.txt").write_text("original\n")
    (s.workdir / "b.txt").write_text("b original\n")
    known = {r["run"] for r in runs(s)}
    proc = _cstart(s, f"echo box > a.txt; echo box > b.txt; {WAIT_GO}; echo ended")
    try:
        run = _wait_upper(s, known, "b.txt", proc)
        (s.workdir / "a.txt").write_text("the user's edit\n")  # the user keeps working meanwhile
        _go(proc)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "ended" in out, err[-3000:]
    changes = by_path(receipt(s, run))
    assert changes["a.txt"].get("conflict") and not changes["b.txt"].get("conflict"), changes
    applied = s.relay("apply", run)
    assert applied.returncode == 1 and "conflict" in applied.stdout, applied.stdout + applied.stderr
    assert (s.workdir / "a.txt").read_text() == "the user's edit\n"  # never overwritten
    assert (s.workdir / "b.txt").read_text() == "box\n"  # the twin: the rest applied
    assert "a.txt" in by_path(receipt(s, run))  # the box's version is still staged


def test_two_container_boxes_on_one_checkout_do_not_see_each_other(csandbox: Sandbox) -> None:
    s = csandbox
    (s.workdir / "shared.txt").write_text("base\n")
    known = {r["run"] for r in runs(s)}
    one = _cstart(s, f"echo one > shared.txt; echo one > one.txt; {WAIT_GO}; cat shared.txt; ls")
    try:
        run1 = _wait_upper(s, known, "one.txt", one)
        two = _cstart(s, "cat shared.txt; ls; echo two > shared.txt; echo two > two.txt")
        out2, err2 = two.communicate(timeout=600)
        _go(one)
        out1, err1 = one.communicate(timeout=300)
    finally:
        if one.poll() is None:
            one.kill()
    assert one.returncode == 0 and two.returncode == 0, err1[-2000:] + err2[-2000:]
    two_boxes_saw_only_their_own(s, known, run1, out1, out2)
