"""The host's secrets looked for in the agent's state (relay/trust/state_scan.py), without a box: each
spelling and cut is found, what a placeholder keeps is not, compressed files are read decompressed and
bounded, and the memo spares a second launch the reading. The box-level attack and twin are in
tests/test_credential_files.py (`recorded_elsewhere`, `synced_file`)."""

from __future__ import annotations

import base64
import bz2
import gzip
import json
import lzma
import os
import secrets
from pathlib import Path
from urllib.parse import quote

import pytest

from relay.egress.secret_scan import secret_forms
from relay.trust import agentstate, state_scan

KEY = "sk-proj-" + secrets.token_urlsafe(48)
JWT = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0." + secrets.token_urlsafe(256)
SLASHED = "/".join(secrets.token_urlsafe(6) for _ in range(6))  # a grant's value: no run of 15 without a `/`
SECRETS = (secret_forms("the openai route's key", KEY), secret_forms("~/.codex/auth.json tokens.access_token", JWT),
           secret_forms("the grant's value", SLASHED))
NEEDLES = state_scan.Needles(SECRETS)
PART = SECRETS[0].forms[0]  # what the placeholder does not keep (the prefix it keeps may run into the key)


def search(data: bytes) -> str | None:
    fd = os.memfd_create("scan")
    try:
        os.write(fd, data)
        return state_scan.search_fd(fd, NEEDLES)
    finally:
        os.close(fd)


NOISE = secrets.token_bytes(300_000)


FOUND = [
    ("as is", b"Authorization: Bearer " + KEY.encode()),
    ("its middle", b"x" + PART[10:30].encode() + b"y"),
    ("a run of 15", b"x" + PART[3:18].encode() + b"y"),
    ("cut by a page", NOISE + PART[:25].encode() + b"\0\0\x10\x07" + PART[25:].encode()),
    ("across a read", b"a" * (state_scan.BLOCK - 11) + KEY.encode() + b"b" * 50),
    ("at the very end", NOISE + KEY.encode()),
    ("percent-encoded", quote(JWT, safe="").encode()),
    ("JSON-escaped", json.dumps(SLASHED).replace("/", "\\/").encode()),
    ("base64", base64.b64encode(b"x" + KEY.encode())),
    ("base64url", base64.urlsafe_b64encode(b"ab" + JWT.encode())),
    ("UTF-16", json.dumps({"k": KEY}).encode("utf-16")),
    ("UTF-16 BE", KEY.encode("utf-16-be")),
    ("gzip", gzip.compress(NOISE + KEY.encode() + NOISE)),
    ("gzip, two members", gzip.compress(NOISE) + gzip.compress(KEY.encode())),
    ("bzip2", bz2.compress(KEY.encode())),
    ("xz", lzma.compress(b"x" * 100 + KEY.encode())),
]
NOT_FOUND = [
    ("a run of 14", b"x" + PART[3:17].encode() + b"y"),
    ("the prefix the placeholder keeps", b"sk-proj- sk-proj-abc"),
    ("a JWT's header and claims", JWT.rsplit(".", 1)[0].encode() + b"."),
    ("noise", NOISE * 4),
    ("text", b'{"type":"assistant","cwd":"/home/dev/src","uuid":"3f2a1c9e-0b1d-4c55-9a77-1e2f3a4b5c6d"}\n' * 9000),
    ("empty", b""),
]


@pytest.mark.parametrize("how, data", FOUND, ids=[how for how, _ in FOUND])
def test_each_spelling_and_cut_is_found(how: str, data: bytes) -> None:
    assert search(data) in ("the openai route's key", "~/.codex/auth.json tokens.access_token", "the grant's value"), how


@pytest.mark.parametrize("how, data", NOT_FOUND, ids=[how for how, _ in NOT_FOUND])
def test_what_is_no_secret_is_not_found(how: str, data: bytes) -> None:
    assert search(data) is None, how


@pytest.mark.parametrize("data, why", [
    (b"\x28\xb5\x2f\xfd" + b"\0" * 64, "zstd"),
    (b"PK\x03\x04" + b"\0" * 64, "zip"),
    (gzip.compress(KEY.encode())[:-12] + b"garbage!" * 4, "gzip"),
])
def test_what_cannot_be_searched_says_so(data: bytes, why: str) -> None:
    with pytest.raises(state_scan.Unsearchable, match=why):
        search(data)


def test_a_decompression_bomb_is_read_a_block_at_a_time_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_scan, "MAX_DECODED", 8 << 20)
    bomb = gzip.compress(b"\0" * (64 << 20))  # 64 KiB on disk
    with pytest.raises(state_scan.Unsearchable, match="over 8 MiB decompressed"):
        search(bomb)


def test_a_short_secret_is_found_whole_only() -> None:
    needles = state_scan.Needles([secret_forms("a short grant", "hunter2pass")])
    assert needles.search([b"pw=hunter2pass;"]) == "a short grant"
    assert needles.search([b"pw=hunter2pas;"]) is None


