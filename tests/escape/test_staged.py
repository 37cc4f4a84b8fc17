"""The staged workdir (issue 25), with real boxes: the box writes freely, the checkout stays as it
was until the user applies from the host, and apply trusts nothing the box wrote.

Attacks: the box plants what runs on the host later (package.json scripts, a Makefile recipe, a
husky hook, a .pth in a venv inside the checkout, an executable), a symlink to the user's SSH key,
a FIFO; the proof is FROM THE HOST: before apply the checkout is byte-for-byte unchanged, and after
`apply --skip-flagged` plain `make`, `npm run`, the venv's `python` run nothing planted. Twins:
ordinary source edits apply cleanly. Faults: a host edit during the run is a conflict and survives;
two boxes on one checkout; `kill -9` of the launcher leaves the layer reviewable across the next
launch's sweep and `clean`.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import Sandbox, have


def snapshot(root: Path) -> dict[str, tuple[str, int, bytes | str]]:
    """Every entry under root (no link followed): kind, mode and content or link target."""
    out: dict[str, tuple[str, int, bytes | str]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", 0, os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", st.st_mode & 0o7777, p.read_bytes())
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", st.st_mode & 0o7777, b"")
            else:
                out[rel] = ("special", st.st_mode, b"")
    return out


def runs(s: Sandbox) -> list[dict]:
    r = s.relay("changes", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def staged_box(s: Sandbox, script: str, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    before = {r["run"] for r in runs(s)}
    r = s.box(script, "shell", "--staged", *args)
    new = [x["run"] for x in runs(s) if x["run"] not in before]
    assert len(new) == 1, (r.stdout, r.stderr)
    return r, new[0]


def receipt(s: Sandbox, run: str) -> dict:
    r = s.relay("changes", run, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def by_path(rec: dict) -> dict[str, dict]:
    return {c["path"]: c for c in rec["changes"]}


PLANT = r"""
set -e
printf '%s\n' '{"name":"p","version":"1.0.0","scripts":{"test":"touch MARK/npm-ran","postinstall":"touch MARK/npm-ran"}}' > package.json
printf 'all:\n\ttouch MARK/make-ran\n' > Makefile
mkdir -p .husky && printf '#!/bin/sh\ntouch MARK/husky-ran\n' > .husky/pre-commit && chmod +x .husky/pre-commit
printf 'import os; open("MARK/pth-ran", "w")\n' > venv/lib/PYVER/site-packages/evil.pth
mkdir -p build && printf '#!/bin/sh\ntouch MARK/exe-ran\n' > build/tool && chmod 4755 build/tool
printf 'print("v2")\n' > src/app.py
printf 'new module\n' > src/new.py
rm src/old.py
echo done
"""


@pytest.fixture
def checkout(box: Sandbox) -> Sandbox:
    w = box.workdir
    (w / "src").mkdir()
    (w / "src" / "app.py").write_text('print("v1")\n')
    (w / "src" / "old.py").write_text("old\n")
    (w / "package.json").write_text('{"name":"p","version":"1.0.0","scripts":{"test":"echo ok"}}\n')
    (w / "Makefile").write_text("all:\n\t@echo ok\n")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(w / "venv")], check=True)
    return box


def _pyver() -> str:
    return f"python{sys.version_info.major}.{sys.version_info.minor}"


def test_planted_runs_later_files_never_reach_the_host_and_source_edits_apply(checkout: Sandbox, report) -> None:
    s = checkout
    mark = s.root / "marks"
    mark.mkdir()
    mark.chmod(0o777)
    before = snapshot(s.workdir)
    r, run = staged_box(s, PLANT.replace("MARK", str(mark)).replace("PYVER", _pyver()))
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert snapshot(s.workdir) == before  # nothing of the box's is live before apply
    report.attack(True)
    changes = by_path(receipt(s, run))
    for planted in ("package.json", "Makefile", ".husky/pre-commit", f"venv/lib/{_pyver()}/site-packages/evil.pth",
                    "build/tool"):
        assert changes[planted]["flags"], planted
        report.attack(True)
    assert not changes.get("src/app.py", {}).get("flags") and changes["src/old.py"]["kind"] == "deleted"
    listing = s.relay("changes", run)
    assert "flagged package-scripts" in listing.stdout and "flagged executable" in listing.stdout
    applied = s.relay("apply", run, "--skip-flagged")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    # The twin: ordinary source edits landed, quietly.
    assert (s.workdir / "src" / "app.py").read_text() == 'print("v2")\n'
    assert (s.workdir / "src" / "new.py").read_text() == "new module\n"
    assert not (s.workdir / "src" / "old.py").exists()
    report.legit(True)
    # From the host: plain make, npm run and the venv's python run nothing planted.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(s.home)}
    assert subprocess.run(["make", "-s"], cwd=s.workdir, env=env, capture_output=True, text=True).stdout == "ok\n"
    if have("npm"):
        subprocess.run(["npm", "run", "test", "--silent"], cwd=s.workdir, env=env, capture_output=True, timeout=120)
    subprocess.run([str(s.workdir / "venv" / "bin" / "python"), "-c", "pass"], cwd=s.workdir, env=env, check=True)
    assert not (s.workdir / "build").exists() and not (s.workdir / ".husky").exists()
    assert sorted(os.listdir(mark)) == []
    report.attack(True)
    # The flagged entries are still staged, reviewable, and can be discarded.
    left = by_path(receipt(s, run))
    assert set(left) >= {"package.json", "Makefile", ".husky/pre-commit", "build/tool"}
    assert s.relay("discard", run).returncode == 0
    assert run not in {x["run"] for x in runs(s)}


def test_a_box_made_link_to_the_ssh_key_lands_as_a_link_and_a_fifo_is_refused(box: Sandbox, report) -> None:
    s = box
    key = s.home / ".ssh" / "id_rsa"
    r, run = staged_box(s, f"ln -s {key} key; ln -s ../../{key.relative_to('/')} rel; mkfifo pipe; mknod dev c 1 3 "
                           "2>/dev/null; echo ok")
    assert r.returncode == 0, r.stderr
    changes = by_path(receipt(s, run))
    assert changes["key"]["kind"] == "symlink" and changes["key"]["flags"]
    assert changes["pipe"]["refused"]
    applied = s.relay("apply", run)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert os.readlink(s.workdir / "key") == str(key) and (s.workdir / "key").is_symlink()
    assert not (s.workdir / "pipe").exists() and not (s.workdir / "dev").exists()
    for entry in snapshot(s.workdir).values():
        assert entry[0] != "special"
        assert not (entry[0] == "file" and b"PRIVATE-KEY" in entry[2])  # type: ignore[operator]
    report.attack(True)


def _wait_for(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _layer(s: Sandbox, run: str) -> Path:
    return s.home / ".local" / "state" / "hive-relay" / "staged" / run


def _start(s: Sandbox, script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "relay", "shell", "local", "--quiet", "--staged", "--prompt",
                             script], cwd=s.workdir, env=s.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _go(proc: subprocess.Popen) -> None:
    """Release a box waiting at WAIT_GO. Through its stdin, not a file in the checkout: a staged box
    caches the name's absence (an overlay's negative dentry), so a file the host makes there later
    may stay unseen for the rest of the run."""
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def _new_run(s: Sandbox, known: set[str], timeout: float = 120) -> str:
    root = s.home / ".local" / "state" / "hive-relay" / "staged"
    deadline = time.monotonic() + timeout
    while True:
        found = [p.name for p in root.glob("*") if p.name not in known and not p.name.endswith("-verify")
                 and (p / "upper").is_dir()] if root.exists() else []
        if found:
            return found[0]
        assert time.monotonic() < deadline, "no staged run appeared"
        time.sleep(0.05)


WAIT_GO = "read -r _go || true"


def test_a_host_edit_during_the_run_is_a_conflict_and_survives_apply(box: Sandbox, report) -> None:
    s = box
    (s.workdir / "a.txt").write_text("original\n")
    (s.workdir / "b.txt").write_text("b original\n")
    s.relay("shell", "--staged", "--prompt", "true", "--quiet")  # the first launch verifies the plan
    known = {p["run"] for p in runs(s)}
    proc = _start(s, f"echo box > a.txt; echo box > b.txt; {WAIT_GO}; echo ended")
    run = _new_run(s, known)
    _wait_for(_layer(s, run) / "upper" / "b.txt")
    (s.workdir / "a.txt").write_text("the user's edit\n")  # the user keeps working meanwhile
    _go(proc)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    changes = by_path(receipt(s, run))
    assert changes["a.txt"].get("conflict") and not changes["b.txt"].get("conflict")
    applied = s.relay("apply", run)
    assert applied.returncode == 1 and "conflict" in applied.stdout, applied.stdout + applied.stderr
    assert (s.workdir / "a.txt").read_text() == "the user's edit\n"  # never overwritten
    assert (s.workdir / "b.txt").read_text() == "box\n"  # the rest applied
    assert "a.txt" in by_path(receipt(s, run))  # the box's version is still staged
    assert s.relay("apply", run).returncode == 1 and (s.workdir / "a.txt").read_text() == "the user's edit\n"
    report.fault(True)


def two_boxes_saw_only_their_own(s: Sandbox, known: set[str], run1: str, out1: str, out2: str) -> None:
    """After two staged boxes shared one checkout (box one: `one`, box two: `two`, both over
    shared.txt): neither saw the other's writes, the checkout is untouched, each run holds its own
    two paths, and the second apply is a conflict on the shared one (the first apply changed it)."""
    assert out2.startswith("base\n") and "one.txt" not in out2, out2  # box two never saw box one's writes
    assert out1.startswith("one\n") and "two.txt" not in out1, out1
    assert (s.workdir / "shared.txt").read_text() == "base\n"
    run2 = next(r["run"] for r in runs(s) if r["run"] not in known | {run1})
    assert set(by_path(receipt(s, run1))) == {"shared.txt", "one.txt"}
    assert set(by_path(receipt(s, run2))) == {"shared.txt", "two.txt"}
    assert s.relay("apply", run1).returncode == 0
    second = s.relay("apply", run2)
    assert second.returncode == 1 and "conflict" in second.stdout
    assert (s.workdir / "shared.txt").read_text() == "one\n" and (s.workdir / "two.txt").read_text() == "two\n"


def test_two_staged_boxes_on_one_checkout_do_not_see_each_other(box: Sandbox, report) -> None:
    s = box
    (s.workdir / "shared.txt").write_text("base\n")
    s.relay("shell", "--staged", "--prompt", "true", "--quiet")
    known = {p["run"] for p in runs(s)}
    one = _start(s, f"echo one > shared.txt; echo one > one.txt; {WAIT_GO}; cat shared.txt; ls")
    run1 = _new_run(s, known)
    _wait_for(_layer(s, run1) / "upper" / "one.txt")
    two = _start(s, "cat shared.txt; ls; echo two > shared.txt; echo two > two.txt")
    out2, err2 = two.communicate(timeout=300)
    _go(one)
    out1, err1 = one.communicate(timeout=300)
    assert one.returncode == 0 and two.returncode == 0, err1 + err2
    two_boxes_saw_only_their_own(s, known, run1, out1, out2)
    report.fault(True)


def test_kill_9_of_the_launcher_leaves_the_layer_reviewable_across_sweep_and_clean(box: Sandbox, report) -> None:
    s = box
    s.relay("shell", "--staged", "--prompt", "true", "--quiet")
    known = {p["run"] for p in runs(s)}
    proc = _start(s, "echo work > kept.txt; sleep 600")
    run = _new_run(s, known)
    _wait_for(_layer(s, run) / "upper" / "kept.txt")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert not (s.workdir / "kept.txt").exists()
    # The next launch sweeps the dead launcher's leftovers; `clean` prunes caches: neither drops the layer.
    assert s.relay("shell", "--prompt", "true", "--quiet").returncode == 0
    assert s.relay("clean").returncode == 0
    rec = receipt(s, run)
    assert set(by_path(rec)) == {"kept.txt"} and rec["running"] is False
    assert s.relay("apply", run).returncode == 0 and (s.workdir / "kept.txt").read_text() == "work\n"
    report.fault(True)


def test_git_in_a_staged_box_leaves_the_host_repository_as_it_was(box: Sandbox, report) -> None:
    s = box
    git = ["git", "-C", str(s.workdir), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "init"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout
    before = snapshot(s.workdir / ".git")
    r, run = staged_box(s, "echo more >> README.md && git add -A && git -c user.email=b@b -c user.name=b commit -qm box "
                           "&& git log --oneline | wc -l")
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr
    assert snapshot(s.workdir / ".git") == before
    assert subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout == head
    rec = receipt(s, run)
    assert rec["git_entries"] > 0 and set(by_path(rec)) == {"README.md"}
    assert s.relay("apply", run, "README.md").returncode == 0
    assert snapshot(s.workdir / ".git") == before  # applying a path of the work tree never writes .git
    report.attack(True)
    applied = s.relay("apply", run)  # the whole run: its objects, its branch, its index
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert subprocess.run(git + ["log", "--format=%s"], capture_output=True, text=True).stdout == "box\ninit\n"
    assert subprocess.run(git + ["status", "--short"], capture_output=True, text=True).stdout == ""
    assert subprocess.run(git + ["fsck", "--no-dangling"], capture_output=True).returncode == 0
    report.legit(True)


def test_a_host_commit_during_the_run_puts_the_box_branch_aside(box: Sandbox, report) -> None:
    s = box
    git = ["git", "-C", str(s.workdir), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q", "-b", "main"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "init"], check=True)
    s.relay("shell", "--staged", "--prompt", "true", "--quiet")
    known = {p["run"] for p in runs(s)}
    proc = _start(s, "echo box > box.txt && git add box.txt && git -c user.email=b@b -c user.name=b commit -qm box "
                     f"&& touch committed; {WAIT_GO}")
    run = _new_run(s, known)
    _wait_for(_layer(s, run) / "upper" / "committed")
    (s.workdir / "host.txt").write_text("host\n")
    subprocess.run(git + ["add", "host.txt"], check=True)
    subprocess.run(git + ["commit", "-qm", "host"], check=True)  # the user commits meanwhile
    host_head = subprocess.run(git + ["rev-parse", "main"], capture_output=True, text=True).stdout.strip()
    _go(proc)
    assert proc.wait(timeout=300) == 0
    applied = s.relay("apply", run)
    assert f"refs/heads/hive-relay/{run}/main" in applied.stdout, applied.stdout + applied.stderr
    assert subprocess.run(git + ["rev-parse", "main"], capture_output=True, text=True).stdout.strip() == host_head
    aside = subprocess.run(git + ["log", "--format=%s", f"hive-relay/{run}/main"], capture_output=True, text=True)
    assert aside.stdout == "box\ninit\n"  # the box's work, whole, on its own branch
    report.fault(True)


def test_tiers_and_modes_without_a_staged_workdir_refuse(box: Sandbox, report) -> None:
    s = box
    r = s.relay("shell", "--isolation", "process", "--profile", "default", "--staged", "--prompt", "true", "--quiet")
    assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1, r.stderr  # (as root: refused earlier)
    assert os.getuid() == 0 or "--staged" in r.stderr
    report.attack(True)


def test_apply_at_exit_lands_source_edits_and_keeps_the_flagged_staged(box: Sandbox, report) -> None:
    s = box
    (s.workdir / "Makefile").write_text("all:\n\t@echo ok\n")
    r = s.box("echo edited >> README.md; printf 'all:\\n\\ttouch /tmp/never\\n' > Makefile", "shell", "--staged", "--apply")
    assert r.returncode == 0, r.stderr
    assert "applied 1 change(s) at exit" in r.stderr and "kept staged: Makefile" in r.stderr
    assert (s.workdir / "README.md").read_text().endswith("edited\n")
    assert (s.workdir / "Makefile").read_text() == "all:\n\t@echo ok\n"  # flagged: still only in the layer
    run = runs(s)[-1]["run"]
    assert set(by_path(receipt(s, run))) == {"Makefile"}
    report.attack(True)
    report.legit(True)
