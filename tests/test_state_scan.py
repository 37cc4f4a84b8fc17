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
import zlib
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


def _zip(members: dict[str, bytes], stored: bool = False) -> bytes:
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return out.getvalue()


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
    (".lzma", lzma.compress(KEY.encode(), format=lzma.FORMAT_ALONE)),
    ("zlib", zlib.compress(b"token=" + KEY.encode())),
    ("gzip in gzip", gzip.compress(gzip.compress(NOISE[:1000] + KEY.encode()))),
    ("a gzip header's comment", gzip.compress(b"x")[:3] + b"\x10" + gzip.compress(b"x")[4:10] + KEY.encode() + b"\0"
     + gzip.compress(b"x")[10:]),
    ("hex", b"token: " + KEY.encode().hex().encode()),
    ("a zip member", _zip({"a.txt": b"nothing", "logs/b.log": b"Bearer " + KEY.encode()})),
    ("a gzip in a zip", _zip({"b.gz": gzip.compress(KEY.encode())}, stored=True)),
]
NOT_FOUND = [
    ("a run of 14", b"x" + PART[3:17].encode() + b"y"),
    ("the prefix the placeholder keeps", b"sk-proj- sk-proj-abc"),
    ("a JWT's header and claims", JWT.rsplit(".", 1)[0].encode() + b"."),
    ("noise", NOISE * 4),
    ("text", b'{"type":"assistant","cwd":"/home/dev/src","uuid":"3f2a1c9e-0b1d-4c55-9a77-1e2f3a4b5c6d"}\n' * 9000),
    ("empty", b""),
    ("UTF-32 (not looked for: its 8-byte words are 2 characters, a box could make every word a hit)",
     KEY.encode("utf-32-le")),
    ("a clean zip", _zip({"a.txt": b"nothing here " * 1000})),
]


@pytest.mark.parametrize("how, data", FOUND, ids=[how for how, _ in FOUND])
def test_each_spelling_and_cut_is_found(how: str, data: bytes) -> None:
    assert search(data) in ("the openai route's key", "~/.codex/auth.json tokens.access_token", "the grant's value"), how


@pytest.mark.parametrize("how, data", NOT_FOUND, ids=[how for how, _ in NOT_FOUND])
def test_what_is_no_secret_is_not_found(how: str, data: bytes) -> None:
    assert search(data) is None, how


