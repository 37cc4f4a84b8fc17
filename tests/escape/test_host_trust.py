"""The host trusts nothing the box wrote: the janitor, guard, sync-back and launcher run with the
caller's rights (root's in the root pass), so each test has the box prepare a trap for them and
checks the host side walked around it, beside the legitimate twin that must still work.

Both modes where the host-side code is shared (guard and sync-back run after a container too).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import Sandbox, require_box

pytestmark = pytest.mark.box

SETTINGS = ".claude/settings.json"
ORIGINAL = '{"theme": "dark"}\n'
HOOKED = '{"hooks": {"Stop": [{"hooks": [{"type": "command", "command": "touch /tmp/pwned"}]}]}}'


@pytest.fixture(params=["local", "container"])
def mode_box(request: pytest.FixtureRequest) -> tuple[Sandbox, str]:
    mode = request.param
    if mode == "local":
        require_box()
        return request.getfixturevalue("sandbox"), mode
    return request.getfixturevalue("csandbox"), mode


def run(s: Sandbox, mode: str, script: str, backend: str = "claude", **kw) -> subprocess.CompletedProcess:
    return s.relay(backend, mode, "--quiet", "--prompt", script, timeout=kw.pop("timeout", 120), **kw)


def _no_aside_escaped(s: Sandbox) -> bool:
    return (s.home / ".bashrc").read_text() == "# the user's own\n"


@pytest.mark.parametrize("trap", ["link-to-bashrc", "fifo", "directory", "huge"])
def test_a_guarded_file_replaced_by_a_trap_is_moved_aside_and_restored(mode_box, trap: str, report) -> None:
    s, mode = mode_box
    (s.home / ".bashrc").write_text("# the user's own\n")
    (s.home / SETTINGS).write_text(ORIGINAL)
    make = {
        "link-to-bashrc": f'rm -f "$HOME/{SETTINGS}"; ln -s "$HOME/.bashrc" "$HOME/{SETTINGS}"',
        "fifo": f'rm -f "$HOME/{SETTINGS}"; mkfifo "$HOME/{SETTINGS}"',
        "directory": f'rm -f "$HOME/{SETTINGS}"; mkdir "$HOME/{SETTINGS}"',
        "huge": f'head -c 6000000 /dev/zero | tr "\\0" " " > "$HOME/{SETTINGS}"; echo \'{HOOKED}\' >> "$HOME/{SETTINGS}"',
    }[trap]
    # Every aside/temporary name the box could predict is a link to the user's .bashrc.
    guesses = " ".join(f'"$HOME/.claude/settings.json.hive-relay-{t}"' for t in ("rejected", "tmp", "rejected-0"))
    script = f'for g in {guesses}; do ln -sf "$HOME/.bashrc" "$g"; done; {make}; echo PLANTED'
    proc = run(s, mode, script)
    assert "PLANTED" in proc.stdout, proc.stderr
    path = s.home / SETTINGS
    restored = path.is_file() and not path.is_symlink() and path.read_text() == ORIGINAL
    # a trap is reverted; an oversized file cannot be judged, so it is kept aside for review (nothing taken)
    said = "reverted" in proc.stderr or (trap == "huge" and "accept-state" in proc.stderr)
    report.attack(restored and _no_aside_escaped(s) and said)
    assert restored, (proc.stderr, path.is_symlink(), path.exists())
    assert _no_aside_escaped(s) and said, proc.stderr
    # The twin: an edit that runs nothing later is kept as the box wrote it.
    proc = run(s, mode, f'printf \'{{"theme": "light"}}\\n\' > "$HOME/{SETTINGS}"')
    report.legit(path.read_text() == '{"theme": "light"}\n')
    assert path.read_text() == '{"theme": "light"}\n' and "reverted" not in proc.stderr, proc.stderr


def test_sync_back_never_copies_through_a_link_the_box_made(mode_box, report) -> None:
    s, mode = mode_box
    before = (s.home / ".claude.json").read_text()
    proc = run(s, mode, 'rm -f "$HOME/.claude.json"; ln -s "$HOME/.ssh/id_rsa" "$HOME/.claude.json"; echo LINKED')
    assert "LINKED" in proc.stdout, proc.stderr
    host = s.home / ".claude.json"
    kept = host.is_file() and not host.is_symlink() and host.read_text() == before
    report.attack(kept and "PRIVATE-KEY" not in host.read_text())
    assert kept and "did not sync" in proc.stderr, proc.stderr
    # The twin: a real edit of the box's copy comes back.
    proc = run(s, mode, 'printf \'{"numStartups": 2}\\n\' > "$HOME/.claude.json"')
    report.legit(host.read_text() == '{"numStartups": 2}\n')
    assert host.read_text() == '{"numStartups": 2}\n', proc.stderr


def _leftovers(s: Sandbox) -> list[str]:
    run_dir = Path(s.env["XDG_RUNTIME_DIR"])
    runs = [p.name for p in run_dir.glob("hive-relay-*")] if run_dir.is_dir() else []
    holders = [p.name for p in s.workdir.iterdir() if p.name.startswith(".") and _empty_file(p)]
    return runs + holders


def _empty_file(p: Path) -> bool:
    """An empty regular file (a placeholder left behind); one the janitor removes between the listing
    and this look is gone, not left over (the census raced the cleanup it waits for)."""
    try:
        st = p.lstat()
    except FileNotFoundError:
        return False
    return st.st_size == 0 and stat.S_ISREG(st.st_mode)


def _wait_for(predicate, timeout: float = 20.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_signal_to_the_box_process_group_spares_the_launcher_and_its_job(mode_box, report) -> None:
    s, mode = mode_box
    already = set(_leftovers(s))  # container mode shares one runtime dir across tests
    # A sentinel in the launcher's own process group: the caller's other processes in the job.
    script = (f'sleep 60 >/dev/null 2>&1 & echo $! > {s.root}/sentinel; exec {sys.executable} -m relay shell {mode} --quiet '
              f'--prompt "echo BOXED; kill -KILL 0; sleep 5; echo SURVIVED"')
    proc = subprocess.run(["sh", "-c", script], cwd=s.workdir, env=s.env, capture_output=True, text=True,
                          timeout=120, start_new_session=True)
    sentinel = int((s.root / "sentinel").read_text())
    alive = _pid_alive(sentinel)
    if alive:
        os.kill(sentinel, signal.SIGKILL)
    cleaned = _wait_for(lambda: not set(_leftovers(s)) - already)
    # Local: the box's shell dies and the launcher lives to report it. Container: the shell is the
    # container's pid 1, which a SIGKILL from inside its own namespace does not reach at all.
    expected = 128 + signal.SIGKILL if mode == "local" else 0
    report.attack(alive and cleaned and proc.returncode == expected)
    assert "BOXED" in proc.stdout and ("SURVIVED" not in proc.stdout) == (mode == "local"), proc.stderr
    assert proc.returncode == expected, proc.stderr
    assert alive, "kill(0) in the box reached the caller's own process group"
    assert cleaned, set(_leftovers(s)) - already
    ok = s.relay("shell", mode, "--quiet", "--prompt", "echo FINE")
    report.legit(ok.returncode == 0 and "FINE" in ok.stdout)
    assert ok.returncode == 0 and "FINE" in ok.stdout, ok.stderr


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_janitor_survives_a_kill_of_the_launchers_group(box_sandbox: Sandbox, report) -> None:
    s = box_sandbox
    (s.home / SETTINGS).write_text(ORIGINAL)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "relay", "claude", "local", "--quiet", "--prompt",
         f"echo '{HOOKED}' > \"$HOME/{SETTINGS}\"; echo READY; sleep 60"],
        cwd=s.workdir, env=s.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True)
    try:
        assert launcher.stdout is not None and "READY" in launcher.stdout.readline()
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    reverted = _wait_for(lambda: _text(s.home / SETTINGS) == ORIGINAL)  # briefly absent while moved aside
    cleaned = _wait_for(lambda: not _leftovers(s))
    report.fault(reverted and cleaned)
    assert reverted, (s.home / SETTINGS).read_text()
    assert cleaned, _leftovers(s)


def test_a_directory_fd_the_caller_leaked_does_not_reach_the_box(mode_box, report) -> None:
    s, mode = mode_box
    fd = os.open(s.home / ".ssh", os.O_RDONLY | os.O_DIRECTORY)
    os.set_inheritable(fd, True)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "relay", "shell", mode, "--quiet", "--prompt",
             f"cat /proc/self/fd/{fd}/id_rsa 2>&1; ls /proc/self/fd/; cat README.md"],
            cwd=s.workdir, env=s.env, capture_output=True, text=True, timeout=120, pass_fds=(fd,))
    finally:
        os.close(fd)
    leaked = "PRIVATE-KEY" in proc.stdout
    report.attack(not leaked)
    assert not leaked, proc.stdout
    assert str(fd) not in proc.stdout.split("\n")[1:-2] or fd <= 3, proc.stdout
    report.legit("hello from the workdir" in proc.stdout)
    assert "hello from the workdir" in proc.stdout, proc.stderr


def test_every_writable_tmpfs_is_sized_within_the_memory_limit(box_sandbox: Sandbox, report) -> None:
    s = box_sandbox
    dirs = ["/tmp", "/var/tmp", "/run", "/dev/shm", str(s.home)]
    proc = s.box(f"df -B1 --output=target,size {' '.join(dirs)}; touch /dev/planted 2>&1; "
                 "echo x > /dev/shm/ok && echo SHM-OK; echo x > /tmp/ok && echo TMP-OK", "shell", "--profile", "agent")
    sizes = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            sizes[parts[0]] = int(parts[1])
    memory = 8 << 30  # the agent profile
    bounded = set(sizes) == set(dirs) and all(v <= memory // 4 for v in sizes.values()) and sum(sizes.values()) <= memory
    dev_ro = "Read-only file system" in proc.stdout
    report.attack(bounded and dev_ro)
    assert bounded, (sizes, proc.stdout, proc.stderr)
    assert dev_ro, proc.stdout
    report.legit("SHM-OK" in proc.stdout and "TMP-OK" in proc.stdout)
    assert "SHM-OK" in proc.stdout and "TMP-OK" in proc.stdout, proc.stderr


def test_hive_relays_own_state_cache_and_config_are_read_only_in_the_box(box_sandbox: Sandbox, report) -> None:
    """Where the workdir covers our own dirs (XDG dirs inside the checkout here), the box can write
    the checkout but not the memos, logs, registry or the user config that may widen the next box."""
    s = box_sandbox
    xdg = {"XDG_CACHE_HOME": str(s.workdir / "xdg-cache"), "XDG_STATE_HOME": str(s.workdir / "xdg-state"),
           "XDG_CONFIG_HOME": str(s.workdir / "xdg-config")}
    cfg = s.workdir / "xdg-config" / "hive-relay"
    cfg.mkdir(parents=True)
    (cfg / "config.yaml").write_text((s.home / ".config" / "hive-relay" / "config.yaml").read_text())
    (s.workdir / "xdg-cache" / "hive-relay").mkdir(parents=True)
    targets = ["xdg-cache/hive-relay/verified.json", "xdg-cache/hive-relay/probe.json",
               "xdg-state/hive-relay/placeholders.json", "xdg-config/hive-relay/config.yaml"]
    script = "; ".join(f'(echo planted > {t}) 2>/dev/null && echo WROTE {t}' for t in targets)
    proc = s.box(script + "; echo edit > src.txt && echo SRC-OK", "shell", extra_env=xdg)
    wrote = [line for line in proc.stdout.splitlines() if line.startswith("WROTE")]
    report.attack(not wrote)
    assert not wrote, (proc.stdout, proc.stderr)
    assert "planted" not in (cfg / "config.yaml").read_text()
    report.legit("SRC-OK" in proc.stdout and (s.workdir / "src.txt").read_text() == "edit\n")
    assert "SRC-OK" in proc.stdout, proc.stderr


def test_the_decision_log_is_never_written_through_a_planted_link(tmp_path: Path, report) -> None:
    from relay.egress.decision_log import DecisionLog
    from relay.policy.egress import Decision

    logs = tmp_path / "logs"
    logs.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("the user's file\n")
    (logs / "run.jsonl").symlink_to(victim)
    log = DecisionLog(str(logs / "run.jsonl"), "shell")
    log.record(Decision(False, "evil.test", 443, "not allowed"), "CONNECT")
    log.close()
    report.attack(victim.read_text() == "the user's file\n" and log.write_errors == 1)
    assert victim.read_text() == "the user's file\n" and log.write_errors == 1
    fresh = DecisionLog(str(logs / "fresh.jsonl"), "shell")
    fresh.record(Decision(False, "evil.test", 443, "not allowed"), "CONNECT")
    fresh.close()
    report.legit('"evil.test"' in (logs / "fresh.jsonl").read_text())
    assert '"evil.test"' in (logs / "fresh.jsonl").read_text()


def test_a_guarded_file_rewritten_in_place_with_its_mtime_restored_is_still_reverted(mode_box, report) -> None:
    """Same inode, same size, mtime set back to the nanosecond: only the bytes tell, so the guard
    compares the bytes."""
    s, mode = mode_box
    original = '{"theme": "dark", "model": "a", "permissions": {"allow": ["Bash(ls)"]}, "note": "' + "x" * 120 + '"}\n'
    (s.home / SETTINGS).write_text(original)
    payload = HOOKED
    script = (f'f="$HOME/{SETTINGS}"; m=$(stat -c %y "$f"); n=$(stat -c %s "$f"); '
              f"p='{payload}'; pad=$((n - ${{#p}} - 1)); "
              'printf "%s%*s\\n" "$p" "$pad" "" 1<>"$f"; touch -d "$m" "$f"; echo DONE')
    proc = run(s, mode, script)
    assert "DONE" in proc.stdout, proc.stderr
    path = s.home / SETTINGS
    # The host's file keeps every non-data key as it was (the box's version is kept aside for review); the
    # box's data-key changes (here: theme and model removed) are the only ones taken.
    host = json.loads(path.read_text())
    reverted = "hooks" not in host and host["permissions"] == {"allow": ["Bash(ls)"]} and "accept-state" in proc.stderr
    report.attack(reverted)
    assert reverted, (path.read_text(), proc.stderr)


def test_a_daemon_the_box_forked_does_not_outlive_the_run(box_sandbox: Sandbox, report) -> None:
    """A double-forked, setsid daemon: in the process tier there is no pid namespace, so the launcher
    reaps every descendant (it is a subreaper) before the guard runs; a root caller is refused that
    tier, and the supervised box is checked in both cases."""
    s = box_sandbox
    daemon = '( setsid sh -c "while :; do date +%s%N > ./tick; sleep 0.05; done" </dev/null >/dev/null 2>&1 & ); sleep 0.3; echo STARTED'
    tiers = ["supervised"] + (["process"] if os.getuid() != 0 else [])
    for tier in tiers:
        proc = s.relay("shell", "local", "--quiet", "--isolation", tier, "--prompt", daemon)
        assert "STARTED" in proc.stdout, (tier, proc.stderr)
        first = (s.workdir / "tick").read_text()
        time.sleep(0.5)
        stopped = (s.workdir / "tick").read_text() == first
        report.attack(stopped)
        assert stopped, f"a daemon from the {tier} tier still writes after the run"
        (s.workdir / "tick").unlink()
    if os.getuid() == 0:
        proc = s.relay("shell", "local", "--quiet", "--isolation", "process", "--prompt", "true")
        report.attack(proc.returncode == 3)
        assert proc.returncode == 3, proc.stderr
    ok = s.box("echo FINE")
    report.legit("FINE" in ok.stdout)
    assert "FINE" in ok.stdout
