"""doctor on this host, and a green selftest (real escape probes in real boxes) for every backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import PODMAN, REPO, Sandbox, podman_env


def invoke(s: Sandbox, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(REPO), *args], cwd=s.workdir,
                          env=s.env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_invoke_list_has_a_help_line_for_every_task(sandbox: Sandbox) -> None:
    out = invoke(sandbox, "--list").stdout
    for name in ("contribute-hive", "doctor", "selftest", "test", "bench", "build-image"):
        line = next((ln for ln in out.splitlines() if ln.strip().startswith(name + " ")), "")
        assert line.strip() != name and len(line.split()) > 2, f"{name} has no help line:\n{out}"


def test_doctor_reports_components_and_tiers(sandbox: Sandbox) -> None:
    proc = invoke(sandbox, "doctor")
    assert proc.returncode == 0, proc.stderr
    for component in ("bubblewrap", "user namespaces", "seccomp", "landlock", "cgroup limits",
                      "tty injection sysctl", "podman", "docker", "cli claude"):
        assert component in proc.stdout
    assert "supervised/agent" in proc.stdout and "enforceable" in proc.stdout
    data = json.loads(invoke(sandbox, "doctor", "--json").stdout)
    assert {c["name"] for c in data["components"]} >= {"bubblewrap", "seccomp", "landlock"}
    assert data["enforceable"]["supervised/agent"] == "enforceable"


@pytest.mark.box
def test_selftest_is_green_for_every_backend(box_sandbox: Sandbox) -> None:
    proc = invoke(box_sandbox, "selftest", "--json")
    rows = json.loads(proc.stdout)
    failed = [r for r in rows if not r["ok"]]
    assert proc.returncode == 0 and not failed, failed or proc.stderr
    assert {r["backend"] for r in rows} == {"claude", "codex", "gemini", "opencode", "shell"}
    probes = {r["probe"] for r in rows}
    for name in ("read ~/.ssh", "write outside the workdir", "connect to a non-allowed host", "AF_UNIX socket()",
                 "TIOCSTI injection", "see host pids", "socketpair()", "connect to an allowed host"):
        assert name in probes
    # The fake HOME has ~/.claude and ~/.codex: each backend's own state is a legitimate probe that worked.
    assert any(r["backend"] == "claude" and r["probe"].endswith("/.claude") and r["ok"] for r in rows)


@pytest.mark.container
def test_selftest_is_green_in_container_mode(csandbox: Sandbox) -> None:
    proc = invoke(csandbox, "selftest", "--mode", "container", "--json", timeout=900)
    rows = json.loads(proc.stdout)
    failed = [r for r in rows if not r["ok"]]
    assert proc.returncode == 0 and not failed, failed or proc.stderr
    assert {r["backend"] for r in rows} == {"claude", "codex", "gemini", "opencode", "shell"}
    assert {r["tier"] for r in rows} == {"container"}
    probes = {r["probe"] for r in rows}
    for name in ("read ~/.ssh", "write outside the workdir", "connect to a non-allowed host", "AF_UNIX socket()",
                 "TIOCSTI injection", "see host pids", "socketpair()", "connect to an allowed host"):
        assert name in probes


def test_selftest_fails_loudly_for_an_unknown_backend(sandbox: Sandbox) -> None:
    proc = invoke(sandbox, "selftest", "--backend", "nope")
    assert proc.returncode == 2 and "unknown backend 'nope'" in proc.stderr


@pytest.mark.container
def test_doctor_reports_the_container_engine_and_whether_it_is_rootless(csandbox: Sandbox) -> None:
    import os

    data = json.loads(invoke(csandbox, "doctor", "--json").stdout)
    podman = next(c for c in data["components"] if c["name"] == "podman")
    assert podman["ok"] and ("rootless" if os.getuid() else "rootful") in podman["detail"]
    # The storage this user's podman really has (CI sets overlay up for its user; a new user may have vfs).
    driver = subprocess.run([PODMAN, "info", "--format", "{{.Store.GraphDriverName}}"], capture_output=True,
                            text=True, env=podman_env()).stdout.strip()
    assert "used for container mode" in podman["detail"] and f"storage {driver}" in podman["detail"], podman
    assert data["enforceable"]["container"].startswith("enforceable with podman")


def test_build_image_help_explains_itself(sandbox: Sandbox) -> None:
    out = invoke(sandbox, "build-image", "--help").stdout
    for flag in ("--base", "--rebuild", "--base-only", "--save-base", "--base-archive"):
        assert flag in out
