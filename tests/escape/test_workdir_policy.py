"""Which workdirs a box may get: $HOME, its ancestors, system trees, the config tree, deny-listed
paths and hive relay's own dirs are refused (exit 3, one line, the fix, nothing left behind),
while a normal checkout (and one under /tmp) works."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relay.policy.workdir import refusal

from ..conftest import Sandbox

HOME = "/home/u"
DENIED = ["/home/u/.ssh", "/home/u/.aws"]
PATH_DIRS = ["/usr/bin", "/home/u/.cargo/bin", "/home/u/go/bin", "/home/u/src/project/.venv/bin"]
OWN = ["/home/u/.config/hive-relay", "/home/u/.local/state/hive-relay", "/home/u/.cache/hive-relay"]


@pytest.mark.parametrize("workdir", [
    "/", "/home", HOME, "/etc", "/etc/nginx", "/usr/local/src", "/tmp", "/var/tmp", "/var", "/run/user/1000",
    "/home/u/.config", "/home/u/.config/nvim", "/home/u/.local/bin", "/home/u/.ssh", "/home/u/.aws/x",
    "/home/u/.cache/hive-relay", "/proc/self", "/home/u/bin", "/home/u/.cargo/bin", "/home/u/go/bin/x",
])
def test_refused_workdirs(workdir: str, report) -> None:
    reason = refusal(workdir, HOME, DENIED, OWN, "/home/u/.config", PATH_DIRS)
    report.attack(reason is not None)
    assert reason and "; fix: " in reason and "\n" not in reason


@pytest.mark.parametrize("workdir", ["/home/u/src/project", "/tmp/project", "/srv/app", "/home/u/.cache/other",
                                     "/var/tmp/x", "/work/main"])
def test_normal_checkouts_are_accepted(workdir: str, report) -> None:
    reason = refusal(workdir, HOME, DENIED, OWN, "/home/u/.config", PATH_DIRS)
    report.legit(reason is None)
    assert reason is None


def _refused(s: Sandbox, workdir: Path) -> tuple[bool, str]:
    before = sorted(os.listdir(s.env["XDG_RUNTIME_DIR"]))
    proc = s.relay("shell", "local", "--quiet", "--workdir", str(workdir), "--prompt", "touch planted")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    ok = (proc.returncode == 3 and len(lines) == 1 and lines[0].startswith("hive-relay: error: ")
          and "fix:" in lines[0] and sorted(os.listdir(s.env["XDG_RUNTIME_DIR"])) == before
          and not (workdir / "planted").exists())
    return ok, proc.stderr


def test_home_and_its_config_tree_are_refused_while_a_checkout_works(box_sandbox: Sandbox, report) -> None:
    s = box_sandbox
    (s.home / ".config" / "nvim").mkdir(parents=True)
    for workdir in (s.home, s.home.parent, s.home / ".config" / "nvim"):
        ok, err = _refused(s, workdir)
        report.attack(ok)
        assert ok, (workdir, err)
    proc = s.relay("shell", "local", "--quiet", "--prompt", "touch planted && echo OK")
    report.legit(proc.returncode == 0 and (s.workdir / "planted").exists())
    assert proc.returncode == 0 and (s.workdir / "planted").exists(), proc.stderr
