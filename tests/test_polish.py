"""Polish that users notice: the dry run speaks like the banner, doctor's MISS lines carry a fix and leave
nothing behind, selftest prints only its table, and a root caller's box user has a sane name."""

from __future__ import annotations

import pytest

from .conftest import Sandbox


@pytest.mark.box
def test_dry_run_says_egress_none_like_the_banner_and_prints_human_sizes(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    dry = s.relay("shell", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    egress = next(ln for ln in lines if ln.startswith("egress "))
    limits = next(ln for ln in lines if ln.startswith("limits "))
    assert egress.split(None, 1)[1] == "none (proxy refuses all)", egress
    assert limits.startswith("limits   8GiB memory, 512 processes via "), limits
    ran = s.relay("shell", "local", "--prompt", "true")
    assert ran.returncode == 0, ran.stderr
    assert "egress: none (proxy refuses all)" in ran.stderr and "limits 8GiB mem" in ran.stderr
    tight = s.relay("shell", "--profile", "tight", "--dry-run").stdout
    assert "limits   256MiB memory, 64 processes" in tight
    assert "egress   no network" in s.relay("shell", "--profile", "default", "--dry-run").stdout


@pytest.mark.box
def test_the_box_user_carries_the_callers_name_never_the_hosts_uid_1000_owner(box_sandbox: Sandbox) -> None:
    import os
    import pwd

    s = box_sandbox
    me = pwd.getpwuid(os.getuid()).pw_name
    proc = s.box("id -un; id -gn; id -u; getent passwd $(id -u); echo x >> /etc/passwd && echo WROTE; "
                 "awk -F: '{print $1}' /etc/passwd | sort | uniq -d | sed 's/^/DUP /'")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == me and lines[1] == me, proc.stdout
    box_uid = int(lines[2])
    entry = lines[3].split(":")
    assert entry[0] == me and entry[2] == str(box_uid), lines[3]
    assert "WROTE" not in proc.stdout and not any(ln.startswith("DUP ") for ln in lines), proc.stdout
    if os.getuid() == 0:
        # Root callers run as 1000 in the box; the host's owner of 1000 (if any) is not named there.
        assert box_uid == 1000 and entry[5] == str(s.home), lines[3]  # the box's HOME
        try:
            host_owner = pwd.getpwuid(1000).pw_name
        except KeyError:
            host_owner = None
        if host_owner and host_owner != me:
            assert host_owner not in proc.stdout
    else:
        assert box_uid == os.getuid()  # the host's own entry, unchanged


def _invoke_argv(*args: str) -> list[str]:
    import sys

    from .conftest import REPO

    return [sys.executable, "-m", "invoke", "--search-root", str(REPO), *args]


@pytest.mark.box
def test_selftest_prints_only_its_table_in_a_terminal(box_sandbox: Sandbox) -> None:
    import pexpect

    s = box_sandbox
    argv = _invoke_argv("selftest", "--backend", "shell")
    child = pexpect.spawn(argv[0], argv[1:], cwd=str(s.workdir), env=s.env, encoding="utf-8", timeout=240,
                          dimensions=(50, 200))
    child.expect(pexpect.EOF)
    child.close()
    lines = [ln for ln in child.before.replace("\r", "").split("\n") if ln.strip()]
    assert child.exitstatus == 0, child.before
    assert lines[0].split() == ["backend", "tier", "profile", "probe", "kind", "result", "detail"], lines[:3]
    assert not [ln for ln in lines if ln.startswith("hive-relay")], lines
    assert lines[-1].endswith("legitimate uses working")


@pytest.mark.box
def test_selftest_attacks_a_planted_key_when_the_user_has_no_ssh_dir(box_sandbox: Sandbox) -> None:
    import json
    import shutil
    import subprocess

    s = box_sandbox
    shutil.rmtree(s.home / ".ssh")
    proc = subprocess.run(_invoke_argv("selftest", "--backend", "shell", "--json"), cwd=s.workdir, env=s.env,
                          capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    row = next(r for r in json.loads(proc.stdout) if r["probe"] == "read ~/.ssh")
    assert row["ok"] and "planted key: " in row["detail"], row
    assert not (s.home / ".ssh").exists(), "the planted key (and the dir made for it) were left behind"
    # With the user's own ~/.ssh, only the planted key goes, and it goes even when the box left a link.
    (s.home / ".ssh").mkdir(mode=0o700)
    (s.home / ".ssh" / "id_ed25519").write_text("KEY\n")
    again = subprocess.run(_invoke_argv("selftest", "--backend", "shell", "--json"), cwd=s.workdir, env=s.env,
                           capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert again.returncode == 0, again.stdout + again.stderr
    assert sorted(p.name for p in (s.home / ".ssh").iterdir()) == ["id_ed25519"]


def test_clean_removes_a_selftest_key_a_killed_selftest_left(sandbox: Sandbox) -> None:
    key = sandbox.home / ".ssh" / "id_hive_relay_selftest_0123456789ab"
    key.write_text("x\n")
    proc = sandbox.relay("clean")
    assert proc.returncode == 0 and not key.exists(), proc.stdout
    assert (sandbox.home / ".ssh" / "id_rsa").exists()
    assert any(ln.startswith("removed") and "selftest key" in ln for ln in proc.stdout.splitlines())


def _doctor(s: Sandbox, *args: str, env: dict[str, str] | None = None):
    import subprocess

    return subprocess.run(_invoke_argv("doctor", *args), cwd=s.workdir, env=env or s.env, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_doctor_gives_every_miss_line_a_fix(sandbox: Sandbox) -> None:
    import os
    import sys

    s = sandbox
    bare = s.root / "bare-bin"  # a PATH with python and nothing else: no bwrap, no engines, no npm CLIs
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)
    proc = _doctor(s, env={**s.env, "PATH": str(bare)})
    assert proc.returncode == 0, proc.stderr
    misses = [ln for ln in proc.stdout.splitlines() if ln.startswith("MISS")]
    assert any(" bubblewrap " in ln for ln in misses) and any(" podman " in ln for ln in misses), proc.stdout
    assert any(" user namespaces " in ln for ln in misses), proc.stdout
    assert [ln for ln in misses if "fix: " not in ln] == []
    full = _doctor(s)
    assert [ln for ln in full.stdout.splitlines() if ln.startswith("MISS") and "fix: " not in ln] == []
    assert os.environ.get("PATH")  # the real host's own MISS lines (if any) were checked too


def test_doctor_never_shows_an_engine_that_does_not_answer_as_ok(sandbox: Sandbox) -> None:
    import json
    import shutil

    from .conftest import require_tool

    require_tool("docker")
    s = sandbox
    only = s.root / "engine-bin"
    only.mkdir()
    (only / "docker").symlink_to(shutil.which("docker"))
    env = {**s.env, "PATH": f"{only}:/usr/bin:/bin", "DOCKER_HOST": f"unix://{s.root}/no-such.sock"}
    data = json.loads(_doctor(s, "--json", env=env).stdout)
    docker = next(c for c in data["components"] if c["name"] == "docker")
    assert not docker["ok"] and "does not answer" in docker["detail"] and "fix: " in docker["detail"], docker


def test_doctor_leaves_no_pause_process_or_engine_dirs_behind(sandbox: Sandbox) -> None:
    import os

    from .conftest import require_tool

    require_tool("podman")
    s = sandbox
    run = s.root / "run"
    before = {p.relative_to(s.root) for p in s.root.rglob("*")}
    proc = _doctor(s)
    assert proc.returncode == 0, proc.stderr
    assert "podman" in proc.stdout
    after = {p.relative_to(s.root) for p in s.root.rglob("*")}
    new = sorted(str(p) for p in after - before if not str(p).startswith("home/.cache/hive-relay"))
    assert new in ([], ["home/.cache"]), new  # only hive relay's own probe memo
    marker = f"XDG_RUNTIME_DIR={run}".encode()
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if marker in fh.read().split(b"\0"):
                    left.append(pid)
        except OSError:
            continue
    assert left == [], f"processes started by doctor are still running: {left}"
