"""Red-team twins for kube mode's host side: what a malicious box pod can put in its log (its patch,
its bytes) against the host's staging, review and follow. Each attack has its legitimate twin.

Real git, real files; no cluster (the patch is what a box prints, the log what `kubectl logs` returns).
"""

from __future__ import annotations

import hashlib
import os
import resource
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import yaml

from relay.config.load import get_backend, load_matrix
from relay.host.fs_view import HostFs
from relay.host.probe import probe
from relay.modes.kube_run import BoxResult, Kubectl, _kubectl, make_bundle, stage_results
from relay.plan.resolve import Request, resolve
from relay.trust import changes, kube_stage, staged
from relay.trust.changes import Entry
from relay.trust.kube_stage import bundle_head
from relay.ui.changes_text import entry_line

from .test_kube_stage import _env, _plan


def _git(work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(work), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          capture_output=True, text=True, check=True)


@pytest.fixture()
def checkout(tmp_path: Path) -> Path:
    work = tmp_path / "checkout"
    (work / "dir").mkdir(parents=True)
    _git(work, "init", "-q")
    (work / "README.md").write_text("hello\n")
    (work / "dir" / "inner.txt").write_text("inner\n")
    _git(work, "add", "-A")
    _git(work, "commit", "-qm", "init")
    return work


B85 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#$%&()*+-;<=>?@^_`{|}~"


def _b85(chunk: bytes) -> bytes:
    out = b""
    for i in range(0, len(chunk), 4):
        acc = int.from_bytes(chunk[i:i + 4].ljust(4, b"\0"), "big")
        digits = []
        for _ in range(5):
            digits.append(B85[acc % 85])
            acc //= 85
        out += bytes(reversed(digits))
    return out


def zero_bomb(path: str, size: int) -> bytes:
    """A `GIT binary patch` creating `path` as `size` zero bytes: deflated, about size/800 bytes."""
    z = zlib.compressobj(9)
    data = b"".join(z.compress(b"\0" * (1 << 20)) for _ in range(size >> 20)) + z.flush()
    h = hashlib.sha1(b"blob %d\0" % size)
    for _ in range(size >> 20):
        h.update(b"\0" * (1 << 20))
    lines = [(bytes([64 + len(c)]) if len(c) <= 26 else bytes([70 + len(c)])) + _b85(c)
             for c in (data[i:i + 52] for i in range(0, len(data), 52))]
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\nindex {'0' * 40}..{h.hexdigest()}\n"
            "GIT binary patch\n").encode() + b"literal %d\n" % size + b"\n".join(lines) + b"\n\nliteral 0\nHcmV?d00001\n\n"


def _stage_on(checkout: Path, tmp_path: Path, patch: bytes, base: str | None = None):  # noqa: ANN202
    env = _env(tmp_path)
    base = base or _git(checkout, "rev-parse", "HEAD").stdout.strip()
    ctime = kube_stage.stamp_ctime(env)
    [out] = stage_results(_plan(checkout, env), f"krt-{os.getpid()}-{os.urandom(3).hex()}", base, ctime,
                          [BoxResult(0, patch, 0)], env)
    return env, out


def test_a_deflate_bomb_patch_is_bounded_on_the_host(checkout: Path, tmp_path: Path) -> None:
    """Attack: a 330 KiB patch that inflates to a 256 MiB blob (800:1; MAX_PATCH of them is ~50 GiB).
    Staging reads its size first and never the blob; git apply's heap is bounded."""
    patch = zero_bomb("bomb.bin", 256 << 20)
    assert len(patch) < 512 << 10
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    env, out = _stage_on(checkout, tmp_path, patch)
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10
    assert out.run is None and out.error and "cannot be staged" in out.error and "bomb.bin" in out.error, out
    assert grew_mib < 128, f"the launcher grew by {grew_mib} MiB reading a blob it does not stage"
    assert staged.runs(env) == []


def test_twin_a_binary_file_within_the_limit_is_staged(checkout: Path, tmp_path: Path) -> None:
    env, out = _stage_on(checkout, tmp_path, zero_bomb("zeros.bin", 2 << 20))
    assert out.error is None and out.run, out
    [e] = changes.review(staged.find(env, out.run)).entries
    assert e.path == "zeros.bin" and e.kind == "added" and e.size == 2 << 20


