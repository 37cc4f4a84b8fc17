"""Boot one guest: the root image (container mode's image as a read-only ext4 disk, cached by its
tag), the initramfs, the qemu argv (pure), and a run that returns the guest command's exit code.

This is the VM tier's guest half, tested for real (tests/test_vm.py); the launcher's half, a Plan run
in the guest with the proxy and the janitor, is relay/modes/vm_runner.py (tests/test_vm_tcg.py).

Why these choices (each checked on this machine type):
- ext4 root, not 9p: node loads thousands of small files; a block device with the guest's page
  cache is far faster than a 9p round trip per stat. `mkfs.ext4 -d DIR` fills it without root
  (Debian 12's e2fsprogs 1.47.0 takes a directory, not yet a tarball), from `podman image mount`
  (inside `podman unshare` when rootless, so the image's owners are kept).
- the workdir over 9p (`security_model=none`: files are created as qemu's own uid). A guest that
  owns its kernel can send any 9p request qemu's uid may perform on the shared paths (a mode bit
  like setuid included), so the launcher must run qemu as an unprivileged host uid, in its own
  box, and mount nothing it shares with the host as suid (not built yet; these tests run qemu
  as the test's own user).
- `-nodefaults`, one serial port on the caller's stdio with `signal=off` (Ctrl-C is the guest's),
  no NIC but qemu's user network with `restrict=on` (the guest reaches no host and no network,
  only explicit forwards), `-no-reboot` and `panic=-1` (a guest panic ends qemu), isa-debug-exit
  for the exit code.
- accel: KVM where vmhost says it can run our guest; `tcg` only when asked (`--vm-accel tcg`, or
  `vm: {accel: tcg}` in the user config), with `-icount shift=auto`: without it, TCG's guest cannot
  calibrate its TSC against the PIT and hangs at boot.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence

from relay.model.errors import RefusedError, RelayError
from relay.model.record import record
from relay.modes import vm_initrd
from relay.render.vm_run import VmRun  # noqa: F401 - the plan's part, named here too for the runner

GUEST_PORT_OFFSET = 1
MAX_SHARES = 20  # microvm has 24 virtio-mmio slots: the disk, the NIC and the control share take three  # isa-debug-exit: qemu exits with (value << 1) | 1
ROOT_SIZE_SLACK = 1.25


@record
class Share:
    """One host directory in the guest, at the same path (a denied path simply has no Share)."""

    tag: str
    path: str
    writable: bool


@record
class Guest:
    """Everything one boot needs; `argv()` is a pure function of it."""

    qemu: str
    kernel: str
    initrd: str
    root_image: str
    ctl_dir: str
    shares: tuple[Share, ...]
    memory_mb: int = 1024
    cpus: int = 1
    accel: str = "kvm"
    guestfwd: str | None = None  # e.g. "tcp:10.0.2.100:3128-cmd:..." to the host-side proxy

    def argv(self) -> list[str]:
        machine = "microvm" + (",accel=tcg" if self.accel == "tcg" else ",accel=kvm")
        argv = [self.qemu, "-M", machine, "-m", str(self.memory_mb), "-smp", str(self.cpus),
                "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"]
        argv += ["-icount", "shift=auto", "-cpu", "max"] if self.accel == "tcg" else ["-cpu", "host"]
        argv += ["-kernel", self.kernel, "-initrd", self.initrd,
                 "-append", "console=ttyS0 quiet loglevel=1 panic=-1 rdinit=/init",
                 "-chardev", "stdio,id=con,signal=off", "-serial", "chardev:con",
                 "-device", "isa-debug-exit,iobase=0xf4,iosize=1",
                 "-drive", f"id=root,file={self.root_image},format=raw,if=none,readonly=on",
                 "-device", "virtio-blk-device,drive=root",
                 "-fsdev", f"local,id=hivectl,path={self.ctl_dir},security_model=none,readonly=on",
                 "-device", "virtio-9p-device,fsdev=hivectl,mount_tag=hivectl"]
        for share in self.shares:
            ro = "" if share.writable else ",readonly=on"
            argv += ["-fsdev", f"local,id={share.tag},path={share.path},security_model=none{ro}",
                     "-device", f"virtio-9p-device,fsdev={share.tag},mount_tag={share.tag}"]
        net = "user,id=net,restrict=on,ipv6=off" + (f",guestfwd={self.guestfwd}" if self.guestfwd else "")
        argv += ["-netdev", net, "-device", "virtio-net-device,netdev=net"]
        return argv


def exit_code(qemu_rc: int) -> int | None:
    """The guest command's exit code from qemu's, or None when the guest never reported one
    (qemu failed, or the guest kernel panicked or powered off without the init's report)."""
    if qemu_rc > 0 and qemu_rc % 2 == 1:
        return (qemu_rc - GUEST_PORT_OFFSET) >> 1
    return None


def guest_layout(mounts: Sequence[tuple[str, str, str | None, int | None]], is_dir: Callable[[str], bool | None]
                 ) -> tuple[tuple[Share, ...], list[str], list[tuple[str, str]]]:
    """The plan's mounts (kind, dst, src, size) as the guest sees them: 9p shares for directories,
    read-only copies for single files (9p shares directories only), sized tmpfs, masks; the root
    bind, /dev and /proc are the guest init's own. Returns (shares, the `mounts` lines, the files to
    copy as (N, host path)). `is_dir(src)`: True, False, or None when the source is missing (skipped,
    as bwrap skips a missing grant)."""
    shares: list[Share] = []
    lines: list[str] = []
    files: list[tuple[str, str]] = []
    for kind, dst, src, size in mounts:
        if kind in ("dev", "proc") or (kind == "ro-bind" and dst == "/"):
            continue
        if any(c.isspace() for c in dst):
            raise RefusedError(f"the vm tier cannot mount {dst!r} (white space in a path); fix: --isolation supervised")
        if kind in ("ro-bind", "bind", "private-bind"):
            found = is_dir(src or dst)
            if found is None:
                continue
            if found:
                tag = f"s{len(shares)}"
                shares.append(Share(tag, src or dst, kind != "ro-bind"))
                lines.append(f"share {tag} {'ro' if kind == 'ro-bind' else 'rw'} {dst}")
            elif kind == "ro-bind":
                files.append((str(len(files)), src or dst))
                lines.append(f"file {len(files) - 1} {dst}")
            else:
                raise RefusedError(f"the vm tier cannot share the single writable file {dst} with its guest yet; "
                                 "fix: --isolation supervised")
        elif kind == "tmpfs":
            lines.append(f"tmpfs {size or 64 << 20} {'1777' if dst != '/run' else '755'} {dst}")
        elif kind == "mask-dir":
            lines.append(f"maskdir {dst}")
        elif kind == "mask-file":
            lines.append(f"maskfile {dst}")
        else:
            raise RefusedError(f"the vm tier has no guest form for a {kind} mount at {dst}")
    if len(shares) > MAX_SHARES:
        raise RefusedError(f"the plan shares {len(shares)} directories with the guest, more than microvm's "
                         f"{MAX_SHARES} virtio slots; fix: --isolation supervised, or fewer grants")
    return tuple(shares), lines, files


def write_ctl(ctl_dir: str, shares: Sequence[Share], uid: int, cwd: str, env: Mapping[str, str], command: str,
              protect: Sequence[str] = (), mounts: Sequence[str] = (), extra: Mapping[str, str] | None = None) -> None:
    """The guest's only input besides its disks: a dir shared read-only (no secret goes in argv or
    on the kernel command line, which every host process can read). World-readable, because 9p
    with security_model=none shows the guest user the host's modes: the launcher puts it inside its
    0700 run dir, so no other host user reaches it."""
    os.makedirs(ctl_dir, mode=0o755, exist_ok=True)
    os.chmod(ctl_dir, 0o755)
    for name, text in (("shares", "".join(f"{s.tag} {'rw' if s.writable else 'ro'} {s.path}\n" for s in shares)),
                       ("uid", f"{uid}\n"), ("cwd", f"{cwd}\n"), ("command", command + "\n"),
                       ("protect", "".join(f"{p}\n" for p in protect)),
                       ("mounts", "".join(f"{line}\n" for line in mounts)), *(extra or {}).items(),
                       ("env", "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items() if k.isidentifier()))):
        with open(os.path.join(ctl_dir, name), "w") as fh:
            fh.write(text)


def ensure_initrd(cache: str, kernel: str) -> str:
    """The initramfs for `kernel`, built once per kernel ABI and recipe (both in the name: a changed
    init or module list is a new file, never a stale cache hit)."""
    from relay.model.hashing import sha256

    release = os.path.basename(kernel).removeprefix("vmlinuz-")
    recipe = sha256(repr((vm_initrd.GUEST_INIT, vm_initrd.GUEST_MODULES, vm_initrd.PROXY_RELAY)).encode()).hexdigest()[:12]
    path = os.path.join(cache, f"initrd-{release}-{recipe}.gz")
    if not os.path.exists(path):
        os.makedirs(cache, mode=0o700, exist_ok=True)
        blob = vm_initrd.build(os.path.join(os.path.dirname(os.path.dirname(kernel)), "lib", "modules", release))
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, path)
    return path


def ensure_root_image(engine: Sequence[str], tag: str, cache: str, rootless: bool) -> str:
    """Container mode's image as a read-only ext4 file, cached by the image's content tag."""
    name = tag.rsplit(":", 1)[-1]
    path = os.path.join(cache, f"root-{name}.ext4")
    if os.path.exists(path):
        return path
    os.makedirs(cache, mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    # `podman image mount` needs the engine's user namespace when rootless; the script is fixed
    # text, the tag and paths are positional arguments (no interpolation into a shell string).
    script = ('set -e; d=$("$@" image mount "$HIVE_TAG"); kb=$(du -sk "$d" | cut -f1); '
              '"$HIVE_MKFS" -q -F -O ^has_journal -L hive-root -d "$d" "$HIVE_OUT" "$(( kb * 5 / 4 + 65536 ))k"; '
              '"$@" image unmount "$HIVE_TAG" >/dev/null')
    # mkfs lives in /usr/sbin, which is not on an unprivileged user's PATH.
    mkfs = shutil.which("mkfs.ext4", path=os.environ.get("PATH", os.defpath) + ":/usr/sbin:/sbin")
    if mkfs is None:
        raise RelayError("mkfs.ext4 is missing (it makes the guest's root image); fix: apt-get install e2fsprogs")
    argv = ([*engine, "unshare"] if rootless else []) + ["sh", "-c", script, "sh", *engine]
    proc = subprocess.run(argv, env={**os.environ, "HIVE_TAG": tag, "HIVE_OUT": tmp, "HIVE_MKFS": mkfs},
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        _unlink(tmp)
        raise RelayError(f"cannot make the guest's root image from {tag}: {proc.stderr.strip()[-300:]}")
    os.replace(tmp, path)
    _remove_superseded(cache, os.path.basename(path))
    return path


def _remove_superseded(cache: str, keep: str) -> None:
    """A new image tag supersedes the older disks of the same user (1.5 GB each), as `build-image`
    removes the superseded images; a guest still booted from one keeps its open file."""
    suffix = keep.rsplit("-", 1)[-1]  # "u1000.ext4": this user's image
    for name in os.listdir(cache):
        if name != keep and name.startswith("root-") and name.endswith(f"-{suffix}"):
            _unlink(os.path.join(cache, name))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL qemu when the thread that started it dies (kill -9 of the
    launcher included). A launcher must still have the janitor reap it (a pdeathsig is lost when
    the parent thread exits first in a threaded launcher); for this helper it is the whole story."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def boot(guest: Guest, timeout: float, stdin: int | None = subprocess.DEVNULL,
         stdout: int | None = None) -> tuple[int | None, int, bytes]:
    """Run the guest to its end: (the command's exit code or None, qemu's own exit code, its
    console output when `stdout` is subprocess.PIPE). A timeout kills qemu, and with it the guest."""
    proc = subprocess.Popen(guest.argv(), stdin=stdin, stdout=stdout, close_fds=True, preexec_fn=_die_with_parent)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return exit_code(proc.returncode), proc.returncode, out or b""
