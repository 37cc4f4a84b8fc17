"""The launch memos (relay/host/memo.py): a parsed config and a compiled seccomp program, named by
the sha256 of their inputs in the cache dir. Each answers only for the exact inputs it was made
from, anything odd in the store is recomputed, and no box can write the store."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from relay.config.load import read_yaml
from relay.host import memo
from relay.render import seccomp_bpf
from relay.render.seccomp_bpf import build_filter, compile_bpf, policy_for

from .conftest import Sandbox


def _env(tmp_path: Path) -> dict[str, str]:
    return {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache")}


def _memos(tmp_path: Path, kind: memo.MemoKind) -> list[Path]:
    folder = tmp_path / "cache" / "hive-relay" / "memo" / kind.value
    return sorted(folder.iterdir()) if folder.is_dir() else []


def test_a_parsed_config_answers_only_for_its_own_bytes(tmp_path: Path) -> None:
    env = _env(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text("backends:\n  a: {command: [x]}\n")
    assert read_yaml(config, env=env) == {"backends": {"a": {"command": ["x"]}}}
    assert len(_memos(tmp_path, memo.MemoKind.PARSED_CONFIG)) == 1
    assert read_yaml(config, env=env) == {"backends": {"a": {"command": ["x"]}}}  # from the memo
    config.write_text("backends:\n  a: {command: [y]}\n")  # an edit is a new name, never a stale answer
    assert read_yaml(config, env=env) == {"backends": {"a": {"command": ["y"]}}}
    assert len(_memos(tmp_path, memo.MemoKind.PARSED_CONFIG)) == 2


def test_a_torn_or_odd_memo_is_parsed_again_and_never_blocks(tmp_path: Path) -> None:
    env = _env(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text("version: 1\n")
    assert read_yaml(config, env=env) == {"version": 1}
    (stored,) = _memos(tmp_path, memo.MemoKind.PARSED_CONFIG)
    stored.write_text('{"version": ')  # torn
    assert read_yaml(config, env=env) == {"version": 1}
    assert stored.read_text() == '{"version":1}', "written anew"
    stored.unlink()
    (tmp_path / "other.json").write_text('{"version": 2}')
    stored.symlink_to(tmp_path / "other.json")  # a link is never followed
    assert read_yaml(config, env=env) == {"version": 1}
    stored.unlink()
    os.mkfifo(stored)  # a FIFO: never opened for a blocking read
    assert read_yaml(config, env=env) == {"version": 1}


def test_values_json_cannot_hold_are_parsed_every_time(tmp_path: Path) -> None:
    env = _env(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text("when: 2026-12-02\n1: int-key\n")
    data = read_yaml(config, env=env)
    assert str(data["when"]) == "2026-12-02" and data[1] == "int-key"
    assert _memos(tmp_path, memo.MemoKind.PARSED_CONFIG) == []


@pytest.fixture
def fresh_bpf():
    """compile_bpf keeps its own in-process memo too: empty it around each test."""
    seccomp_bpf._COMPILED.clear()
    yield
    seccomp_bpf._COMPILED.clear()


def _libseccomp_export(policy: seccomp_bpf.SeccompPolicy) -> bytes:
    with tempfile.TemporaryFile() as out:
        build_filter(policy).export_bpf(out)
        out.seek(0)
        return out.read()


def test_the_compiled_filter_memo_is_libseccomps_own_program(tmp_path: Path, fresh_bpf: None) -> None:
    env = _env(tmp_path)
    policy = policy_for(nested_userns=False)
    first = compile_bpf(policy, env=env)
    assert first == _libseccomp_export(policy)
    (stored,) = _memos(tmp_path, memo.MemoKind.SECCOMP_BPF)
    assert stored.read_bytes() == first and stored.stat().st_mode & 0o777 == 0o600
    seccomp_bpf._COMPILED.clear()
    assert compile_bpf(policy, env=env) == first
    other = policy_for(nested_userns=True)  # another policy is another name
    seccomp_bpf._COMPILED.clear()
    assert compile_bpf(other, env=env) == _libseccomp_export(other) != first
    assert len(_memos(tmp_path, memo.MemoKind.SECCOMP_BPF)) == 2


def test_a_filter_memo_of_the_wrong_shape_is_compiled_again(tmp_path: Path, fresh_bpf: None) -> None:
    env = _env(tmp_path)
    policy = policy_for(nested_userns=False)
    real = compile_bpf(policy, env=env)
    (stored,) = _memos(tmp_path, memo.MemoKind.SECCOMP_BPF)
    for bad in (b"", b"\x06\x00\x00\x00\x00\x00\xff\x7f\x00", b"x" * (seccomp_bpf.MAX_BPF_BYTES + 8)):
        stored.write_bytes(bad)
        seccomp_bpf._COMPILED.clear()
        assert compile_bpf(policy, env=env) == real


def test_the_oci_profile_memo_is_the_rendered_profile_and_a_bad_one_is_rendered_again(tmp_path: Path) -> None:
    import json

    from relay.modes.container_runner import seccomp_profile
    from relay.render.seccomp_oci import default_profile, render

    env = _env(tmp_path)
    policy = policy_for(nested_userns=False)
    rendered = json.dumps(render(policy, default_profile())).encode()
    assert seccomp_profile(policy, env) == rendered
    (stored,) = _memos(tmp_path, memo.MemoKind.SECCOMP_OCI)
    assert stored.read_bytes() == rendered and seccomp_profile(policy, env) == rendered
    other = policy_for(nested_userns=True)  # another policy is another name
    assert seccomp_profile(other, env) == json.dumps(render(other, default_profile())).encode() != rendered
    for bad in (b"", b"[]", b'{"syscalls": 1}', b"{not json"):  # the wrong shape is rendered again
        stored.write_bytes(bad)
        assert seccomp_profile(policy, env) == rendered


@pytest.mark.parametrize("isolation", ["supervised", "gvisor"])
def test_no_box_can_write_the_memo_store_even_as_its_workdir(box_sandbox: Sandbox, isolation: str) -> None:
    """The attack: a live box whose workdir is ~/.cache plants a filter where the next launch looks.
    ~/.cache/hive-relay is one of our own paths, bound read-only over any workdir or grant. The twin:
    the same box writes the rest of ~/.cache, and the next launch still runs with the real filter."""
    s = box_sandbox
    cache = s.home / ".cache"
    assert s.relay("shell", "local", "--quiet", "--prompt", "true").returncode == 0  # makes the memos
    stored = sorted((cache / "hive-relay" / "memo" / memo.MemoKind.SECCOMP_BPF.value).iterdir())
    assert stored, "the launch memoized its filter"
    before = {p: p.read_bytes() for p in stored}
    target = stored[0].relative_to(cache)
    script = (f"printf 'ALLOW' > {target} 2>/dev/null && echo PLANTED; rm -f {target} 2>/dev/null && echo REMOVED; "
              "echo twin > other.txt && echo TWIN-OK")
    proc = s.relay("shell", "local", "--quiet", "--isolation", isolation, "--live", "--workdir", str(cache),
                   "--prompt", script)
    assert proc.returncode == 0, proc.stderr
    assert "PLANTED" not in proc.stdout and "REMOVED" not in proc.stdout
    assert {p: p.read_bytes() for p in stored} == before
    assert "TWIN-OK" in proc.stdout and (cache / "other.txt").read_text() == "twin\n"
    probe = s.relay("shell", "local", "--quiet", "--isolation", isolation, "--prompt",
                    "/usr/bin/python3 -c 'import socket; socket.socket(socket.AF_UNIX)' 2>&1 | tail -1")
    assert "PermissionError" in probe.stdout, "the next box still has the real filter"


def test_the_store_keeps_only_the_newest_memos_of_each_kind(tmp_path: Path) -> None:
    """Every edit of a config file is a new memo: the store stays bounded, newest first, and a
    link planted among them is removed as a name, its target untouched."""
    env = _env(tmp_path)
    target = tmp_path / "precious"
    target.write_text("keep me")
    memo.put(env, memo.MemoKind.PARSED_CONFIG, "first", b"{}")
    folder = tmp_path / "cache" / "hive-relay" / "memo" / memo.MemoKind.PARSED_CONFIG.value
    os.utime(folder / "first", (500, 500))
    os.symlink(target, folder / "a-link")
    os.utime(folder / "a-link", (1, 1), follow_symlinks=False)
    for i in range(memo.KEEP + 5):
        memo.put(env, memo.MemoKind.PARSED_CONFIG, f"k{i:03d}", b"{}")
        os.utime(folder / f"k{i:03d}", (1000 + i, 1000 + i))
    memo.put(env, memo.MemoKind.PARSED_CONFIG, "last", b"{}")
    left = {p.name for p in folder.iterdir()}
    assert len(left) == memo.KEEP and "last" in left and "a-link" not in left and "first" not in left
    assert target.read_text() == "keep me"
    assert memo.get(env, memo.MemoKind.SECCOMP_BPF, "last", 64) is None, "kinds never share a name"
