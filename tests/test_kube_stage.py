"""kube mode's patches become staged runs (relay/trust/kube_stage.py), reviewed and applied with the same
`changes`/`diff`/`apply` as local mode's layers. Real git, real files; no cluster is needed for
this part (the patches are what a box pod prints: tests/test_kube_podman.py makes them for real).

Attack and twin: a patch that reaches into `.git`, out of the checkout or through a symlink is
refused by git's own path checks and stages nothing; a planted Makefile target or npm script is
flagged and left out by `--skip-flagged`, and afterwards plain `make` and `npm run` on the host run
nothing planted; the user's uncommitted edit, a host edit during the run, and the second of two
boxes' edits to one path are conflicts that apply never overwrites; ordinary edits land.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from relay.config.load import get_backend, load_matrix
from relay.host.fs_view import HostFs
from relay.host.probe import probe
from relay.modes.kube_run import BoxResult, stage_results
from relay.plan.resolve import Request, resolve
from relay.trust import changes, kube_stage, staged

REPO = Path(__file__).resolve().parent.parent


def _git(work: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(work), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          capture_output=True, text=True, check=check)


@pytest.fixture()
def checkout(tmp_path: Path) -> Path:
    work = tmp_path / "checkout"
    work.mkdir()
    _git(work, "init", "-q")
    (work / "README.md").write_text("hello\n")
    (work / "keep.txt").write_text("the user's\n")
    (work / "gone.txt").write_text("to delete\n")
    (work / "Makefile").write_text("all:\n\t@echo built\n")
    (work / "package.json").write_text('{"name": "x", "scripts": {"test": "echo tested"}}\n')
    (work / "dir").mkdir()
    (work / "dir" / "inner.txt").write_text("inner\n")
    _git(work, "add", "-A")
    _git(work, "commit", "-qm", "init")
    return work


def _box_patch(checkout: Path, tmp_path: Path, name: str, edit) -> bytes:  # noqa: ANN001 - a callable on a Path
    """What a box pod prints: its clone's `git diff --cached --binary --full-index BASE` after the edit."""
    clone = tmp_path / f"clone-{name}"
    subprocess.run(["git", "clone", "-q", str(checkout), str(clone)], check=True)
    base = _git(clone, "rev-parse", "HEAD").stdout.strip()
    edit(clone)
    _git(clone, "add", "-A")
    return subprocess.run(["git", "-C", str(clone), "diff", "--cached", "--binary", "--full-index", base],
                          capture_output=True, check=True).stdout


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HOME": str(tmp_path / "home"), "XDG_STATE_HOME": str(tmp_path / "state")}


def _plan(checkout: Path, env: dict[str, str]):  # noqa: ANN202 - plan.Plan
    matrix = load_matrix(env, workdir=None)
    req = Request("shell", mode="kube", workdir=str(checkout), run_id="kst-1-abc", prompt="x")
    return resolve(get_backend(matrix, "shell"), matrix, req, probe(env), env, fs=HostFs())


def _stage(checkout: Path, tmp_path: Path, patches: list[bytes]) -> tuple[dict[str, str], list]:
    env = _env(tmp_path)
    base = _git(checkout, "rev-parse", "HEAD").stdout.strip()
    ctime = kube_stage.stamp_ctime(env)
    plan = _plan(checkout, env)
    results = [BoxResult(i, p, 0) for i, p in enumerate(patches)]
    return env, stage_results(plan, f"kst-{os.getpid()}-{os.urandom(3).hex()}", base, ctime, results, env)