def test_a_json_file_gets_placeholders_only_where_a_secret_is() -> None:
    raw = json.dumps({"theme": "dark", "history": [{"display": f"use {KEY} now"}], "n": 3}).encode()
    out, written = state_scan.masked_json(raw, NEEDLES)
    data = json.loads(out)
    assert data["theme"] == "dark" and data["n"] == 3 and PART not in out.decode()
    assert written == [(("history", 0, "display"), data["history"][0]["display"])]
    with pytest.raises(ValueError):  # a secret as a key: no placeholder can hold it
        state_scan.masked_json(json.dumps({KEY: 1}).encode(), NEEDLES)


# --- in the copy: what stays out, and the memo -----------------------------------------------------------------

def _copy(tmp_path: Path, run: str, home: Path, env: dict) -> agentstate.AgentState:
    box = tmp_path / run / "home"
    box.mkdir(parents=True)
    state = agentstate.new(str(home), (str(home / ".agent"),), (), (), str(tmp_path / "state"), "1-deadbeef")
    state.secrets, state.memo_env = SECRETS, env
    agentstate.copy_in(state, str(box))
    return state


def test_a_file_holding_a_secret_stays_out_and_the_memo_spares_the_next_launch(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".agent" / "log").mkdir(parents=True)
    (home / ".agent" / "log" / "tui.log").write_text(f"Bearer {KEY}\n")
    (home / ".agent" / "history.jsonl").write_bytes(b'{"display":"hello"}\n' * 50_000)
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "cache")}

    first = _copy(tmp_path, "r1", home, env)
    assert not (tmp_path / "r1" / "home" / ".agent" / "log" / "tui.log").exists()
    assert (tmp_path / "r1" / "home" / ".agent" / "history.jsonl").exists()
    assert any("~/.agent/log/tui.log holds the openai route's key" in n for n in first.notes), first.notes
    assert first.scanned_bytes >= 1_000_000

    second = _copy(tmp_path, "r2", home, env)  # nothing changed: nothing read but the file that held one
    assert second.scanned_bytes < 100 and not (tmp_path / "r2" / "home" / ".agent" / "log" / "tui.log").exists()

    with open(home / ".agent" / "history.jsonl", "ab") as fh:  # appended: read again, found
        fh.write(f'{{"display":"{KEY}"}}\n'.encode())
    third = _copy(tmp_path, "r3", home, env)
    assert third.scanned_bytes >= 1_000_000 and not (tmp_path / "r3" / "home" / ".agent" / "history.jsonl").exists()

    fourth = _copy(tmp_path, "r4", home, {**env, "XDG_CACHE_HOME": str(tmp_path / "other-cache")})
    assert fourth.scanned_bytes >= 1_000_000  # another cache dir: no memo, everything read


def test_a_new_secret_reads_the_files_found_clean_of_the_old_ones(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".agent").mkdir(parents=True)
    new_key = "sk-proj-" + secrets.token_urlsafe(48)
    (home / ".agent" / "cache.txt").write_text(f"refreshed: {new_key}\n")
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    assert (tmp_path / "cache").mkdir() is None
    _copy(tmp_path, "r1", home, env)
    assert (tmp_path / "r1" / "home" / ".agent" / "cache.txt").exists()  # not a secret of this launch
    box = tmp_path / "r2" / "home"
    box.mkdir(parents=True)
    state = agentstate.new(str(home), (str(home / ".agent"),), (), (), str(tmp_path / "state"), "1-deadbeef")
    state.secrets, state.memo_env = (*SECRETS, secret_forms("the refreshed key", new_key)), env
    agentstate.copy_in(state, str(box))
    assert not (box / ".agent" / "cache.txt").exists(), state.notes


def test_the_bench_rows_time_the_copy_with_and_without_the_search() -> None:
    from relay.dev import bench_state_scan

    r = bench_state_scan.measure(1, quick=True)
    assert r["scanned_mb"] >= 32 and set(r["ratio"]) == {"copy alone", "copy + search, cold", "copy + search, warm"}
    lines, _ = bench_state_scan.rows(r)
    assert any("copy + search, cold" in ln and "× the copy alone" in ln for ln in lines), lines


def test_a_corrupt_or_cut_off_compressed_file_cannot_be_searched() -> None:
    for data, why in ((lzma.compress(b"hello " * 100)[:-20] + b"\xff" * 40, "xz"), (b"BZh9" + b"\x00" * 64, "bzip2"),
                      (gzip.compress(b"hello " * 100)[:-30], "gzip")):
        with pytest.raises(state_scan.Unsearchable, match=why):
            search(data)


def test_a_token_behind_a_compression_magic_is_found_raw() -> None:
    for magic in (b"\x1f\x8b", b"BZh9", b"\xfd7zXZ\x00"):
        assert search(magic + b" Bearer " + KEY.encode()) == "the openai route's key", magic
