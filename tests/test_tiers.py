"""Tier auto-pick, refusal and opt-in, with real host probes and probes forced to fail (no bwrap on PATH)."""

from __future__ import annotations

import os
from pathlib import Path

from .conftest import Sandbox

TOOLS = ("sh", "cat", "ls", "id", "echo", "env", "python3", "true", "head")


def without_bwrap(s: Sandbox) -> dict[str, str]:
    """A PATH that has the usual tools but no bubblewrap: the probe must notice, not assume."""
    bindir = s.root / "nobwrap-bin"
    bindir.mkdir(exist_ok=True)
    for tool in TOOLS:
        link = bindir / tool
        if not link.exists():
            link.symlink_to(f"/usr/bin/{tool}")
    return {"PATH": str(bindir)}


ROOT = os.getuid() == 0


def test_auto_without_bwrap_falls_back_or_refuses_with_the_missing_piece(sandbox: Sandbox) -> None:
    proc = sandbox.relay("shell", "local", "--prompt", "echo RAN", extra_env=without_bwrap(sandbox))
    if ROOT:
        assert proc.returncode == 3
        assert "bubblewrap is not installed; fix: apt-get install bubblewrap" in proc.stderr
        assert "root caller" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert "RAN" in proc.stdout
        assert "process · profile default" in proc.stderr
        assert "note: using the fail-closed default profile at the process tier: bubblewrap is not installed" in proc.stderr


def test_agent_backend_without_bwrap_is_refused_naming_the_opt_in(sandbox: Sandbox) -> None:
    """An agent at the process tier would start with no network and fail: refused, root or not."""
    proc = sandbox.relay("claude", "local", "--prompt", "echo RAN", extra_env=without_bwrap(sandbox))
    assert "HIVE_RELAY_UNSANDBOXED_CLAUDE=1" in proc.stderr
    assert proc.returncode == 3 and "RAN" not in proc.stdout


def test_explicit_agent_profile_is_never_downgraded(sandbox: Sandbox) -> None:
    proc = sandbox.relay("shell", "local", "--profile", "agent", "--prompt", "echo RAN", extra_env=without_bwrap(sandbox))
    assert proc.returncode == 3
    assert "RAN" not in proc.stdout
    assert "profile 'agent' needs egress" in proc.stderr and "apt-get install bubblewrap" in proc.stderr


def test_agent_at_process_tier_is_refused_even_with_bwrap(sandbox: Sandbox) -> None:
    proc = sandbox.relay("shell", "local", "--profile", "agent", "--isolation", "process", "--prompt", "echo RAN")
    assert proc.returncode == 3 and "RAN" not in proc.stdout
    assert "only the supervised tier enforces" in proc.stderr


def test_explicit_supervised_without_bwrap_refuses(sandbox: Sandbox) -> None:
    proc = sandbox.relay("shell", "local", "--isolation", "supervised", "--prompt", "echo RAN", extra_env=without_bwrap(sandbox))
    assert proc.returncode == 3 and "RAN" not in proc.stdout
    assert "--isolation supervised cannot be enforced: bubblewrap is not installed" in proc.stderr


def test_opt_in_runs_unsandboxed_with_a_loud_banner(sandbox: Sandbox) -> None:
    env = {**without_bwrap(sandbox), "HIVE_RELAY_UNSANDBOXED_CLAUDE": "1"}
    proc = sandbox.relay("claude", "local", "--prompt", "echo RAN-NATIVE; exit 4", extra_env=env)
    assert proc.returncode == 4
    assert "RAN-NATIVE" in proc.stdout
    assert "WARNING: claude runs WITHOUT the hive relay box" in proc.stderr


def test_opt_in_is_ignored_when_the_box_works(box_sandbox: Sandbox) -> None:
    proc = box_sandbox.relay("claude", "local", "--prompt", "cat ~/.ssh/id_rsa 2>&1; true",
                             extra_env={"HIVE_RELAY_UNSANDBOXED_CLAUDE": "1"})
    assert "supervised · profile agent" in proc.stderr
    assert "PRIVATE-KEY" not in proc.stdout


def test_process_tier_confines_files_network_and_sockets(sandbox: Sandbox) -> None:
    """Unprivileged: confinement checked from inside. Root (CI's other pass): the explicit tier is
    refused rather than run weaker, since Landlock cannot hide root-owned files from uid 0."""
    s = sandbox
    script = (
        "cat ~/.ssh/id_rsa 2>&1 || echo NO-SSH; ls ~ 2>&1 || echo NO-HOME; "
        "echo x > /tmp/outside 2>&1 || echo NO-TMP; echo y > \"$TMPDIR/in\" && echo PRIVATE-TMP-OK; "
        "echo z > made.txt && echo WD-OK; "
        "/usr/bin/python3 -c 'import socket\ntry:\n socket.create_connection((\"127.0.0.1\", 9), timeout=2)\n"
        "except OSError as e: print(\"NET\", e.errno)\ntry:\n socket.socket(socket.AF_UNIX)\n"
        "except OSError as e: print(\"UNIX\", e.errno)\na, b = socket.socketpair(); print(\"PAIR-OK\")'"
    )
    proc = s.relay("shell", "local", "--isolation", "process", "--prompt", script)
    out = proc.stdout
    if ROOT:
        assert proc.returncode == 3 and "root caller" in proc.stderr and out == ""
        assert sorted(p.name for p in s.workdir.iterdir()) == ["README.md"]
        return
    assert proc.returncode == 0, proc.stderr
    assert "PRIVATE-KEY" not in out and "NO-SSH" in out and "NO-HOME" in out
    assert "NO-TMP" in out and "PRIVATE-TMP-OK" in out and "WD-OK" in out
    assert "NET 1" in out and "UNIX 1" in out and "PAIR-OK" in out
    assert (s.workdir / "made.txt").exists() and not Path("/tmp/outside").exists()
    assert list((s.root / "run").iterdir()) == []


def test_process_tier_refuses_root_and_only_root() -> None:
    from relay.host.probe import probe
    from relay.policy.tiers import process_error

    error = process_error(probe(use_cache=False)) or ""
    assert ("root caller" in error) is ROOT


def test_process_tier_refuses_a_workdir_holding_our_cache(sandbox: Sandbox) -> None:
    """The process tier's Landlock rules cannot keep ~/.cache/hive-relay read-only inside a writable
    workdir, and the next launch trusts the memos there (relay/host/memo.py): refused. Twin: the same
    run from a workdir that holds none of our paths writes its file."""
    s = sandbox
    cache = s.home / ".cache"
    (cache / "hive-relay").mkdir(parents=True)
    env = {**without_bwrap(s)}
    proc = s.relay("shell", "local", "--isolation", "process", "--live", "--workdir", str(cache),
                   "--prompt", "echo planted > hive-relay/x; echo RAN", extra_env=env)
    assert proc.returncode == 3 and "RAN" not in proc.stdout
    assert not (cache / "hive-relay" / "x").exists()
    if not ROOT:
        assert f"the workdir {cache} holds hive relay's own {cache / 'hive-relay'}" in proc.stderr
        twin = s.relay("shell", "local", "--isolation", "process", "--live", "--prompt", "echo ok > made.txt; echo RAN",
                       extra_env=env)
        assert twin.returncode == 0 and "RAN" in twin.stdout, twin.stderr
        assert (s.workdir / "made.txt").read_text() == "ok\n"
