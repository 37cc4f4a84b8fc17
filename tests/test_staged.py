"""The staged workdir without a box: the plan's choice (and refusals), the config key, and the
host side of apply against a layer written by hand the way a hostile box could leave it."""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import replace
from pathlib import Path

import pytest

from relay.config.load import load_matrix, load_shipped
from relay.model.backend import Matrix
from relay.model.errors import ConfigError, RefusedError, UsageError
from relay.plan.resolve import Request, resolve
from relay.trust import changes, staged
from relay.ui import changes_text

from .fakefs import WORKDIR, fake_host, no_host_io
from .test_plan_golden import ENV, PROCESS, SUPERVISED, fake_checkout  # noqa: F401 - fixture


def _resolve(request: Request, facts=SUPERVISED, matrix: Matrix | None = None):  # noqa: ANN001, ANN202
    backends = load_shipped()
    matrix = matrix or Matrix(backends=backends, profiles={}, allow_unsandboxed=frozenset(), sources=())
    with no_host_io() as attempted:
        plan = resolve(backends["shell"], matrix, replace(request, backend="shell", workdir=WORKDIR, run_id="1-t"),
                       facts, dict(ENV), fs=fake_host(), now=0)
    assert attempted == []
    return plan


def test_staged_is_the_default_and_shown_in_the_plan(fake_checkout: None) -> None:  # noqa: F811
    plan = _resolve(Request(""))
    data = plan.to_json()
    assert data["workdir_mode"] == "staged" and data["staged"]["run"] == "1-t"
    assert data["staged"]["root"].endswith("/.local/state/hive-relay/staged/1-t")
    assert _resolve(Request("", staged=True)).to_json() == data  # --staged says the default out loud
    live = _resolve(Request("", live=True))
    assert live.workdir_mode == "live" and live.staged is None
    assert live.to_json()["workdir_mode"] == "live" and "staged" not in live.to_json()
    assert plan.profile_digest != live.profile_digest  # the policy says which mode it is
    # The same mounts: the overlay is mounted under them, at the workdir's own path. The masks'
    # placeholders in the workdir are made in the layer (by bwrap), not in the checkout.
    assert plan.mounts == live.mounts
    inside = [p for p in live.placeholders if p.startswith(WORKDIR + "/")]
    assert inside and not [p for p in plan.placeholders if p.startswith(WORKDIR + "/")]
    assert list(plan.staged.placeholders) == inside


def test_tiers_without_a_mount_namespace_and_other_modes_refuse(fake_checkout: None) -> None:  # noqa: F811
    for staged_flag in (True, False):  # asked for, or the default: refused either way, never quietly live
        for request, facts in ((Request("", staged=staged_flag, profile="default"), PROCESS),
                               (Request("", staged=staged_flag, isolation="process", profile="default"), SUPERVISED),
                               (Request("", staged=staged_flag, mode="container"),
                                replace(SUPERVISED, podman=None, docker="/usr/bin/docker"))):
            with pytest.raises(RefusedError) as err:
                _resolve(request, facts)
            assert err.value.exit_code == 3 and "; fix: " in err.value.message and "\n" not in err.value.message
            assert err.value.message.startswith("--staged: " if staged_flag else "staged (the default): ")
            assert ("--live" in err.value.message) is not staged_flag  # the way past, when it is the default
    live = _resolve(Request("", live=True, isolation="process", profile="default"), SUPERVISED)
    assert live.workdir_mode == "live"


def test_live_and_its_companions_are_checked(fake_checkout: None) -> None:  # noqa: F811
    for request, words in ((Request("", live=True, staged=True), "contradict"),
                           (Request("", live=True, apply=True), "--apply"),
                           (Request("", shared_live=True), "--shared-live"),
                           (Request("", mode="kube", live=True), "kube")):
        with pytest.raises(UsageError) as err:
            _resolve(request)
        assert err.value.exit_code == 2 and words in err.value.message and "fix:" in err.value.message
    assert _resolve(Request("", live=True, shared_live=True)).to_json()["shared_live"] is True
    forced = Matrix(backends=load_shipped(), profiles={}, allow_unsandboxed=frozenset(), sources=(),
                    workdir_mode="staged", workdir_forced="/w/.hive-relay.yaml")
    with pytest.raises(RefusedError) as refused:
        _resolve(Request("", live=True), matrix=forced)
    assert refused.value.exit_code == 3 and "/w/.hive-relay.yaml" in refused.value.message
    user_live = Matrix(backends=load_shipped(), profiles={}, allow_unsandboxed=frozenset(), sources=(),
                       workdir_mode="live")
    assert _resolve(Request(""), matrix=user_live).workdir_mode == "live"
    assert _resolve(Request("", staged=True), matrix=user_live).workdir_mode == "staged"  # the flag wins


