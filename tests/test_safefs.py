"""The safe-file layer on its own: every way a box can prepare a path for the host to trip on.

Each hostile shape (a link at every component, a FIFO, a directory, a device, an oversized file,
a pre-created temporary name) is refused without blocking, beside the legitimate twin that works.
Both code paths run: openat2 (this kernel) and the O_NOFOLLOW walk used where openat2 is missing.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from relay.host import safefs


@pytest.fixture(params=["openat2", "walk"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "openat2":
        assert safefs.have_openat2(), "this kernel (5.6+) has openat2; CI runs on one"
    monkeypatch.setattr(safefs, "_HAVE_OPENAT2", request.param == "openat2")
    return request.param


def _tree(tmp: Path) -> Path:
    base = tmp / "base"
    (base / "a" / "b").mkdir(parents=True)
    (base / "a" / "b" / "f.json").write_text('{"ok": 1}')
    (tmp / "secret").write_text("SECRET-TOKEN")
    (tmp / "elsewhere").mkdir()
    (tmp / "elsewhere" / "f.json").write_text("SECRET-TOKEN")
    return base


def test_a_plain_file_is_read(tmp_path: Path, impl: str) -> None:
    base = _tree(tmp_path)
    assert safefs.read_file(str(base / "a/b/f.json"), base=str(base)) == b'{"ok": 1}'
    assert safefs.read_file(str(base / "a/b/missing"), base=str(base)) is None


@pytest.mark.parametrize("component", ["a", "a/b", "a/b/f.json"])
def test_a_link_at_any_component_is_refused(tmp_path: Path, impl: str, component: str) -> None:
    base = _tree(tmp_path)
    target = {"a": tmp_path / "elsewhere", "a/b": tmp_path / "elsewhere", "a/b/f.json": tmp_path / "secret"}[component]
    victim = base / component
    if victim.is_dir():
        os.rename(victim, tmp_path / "moved")
    else:
        victim.unlink()
    victim.symlink_to(target)
    rel = "a/b/f.json" if component != "a" else "a/f.json"
    with pytest.raises(safefs.UnsafePath):
        safefs.read_file(str(base / rel), base=str(base))


def test_special_files_never_block(tmp_path: Path, impl: str) -> None:
    base = _tree(tmp_path)
    os.mkfifo(base / "fifo")
    (base / "dir").mkdir()
    os.symlink("/dev/zero", base / "zero")
    done = threading.Event()

    def attempt() -> None:
        for name in ("fifo", "dir", "zero"):
            with pytest.raises(OSError):
                safefs.read_file(str(base / name), base=str(base))
        done.set()

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(20)
    assert done.is_set(), "reading a FIFO blocked"


def test_an_oversized_file_is_refused_and_a_small_one_read(tmp_path: Path, impl: str) -> None:
    base = _tree(tmp_path)
    (base / "big").write_bytes(b"x" * 2048)
    with pytest.raises(safefs.UnsafePath):
        safefs.read_file(str(base / "big"), limit=1024, base=str(base))
    assert safefs.read_file(str(base / "big"), limit=4096, base=str(base)) == b"x" * 2048


def test_dotdot_and_absolute_relatives_are_refused(tmp_path: Path) -> None:
    base = _tree(tmp_path)
    with safefs.base_dir(str(base)) as dfd:
        for rel in ("../secret", "/etc/passwd", "a/../../secret", ""):
            with pytest.raises(safefs.UnsafePath):
                safefs.read_beneath(dfd, rel)


def test_writes_replace_a_planted_link_instead_of_following_it(tmp_path: Path, impl: str) -> None:
    base = _tree(tmp_path)
    (base / "a" / "b" / "f.json").unlink()
    (base / "a" / "b" / "f.json").symlink_to(tmp_path / "secret")
    safefs.write_file(str(base / "a/b/f.json"), b"new", base=str(base))
    assert (tmp_path / "secret").read_text() == "SECRET-TOKEN"  # the target is untouched
    assert not (base / "a/b/f.json").is_symlink() and (base / "a/b/f.json").read_bytes() == b"new"


def test_writes_through_a_linked_parent_are_refused(tmp_path: Path, impl: str) -> None:
    base = _tree(tmp_path)
    os.rename(base / "a" / "b", tmp_path / "b-moved")
    (base / "a" / "b").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(safefs.UnsafePath):
        safefs.write_file(str(base / "a/b/f.json"), b"evil", base=str(base))
    assert (tmp_path / "elsewhere" / "f.json").read_text() == "SECRET-TOKEN"


def test_keep_aside_uses_a_fresh_unguessable_name(tmp_path: Path, impl: str) -> None:
    base = _tree(tmp_path)
    # The box pre-creates every name it could predict, as links to a file it wants overwritten.
    for guess in ("f.json.hive-relay-rejected", "f.json.hive-relay-rejected-0", "f.json.tmp"):
        (base / "a" / "b" / guess).symlink_to(tmp_path / "secret")
    first = safefs.keep_aside(str(base / "a/b/f.json"), b"box version", "rejected", base=str(base))
    second = safefs.keep_aside(str(base / "a/b/f.json"), b"box version", "rejected", base=str(base))
    assert first != second and Path(first).read_bytes() == b"box version"
    assert not Path(first).is_symlink() and (tmp_path / "secret").read_text() == "SECRET-TOKEN"


def test_create_new_never_reuses_an_existing_name(tmp_path: Path) -> None:
    base = _tree(tmp_path)
    with safefs.base_dir(str(base)) as dfd:
        os.symlink(tmp_path / "secret", base / "taken")
        with pytest.raises(FileExistsError):
            safefs.create_new(dfd, "taken", b"x")
        safefs.create_new(dfd, "fresh", b"x")
    assert (tmp_path / "secret").read_text() == "SECRET-TOKEN" and (base / "fresh").read_bytes() == b"x"


def test_rename_noreplace_keeps_what_is_there(tmp_path: Path) -> None:
    base = _tree(tmp_path)
    (base / "src").write_text("a")
    (base / "dst").write_text("b")
    with safefs.base_dir(str(base)) as dfd:
        with pytest.raises(FileExistsError):
            safefs.rename_noreplace(dfd, "src", "dst")
        safefs.rename_noreplace(dfd, "src", "new")
    assert (base / "dst").read_text() == "b" and (base / "new").read_text() == "a"


def test_unlink_beneath_does_not_cross_a_linked_parent(tmp_path: Path, impl: str) -> None:
    base = _tree(tmp_path)
    (tmp_path / "elsewhere" / "empty").write_text("")
    os.rename(base / "a", tmp_path / "a-moved")
    (base / "a").symlink_to(tmp_path / "elsewhere")
    with safefs.base_dir(str(base)) as dfd:
        with pytest.raises(safefs.UnsafePath):
            safefs.unlink_beneath(dfd, "a/empty")
        assert (tmp_path / "elsewhere" / "empty").exists()
        (tmp_path / "a-moved" / "gone").write_text("")
        os.unlink(base / "a")
        os.rename(tmp_path / "a-moved", base / "a")
        assert safefs.unlink_beneath(dfd, "a/gone") and not (base / "a" / "gone").exists()


def test_a_tree_of_any_shape_is_removed_with_few_fds_and_no_link_followed(tmp_path: Path) -> None:
    """safefs.remove_tree (the run dirs', the staged layers' and the kube stage's removal) on what a box can
    make: 1,500 levels deep under a 128-fd limit (deeper than Python's recursion and than the fds it may
    hold), 1,500 wide (each listed once), a mode-000 dir, a
    link to a directory outside and a FIFO; the link's target is untouched and no fd is left open."""
    import subprocess
    import sys

    from .conftest import REPO

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    script = f"""
import os, resource, sys
from relay.host.safefs import remove_tree
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
root = sys.argv[1]
cur = os.open(root, os.O_RDONLY)
os.mkdir("deep", dir_fd=cur)
nxt = os.open("deep", os.O_RDONLY, dir_fd=cur); os.close(cur); cur = nxt
for i in range(1500):
    os.mkdir("d", dir_fd=cur); nxt = os.open("d", os.O_RDONLY, dir_fd=cur); os.close(cur); cur = nxt
os.close(cur)
os.makedirs(root + "/wide")
for i in range(1500):
    os.mkdir(f"{{root}}/wide/w{{i}}")
os.makedirs(root + "/odd/a/b"); os.chmod(root + "/odd/a", 0)
os.symlink({str(outside)!r}, root + "/odd/link"); os.mkfifo(root + "/odd/fifo")
before = len(os.listdir("/proc/self/fd"))
pfd = os.open(root, os.O_RDONLY)
for name in ("deep", "wide", "odd"):
    remove_tree(pfd, name)
os.close(pfd)
print(sorted(os.listdir(root)), len(os.listdir("/proc/self/fd")) - before)
"""
    tree = tmp_path / "tree"
    tree.mkdir()
    out = subprocess.run([sys.executable, "-c", script, str(tree)], env={"PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "0"], out.stdout
    assert (outside / "keep").read_text() == "keep"


def test_the_sweep_removes_a_stale_run_dir_however_deep_the_box_made_it(tmp_path: Path) -> None:
    """The sweep (every launch's, for run dirs whose launcher died with kill -9) removes as the janitor
    does: a 1,500-deep tree in the run dir's git dir goes too (rmtree's recursion stopped there), and a
    live launcher's run dir beside it stays (the twin)."""
    import subprocess
    import sys

    from relay.host import liveness
    from relay.trust import rundirs

    from .conftest import REPO

    dead = subprocess.run([sys.executable, "-c", "from relay.host.liveness import new_run_id; print(new_run_id())"],
                          env={"PYTHONPATH": str(REPO)}, capture_output=True, text=True, check=True).stdout.strip()
    stale, live = tmp_path / f"hive-relay-{dead}", tmp_path / f"hive-relay-{liveness.new_run_id()}"
    deep = stale / "git" / "0"
    deep.mkdir(parents=True)
    fd = os.open(deep, os.O_RDONLY)
    for _ in range(1500):
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    live.mkdir()
    assert rundirs.run_dirs(str(tmp_path)) == 1
    assert not stale.exists() and live.is_dir()