def test_a_rename_whose_new_half_cannot_be_staged_stages_nothing(checkout: Path, tmp_path: Path) -> None:
    """Attack (or an unlucky box): `mv data.bin data2.bin` of an untracked 70 MiB file. The new half is
    over the blob limit; staging the rest would leave one entry, `D data.bin`, and apply would delete
    the user's only copy (it was never committed)."""
    (checkout / "data.bin").write_bytes(b"\1" * (70 << 20))  # untracked: the snapshot carries it
    bundle = make_bundle(str(checkout))
    base = bundle_head(bundle)
    (tmp_path / "b.bundle").write_bytes(bundle)
    clone = tmp_path / "box"
    subprocess.run(["git", "clone", "-q", str(tmp_path / "b.bundle"), str(clone)], check=True)
    _git(clone, "read-tree", "-u", "--reset", base)
    (clone / "data.bin").rename(clone / "data2.bin")
    _git(clone, "add", "-A")
    patch = subprocess.run(["git", "-C", str(clone), "diff", "--cached", "--binary", "--full-index", "--no-renames",
                            base], capture_output=True, check=True).stdout
    env, out = _stage_on(checkout, tmp_path, patch, base)
    assert out.run is None and out.error and "data2.bin" in out.error, out
    assert (checkout / "data.bin").stat().st_size == 70 << 20
    assert staged.runs(env) == []


def test_a_submodule_pointer_in_the_patch_stages_nothing(checkout: Path, tmp_path: Path) -> None:
    oid = _git(checkout, "rev-parse", "HEAD").stdout.strip()
    patch = (f"diff --git a/dir/inner.txt b/dir/inner.txt\ndeleted file mode 100644\n--- a/dir/inner.txt\n"
             "+++ /dev/null\n@@ -1 +0,0 @@\n-inner\n"
             f"diff --git a/sub b/sub\nnew file mode 160000\nindex 0000000..{oid[:7]}\n--- /dev/null\n+++ b/sub\n"
             f"@@ -0,0 +1 @@\n+Subproject commit {oid}\n").encode()
    env, out = _stage_on(checkout, tmp_path, patch)
    assert out.run is None and out.error and "submodule" in out.error, out


def test_box_chosen_names_cannot_forge_or_hide_review_lines() -> None:
    """Attack: a file named `0README\\x1b[8m` (conceal: every later line of the listing is invisible
    on a terminal, the flagged ones too) and one named `notes.txt\\n  A docs.md` (a forged line)."""
    hide = entry_line(Entry("0README\x1b[8m", "added", 0o100644))
    forge = entry_line(Entry("notes.txt\n  A docs.md", "added", 0o100644))
    link = entry_line(Entry("l", "symlink", 0o120777, link="/etc\x1b[2K"))
    odd = entry_line(Entry("bad\udcff", "added", 0o100644))
    for line in (hide, forge, link, odd):
        assert line.isprintable() and "\x1b" not in line and "\n" not in line, repr(line)
    assert "\\x1b" in hide and "\\n" in forge and "\\xff" in odd


def test_twin_ordinary_names_are_shown_as_they_are() -> None:
    assert entry_line(Entry("src/naïve café.py", "added", 0o100644)) == "  A src/naïve café.py"


def test_a_box_log_that_is_not_utf8_does_not_crash_the_launcher(tmp_path: Path) -> None:
    """Attack (or any agent that cats a binary file): a byte that is not UTF-8 in a box's log. The
    launcher reads every box's log in one go; a decode error lost every box's patch with it."""
    fake = tmp_path / "kubectl"
    fake.write_text("#!/bin/sh\nprintf 'agent says \\377\\n'\n")
    fake.chmod(0o755)
    assert "agent says" in _kubectl(Kubectl(str(fake)), dict(os.environ), "logs", "pod", "-c", "box")


FAKE_KUBECTL = r'''#!/usr/bin/env python3
"""A recording kubectl: each call's argv, stdin and the context current at that moment, one JSON line."""
import json, os, sys
log, ctx = os.environ["FAKE_KUBECTL_LOG"], os.environ["FAKE_KUBECTL_CTX"]
argv = sys.argv[1:]
stdin = "" if sys.stdin.isatty() else sys.stdin.buffer.read().decode(errors="replace")
with open(log, "a") as fh:
    fh.write(json.dumps({"argv": argv, "stdin": stdin, "ctx": open(ctx).read().strip()}) + "\n")
if argv[:1] == ["apply"]:  # the user switches context in another terminal, mid-run
    open(ctx, "w").write("ctx-b\n")
if argv[:2] == ["config", "current-context"]:
    print(open(ctx).read().strip())
elif "jsonpath={.spec.clusterIP}" in argv:
    print("10.0.0.7")
elif "jsonpath={.metadata.uid}" in argv:
    print("uid-1")
elif "pods" in argv and "json" in argv:
    print(json.dumps({"items": [{"metadata": {"name": "boxes-0", "annotations": {
        "batch.kubernetes.io/job-completion-index": "0"}}, "status": {"phase": "Succeeded"}}]}))
elif argv and argv[0] == "-n" and "logs" in argv:
    sys.stdout.buffer.write(b"agent: done\n%(begin)s\n\n%(end)s 0\n")
'''


