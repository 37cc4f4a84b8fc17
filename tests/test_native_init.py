"""The gvisor box's compiled init (relay/host/native_init.py): built once per source and compiler, used
only from a cache that is ours alone, a failed build kept (and said), the Python init on request. The
init's behaviour in a real box is tests/test_gvisor.py's (each test on both inits)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from relay.host import native_init

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and os.environ.get("CI") != "true",
                                reason="LOUD SKIP: no C compiler here (CI installs gcc and libc6-dev)")


def _env(tmp_path: Path, **more: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", os.defpath), "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "HOME": str(tmp_path), **more}


def test_built_once_then_found_and_run(tmp_path: Path) -> None:
    import subprocess

    env = _env(tmp_path)
    path, how = native_init.find(env)
    assert path and how.startswith("compiled") and Path(path).read_bytes()[:4] == b"\x7fELF", how
    assert os.stat(path).st_mode & 0o777 == 0o500
    built = os.stat(path).st_mtime_ns
    assert native_init.find(env) == (path, how) and os.stat(path).st_mtime_ns == built  # not built again
    usage = subprocess.run([path], capture_output=True, text=True)  # the binary itself: its usage, exit 2
    assert usage.returncode == 2 and "usage: gvisor-init" in usage.stderr
    bad = tmp_path / "bad.bpf"
    bad.write_bytes(b"1234567")  # not a whole sock_filter: the agent never starts, unfiltered or otherwise
    run = subprocess.run([path, "-", "-", str(bad), "--", "/bin/echo", "RAN"], capture_output=True, text=True)
    assert run.returncode == 3 and "malformed seccomp program" in run.stderr and "RAN" not in run.stdout
    twin = subprocess.run([path, "-", "-", "-", "--", "/bin/sh", "-c", "exit 7"], capture_output=True, text=True)
    assert twin.returncode == 7
    missing = subprocess.run([path, "-", "-", "-", "--", "/nonexistent/agent"], capture_output=True, text=True)
    assert missing.returncode == 127 and "cannot start /nonexistent/agent" in missing.stderr


def test_a_binary_another_could_have_written_is_never_used(tmp_path: Path) -> None:
    env = _env(tmp_path)
    path, _ = native_init.find(env)
    assert path
    os.chmod(path, 0o577)  # writable by its group and others: built again, never run as it is
    again, how = native_init.find(env)
    assert again == path and os.stat(path).st_mode & 0o777 == 0o500, how
    os.chmod(os.path.dirname(path), 0o777)  # a folder on the way that others may write: not ours alone
    assert native_init._trusted(str(tmp_path / "cache"), os.path.relpath(path, tmp_path / "cache").rsplit("/", 1)[0]) \
        is None


def test_a_compiler_that_fails_is_said_once_and_the_python_init_runs(tmp_path: Path) -> None:
    fake = tmp_path / "bin" / "cc"
    fake.parent.mkdir()
    count = tmp_path / "runs"
    fake.write_text(f"#!/bin/sh\necho run >> {count}\necho 'cannot find -lc' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = _env(tmp_path, CC=str(fake))
    path, why = native_init.find(env)
    assert path is None and "cannot link the compiled init statically (cannot find -lc)" in why
    assert "apt-get install gcc libc6-dev" in why
    assert native_init.find(env) == (None, why) and count.read_text() == "run\n"  # kept: not compiled again


def test_the_python_init_on_request_and_without_a_compiler(tmp_path: Path) -> None:
    assert native_init.find(_env(tmp_path, HIVE_RELAY_GVISOR_INIT="python")) == (None, "HIVE_RELAY_GVISOR_INIT=python")
    path, why = native_init.find(_env(tmp_path, CC="no-such-cc"))
    assert path is None and "no C compiler" in why and "fix:" in why


def test_the_build_runs_nothing_from_the_callers_path_and_a_link_in_the_cache_is_said(tmp_path: Path) -> None:
    """A PATH entry the box could write (a checkout's bin/) holds a planted `as` and `cc`: the build uses
    the system's (red team: gcc found `as` on the caller's PATH). A link where the binary goes is one
    line and the Python init, never a crash."""
    planted = tmp_path / "work" / "bin"
    planted.mkdir(parents=True)
    for tool in ("as", "cc", "ld"):
        (planted / tool).write_text(f"#!/bin/sh\ntouch {tmp_path}/planted-{tool}-ran\nexit 1\n")
        (planted / tool).chmod(0o755)
    env = _env(tmp_path, PATH=f"{planted}:{os.environ.get('PATH', os.defpath)}")
    path, how = native_init.find(env)
    assert path and how.startswith("compiled"), how
    assert not list(tmp_path.glob("planted-*-ran"))
    os.unlink(path)
    os.symlink("/bin/true", path)
    again, why = native_init.find(env)
    assert again is None and "not a plain file of ours" in why, why
