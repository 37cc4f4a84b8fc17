"""The git dir allowlist's pure parts: the plan's mounts, the validators, the index's gitlinks."""

from __future__ import annotations

import subprocess
from pathlib import Path

from relay.trust.gitdir import gitlinks_in, validate

from .conftest import Sandbox
from .test_plan import plan_for

OID = "0123456789abcdef0123456789abcdef01234567"


def git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@e", "-c", "user.name=t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_the_plan_binds_a_private_git_dir_with_an_allowlist(sandbox: Sandbox) -> None:
    wd = sandbox.workdir
    git(wd, "init", "-q")
    plan = plan_for(sandbox, "shell")
    kinds = {m.dst: m.kind for m in plan.mounts}
    dot = f"{wd}/.git"
    assert kinds[dot] == "private-bind"
    assert all(kinds[f"{dot}/{d}"] == "bind" for d in ("objects", "refs"))
    assert all(kinds[f"{dot}/{f}"] == "ro-bind" for f in ("config", "hooks", "info", "description"))
    assert f"{dot}/HEAD" not in kinds  # a copy in the private dir: git renames HEAD.lock onto it
    assert f"{dot}/objects/info/alternates" in kinds and kinds[f"{dot}/objects/info/alternates"] == "ro-bind"
    assert not [p for p in plan.placeholders if p.startswith(dot + "/") and "/objects/" not in p]
    assert plan.git is not None and {d.kind for d in plan.git.dirs} == {"common"}
    assert f"{dot}/hooks" in plan.protected


def test_a_linked_worktree_workdir_protects_its_dotgit_file(sandbox: Sandbox) -> None:
    main = sandbox.root / "main"
    main.mkdir()
    git(main, "init", "-q")
    git(main, "commit", "-q", "--allow-empty", "-m", "x")
    (sandbox.workdir / "README.md").unlink()
    sandbox.workdir.rmdir()
    git(main, "worktree", "add", "-q", str(sandbox.workdir))
    plan = plan_for(sandbox, "shell")
    kinds = {m.dst: m.kind for m in plan.mounts}
    assert kinds[f"{sandbox.workdir}/.git"] == "ro-bind"
    assert kinds[f"{main}/.git"] == "private-bind"
    assert kinds[f"{main}/.git/objects"] == "bind"


def test_validators() -> None:
    assert validate("HEAD", b"ref: refs/heads/main\n") is None
    assert validate("HEAD", f"{OID}\n".encode()) is None
    for bad in (b"ref: refs/heads/../../config\n", b"ref: /etc/passwd\n", b"garbage\n", b"ref: refs/heads/x",
                b"ref: refs/heads/a b\n", f"{OID}\n{OID}\n".encode()):
        assert validate("HEAD", bad), bad
    assert validate("ORIG_HEAD", f"{OID}\n".encode()) is None
    assert validate("MERGE_HEAD", f"{OID}\n{OID}\n".encode()) is None
    assert validate("FETCH_HEAD", f"{OID}\t\tbranch 'main' of /x\n{OID}\tnot-for-merge\tt\n".encode()) is None
    assert validate("FETCH_HEAD", b"exec evil\n")
    assert validate("packed-refs", f"# pack-refs with: peeled fully-peeled sorted \n{OID} refs/heads/main\n^{OID}\n".encode()) is None
    assert validate("packed-refs", f"{OID} HEAD\n".encode())
    assert validate("index", b"DIRC" + b"\0" * 40)
    assert validate("commondir", b"../..\n") is None and validate("commondir", b"/elsewhere\n")
    assert validate("config", b"[core]\n")  # never on the allowlist


def test_gitlinks_in_every_index_version(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    (tmp_path / "dir" / "deep").mkdir(parents=True)
    for name in ("dir/deep/a", "dir/deep/b", "zz"):
        (tmp_path / name).write_text("x")
    git(tmp_path, "add", ".")
    for path in ("dir/deep/sub", "dir/other"):
        git(tmp_path, "update-index", "--add", "--cacheinfo", f"160000,{OID},{path}")
    for version in ("2", "3", "4"):
        git(tmp_path, "update-index", "--index-version", version)
        data = (tmp_path / ".git" / "index").read_bytes()
        assert validate("index", data) is None
        assert gitlinks_in(data) == ["dir/deep/sub", "dir/other"], version


def test_an_empty_dot_git_is_no_repository(tmp_path) -> None:  # noqa: ANN001
    """Another box's placeholder: git needs HEAD to call it a git dir, and so does the planner, or a
    box planned while the placeholder stood would bind a private git dir that vanishes with it."""
    from relay.host.fs_view import HostFs as FsView
    from relay.trust.gitdir import locate, plan_git

    (tmp_path / ".git").mkdir()
    assert locate(str(tmp_path), FsView()) is None and plan_git(str(tmp_path), FsView()) is None
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert locate(str(tmp_path), FsView()) is not None
