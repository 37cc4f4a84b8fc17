"""relay/trust/gitindex.py on indexes real git wrote: every version and hash, the extensions, and the rules
of `sanitize` (which bits, extensions and stat data survive, and when an index is refused)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from relay.trust import gitindex as gi


def git(cwd: Path, *args: str) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), "GIT_CONFIG_NOSYSTEM": "1",
           "LANG": "C.UTF-8"}
    return subprocess.run(["git", "-c", "user.email=t@e", "-c", "user.name=t", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, check=True).stdout


def repo(tmp: Path, fmt: str = "sha1") -> Path:
    git(tmp, "init", "-q", f"--object-format={fmt}", "r")
    r = tmp / "r"
    (r / "a" / "b").mkdir(parents=True)
    for name in ("a/b/x", "a/b/y", "a/c", "z", "Makefile"):
        (r / name).write_text(name + "\n")
    git(r, "add", "-A")
    # A path of 0xFFF bytes and more (its length no longer fits the flags): no file needed.
    git(r, "update-index", "--add", "--cacheinfo", f"100644,{git(r, 'hash-object', 'z').strip()},{'d/' * 2046}fff")
    git(r, "commit", "-qm", "i")
    git(r, "status")
    return r


def index(r: Path) -> bytes:
    return (r / ".git" / "index").read_bytes()


def tree(r: Path) -> gi.WorkTree:
    return gi.WorkTree(os.open(r, os.O_RDONLY | os.O_DIRECTORY))


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
@pytest.mark.parametrize("version", ["2", "3", "4"])
def test_round_trip_every_version_and_hash(tmp_path: Path, version: str, fmt: str) -> None:
    r = repo(tmp_path, fmt)
    git(r, "update-index", "--index-version", version)
    git(r, "update-index", "--skip-worktree", "a/c")  # extended flags: git writes version 3 for 2
    data = index(r)
    parsed = gi.parse(data)
    assert parsed.hash_len == (20 if fmt == "sha1" else 32)
    assert len(parsed.entries) == 6 and gi.serialize(parsed) == data
    assert any(len(e.name) >= gi.NAME_MASK for e in parsed.entries)


@pytest.mark.parametrize("bad", ["checksum", "order", "dotgit", "dotdot", "xflags", "mode", "truncated", "count"])
def test_what_git_would_not_write_is_refused(tmp_path: Path, bad: str) -> None:
    parsed = gi.parse(index(repo(tmp_path)))
    e = list(parsed.entries)
    if bad == "checksum":
        data = gi.serialize(parsed)
        data = data[:-1] + bytes([data[-1] ^ 1])
    else:
        if bad == "order":
            e[0], e[1] = e[1], e[0]
        elif bad == "dotgit":
            e[0] = replace(e[0], name=b".GIT/hooks/pre-commit")
        elif bad == "dotdot":
            e[0] = replace(e[0], name=b"a/../../x")
        elif bad == "xflags":
            e[0] = replace(e[0], xflags=0x0800)
        elif bad == "mode":
            e[0] = replace(e[0], mode=0o104755)
        data = gi.serialize(replace(parsed, version=3, entries=tuple(e)))
        if bad == "truncated":
            data = data[:40] + hashlib.sha1(data[:40]).digest()
        elif bad == "count":
            body = data[:8] + (1 << 30).to_bytes(4, "big") + data[12:-20]
            data = body + hashlib.sha1(body).digest()
    with pytest.raises(gi.BadIndex):
        gi.parse(data)
    assert gi.sanitize(data, None).refused


def test_hiding_bits_and_extensions(tmp_path: Path) -> None:
    r = repo(tmp_path)
    start = index(r)
    (r / "Makefile").write_text("evil\n")
    (r / "new.py").write_text("x\n")
    git(r, "update-index", "--skip-worktree", "Makefile")
    git(r, "update-index", "--assume-unchanged", "z")
    git(r, "-c", "core.untrackedCache=true", "status")
    out = gi.sanitize(index(r), start, tree(r))
    assert out.refused is None and out.data is not None
    assert sorted(out.cleared) == ["Makefile (skip-worktree)", "z (assume-unchanged)"]
    assert "UNTR" in out.dropped
    clean = gi.parse(out.data)
    assert not any(e.flags & gi.ASSUME_VALID or e.xflags & gi.SKIP_WORKTREE for e in clean.entries)
    assert clean.extension(b"UNTR") is None
    (r / ".git" / "index").write_bytes(out.data)
    assert " M Makefile" in git(r, "status", "--porcelain").splitlines()


def test_unchanged_index_keeps_its_stat_and_tree(tmp_path: Path) -> None:
    r = repo(tmp_path)
    start = index(r)
    out = gi.sanitize(start, start, tree(r))
    assert out.data == start and out.smudged == 0


def test_changed_entries_are_smudged_and_tree_dropped(tmp_path: Path) -> None:
    r = repo(tmp_path)
    start = index(r)
    (r / "a" / "c").write_text("staged\n")
    git(r, "add", "a/c")
    git(r, "write-tree")  # a TREE extension that covers the change
    out = gi.sanitize(index(r), start, tree(r))
    assert out.refused is None and out.data is not None
    entries = {e.name: e for e in gi.parse(out.data).entries}
    assert entries[b"a/c"].size == 0 and entries[b"a/c"].mtime_s == 0 and entries[b"z"].size != 0
    assert gi.parse(out.data).extension(b"TREE") is None
    (r / ".git" / "index").write_bytes(out.data)
    assert "M  a/c" in git(r, "status", "--porcelain").splitlines()


def test_an_edited_file_under_an_unchanged_entry_is_smudged(tmp_path: Path) -> None:
    """core.trustctime=false on the host would miss a same-size rewrite with the mtime set back."""
    r = repo(tmp_path)
    start = index(r)
    st = os.stat(r / "z")
    (r / "z").write_text("Z\n")
    os.utime(r / "z", ns=(st.st_atime_ns, st.st_mtime_ns))
    out = gi.sanitize(start, start, tree(r))
    assert out.data is not None and out.smudged == 1
    (r / ".git" / "index").write_bytes(out.data)
    assert " M z" in git(r, "-c", "core.trustctime=false", "status", "--porcelain").splitlines()


def _forge(r: Path, path: str, content: bytes) -> tuple[bytes, bytes]:
    """The box's forgery: the file's own stat data (mtime set back) with its original blob id."""
    start = index(r)
    parsed = gi.parse(start)
    orig = next(e for e in parsed.entries if e.name == path.encode())
    st = os.stat(r / path)
    (r / path).write_bytes(content)
    os.utime(r / path, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))
    git(r, "add", path)
    box = gi.parse(index(r))
    forged = [replace(e, oid=orig.oid) if e.name == orig.name else e for e in box.entries]
    return start, gi.serialize(replace(box, entries=tuple(forged)))


def test_the_lie_rule(tmp_path: Path) -> None:
    r = repo(tmp_path)
    start, forged = _forge(r, "Makefile", b"all:\n\t@evil\n")
    out = gi.sanitize(forged, start, tree(r), time.time_ns())
    assert out.refused and "Makefile" in out.refused and "forged" in out.refused
    # Racy (mtime not before the index's): git itself re-reads it, so only smudged.
    assert gi.sanitize(forged, start, tree(r), 1).refused is None
    # No worktree to look at: smudged, never judged.
    assert gi.sanitize(forged, start, None).refused is None


@pytest.mark.parametrize("kind", ["crlf", "lfs"])
def test_the_lie_rule_knows_conversions(tmp_path: Path, kind: str) -> None:
    r = repo(tmp_path)
    content = b"line one\r\nline two\r\n" if kind == "crlf" else b"\x00big binary\x00" * 100
    start = index(r)
    (r / "conv").write_bytes(content)
    git(r, "add", "conv")
    box = gi.parse(index(r))
    if kind == "crlf":
        blob = content.replace(b"\r\n", b"\n")
    else:
        blob = gi.LFS_POINTER % (hashlib.sha256(content).hexdigest().encode(), len(content))
    oid = gi.blob_id(blob, 20)
    data = gi.serialize(replace(box, entries=tuple(replace(e, oid=oid) if e.name == b"conv" else e
                                                   for e in box.entries)))
    assert gi.sanitize(data, start, tree(r), time.time_ns()).refused is None
    wrong = gi.serialize(replace(box, entries=tuple(replace(e, oid=gi.blob_id(b"other", 20))
                                                    if e.name == b"conv" else e for e in box.entries)))
    assert gi.sanitize(wrong, start, tree(r), time.time_ns()).refused


def test_split_index_and_required_extensions_are_refused(tmp_path: Path) -> None:
    r = repo(tmp_path)
    start = index(r)
    git(r, "update-index", "--split-index")
    assert "split index" in (gi.sanitize(index(r), start, tree(r)).refused or "")
    git(r, "update-index", "--no-split-index")
    parsed = gi.parse(index(r))
    odd = gi.serialize(replace(parsed, extensions=(*parsed.extensions, (b"zzzz", b"x"))))
    assert "required extension" in (gi.sanitize(odd, start, tree(r)).refused or "")


def test_a_sparse_checkout_keeps_its_skip_worktree_bits(tmp_path: Path) -> None:
    """The host's own sparse checkout (the box cannot change info/sparse-checkout): bits on files
    that are not in the worktree stay; a sparse index's directory entries stay when the host had them."""
    r = repo(tmp_path)
    git(r, "sparse-checkout", "set", "--no-cone", "/z", "/Makefile")
    start = index(r)
    assert not (r / "a").exists()
    out = gi.sanitize(start, start, tree(r))
    assert out.data == start and not out.cleared
    git(r, "sparse-checkout", "set", "--cone", "a/b")
    git(r, "config", "index.sparse", "true")
    git(r, "sparse-checkout", "reapply")
    start = index(r)
    assert any(e.mode == gi.SPARSE_DIR for e in gi.parse(start).entries)
    assert gi.sanitize(start, start, tree(r)).refused is None
    assert "sparse-directory" in (gi.sanitize(start, None, tree(r)).refused or "")