def test_container_mode_stages_through_podman_overlay_volumes(fake_checkout: None) -> None:  # noqa: F811
    """The workdir and each writable bind inside it become `:O,upperdir=` volumes whose upper dirs
    are the places in the one upper layer (the layout local mode's review and git apply read)."""
    live = _resolve(Request("", mode="container", live=True))
    plan = _resolve(Request("", mode="container"))  # staged: the default
    assert plan.workdir_mode == "staged" and plan.mounts == live.mounts
    assert plan.staged is not None
    up, work = plan.staged.upper, plan.staged.work
    volumes = [a for a in plan.command if ":O," in a]
    assert volumes[0] == f"{WORKDIR}:{WORKDIR}:O,upperdir={up},workdir={work}"
    for v in volumes[1:]:
        src, dst, opts = v.split(":", 2)
        assert src == dst and src.startswith(WORKDIR + "/")
        assert opts.startswith(f"O,upperdir={up}/{os.path.relpath(dst, WORKDIR)},workdir={work}-")
    # Nothing writable from the host's side inside the workdir is left a plain bind.
    plain = [a for a in plan.command if a.startswith(WORKDIR + "/") and a.endswith(":rw")]
    assert plain == []


def test_the_config_key_and_a_repo_may_only_force_staged(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    work = tmp_path / "work"
    work.mkdir()
    env = {"HOME": str(tmp_path), "HIVE_RELAY_CONFIG": str(cfg)}
    assert load_matrix({"HOME": str(tmp_path)}, work).workdir_mode == "staged"  # the default, no config at all
    cfg.write_text("workdir: staged\n")
    assert load_matrix(env, work).workdir_mode == "staged"
    cfg.write_text("workdir: live\n")
    assert load_matrix(env, work).workdir_mode == "live"
    (work / ".hive-relay.yaml").write_text("workdir: staged\n")
    assert load_matrix(env, work).workdir_mode == "staged"  # the repo narrows the box
    assert load_matrix(env, work).workdir_forced == str(work / ".hive-relay.yaml")
    (work / ".hive-relay.yaml").write_text("workdir: live\n")
    with pytest.raises(ConfigError) as err:
        load_matrix(env, work)
    assert "workdir" in err.value.message and "fix:" in err.value.message


# ---- the host side of apply -------------------------------------------------------------------

def _run(tmp_path: Path, protected: tuple[str, ...] = ()) -> tuple[staged.Run, Path, Path]:
    """A staged run whose upper layer the test writes as a box would leave it."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    env = {"HOME": str(tmp_path / "home")}
    layer = staged.for_run(env, f"{os.getpid()}-1-x-{os.urandom(2).hex()}")
    staged.create(layer, str(work), {"backend": "shell", "protected": [str(work / p) for p in protected],
                                     "profile_digest": "d"})
    return staged.find(env, layer.run), work, Path(layer.upper)


def test_apply_lands_edits_by_rename_cuts_modes_and_keeps_the_rest(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "a.txt").write_text("a\n")
    (tmp_path / "work" / "keep.txt").write_text("k\n")
    time.sleep(0.02)
    run, work, upper = _run(tmp_path)
    (upper / "a.txt").write_text("a2\n")
    (upper / "tool").write_text("#!/bin/sh\n")
    os.chmod(upper / "tool", 0o6755)
    (upper / "keep.txt").write_text("k2\n")
    (upper / "deep" / "er").mkdir(parents=True)
    (upper / "deep" / "er" / "x").write_text("x\n")
    rv = {e.path: e for e in changes.review(run).entries}
    assert set(rv) == {"a.txt", "tool", "keep.txt", "deep/er/x"}
    assert rv["tool"].flags and not rv["a.txt"].flags
    done, held = changes.apply(run, ["a.txt", "tool", "deep"])
    assert {e.path for e in done} == {"a.txt", "tool", "deep/er/x"} and not held
    assert (work / "a.txt").read_text() == "a2\n" and (work / "deep" / "er" / "x").read_text() == "x\n"
    assert stat.S_IMODE((work / "tool").stat().st_mode) == 0o755  # no setuid/setgid ever lands
    assert (work / "keep.txt").read_text() == "k\n"
    assert [e.path for e in changes.review(run).entries] == ["keep.txt"]  # the rest stays staged
    assert not (upper / "deep").exists()
    # Re-run after an interruption between the rename and the drop: same result, nothing new.
    (upper / "a.txt").write_text("a2\n")
    assert [e.path for e in changes.review(run).entries] == ["keep.txt"]
    rec = changes.receipt(run)
    assert {a["path"] for a in rec["applied"]} == {"a.txt", "tool", "deep/er/x"}
    assert all(a["by"] and a["at"] and a.get("sha256") for a in rec["applied"])
    assert rec["profile_digest"] == "d" and rec["base"]["ctime_ns"] > 0
    assert changes.discard(run, ["keep.txt"]) == ["keep.txt"] and changes.review(run).entries == []


def test_apply_follows_no_host_link_and_writes_no_protected_path(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "work").mkdir()
    os.symlink(outside, tmp_path / "work" / "sub")  # the host's own link, in the way
    run, work, upper = _run(tmp_path, protected=(".envrc",))
    (upper / "sub").mkdir()
    (upper / "sub" / "x").write_text("through the link\n")
    (upper / ".envrc").write_text("export EVIL=1\n")
    done, held = changes.apply(run)
    assert not done and os.listdir(outside) == []
    why = {e.path: w for e, w in held}
    assert why[".envrc"].startswith("protected") and not (work / ".envrc").exists()
    assert any(p.startswith("sub") for p in why)


def test_a_link_is_recreated_never_followed_and_specials_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE\n")
    run, work, upper = _run(tmp_path)
    os.symlink(str(secret), upper / "key")
    os.mkfifo(upper / "pipe")
    rv = {e.path: e for e in changes.review(run).entries}
    assert rv["key"].kind == "symlink" and rv["key"].flags and rv["pipe"].refused
    done, held = changes.apply(run)
    assert [e.path for e in done] == ["key"] and [e.path for e, _ in held] == ["pipe"]
    assert os.readlink(work / "key") == str(secret) and not (work / "pipe").exists()


def test_whiteouts_delete_and_a_host_edit_is_a_conflict(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    for name in ("gone.txt", "edited.txt"):
        (tmp_path / "work" / name).write_text("host\n")
    run, work, upper = _run(tmp_path)
    (upper / "edited.txt").write_text("box\n")
    (work / "edited.txt").write_text("the user's\n")  # after the stamp: during the run
    if os.getuid() == 0:  # a whiteout is a 0/0 character device; only root makes one by hand
        os.mknod(upper / "gone.txt", stat.S_IFCHR | 0o600, 0)
    rv = {e.path: e for e in changes.review(run).entries}
    assert rv["edited.txt"].conflict
    done, held = changes.apply(run)
    assert (work / "edited.txt").read_text() == "the user's\n" and [e.path for e, _ in held] == ["edited.txt"]
    if os.getuid() == 0:
        assert rv["gone.txt"].kind == "deleted" and not (work / "gone.txt").exists()


def test_diff_is_plain_off_a_terminal_and_names_binaries(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "t.txt").write_text("one\n")
    run, work, upper = _run(tmp_path)
    (upper / "t.txt").write_text("two\n")
    (upper / "b.bin").write_bytes(b"\0\1\2")
    text = "".join(changes_text.diff_text(run))
    assert "-one\n+two\n" in text and "Binary files a/b.bin and b/b.bin differ" in text and "\x1b[" not in text
    env = {"HOME": str(tmp_path / "home")}
    assert changes_text.changes_main(run.layer.run, as_json=True, env=env) == 0
    assert {c["path"] for c in json.loads(capsys.readouterr().out)["changes"]} == {"t.txt", "b.bin"}


def test_apply_at_exit_needs_a_staged_run(fake_checkout: None) -> None:  # noqa: F811
    from relay.model.errors import UsageError

    with pytest.raises(UsageError):
        _resolve(Request("", apply=True, live=True))
    assert _resolve(Request("", apply=True)).to_json()["staged"]["apply_at_exit"] is True
    assert _resolve(Request("", staged=True, apply=True)).to_json()["staged"]["apply_at_exit"] is True


def test_a_nested_git_dir_the_box_made_is_refused(tmp_path: Path) -> None:
    run, work, upper = _run(tmp_path)
    (upper / "vendor" / "lib" / ".git" / "hooks").mkdir(parents=True)
    (upper / "vendor" / "lib" / ".git" / "config").write_text("[core]\n\tfsmonitor = touch /tmp/x\n")
    (upper / "vendor" / "lib" / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\n")
    (upper / "vendor" / "lib" / "code.py").write_text("x = 1\n")
    done, held = changes.apply(run)
    assert [e.path for e in done] == ["vendor/lib/code.py"]
    assert not (work / "vendor" / "lib" / ".git").exists() and held
