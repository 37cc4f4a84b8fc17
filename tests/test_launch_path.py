"""What the launch path does instead of importing a module for one call (issue 26's import budget),
each held to the stdlib call it replaces."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relay.host.paths import which

from .conftest import REPO


def test_which_finds_what_shutil_which_finds(tmp_path: Path) -> None:
    bin_a, bin_b, plain = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (bin_a, bin_b, plain):
        d.mkdir()
    (bin_a / "tool").write_text("#!/bin/sh\n")  # not executable: skipped
    (bin_b / "tool").write_text("#!/bin/sh\n")
    (bin_b / "tool").chmod(0o755)
    (plain / "tool").mkdir()  # a directory: skipped
    path = os.pathsep.join([str(plain), str(bin_a), str(bin_b), "/usr/bin", "/bin"])
    for name in ("tool", "sh", "no-such-tool", str(bin_b / "tool"), str(bin_a / "tool")):
        assert which(name, path) == shutil.which(name, path=path), name
    assert which("sh") == shutil.which("sh", path=os.defpath)
    assert which("sh", "") is None is shutil.which("sh", path="")


def test_which_never_finds_a_tool_the_box_planted_in_the_workdir(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """A relative PATH entry (empty, `.`, `bin`) is the current directory, the box-writable workdir:
    skipped, where shutil.which would run the planted `bwrap`; the real one on an absolute entry is the twin."""
    planted = tmp_path / "bin"
    planted.mkdir()
    for d in (tmp_path, planted):
        (d / "bwrap").write_text("#!/bin/sh\necho planted\n")
        (d / "bwrap").chmod(0o755)
    monkeypatch.chdir(tmp_path)
    for path in ("", ":", ".", "bin", ".:bin:"):
        assert which("bwrap", path) is None, path
    assert shutil.which("bwrap", path=".") is not None  # what the stdlib would have run
    real = shutil.which("bwrap", path="/usr/bin:/bin")
    assert real and which("bwrap", ".:bin::/usr/bin:/bin") == real


def test_a_launch_loads_neither_shutil_nor_datetime_and_help_still_fits_the_terminal() -> None:
    script = """
import sys
import time
from relay.commands.cli import build_parser
build_parser().format_help()
import relay.modes.runner, relay.modes.bwrap_runner, relay.egress.proxy, relay.modes.install
print(sorted(m for m in ("shutil", "datetime", "bz2", "lzma") if m in sys.modules))
"""
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "COLUMNS": "60"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out
    helped = subprocess.run([sys.executable, "-m", "relay", "--help"], env=env, capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert helped.returncode == 0 and max(len(line) for line in helped.stdout.splitlines()) <= 60, helped.stdout


@pytest.mark.box
@pytest.mark.parametrize("path", ["", ".:/usr/bin:/bin", "/usr/bin::/bin", "bin:/usr/bin:/bin"])
def test_no_host_tool_is_ever_found_in_the_workdir(box_sandbox, tmp_path: Path, path: str) -> None:  # noqa: ANN001
    """The workdir is the box's to write: tools planted there (bwrap, git, podman) never run on the host,
    whatever relative entries the caller's PATH has; the box still starts and runs (the twin)."""
    s = box_sandbox
    subprocess.run(["git", "init", "-q", str(s.workdir)], check=True)
    ran = tmp_path / "planted-ran"
    for where in (s.workdir, s.workdir / "bin"):
        where.mkdir(exist_ok=True)
        for tool in ("bwrap", "git", "podman", "npm"):
            (where / tool).write_text(f"#!/bin/sh\necho {tool} >> {ran}\nexit 0\n")
            (where / tool).chmod(0o755)
    env = {**s.env, "PATH": path}
    out = subprocess.run([sys.executable, "-m", "relay", "shell", "--quiet", "--prompt", "echo BOX-RAN"],
                         cwd=s.workdir, env=env, capture_output=True, text=True, timeout=120)
    assert not ran.exists(), ran.read_text()
    assert out.returncode == 0 and "BOX-RAN" in out.stdout, out


