"""The container engine's start gate: a FIFO where the engine reads its seccomp profile.

Why: `podman run` spends ~35 ms (its Go start, containers.conf, the storage, the image lookup) before
it reads the `--security-opt seccomp=FILE` profile, and it touches none of the run's other paths (the
volumes' sources, the pidfile, the staged layer) before that read: the profile is loaded while the
OCI spec is generated, before the volumes are looked at and before the container exists (podman
4.3, checked with strace; tests/test_engine_gate.py holds a real launch to it). So with that FILE a
FIFO, the engine can start the moment its argv is known, and the launcher's host steps (run dir,
private git dir, placeholders, the janitor, the staged layer) overlap its start. Writing the profile
into the FIFO is the go; nothing of the container exists before it.

Fail closed, whatever happens to the launcher:
- the launcher holds the FIFO open read-write from before the engine starts, so the engine's open
  never blocks, and the launcher's death closes the last writer: the engine reads end of file, an
  empty or cut profile, which is not JSON, and podman exits before it creates anything;
- a profile is written whole, and the write end is closed only once the engine has read every byte
  (nothing is left in the pipe), so the engine's read ends there, with the whole profile;
- `cancel` kills an engine still waiting (SIGKILL: it has created nothing, and says nothing);
- the engine client dies with its launcher (PR_SET_PDEATHSIG), so one that had not yet opened the FIFO
  when the launcher died does not wait in open() for a writer that will never come.

Only podman is gated (relay/modes/container_runner.py `gated`): docker's client reads the file too,
but is not tested here.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import signal
import subprocess
import termios
import time
from collections.abc import Mapping, Sequence

PIPE_BYTES = 1 << 20  # the pipe is sized to hold a whole profile (relay/modes/container_runner.py MAX_PROFILE_BYTES)
PROFILE_NAME = "seccomp.json"  # the gate's name in the run dir: the plan's `--security-opt seccomp=` path


class GateError(OSError):
    """The gate could not be made (its one line says where)."""


class EngineGate:
    """One run's gate: the FIFO at the engine's seccomp path, the launcher's read-write end of it, and
    the engine client started behind it (None until `start`)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd: int | None = fd
        self.proc: subprocess.Popen | None = None
        self.argv: list[str] = []
        self.env: dict[str, str] = {}
        self.cwd = ""
        self.released = False

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> bool:
        """The engine client for ARGV behind this gate; one already running with the same argv, env and
        cwd is kept (a prestarted one: relay/modes/container_prestart.py), any other is killed first.
        Returns whether the running one was kept."""
        argv, env = list(argv), dict(env)
        if self.proc is not None and self.proc.poll() is None and (argv, env, cwd) == (self.argv, self.env, self.cwd):
            return True
        self.stop_engine()
        # The engine client gets the caller's environment: `--env NAME` copies values by name from it.
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, close_fds=True, preexec_fn=_die_with(os.getpid()))
        self.argv, self.env, self.cwd = argv, env, cwd
        return False

    def release(self, profile: bytes, timeout: float) -> None:
        """The go: PROFILE into the FIFO, then the write end closed once the engine has read all of it,
        or has exited. An engine that has not read it within TIMEOUT seconds is killed (it created
        nothing) and the launch fails with one line: closing early would lose the profile, and leave
        an engine that opens the FIFO later waiting for a writer."""
        assert self.fd is not None and self.proc is not None and not self.released
        fd, self.fd, self.released = self.fd, None, True
        deadline = time.monotonic() + timeout
        pause = 0.0002  # the engine is waiting in its read (~35 ms after its start): microseconds, usually
        try:
            view = memoryview(profile)
            while view and self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    select.poll().poll(5)
            while self.proc.poll() is None and _unread(fd):
                if time.monotonic() >= deadline:
                    self.stop_engine()
                    raise GateError(errno.ETIMEDOUT, f"the container engine did not read its start gate within "
                                                     f"{timeout:.0f} s; fix: check `podman info`, then run again")
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
        finally:
            os.close(fd)

    def stop_engine(self) -> None:
        """Kill an engine client that has not been let through: it holds no lock and created nothing."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signal.SIGKILL)
            except OSError:
                pass
            proc.wait()

    def cancel(self) -> None:
        """The run ends before the go: the engine killed, the launcher's end closed (the FIFO itself
        goes with the run dir)."""
        if not self.released:
            self.stop_engine()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _die_with(launcher: int):  # noqa: ANN202 - a preexec_fn
    """The engine client dies with its launcher (SIGKILL, as bwrap's --die-with-parent): one that has
    not opened the gate yet would otherwise wait in open() for a writer that is gone, for ever. After
    the go, the janitor removes the container as before (relay/trust/janitor.py)."""
    import ctypes

    def child() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:  # it died before the prctl
            os._exit(1)
    return child


PR_SET_PDEATHSIG = 1


def _unread(fd: int) -> int:
    """Bytes still in the pipe (FIONREAD): the engine has not read them yet."""
    buf = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return int.from_bytes(buf, "little")


def make(run_dir: str) -> EngineGate:
    """The gate in RUN_DIR (ours, just made): a FIFO only we may open, held read-write and non-blocking,
    its pipe sized for a whole profile."""
    path = os.path.join(run_dir, PROFILE_NAME)
    try:
        os.mkfifo(path, 0o600)
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as err:
        raise GateError(err.errno or errno.EIO, f"cannot make the engine's start gate {path}: "
                                                f"{err.strerror or err}") from None
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        pass  # over /proc/sys/fs/pipe-max-size: the writes then wait for the engine's reads
    return EngineGate(path, fd)
