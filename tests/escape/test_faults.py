"""Faults: the launcher killed, the agent crashing, upstreams dying mid-stream, the workdir vanishing,
an unwritable log, Ctrl-C storms. Each must leave no stray process, temp dir or socket file, and
the exit code and message must say what happened."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pexpect

from ..conftest import Sandbox, own_processes
from ..servers import start_tcp
from ..test_box import _leftovers

PY = "/usr/bin/python3"


def _own_cmdlines() -> list[str]:
    """This user's command lines only: the other test pass runs the same `sleep N` meanwhile."""
    return [c for _, c in own_processes()]


def wait_gone(fragment: str, s: Sandbox, timeout: float = 10) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(fragment in c for c in _own_cmdlines() if not c.startswith(sys.executable)) and not _leftovers(s):
            return True
        time.sleep(0.05)
    return False


def test_kill_9_during_an_interactive_session(box: Sandbox, report) -> None:
    child = pexpect.spawn(sys.executable, ["-m", "relay", "claude", "local", "--quiet"], cwd=str(box.workdir),
                          env=box.env, encoding="utf-8", timeout=30)
    child.sendline("sleep 302 & echo READY$((1+1))")
    child.expect("READY2")
    os.kill(child.pid, signal.SIGKILL)
    child.close(force=True)
    clean = wait_gone("sleep 302", box)
    report.fault(clean)
    assert clean, _leftovers(box)


def test_agent_crash_is_reported(box: Sandbox, report) -> None:
    proc = box.box("echo before; kill -SEGV $$", "shell")
    ok = proc.returncode == 139 and "killed by SIGSEGV" in proc.stderr and "before" in proc.stdout
    report.fault(ok and not _leftovers(box))
    assert ok, proc.stderr
    assert not _leftovers(box)


def _dying_upstream() -> tuple[socket.socket, int]:
    """Sends half a response, then drops the connection; a second connection gets a full answer."""

    def handle(conn: socket.socket, n: int) -> None:
        with conn:
            conn.recv(65536)
            if n == 1:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 1000)
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond")

    return start_tcp(handle)


def test_upstream_dying_mid_stream(box: Sandbox, report) -> None:
    sock, port = _dying_upstream()
    try:
        proc = box.box(f"curl -s -o /dev/null -w 'first=%{{size_download}} ' http://up.test:{port}/a; echo rc=$?; "
                       f"curl -s http://up.test:{port}/b", "shell", "--allow-host", f"up.test:{port}=127.0.0.1:{port}")
    finally:
        sock.close()
    ok = "first=1000" in proc.stdout and "rc=18" in proc.stdout and proc.stdout.endswith("second")
    report.fault(ok)
    assert ok, proc.stdout + proc.stderr  # curl 18: partial file; the proxy kept serving


def test_workdir_disappearing(box: Sandbox, report) -> None:
    victim = box.root / "vanishing"
    victim.mkdir()
    launcher = subprocess.Popen([sys.executable, "-m", "relay", "shell", "--quiet", "--workdir", str(victim), "--prompt",
                                 "touch started; sleep 2; ls . >/dev/null 2>&1 || echo GONE; exit 5"],
                                cwd=box.workdir, env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 20
    while not (victim / "started").exists() and time.time() < deadline:
        time.sleep(0.05)
    shutil.rmtree(victim, ignore_errors=True)
    out, err = launcher.communicate(timeout=60)
    ok = launcher.returncode == 5 and not _leftovers(box)
    report.fault(ok)
    assert ok, (launcher.returncode, out, err)


def test_unwritable_log_is_reported_not_fatal(box: Sandbox, report) -> None:
    logs = box.home / ".local" / "state" / "hive-relay" / "logs"
    logs.mkdir(parents=True)
    logs.chmod(0o500)
    try:
        proc = box.box("curl -s -o /dev/null -w 'code=%{http_connect}' https://example.com/; exit 0", "shell")
    finally:
        logs.chmod(0o700)
    # Root ignores directory permissions; then the log is simply written.
    expect_error = os.getuid() != 0
    ok = proc.returncode == 0 and "code=403" in proc.stdout and (
        ("egress log could not be fully written" in proc.stderr) == expect_error)
    report.fault(ok)
    assert ok, proc.stdout + proc.stderr


def test_ctrl_c_storm_interactive(box: Sandbox, report) -> None:
    child = pexpect.spawn(sys.executable, ["-m", "relay", "shell", "local", "--quiet"], cwd=str(box.workdir),
                          env=box.env, encoding="utf-8", timeout=30)
    child.sendline("echo READY$((1+1))")
    child.expect("READY2")
    child.sendline("sleep 100")
    # The storm hits the running sleep, not the line before bash has read it: on a busy machine a storm
    # sent at once can end before `sleep 100` starts, which then holds the shell past every try below.
    deadline = time.time() + 20
    while not any(c.startswith("sleep 100") for c in _own_cmdlines()) and time.time() < deadline:
        time.sleep(0.05)
    for _ in range(50):
        child.sendintr()
    # A late ^C may discard a line typed right after the storm; the shell must answer one of them.
    alive = _answers(child, "echo ALIVE$((2+2))", "ALIVE4")
    for _ in range(50):
        child.sendintr()
    exited = _answers(child, "exit 0", pexpect.EOF)
    child.close()
    gone = wait_gone("sleep 100", box)
    ok = alive and exited and child.exitstatus == 0 and gone
    report.fault(ok)
    assert ok, (alive, exited, child.exitstatus, child.signalstatus, gone)


def _answers(child: pexpect.spawn, line: str, expected: object, tries: int = 10) -> bool:
    for _ in range(tries):
        child.sendline(line)
        if child.expect([expected, pexpect.TIMEOUT], timeout=3) == 0:
            return True
    return False


def _launch_sleeper(box: Sandbox, backend: str, seconds: int) -> subprocess.Popen:
    """A --prompt run whose agent is `sleep N`; returns once that sleep runs in the box."""
    launcher = subprocess.Popen([sys.executable, "-m", "relay", backend, "--quiet", "--prompt", f"sleep {seconds}"],
                                cwd=box.workdir, env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 20
    while f"sleep {seconds} " not in _own_cmdlines() and time.time() < deadline:
        time.sleep(0.05)
    return launcher


def test_sigint_storm_on_a_prompt_run(box: Sandbox, report) -> None:
    launcher = _launch_sleeper(box, "shell", 303)
    for _ in range(50):
        try:
            launcher.send_signal(signal.SIGINT)
        except ProcessLookupError:
            break
    for pid, cmdline in own_processes():  # never another user's `sleep 303` (a second test pass)
        if cmdline == "sleep 303 ":
            try:
                os.kill(pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the agent too
            except OSError:
                pass
    out, err = launcher.communicate(timeout=60)
    ok = launcher.returncode == 130 and "Traceback" not in err and wait_gone("sleep 303", box)
    report.fault(ok)
    assert ok, (launcher.returncode, err)


def test_sigterm_to_the_launcher(box: Sandbox, report) -> None:
    launcher = _launch_sleeper(box, "claude", 304)
    launcher.terminate()
    _, err = launcher.communicate(timeout=60)
    ok = launcher.returncode == 143 and "stopped by SIGTERM" in err and wait_gone("sleep 304", box)
    report.fault(ok)
    assert ok, (launcher.returncode, err)
