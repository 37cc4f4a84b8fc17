"""Rootless podman's storage on first use (issue 27.4), with the real engine: a new user's empty vfs
storage becomes native overlay, said in one line; storage with something in it, or a storage.conf
of the user's own, is never reset, only advised. As root (rootful podman) nothing is touched.

Each case runs podman with a HOME and runtime dir of its own, as a new user's first run would see
it, and leaves nothing behind (the storage removed through `podman unshare`, the pause process gone).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relay.host.container_engine import EngineInfo
from relay.host.podman_storage import StorageStep, decide

from .conftest import REPO

pytestmark = pytest.mark.container

ROOTLESS_VFS = EngineInfo("podman", "podman", "4.3.1", True, "vfs", None)


def test_decide_sets_up_only_empty_unconfigured_rootless_vfs() -> None:
    assert decide(ROOTLESS_VFS, conf_exists=False, empty=True) == StorageStep.SET_UP
    assert decide(ROOTLESS_VFS, conf_exists=True, empty=True) == StorageStep.ADVISE
    assert decide(ROOTLESS_VFS, conf_exists=False, empty=False) == StorageStep.ADVISE
    for other in (EngineInfo("podman", "podman", "4.3.1", True, "overlay", None),
                  EngineInfo("podman", "podman", "4.3.1", False, "vfs", None),
                  EngineInfo("docker", "docker", "27", True, "vfs", None),
                  EngineInfo("podman", "podman", None, False, None, "podman does not answer")):
        assert decide(other, conf_exists=False, empty=True) == StorageStep.KEEP


@pytest.fixture
def new_user(tmp_path: Path):  # noqa: ANN201 - yields the environment
    home = tmp_path / "home"
    run = tmp_path / "run"
    home.mkdir()
    run.mkdir(mode=0o700)
    env = {"HOME": str(home), "XDG_RUNTIME_DIR": str(run), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
           "LANG": "C.UTF-8"}
    yield env
    if os.getuid() != 0:
        subprocess.run(["podman", "unshare", "rm", "-rf", str(home / ".local")], env=env, capture_output=True)
        try:
            os.kill(int((run / "libpod" / "tmp" / "pause.pid").read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    shutil.rmtree(tmp_path, ignore_errors=True)


def _ensure(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "import os; from relay.host.podman_storage import ensure_overlay; print(ensure_overlay('podman', os.environ, print).value)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def _driver(env: dict[str, str]) -> str:
    return subprocess.run(["podman", "info", "--format", "{{.Store.GraphDriverName}}"], env=env, capture_output=True,
                          text=True, timeout=300).stdout.strip()


def test_a_new_rootless_users_empty_vfs_storage_becomes_overlay(new_user: dict[str, str]) -> None:
    env = new_user
    conf = Path(env["HOME"]) / ".config" / "containers" / "storage.conf"
    if os.getuid() == 0:  # rootful podman: its storage is the system's, never changed from here
        proc = _ensure(env)
        assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "keep", proc.stderr
        assert not conf.exists()
        return
    assert _driver(env) == "vfs"  # what a new user of this machine type gets
    proc = _ensure(env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "set-up" and "set up native overlay" in lines[0] and str(conf) in lines[0]
    assert _driver(env) == "overlay" and 'driver = "overlay"' in conf.read_text()
    again = _ensure(env)
    assert again.stdout.strip() == "keep"  # once: later runs find overlay


def test_storage_with_something_in_it_is_never_reset(new_user: dict[str, str]) -> None:
    env = new_user
    if os.getuid() == 0:
        assert _ensure(env).stdout.strip().splitlines()[-1] == "keep"
        return
    made = subprocess.run(["podman", "volume", "create", "keepme"], env=env, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    proc = _ensure(env)
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "advise" and "fix:" in lines[0] and "podman system reset" in lines[0]
    assert _driver(env) == "vfs"
    assert "keepme" in subprocess.run(["podman", "volume", "ls", "-q"], env=env, capture_output=True, text=True).stdout
    assert not (Path(env["HOME"]) / ".config" / "containers" / "storage.conf").exists()