def test_no_credential_reaches_an_annotation_argv_or_other_object(checkout: Path, tmp_path: Path) -> None:
    """Attack surface: `kubectl apply` of a Secret copies its stringData into the object's
    last-applied-configuration annotation (printed by `kubectl describe`). The value must travel
    once, in the stdin of a `create` of the Secret alone, and appear in no argv and no other object."""
    from relay.modes.kube_objects import RESULT_BEGIN, RESULT_END
    from relay.modes.kube_run import Kubectl, apply_and_follow, kube_run_for

    fake = tmp_path / "bin" / "kubectl"
    fake.parent.mkdir()
    fake.write_text(FAKE_KUBECTL % {"begin": RESULT_BEGIN, "end": RESULT_END})
    fake.chmod(0o755)
    (tmp_path / "ctx").write_text("ctx-a\n")
    secret = "sk-ant-" + os.urandom(8).hex()
    env = {**_env(tmp_path), "ANTHROPIC_API_KEY": secret, "FAKE_KUBECTL_LOG": str(tmp_path / "calls"),
           "FAKE_KUBECTL_CTX": str(tmp_path / "ctx"), "HIVE_RELAY_KUBE_IMAGE": "localhost/box:1",
           "HIVE_RELAY_KUBE_PROXY_IMAGE": "localhost/proxy:1"}
    matrix = load_matrix(env, workdir=None)
    req = Request("claude", mode="kube", workdir=str(checkout), run_id=f"krt-{os.getpid()}-abc", prompt="x")
    plan = resolve(get_backend(matrix, "claude"), matrix, req, probe(env), env, fs=HostFs())
    run = kube_run_for(plan, req.run_id, 1, 1, env)
    assert apply_and_follow(Kubectl(str(fake), "ctx-a"), plan, run, env) == 0
    calls = [__import__("json").loads(line) for line in (tmp_path / "calls").read_text().splitlines()]
    carrying = [c for c in calls if secret in c["stdin"]]
    assert all(secret not in " ".join(c["argv"]) for c in calls)
    assert [c["argv"][:3] for c in carrying] == [["create", "-f", "-"]], [c["argv"] for c in carrying]
    docs = list(yaml.safe_load_all(carrying[0]["stdin"]))
    assert [d["kind"] for d in docs] == ["Secret"]
    assert not any(secret in c["stdin"] for c in calls if c["argv"][:1] == ["apply"])
    # Every call after the first names the context the run began on, the delete included.
    assert any(c["ctx"] == "ctx-b" for c in calls)
    unpinned = [c["argv"] for c in calls if "--context=ctx-a" not in c["argv"]]
    assert unpinned == [], unpinned
    assert any(c["argv"][:2] == ["delete", "namespace"] and c["ctx"] == "ctx-b" for c in calls)


def test_a_box_holding_idle_connections_cannot_crowd_the_bundle_server(tmp_path: Path) -> None:
    """Attack: one box opens hundreds of connections to :3129 and sends half a request line. Each held
    a thread until the 128 MiB container was OOM-killed; now one address holds at most PER_CLIENT.
    Twin: another address (another box pod) still gets the bundle."""
    import http.client
    import socket
    import time

    from relay.modes import kube_bundle

    (tmp_path / kube_bundle.NAME).write_bytes(b"the bundle")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "relay.modes.kube_bundle", "serve", "--dir", str(tmp_path), "--listen",
                               f"0.0.0.0:{port}"], stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parent.parent)
    held = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        for _ in range(300):
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            c.sendall(b"GET /workspace.bundle HTTP/1.1\r\n")
            held.append(c)
        time.sleep(1)
        threads = int(next(ln.split()[1] for ln in open(f"/proc/{server.pid}/status") if ln.startswith("Threads:")))
        assert threads <= kube_bundle.PER_CLIENT + 4, threads
        # Another box pod's address (all of 127/8 is loopback).
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=("127.0.0.2", 0))
        conn.request("GET", kube_bundle.PATH)
        assert conn.getresponse().read() == b"the bundle"
        conn.close()
    finally:
        for c in held:
            c.close()
        server.kill()
        server.wait()
