"""The vm tier: the plan's box as a qemu microVM whose kernel is not the host's, started as a job of
the caller's terminal, in the run's cgroup, with the proxy already serving on the unix socket the
guest's one forward reaches.

Order: the root image (container mode's image as a read-only ext4 disk, made once per image tag)
and the initramfs (once per kernel and recipe) in the user's VM cache; the control dir in the run
dir (the plan's mounts as the guest init reads them, read-only copies of single-file binds, the
environment, the command, the caller's clock and window size); the proxy's socket; the proxy
starts; then qemu is forked, and between fork and exec the child takes its own process group,
joins the cgroup, dies with the launcher, keeps only fds 0, 1 and 2 and moves to the run's vm dir
(the forward names the socket relative to it).

What the guest reaches of the host: its disks (the image, read-only), the 9p shares (the workdir,
the grants, the per-run private dirs: exactly the plan's binds; a denied path is never shared),
the read-only control share, and one TCP forward (10.0.2.100:3128, relayed from the guest's own
127.0.0.1:3128) to the host-side proxy; qemu's user network has `restrict=on`, so nothing else.

The terminal: qemu's serial console on the caller's stdio with `signal=off`, so Ctrl-C, Ctrl-Z
and the rest are the guest's (its init gives the command the console as its controlling tty, with
the caller's window size). qemu puts the terminal in raw mode; the job's end restores it.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import stat
import struct
import time
from collections.abc import Mapping

from relay.box import jobctl, overlay
from relay.box import resource_limits as limits
from relay.box.landlock import die_with_parent
from relay.egress.proxy import EgressProxy
from relay.host import procs, safefs
from relay.host.phase_marks import mark
from relay.model.errors import RefusedError, RelayError
from relay.model.refusal import ENTRY
from relay.modes import vm_boot
from relay.modes.box_start import BoxProcess, box_env, start_proxy
from relay.plan.resolve import Plan
from relay.trust import janitor, staged

FILE_LIMIT = 1 << 20  # a single-file bind copied into the control share (rc files, git's config)
GUEST_FAILED = 70  # the guest ended without its init's report (qemu failed, the kernel panicked)


class VmProcess(BoxProcess):
    """qemu as the box: its exit status is the guest command's exit code (isa-debug-exit)."""

    def poll(self) -> int | None:
        if self.returncode is None and super().poll() is not None:
            raw = self.returncode
            assert raw is not None
            code = vm_boot.exit_code(raw)
            self.returncode = code if code is not None else (raw if raw < 0 else GUEST_FAILED)
        return self.returncode


def _is_dir(path: str) -> bool | None:
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return None


def _engine(caller_env: Mapping[str, str]) -> list[str]:
    from relay.host.probe import probe
    from relay.policy.tiers import choose_engine

    return [choose_engine(probe(caller_env), caller_env)]


def ensure_guest_parts(run: vm_boot.VmRun, caller_env: Mapping[str, str]) -> tuple[str, str]:
    """(initrd, root image) in the user's VM cache, made when missing; the image must exist."""
    from relay.modes import image

    initrd = vm_boot.ensure_initrd(run.cache, run.kernel)
    path = run.root_image()
    if not os.path.exists(path):
        engine = _engine(caller_env)
        if not image.exists(engine, run.image):
            raise RefusedError(f"--isolation vm boots container mode's image {run.image}, which is not built; "
                               f"fix: `{ENTRY} build-image`")
        path = vm_boot.ensure_root_image(engine, run.image, run.cache, rootless=os.getuid() != 0)
    return initrd, path


