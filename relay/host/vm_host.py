"""Can this host run the VM tier: KVM, qemu's microvm and a guest kernel, each with its fix.

The VM tier (issue 20) puts the same policy behind a hardware boundary. Before anything is built
or booted, three facts decide whether it can run here, and `doctor`, the tier choice and the
refusal all read them from this one place:

- a usable /dev/kvm: present, openable by the caller, answering KVM_GET_API_VERSION, and *not* a
  PVM hypervisor (`kvm_pvm`, nested virtualization by page tables on hosts without VT-x/AMD-V):
  PVM runs only guest kernels built for it (CONFIG_PVM_GUEST, a PIE kernel). Debian's kernels
  are not, and on this machine type they never reach their first console line (measured: the
  generic and the cloud kernel, bzImage and PVH entry, 400 s without output; the vCPU crawls
  through early boot at about 800 KB/s of memory touched);
- qemu-system-x86_64 (Debian 12: qemu-system-x86 7.2, which has the `microvm` machine);
- a guest kernel in the VM cache (Debian's generic kernel: the cloud flavour has no 9p at all,
  and virtiofsd is not packaged in Debian 12, so 9p is the only workdir share there is).

Cheap (an open, two ioctls, a stat, a PATH lookup, a glob): probed at every launch like bwrap.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import re
import shutil
import stat
from collections.abc import Mapping

KVM_DEV = "/dev/kvm"
KVM_GET_API_VERSION = 0xAE00
KVM_CREATE_VM = 0xAE01
KVM_API_VERSION = 12
PVM_MODULE = "/sys/module/kvm_pvm"
QEMU = "qemu-system-x86_64"
DEFAULT_CACHE = "/var/cache/hive-relay/vm"
KERNEL_FLAVOUR = "amd64"  # Debian's generic flavour: 9p, virtio-mmio and ext4 as modules
_KERNEL_NAME = re.compile(r"vmlinuz-(\d+)\.(\d+)\.(\d+)-(\d+)-" + KERNEL_FLAVOUR)
KERNEL_FIX = ("apt-get download linux-image-$(uname -m | sed s/x86_64/amd64/) (the metapackage's "
              "linux-image-6.1.0-N-amd64) and dpkg-deb -x it into {cache} (as .ci/run does); never install it")


def vm_cache(env: Mapping[str, str]) -> str:
    """Where the guest kernel, initramfs and root images live: shared read-only, like the npm cache."""
    return env.get("HIVE_RELAY_VM_CACHE") or DEFAULT_CACHE


def kvm_error(dev: str = KVM_DEV, pvm_module: str = PVM_MODULE, user_kernel: str | None = None) -> str | None:
    """Why KVM cannot run our guest here (with the fix), or None."""
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return (f"{dev} does not exist (no hardware virtualization, or the kvm module is not loaded); "
                "fix: modprobe kvm_intel (or kvm_amd), or use a machine type with nested virtualization")
    except PermissionError:
        return _permission_fix(dev)
    except OSError as err:
        return f"{dev} cannot be opened: {os.strerror(err.errno or errno.EIO)}"
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION)
        if version != KVM_API_VERSION:
            return f"{dev} speaks KVM API {version}, not {KVM_API_VERSION}"
        vm = fcntl.ioctl(fd, KVM_CREATE_VM, 0)
        os.close(vm)
    except OSError as err:
        return f"{dev} refused to create a VM: {os.strerror(err.errno or errno.EIO)}"
    finally:
        os.close(fd)
    if os.path.isdir(pvm_module) and not user_kernel:
        return (f"{dev} is PVM (kvm_pvm: nested virtualization without VT-x/AMD-V), which boots only guest "
                "kernels built for PVM (CONFIG_PVM_GUEST); Debian's kernels hang before their first console "
                "line there; fix: use a machine with hardware KVM (or nested VT-x/AMD-V), or set "
                "HIVE_RELAY_VM_KERNEL to a PVM guest vmlinux")
    return None


def _permission_fix(dev: str) -> str:
    try:
        st = os.stat(dev)
    except OSError:
        return f"no access to {dev}"
    import grp

    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    mode = stat.filemode(st.st_mode)
    if group == "root" or not st.st_mode & stat.S_IRWXG:
        fix = (f"as root: groupadd -f kvm && chgrp kvm {dev} && chmod 660 {dev} && usermod -aG kvm $USER "
               "(then log in again)")
    else:
        fix = f"usermod -aG {group} $USER as root, then log in again"
    return f"no access to {dev} ({mode} root:{group}); fix: {fix}"


def qemu_path(env: Mapping[str, str]) -> str | None:
    return shutil.which(QEMU, path=env.get("PATH", os.defpath))


def guest_kernel(env: Mapping[str, str]) -> str | None:
    """The guest kernel: $HIVE_RELAY_VM_KERNEL, else the newest generic kernel extracted in the cache."""
    own = env.get("HIVE_RELAY_VM_KERNEL")
    if own:
        return own if os.path.isfile(own) else None
    found = []
    for path in glob.glob(os.path.join(vm_cache(env), "boot", "vmlinuz-*")):
        m = _KERNEL_NAME.fullmatch(os.path.basename(path))
        if m:  # the generic flavour only (vmlinuz-6.1.0-9-cloud-amd64 has no 9p), newest ABI by number
            found.append((tuple(int(n) for n in m.groups()), path))
    return max(found)[1] if found else None


TCG_FIX = ("or pass --vm-accel tcg (qemu emulates the CPU: the same guest and boundary, about 16-37 s a boot; "
           "`vm: {accel: tcg}` in your user config)")


def vm_error(env: Mapping[str, str], accel: str = "kvm") -> str | None:
    """Why the VM tier cannot run here (the first missing piece, with its fix), or None. Under TCG
    (`accel="tcg"`, only ever asked for by name) /dev/kvm is not used at all, so not probed."""
    error = None if accel == "tcg" else kvm_error(user_kernel=env.get("HIVE_RELAY_VM_KERNEL"))
    if error:
        return f"{error}; {TCG_FIX}" if "fix:" in error else f"{error}; fix: {TCG_FIX.removeprefix('or ')}"
    if qemu_path(env) is None:
        return f"{QEMU} is not installed; fix: apt-get install qemu-system-x86"
    if guest_kernel(env) is None:
        own = env.get("HIVE_RELAY_VM_KERNEL")
        if own:
            return f"HIVE_RELAY_VM_KERNEL={own} is not a file; fix: point it at a guest vmlinux or unset it"
        return f"no guest kernel in {vm_cache(env)}/boot; fix: {KERNEL_FIX.format(cache=vm_cache(env))}"
    return None


def rows(env: Mapping[str, str]) -> list[tuple[str, bool, str]]:
    """doctor's rows: KVM, qemu, the guest kernel (the image is container mode's, reported there)."""
    kvm = kvm_error(user_kernel=env.get("HIVE_RELAY_VM_KERNEL"))
    qemu = qemu_path(env)
    kernel = guest_kernel(env)
    return [
        ("vm: kvm", kvm is None, kvm or f"{KVM_DEV} creates VMs"),
        ("vm: qemu", qemu is not None, qemu or "missing; fix: apt-get install qemu-system-x86 (the VM tier only)"),
        ("vm: guest kernel", kernel is not None,
         kernel or f"missing; fix: {KERNEL_FIX.format(cache=vm_cache(env))} (the VM tier only)"),
    ]
