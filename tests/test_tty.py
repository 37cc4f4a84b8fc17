"""Interactive sessions through a real terminal (pexpect): the box keeps the caller's tty."""

from __future__ import annotations

import os
import sys
import time

import pexpect
import pytest

from .conftest import Sandbox

pytestmark = [pytest.mark.box, pytest.mark.tty]


@pytest.fixture(params=["local", "container"])
def tty_box(request: pytest.FixtureRequest) -> tuple[Sandbox, str]:
    """The same terminal behaviour in both modes: local mode shares the caller's tty, container
    mode gets the engine's pty (`-t`) proxied to it."""
    mode = request.param
    return request.getfixturevalue("box_sandbox" if mode == "local" else "csandbox"), mode


def spawn(s: Sandbox, *args: str, mode: str = "local") -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, ["-m", "relay", "shell", mode, "--quiet", *args], cwd=str(s.workdir),
                          env=s.env, encoding="utf-8", timeout=60, dimensions=(24, 80))
    say(child, "echo READY$((40+2))")
    child.expect("READY42")
    return child


def wait_for_process(cmdline: str, foreground: bool = False, timeout: float = 10) -> None:
    """Wait until a process with exactly this command line runs (the host sees into the box),
    and with `foreground`, until its process group owns the terminal (so a key signal hits it)."""
    from .conftest import real_uid

    deadline = time.time() + timeout
    want = cmdline.replace(" ", "\0").encode() + b"\0"
    while time.time() < deadline:
        for pid in os.listdir("/proc"):
            if real_uid(pid) != os.getuid():  # never another user's `sleep 5` (the other test pass)
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if fh.read() != want:
                        continue
                with open(f"/proc/{pid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                if not foreground or fields[2] == fields[5]:  # pgrp == tty foreground pgrp
                    return
            except OSError:
                continue
        time.sleep(0.02)
    raise AssertionError(f"{cmdline!r} never started" + (" in the foreground" if foreground else ""))


def in_foreground(child: pexpect.spawn, line: str, cmdline: str = "sleep 100") -> None:
    """Type a line that (re)starts `cmdline` and wait until it owns the terminal, so that a key
    signal sent next hits it and not the shell."""
    say(child, line)
    child.expect(cmdline)
    wait_for_process(cmdline, foreground=True)


def leave(child: pexpect.spawn, code: int = 0) -> None:
    """Exit the box's shell and check that its status came through the launcher."""
    say(child, f"exit {code}")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == code


def say(child: pexpect.spawn, line: str) -> None:
    child.sendline(line)


def check(child: pexpect.spawn, command: str, marker: str) -> str:
    """Run a command and return what it printed before the marker."""
    say(child, f"{command}; echo {marker}$((1+1))")
    child.expect(f"{marker}2")
    return child.before


def test_tty_and_term_are_the_callers(tty_box: tuple[Sandbox, str]) -> None:
    child = spawn(tty_box[0], mode=tty_box[1])
    out = check(child, "tty >/dev/null && echo tty-ok; echo term=$TERM", "T")
    assert "tty-ok" in out and "not a tty" not in out
    assert "term=xterm-256color" in out
    leave(child, 3)


def test_job_control_works(tty_box: tuple[Sandbox, str]) -> None:
    child = spawn(tty_box[0], mode=tty_box[1])
    out = check(child, "sleep 100 & jobs", "J")
    assert "Running" in out and "sleep 100" in out
    in_foreground(child, "fg")
    child.sendcontrol("z")
    child.expect("Stopped")
    out = check(child, "jobs", "K")
    assert "Stopped" in out
    # Bring the stopped job back and interrupt it, so no job is left for `exit` to complain about.
    in_foreground(child, "fg")
    child.sendintr()
    out = check(child, "jobs; echo still-here", "L")
    printed = out.split("echo L$((1+1))")[-1]  # what ran, after the echo of the typed line
    assert "still-here" in printed and "Stopped" not in printed and "sleep 100" not in printed
    leave(child)


def test_ctrl_c_interrupts_the_work_not_the_launcher(tty_box: tuple[Sandbox, str]) -> None:
    child = spawn(tty_box[0], mode=tty_box[1])
    in_foreground(child, "sleep 100")  # an earlier Ctrl-C would hit the shell, not the work
    child.sendintr()
    out = check(child, "echo last=$?; pgrep -c -x sleep || true", "A")
    assert "last=130" in out  # the sleep died of SIGINT; the shell and the box live on
    assert "\n0" in out.replace("\r", "")
    assert child.isalive()
    leave(child)


def test_window_resize_reaches_the_box(tty_box: tuple[Sandbox, str]) -> None:
    child = spawn(tty_box[0], mode=tty_box[1])
    out = check(child, "stty size", "S")
    assert "24 80" in out
    say(child, "trap 'echo GOT-WINCH' WINCH; sleep 5 & wait")
    child.expect("wait")
    wait_for_process("sleep 5")  # the trap is set once the line runs
    child.setwinsize(40, 132)
    child.expect("GOT-WINCH")
    out = check(child, "stty size", "R")
    assert "40 132" in out
    leave(child)


INJECT = ("import fcntl, termios, errno, os\\n"
          "fd = os.open(\\\"/dev/tty\\\", os.O_RDWR)\\n"
          "try:\\n fcntl.ioctl(fd, termios.TIOCSTI, b\\\"X\\\"); print(\\\"INJ\\\" \\\"ECTED\\\")\\n"
          "except OSError as e: print(\\\"STI\\\", errno.errorcode[e.errno])\\n"
          "print(\\\"ROWS\\\", os.get_terminal_size(fd).lines)")


def test_tiocsti_injection_into_the_callers_terminal_is_refused(box_sandbox: Sandbox) -> None:
    child = spawn(box_sandbox)
    out = check(child, f'/usr/bin/python3 -c "$(printf \'{INJECT}\')"', "I")
    assert "STI EPERM" in out and "INJECTED" not in out
    assert "ROWS 24" in out  # ordinary tty ioctls still work
    leave(child)


def test_a_stopped_box_stops_the_launcher_as_a_job_and_fg_resumes_it(box_sandbox: Sandbox) -> None:
    """The box is its own process group (so its kill(0) cannot reach the launcher), made the
    terminal's foreground as a shell does for a job: when the whole box stops, the launcher takes the
    terminal back and stops too, so the caller's shell sees a stopped job, and `fg` resumes both."""
    s = box_sandbox
    env = {**s.env, "PS1": "$ "}
    child = pexpect.spawn("bash", ["--norc", "--noprofile", "-i"], cwd=str(s.workdir), env=env, encoding="utf-8",
                          timeout=60, dimensions=(24, 80))
    say(child, f"{sys.executable} -m relay shell local --quiet --prompt 'echo BEF''ORE; kill -TSTP 0; echo AF''TER'")
    child.expect("BEFORE")
    child.expect("Stopped")
    say(child, "fg")
    child.expect("AFTER")
    say(child, "echo rc=$?")
    child.expect(r"rc=(\d+)")
    assert child.match.group(1) == "0"
    say(child, "exit")
    child.expect(pexpect.EOF)


SETD = ("import fcntl, struct, errno\\n"
        "try:\\n fcntl.ioctl(0, 0x5423, struct.pack(\\\"i\\\", 27)); print(\\\"LDISC\\\" \\\"-SET\\\")\\n"
        "except OSError as e: print(\\\"SETD\\\", errno.errorcode[e.errno])")


def test_the_box_cannot_break_the_callers_terminal_for_after_the_run(box_sandbox: Sandbox) -> None:
    """TIOCSETD (line discipline N_NULL would discard all later input) is refused, and terminal
    modes the box changed (no echo, raw) are restored when it ends, as a shell does after a job."""
    s = box_sandbox
    env = {**s.env, "PS1": "$ "}
    child = pexpect.spawn("bash", ["--norc", "--noprofile", "-i"], cwd=str(s.workdir), env=env, encoding="utf-8",
                          timeout=60, dimensions=(24, 80))
    say(child, f"{sys.executable} -m relay shell local --quiet --prompt 'python3 -c \"$(printf \"{SETD}\")\"; "
               "stty -echo -icanon; echo MO''DES-CHANGED'")
    child.expect(r"SETD EPERM|LDISC-SET")
    assert child.after == "SETD EPERM"
    child.expect("MODES-CHANGED")
    say(child, "stty -a | tr ' ' '\\n' | grep -x -e echo -e icanon | sort | tr '\\n' + ; echo")
    child.expect(r"echo\+icanon\+")
    say(child, "exit")
    child.expect(pexpect.EOF)