def _winsize() -> tuple[int, int] | None:
    import fcntl
    import termios

    try:
        rows, cols, _, _ = struct.unpack("HHHH", fcntl.ioctl(0, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        return None
    return (rows, cols) if rows and cols else None


def guest_env(plan: Plan, caller_env: Mapping[str, str]) -> dict[str, str]:
    """The box's environment, as in every tier (its proxy is the guest's 127.0.0.1:3128 too)."""
    return box_env(plan, caller_env)


def prepare(plan: Plan, caller_env: Mapping[str, str], interactive: bool) -> tuple[vm_boot.Guest, socket.socket | None]:
    """The guest's disks and control dir, and the proxy's listener; returns the Guest to boot."""
    run = plan.vm
    assert run is not None
    if plan.vm.socket and not _which("socat"):
        raise RefusedError("the vm tier's forward to the proxy needs socat on the host; fix: apt-get install socat")
    initrd, root = ensure_guest_parts(run, caller_env)
    shares, lines, files = vm_boot.guest_layout([(m.kind, m.dst, m.src, m.size) for m in plan.mounts], _is_dir)
    os.mkdir(run.dir, 0o700)
    extra = {"time": f"{int(time.time())}\n"}
    if run.socket:
        extra["proxy"] = "\n"
    size = _winsize() if interactive else None
    if size:
        extra["winsize"] = f"{size[0]} {size[1]}\n"
    vm_boot.write_ctl(run.ctl_dir, (), run.uid, plan.workdir, guest_env(plan, caller_env),
                      "exec " + shlex.join(plan.argv), mounts=lines, extra=extra)
    if files:
        os.mkdir(os.path.join(run.ctl_dir, "files"), 0o755)
    for n, src in files:
        data = safefs.read_file(src, FILE_LIMIT)  # no link followed, bounded, no blocking on a fifo
        if data is None:
            raise RelayError(f"cannot copy {src} into the guest (missing, a link, special or over 1 MiB); "
                             "fix: --isolation supervised")
        with open(os.path.join(run.ctl_dir, "files", n), "wb") as fh:
            fh.write(data)
    listener = None
    if run.socket:
        fd = os.open(run.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            listener = safefs.bind_unix(fd, os.path.basename(run.socket), 1024)
        finally:
            os.close(fd)
    guest = vm_boot.Guest(qemu=run.qemu, kernel=run.kernel, initrd=initrd, root_image=root, ctl_dir=run.ctl_dir,
                          shares=shares, memory_mb=run.memory_mb, cpus=run.cpus, accel=run.accel, guestfwd=run.guestfwd())
    return guest, listener


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")


def start(
    plan: Plan, caller_env: Mapping[str, str], state: janitor.RunState, nofile: tuple[int, int], lifeline: int,
    job: jobctl.Job,
) -> tuple[BoxProcess, EgressProxy | None]:
    """Make the guest's parts, start the proxy, fork qemu (as described above)."""
    run = plan.vm
    assert run is not None
    interactive = plan.interactive and job.fd is not None and os.isatty(0)
    try:
        guest, listener = prepare(plan, caller_env, interactive)
    except OSError as err:
        raise RelayError(f"cannot prepare the guest in {run.dir}: {err.strerror or err}") from None
    mark("box_ready")
    proxy = start_proxy(plan, listener, caller_env) if listener is not None else None
    mark("proxy_started")
    # Staged: qemu runs in a mount namespace with the layer over the workdir (relay/box/overlay.py, as the
    # gvisor tier's runsc), so its 9p share of the workdir is the merged view and the guest's writes land
    # in the upper dir; the host's checkout is not written.
    layer = staged.create(plan.staged, plan.workdir, staged.launch_meta(plan)) if plan.staged is not None else None
    argv = guest.argv()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": caller_env.get("HOME", "/")}
    closes = [fd for fd in procs.inheritable_fds() if fd not in (0, 1, 2)]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the forked child, until exec
        try:
            os.setpgid(0, 0)
            limits.child_setup(state.cgroup, None, plan.limits.pids, False, nofile)
            die_with_parent()
            if layer is not None:
                overlay.enter(layer)
            os.chdir(run.dir)
            for fd in closes:
                try:
                    os.close(fd)
                except OSError:
                    pass
            if not interactive:  # qemu would take a non-tty stdin as the console's input all the same
                signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(argv[0], argv, env)
        except OSError as err:
            try:
                os.write(2, f"hive-relay: cannot start {argv[0]}: {err.strerror or err}; the box did not start\n"
                         .encode())
            except OSError:
                pass
        finally:
            os._exit(3)
    janitor.tell(lifeline, pid)  # first: should we die from here on, the janitor knows the box's group
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    proc = VmProcess(pid, job)
    job.give(pid)
    mark("spawned")
    return proc, proxy