@pytest.mark.parametrize("data, why", [
    (b"\x28\xb5\x2f\xfd" + b"\0" * 64, "zstd"),
    (b"\x50\x2a\x4d\x18" + b"\0" * 64, "zstd"),  # a skippable frame first
    (b"\x04\x22\x4d\x18" + b"\0" * 64, "lz4"),
    (b"".join(gzip.compress(b"") for _ in range(5000)), "over 4096 members"),
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
    assert written == [(("history", 0, "display"), data["history"][0]["display"], ("history", 0))]
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


def test_a_damaged_compressed_file_is_searched_as_far_as_any_reader_gets() -> None:
    """Not unsearchable: what decodes is searched, the bytes past the damage are searched as they are
    (gzip -dc stops there too), so a gzip with trailing padding, a cut-off xz or a file that only
    starts like one is an ordinary file; the twin: a key before the damage is found."""
    for data in (gzip.compress(b"hello " * 100) + b"\0" * 512, lzma.compress(b"hello " * 100)[:-20] + b"\xff" * 40,
                 b"BZh9" + b"\x00" * 64, gzip.compress(b"hello " * 100)[:-30], b"\x1f\x8bnot gzip at all " * 10):
        assert search(data) is None, data[:16]
    assert search(gzip.compress(b"x" * 5000 + KEY.encode() + b"y" * 5000)[:-40]) == "the openai route's key"


def test_a_token_behind_a_compression_magic_is_found_raw() -> None:
    for magic in (b"\x1f\x8b", b"BZh9", b"\xfd7zXZ\x00"):
        assert search(magic + b" Bearer " + KEY.encode()) == "the openai route's key", magic


def test_a_file_written_while_it_is_copied_is_searched_whatever_the_memo_says(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The race the red team found: a file the memo knows as clean, written by the host's CLI after
    the walk and before its copy, is searched (the memo speaks only for the identity the copy saw
    before and after). The write is injected at the copy's start, where a concurrent writer lands."""
    home = tmp_path / "home"
    (home / ".agent" / "log").mkdir(parents=True)
    log = home / ".agent" / "log" / "tui.log"
    log.write_text("started\n" * 1000)
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    assert (tmp_path / "r1" / "home").parent.mkdir() is None
    first = _copy(tmp_path, "r1/x", home, env)
    assert first.scanned_bytes >= 8000 and (tmp_path / "r1" / "x" / "home" / ".agent" / "log" / "tui.log").exists()
    real = agentstate._copy_fd

    def writer_meanwhile(src: int, dst: int, size: int) -> None:
        with open(log, "a") as fh:
            fh.write(f"Authorization: Bearer {KEY}\n")
        real(src, dst, size + 200)

    monkeypatch.setattr(agentstate, "_copy_fd", writer_meanwhile)
    second = _copy(tmp_path, "r2", home, env)
    assert not (tmp_path / "r2" / "home" / ".agent" / "log" / "tui.log").exists(), second.notes
    assert any("tui.log holds the openai route's key" in n for n in second.notes), second.notes


def test_the_memo_keeps_each_verdict_and_the_secrets_a_file_was_cleared_of(tmp_path: Path) -> None:
    """A file that cannot be searched (a bomb the box left in a synced dir) is judged once, not at every
    launch; a launch with fewer secrets keeps the others' clearance, so the next with all reads nothing."""
    home = tmp_path / "home"
    (home / ".agent").mkdir(parents=True)
    (home / ".agent" / "frame.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 5000)
    (home / ".agent" / "history.jsonl").write_bytes(b'{"display":"hello"}\n' * 50_000)
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = _copy(tmp_path, "r1", home, env)
    assert any("frame.zst cannot be searched" in n for n in first.notes) and first.scanned_bytes > 1_000_000
    second = _copy(tmp_path, "r2", home, env)
    assert second.scanned_bytes == 0 and any("frame.zst cannot be searched for the host's secrets (zstd" in n for n in second.notes)
    box = tmp_path / "r3" / "home"
    box.mkdir(parents=True)
    fewer = agentstate.new(str(home), (str(home / ".agent"),), (), (), str(tmp_path / "state"), "1-deadbeef")
    fewer.secrets, fewer.memo_env = SECRETS[:1], env
    agentstate.copy_in(fewer, str(box))
    assert fewer.scanned_bytes == 0
    assert _copy(tmp_path, "r4", home, env).scanned_bytes == 0


def test_the_launchs_decompression_budget_leaves_the_rest_for_the_next_launch() -> None:
    bomb = gzip.compress(b"\0" * (4 << 20))
    budget = state_scan.Budget(6 << 20)
    fd = os.memfd_create("bomb")
    try:
        os.write(fd, bomb)
        assert state_scan.search_fd(fd, NEEDLES, budget) is None
        with pytest.raises(state_scan.Spent, match="budget is spent"):
            state_scan.search_fd(fd, NEEDLES, budget)
    finally:
        os.close(fd)


@pytest.mark.parametrize("how, data", [
    ("xz, padding, xz", lzma.compress(b"clean " * 100) + b"\0" * 4 + lzma.compress(KEY.encode())),
    ("gzip, zeros, gzip", gzip.compress(b"clean " * 100) + b"\0" * 16 + gzip.compress(KEY.encode())),
    ("zlib then zlib", zlib.compress(b"clean " * 100) + zlib.compress(KEY.encode())),
    ("gzip then xz", gzip.compress(b"clean") + lzma.compress(KEY.encode())),
    ("a zip after a stub", b"#!/bin/sh\nexit 0\n" * 50 + _zip({"k.txt": b"Bearer " + KEY.encode()})),
], ids=lambda v: v if isinstance(v, str) else "")
def test_what_follows_a_stream_is_searched_too(how: str, data: bytes) -> None:
    """Red team round 2: xz -dc and Python's gzip read on past zero padding; a second stream of another
    kind; a self-extracting stub before a zip."""
    assert search(data) in ("the openai route's key", "~/.codex/auth.json tokens.access_token"), how


def test_what_the_standard_library_cannot_read_is_left_out_never_a_crash() -> None:
    """A zip zipfile refuses or cannot read a member of (unzip may still read it), and compression deeper
    than MAX_DEPTH: Unsearchable, never an exception that aborts the launch (red team round 2)."""
    good = _zip({"k.txt": b"x" * 5000})
    damaged = good.replace(zlib.compress(b"x" * 5000)[2:-4], b"\xff" * len(zlib.compress(b"x" * 5000)[2:-4]), 1)
    deep = KEY.encode()
    for _ in range(5):
        deep = gzip.compress(deep)
    for data in (damaged, deep, good[:30] + b"\x00" * 10 + good[40:]):
        try:
            search(data)
        except state_scan.Unsearchable:
            pass
    with pytest.raises(state_scan.Unsearchable, match="more than 3 deep"):
        search(deep)


def test_a_lone_surrogate_in_a_json_file_is_text_not_a_crash() -> None:
    raw = b'{"note": "cut emoji \\ud83d", "history": ["use ' + KEY.encode() + b'"]}'
    assert b"cut emoji" in state_scan.json_text(raw)
    out, written = state_scan.masked_json(raw, NEEDLES)
    assert KEY.encode() not in out and len(written) == 1


def test_sync_back_puts_a_value_back_only_where_the_object_holding_it_is_the_hosts() -> None:
    """Red team round 3: a box that added ANTHROPIC_BASE_URL beside `env.ANTHROPIC_API_KEY` (or changed the
    URL beside a key) got the real key put back next to its URL, one accept-state from the host; and a
    prompt the box added to a history list left the placeholder in the host's file for good."""
    from relay.model import credential_files

    host = {"env": {"ANTHROPIC_API_KEY": KEY}, "history": [{"display": f"use {KEY}"}], "theme": "dark"}
    raw = json.dumps(host).encode()
    masked, written = credential_files.mask(raw, ("env.*",), written=(table := []))[0], table
    masked, more = state_scan.masked_json(masked, NEEDLES)
    box = json.loads(masked)
    box["history"].append({"display": "a new prompt"})
    box["theme"] = "light"
    back = json.loads(credential_files.restore(json.dumps(box).encode(), raw, written + more))
    assert back["env"]["ANTHROPIC_API_KEY"] == KEY and back["history"][0]["display"] == f"use {KEY}"
    assert back["history"][1] == {"display": "a new prompt"} and back["theme"] == "light"
    box["env"]["ANTHROPIC_BASE_URL"] = "https://evil.example"
    back = json.loads(credential_files.restore(json.dumps(box).encode(), raw, written + more))
    assert KEY not in back["env"]["ANTHROPIC_API_KEY"], back  # the placeholder stays beside the box's URL
