"""The box as a job: its own process group, made the terminal's foreground group, as a shell does.

Without `setsid` the box keeps the caller's terminal (job control, resize, Ctrl-C work), but if it
shared the launcher's process group, a `kill(0, SIGKILL)` inside the box (process groups reach
across pid namespaces) would kill the launcher and everything else in the caller's job, and
nothing would be reverted, synced or removed. So the box gets a group of its own, and the
launcher hands it the terminal, takes it back when the box stops (Ctrl-Z) or ends, and stops
itself so that the caller's shell sees the job stopped.
"""

from __future__ import annotations

import fcntl
import os
import signal
import termios
from collections.abc import Iterator
from contextlib import contextmanager


def _tty_fd() -> int | None:
    """The caller's terminal when we are its foreground job; None otherwise (pipes, background)."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return fd
        except OSError:
            continue
    return None


@contextmanager
def _no_ttou() -> Iterator[None]:
    """tcsetpgrp from a background group raises SIGTTOU unless it is ignored."""
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTTOU, old)


class Job:
    """The terminal's foreground, moved between the launcher and the box's process group."""

    def __init__(self) -> None:
        self.fd = _tty_fd()
        self.own = os.getpgrp()
        self.box: int | None = None
        self.modes: list | None = None
        self.ldisc: bytes | None = None
        if self.fd is not None:
            try:
                self.modes = termios.tcgetattr(self.fd)
                self.ldisc = fcntl.ioctl(self.fd, termios.TIOCGETD, b"\0" * 4)
            except OSError:
                pass

    def give(self, pgid: int) -> None:
        """The box's group takes the terminal (a no-op without one)."""
        self.box = pgid
        if self.fd is not None:
            with _no_ttou():
                try:
                    os.tcsetpgrp(self.fd, pgid)
                except OSError:
                    pass

    def take_back(self) -> None:
        if self.fd is not None:
            with _no_ttou():
                try:
                    os.tcsetpgrp(self.fd, self.own)
                except OSError:
                    pass

    def end(self) -> None:
        """The box is gone: take the terminal back and restore its modes and line discipline as they
        were before the box started, as a shell does after a job (a box killed in raw mode, or one
        that changed them on purpose, must not leave the caller's terminal unusable)."""
        self.take_back()
        if self.fd is None:
            return
        with _no_ttou():
            try:
                if self.ldisc is not None and fcntl.ioctl(self.fd, termios.TIOCGETD, b"\0" * 4) != self.ldisc:
                    fcntl.ioctl(self.fd, termios.TIOCSETD, self.ldisc)
                if self.modes is not None:
                    termios.tcsetattr(self.fd, termios.TCSADRAIN, self.modes)
            except (OSError, termios.error):
                pass

    def suspend(self) -> None:
        """The box stopped (Ctrl-Z): stop the launcher's own job like a shell's child would, and
        when the caller's shell continues us (`fg`), give the terminal back and continue the box."""
        if self.fd is None:
            return  # no terminal, no shell to resume us: the box stays stopped until it is continued
        self.take_back()
        os.killpg(self.own, signal.SIGTSTP)
        if self.box is not None:
            self.give(self.box)
            try:
                os.killpg(self.box, signal.SIGCONT)
            except OSError:
                pass


def child_takes_terminal() -> None:
    """For a forked child before exec: its own group, and the terminal if the parent's group had it.
    The parent does the same after the fork, as shells do, so neither order leaves the child stopped."""
    parent_group = os.getpgid(os.getppid())
    os.setpgid(0, 0)
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd) and os.tcgetpgrp(fd) == parent_group:
                with _no_ttou():
                    os.tcsetpgrp(fd, os.getpgrp())
                return
        except OSError:
            continue
