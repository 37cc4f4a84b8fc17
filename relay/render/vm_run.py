"""The vm tier's part of the plan (`--dry-run --json` key `vm`): what relay/plan/resolve.py decides
about one guest. The boot itself (qemu's argv with the shares, the initramfs, the root disk) is
relay/modes/vm_boot.py, run by relay/modes/vm_runner.py."""

from __future__ import annotations

import os

from relay.model.record import record


@record
class VmRun:
    """How one VM box is booted (the plan's part; `--dry-run --json` shows it as `vm`): qemu, the guest
    kernel, the accelerator (`emulated` is TCG: the CPU is emulated, the boundary the same), the root
    image's tag (container mode's image, made into a read-only ext4 disk in `cache` at launch), and
    the run-dir paths of the guest's control dir and the proxy's unix socket."""

    qemu: str
    kernel: str
    accel: str
    emulated: bool
    image: str
    cache: str
    dir: str  # run_dir/vm: the control dir, the proxy socket, qemu's cwd
    socket: str | None  # the proxy's unix socket (None: a box without network)
    uid: int  # the guest user: the caller's uid, so that 9p shows it its own files as its own
    memory_mb: int = 2048
    cpus: int = 1

    @property
    def ctl_dir(self) -> str:
        return os.path.join(self.dir, "ctl")

    def root_image(self) -> str:
        return os.path.join(self.cache, f"root-{self.image.rsplit(':', 1)[-1]}.ext4")

    def guestfwd(self) -> str | None:
        """The guest's one way out: 10.0.2.100:3128 to the proxy's socket, by a name relative to qemu's
        cwd (the run dir may hold characters qemu's option syntax or slirp's argv split would break)."""
        return f"tcp:10.0.2.100:3128-cmd:socat STDIO UNIX-CONNECT:{os.path.basename(self.socket)}" if self.socket else None