@pytest.mark.box
def test_the_bootstrap_through_a_link_runs_nothing_planted_in_the_workdir(box_sandbox, tmp_path: Path) -> None:  # noqa: ANN001
    """bin/contribute-hive installed as a link on PATH (the README's way) resolves itself with readlink:
    by then its own PATH has only absolute entries, so a `readlink` (or dirname, cksum, sed) the box left
    in the workdir never runs; the launch through the link works (the twin)."""
    s = box_sandbox
    ran = tmp_path / "planted-ran"
    for where in (s.workdir, s.workdir / "bin"):
        where.mkdir(exist_ok=True)
        for tool in ("readlink", "dirname", "cksum", "cut", "sed", "date", "python3"):
            (where / tool).write_text(f"#!/bin/sh\necho {tool} >> {ran}\nexit 0\n")
            (where / tool).chmod(0o755)
    link_dir = tmp_path / "links"
    link_dir.mkdir()
    (link_dir / "contribute-hive").symlink_to(REPO / "bin" / "contribute-hive")
    env = {**s.env, "PATH": f"{link_dir}:.:bin::/usr/bin:/bin"}
    out = subprocess.run(["contribute-hive", "shell", "--quiet", "--prompt", "echo BOX-RAN"], cwd=s.workdir,
                         env=env, capture_output=True, text=True, timeout=120)
    assert not ran.exists(), ran.read_text()
    assert out.returncode == 0 and "BOX-RAN" in out.stdout, out


def test_the_kube_reaper_never_imports_a_relay_package_from_its_cwd(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The reaper is started with -P: a `relay/` the box left in the workdir (the launcher's cwd) is
    not what it imports; the real one runs its delete (the twin)."""
    from relay.modes import kube_reaper

    planted = tmp_path / "relay"
    planted.mkdir()
    marker = tmp_path / "planted-ran"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    deleted = tmp_path / "deleted"
    monkeypatch.chdir(tmp_path)
    w = kube_reaper.start(["/bin/sh", "-c", f"touch {deleted}"], dict(os.environ))
    os.close(w)  # the launcher is gone without saying done: the reaper deletes
    deadline = time.monotonic() + 30
    while not deleted.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert deleted.exists() and not marker.exists()


def test_the_entry_runs_without_site_and_still_finds_the_venvs_packages(sandbox, tmp_path: Path) -> None:  # noqa: ANN001
    """bin/contribute-hive starts Python with -S (no .pth, sitecustomize or user site-packages, ~5 ms)
    and puts the venv's site-packages on the path itself: a cold memo parses the user's YAML config
    with PyYAML from there (the twin: the config's host is in the plan)."""
    s = sandbox
    conf = s.home / ".config" / "hive-relay" / "config.yaml"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("version: 1\nbackends:\n  shell: {egress: [pypi.example.org]}\n")
    out = subprocess.run([str(REPO / "bin" / "contribute-hive"), "shell", "local", "--dry-run", "--json"],
                         cwd=s.workdir, env=s.env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pypi.example.org" in out.stdout
    assert " -S -c " in (REPO / "bin" / "contribute-hive").read_text().replace("\\\n  ", " ")


def test_a_relative_pythonpath_entry_never_imports_a_module_the_box_planted(sandbox, tmp_path: Path) -> None:  # noqa: ANN001
    """A relative PYTHONPATH entry is the launch's cwd, the workdir: bin/contribute-hive drops it, so a
    stdlib name the box planted there (shlex, imported by every launch) never runs on the host. The
    twin: the launch works, with the caller's absolute entries kept."""
    s = sandbox
    ran = tmp_path / "planted-ran"
    (s.workdir / "plant").mkdir()
    (s.workdir / "plant" / "shlex.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    env = {**s.env, "PYTHONPATH": f"plant:{tmp_path}"}
    out = subprocess.run([str(REPO / "bin" / "contribute-hive"), "shell", "local", "--dry-run"], cwd=s.workdir,
                         env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert not ran.exists()
    assert out.returncode == 0, out.stderr[-2000:]