def _edit(clone: Path) -> None:
    (clone / "README.md").write_text("hello\nfrom the box\n")
    (clone / "new.txt").write_text("new\n")
    (clone / "gone.txt").unlink()
    (clone / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    (clone / "tool.sh").chmod(0o755)
    (clone / "link").symlink_to("README.md")
    (clone / "blob.bin").write_bytes(bytes(range(256)) * 4)
    shutil.rmtree(clone / "dir")
    (clone / "dir").write_text("a file where a directory was\n")


def test_a_box_patch_is_staged_reviewed_and_applied_like_a_local_run(checkout: Path, tmp_path: Path) -> None:
    patch = _box_patch(checkout, tmp_path, "a", _edit)
    env, [out] = _stage(checkout, tmp_path, [patch])
    assert out.error is None and out.run and out.run.endswith("-0"), out
    before = _git(checkout, "status", "--porcelain").stdout
    assert before == ""  # staging wrote nothing into the checkout
    run = staged.find(env, out.run)
    assert run.meta["mode"] == "kube" and run.meta["base_commit"] == _git(checkout, "rev-parse", "HEAD").stdout.strip()
    kinds = {e.path: e.kind for e in changes.review(run).entries}
    assert kinds["README.md"] == "modified" and kinds["new.txt"] == "added" and kinds["gone.txt"] == "deleted"
    assert kinds["tool.sh"] == "added" and kinds["link"] == "symlink" and kinds["blob.bin"] == "added"
    assert kinds["dir"] == "modified", kinds  # a file where a directory was
    flagged = {e.path for e in changes.review(run).entries if e.flagged}
    assert "tool.sh" in flagged  # a new executable runs later
    # The same commands as local mode's, from the real entry point.
    cli = [sys.executable, "-m", "relay"]
    listed = json.loads(subprocess.run([*cli, "changes", "--json"], capture_output=True, text=True, env=env, cwd=REPO,
                                       check=True).stdout)
    assert [r["run"] for r in listed] == [out.run] and listed[0]["files"] >= 7
    diff = subprocess.run([*cli, "diff", out.run, "README.md"], capture_output=True, text=True, env=env, cwd=REPO,
                          check=True).stdout
    assert "+from the box" in diff
    proc = subprocess.run([*cli, "apply", out.run, "--skip-flagged"], capture_output=True, text=True, env=env,
                          cwd=REPO)
    assert proc.returncode == 1 and "kept staged 2" in proc.stdout, proc.stdout + proc.stderr  # tool.sh and link
    assert (checkout / "README.md").read_text() == "hello\nfrom the box\n"
    assert (checkout / "new.txt").read_text() == "new\n" and not (checkout / "gone.txt").exists()
    assert (checkout / "blob.bin").read_bytes() == bytes(range(256)) * 4
    assert not (checkout / "tool.sh").exists()  # flagged: still staged
    left = {e.path for e in changes.review(staged.find(env, out.run)).entries}
    assert "tool.sh" in left and "README.md" not in left
    receipt = json.loads(subprocess.run([*cli, "changes", out.run, "--json"], capture_output=True, text=True, env=env,
                                        cwd=REPO, check=True).stdout)
    assert any(a["path"] == "README.md" for a in receipt.get("applied", [])), receipt


def test_the_users_uncommitted_work_and_a_host_edit_during_the_run_are_conflicts(checkout: Path,
                                                                                 tmp_path: Path) -> None:
    (checkout / "keep.txt").write_text("the user's uncommitted edit\n")  # before the launch: not in the commit
    patch = _box_patch(checkout, tmp_path, "a", lambda c: [(c / "keep.txt").write_text("box\n"),
                                                            (c / "README.md").write_text("box readme\n"),
                                                            (c / "other.txt").write_text("box other\n")])
    env = _env(tmp_path)
    base = _git(checkout, "rev-parse", "HEAD").stdout.strip()
    ctime = kube_stage.stamp_ctime(env)
    (checkout / "other.txt").write_text("the user made this during the run\n")
    [out] = stage_results(_plan(checkout, env), "kst-2-abc", base, ctime, [BoxResult(0, patch, 0)], env)
    run = staged.find(env, out.run)
    conflicts = {e.path: e.conflict for e in changes.review(run).entries if e.conflict}
    assert set(conflicts) == {"keep.txt", "other.txt"}, conflicts
    done, held = changes.apply(run)
    assert [e.path for e in done] == ["README.md"]
    assert (checkout / "keep.txt").read_text() == "the user's uncommitted edit\n"
    assert (checkout / "other.txt").read_text() == "the user made this during the run\n"
    assert (checkout / "README.md").read_text() == "box readme\n"  # the twin: the clean path landed
    assert {e.path for e, _ in held} == {"keep.txt", "other.txt"}


def test_two_boxes_one_path_the_second_apply_is_a_conflict(checkout: Path, tmp_path: Path) -> None:
    p0 = _box_patch(checkout, tmp_path, "0", lambda c: [(c / "README.md").write_text("box 0\n"),
                                                         (c / "zero.txt").write_text("0\n")])
    p1 = _box_patch(checkout, tmp_path, "1", lambda c: [(c / "README.md").write_text("box 1\n"),
                                                         (c / "one.txt").write_text("1\n")])
    env, outs = _stage(checkout, tmp_path, [p0, p1, b""])
    assert [o.run is not None for o in outs] == [True, True, False]  # an empty patch stages nothing
    first, second = (staged.find(env, o.run) for o in outs[:2])
    changes.apply(first)
    done, held = changes.apply(second)
    assert [e.path for e in done] == ["one.txt"] and [e.path for e, _ in held] == ["README.md"]
    assert (checkout / "README.md").read_text() == "box 0\n"
    assert (checkout / "one.txt").read_text() == "1\n" and (checkout / "zero.txt").read_text() == "0\n"


def test_planted_hooks_are_flagged_and_after_skip_flagged_nothing_planted_runs_on_the_host(checkout: Path,
                                                                                           tmp_path: Path) -> None:
    marker = tmp_path / "PLANTED"

    def plant(c: Path) -> None:
        (c / "Makefile").write_text(f"all:\n\t@touch {marker}; echo built\n")
        (c / "package.json").write_text(json.dumps({"name": "x", "scripts": {"test": f"touch {marker}"}}) + "\n")
        (c / "src.txt").write_text("an ordinary edit\n")

    env, [out] = _stage(checkout, tmp_path, [_box_patch(checkout, tmp_path, "p", plant)])
    run = staged.find(env, out.run)
    flagged = {e.path for e in changes.review(run).entries if e.flagged}
    assert {"Makefile", "package.json"} <= flagged and "src.txt" not in flagged
    changes.apply(run, skip_flagged=True)
    assert (checkout / "src.txt").read_text() == "an ordinary edit\n"
    if shutil.which("make"):
        assert "built" in subprocess.run(["make", "-C", str(checkout)], capture_output=True, text=True).stdout
    if shutil.which("npm"):
        subprocess.run(["npm", "test", "--prefix", str(checkout)], capture_output=True, text=True, timeout=120)
    assert not marker.exists()


@pytest.mark.parametrize("evil", ["dotgit", "dotdot", "absolute", "through-symlink"])
def test_a_patch_that_reaches_out_stages_nothing(checkout: Path, tmp_path: Path, evil: str) -> None:
    (checkout / "sym").symlink_to("/tmp")
    _git(checkout, "add", "sym")
    _git(checkout, "commit", "-qm", "sym")
    target = {"dotgit": ".git/hooks/pre-commit", "dotdot": "../escaped", "absolute": "/tmp/escaped",
              "through-symlink": "sym/escaped"}[evil]
    patch = (f"diff --git a/{target} b/{target}\nnew file mode 100755\n--- /dev/null\n+++ b/{target}\n"
             "@@ -0,0 +1 @@\n+#!/bin/sh\n").encode()
    env, [out] = _stage(checkout, tmp_path, [patch])
    assert out.run is None and out.error and "does not apply" in out.error, out
    assert not (tmp_path / "escaped").exists() and not (checkout / ".git" / "hooks" / "pre-commit").exists()
    assert staged.runs(env) == []


def test_the_upper_layer_holds_only_what_changed(checkout: Path, tmp_path: Path) -> None:
    for i in range(200):
        (checkout / f"f{i}.txt").write_text(f"{i}\n")
    _git(checkout, "add", "-A")
    _git(checkout, "commit", "-qm", "many")
    env, [out] = _stage(checkout, tmp_path, [_box_patch(checkout, tmp_path, "x",
                                                         lambda c: (c / "f7.txt").write_text("seven\n"))])
    upper = Path(staged.find(env, out.run).layer.upper)
    files = [p.relative_to(upper).as_posix() for p in upper.rglob("*") if not p.is_dir()]
    assert files == ["f7.txt"]
    assert stat.S_IMODE((upper / "f7.txt").stat().st_mode) & 0o7000 == 0


def test_the_bundle_writes_nothing_into_the_users_repository(checkout: Path, tmp_path: Path) -> None:
    """The bundle's refs live in a scratch repository that borrows the user's objects: afterwards
    the user's refs, index and status are exactly as before (no snapshot ref, even for a moment a
    kill -9 could catch), and the bundle still carries the snapshot (a clone has the untracked file)."""
    from relay.modes.kube_run import SNAPSHOT_REF, make_bundle

    (checkout / "README.md").write_text("hello\nuncommitted\n")
    (checkout / "untracked.txt").write_text("untracked\n")

    def state() -> tuple[str, str, str, bytes]:
        return (_git(checkout, "for-each-ref").stdout, _git(checkout, "rev-parse", "HEAD").stdout,
                _git(checkout, "status", "--porcelain").stdout, (checkout / ".git" / "index").read_bytes())

    before = state()
    bundle = make_bundle(str(checkout))
    assert state() == before
    assert SNAPSHOT_REF.encode() in bundle.split(b"PACK", 1)[0]
    clone = tmp_path / "clone"
    (tmp_path / "b.bundle").write_bytes(bundle)
    subprocess.run(["git", "clone", "-q", str(tmp_path / "b.bundle"), str(clone)], check=True, capture_output=True)
    snap = kube_stage.bundle_head(bundle)
    shown = _git(clone, "show", f"{snap}:untracked.txt").stdout
    assert shown == "untracked\n" and _git(clone, "show", f"{snap}:README.md").stdout == "hello\nuncommitted\n"
    assert _git(clone, "rev-parse", "HEAD").stdout.strip() == _git(checkout, "rev-parse", "HEAD").stdout.strip()


def test_line_ending_conversion_is_not_a_conflict_but_a_real_edit_is(checkout: Path, tmp_path: Path) -> None:
    """With core.autocrlf the checkout's bytes (CRLF) differ from the commit's blob (LF): review
    compares what git would store, so the box's edit is no false conflict; the twin, the user's real
    uncommitted edit of another such file, still is one."""
    _git(checkout, "config", "core.autocrlf", "true")
    (checkout / "crlf.txt").write_bytes(b"one\r\ntwo\r\n")
    (checkout / "mine.txt").write_bytes(b"mine\r\n")
    _git(checkout, "add", "crlf.txt", "mine.txt")
    _git(checkout, "commit", "-qm", "crlf")
    assert _git(checkout, "status", "--porcelain").stdout == ""

    def edit(c: Path) -> None:
        (c / "crlf.txt").write_bytes(b"one\r\ntwo\r\nthree\r\n")
        (c / "mine.txt").write_bytes(b"box\r\n")

    patch = _box_patch(checkout, tmp_path, "c", edit)
    (checkout / "mine.txt").write_bytes(b"the user's edit\r\n")
    env, [out] = _stage(checkout, tmp_path, [patch])
    conflicts = {e.path: e.conflict for e in changes.review(staged.find(env, out.run)).entries}
    assert conflicts["crlf.txt"] is None and conflicts["mine.txt"], conflicts
