"""The box's seccomp filter, built with libseccomp (pyseccomp) and handed to bwrap as BPF.

Default allow, with targeted EPERM rules: the box must run node, python and git
unchanged, so we deny the kernel surfaces an agent never needs (other processes' memory,
new namespaces, mounts, io_uring) and the two attacks an allowlisted filesystem does not
stop (AF_UNIX sockets towards host daemons, TIOCSTI injection into the caller's tty).
"""

from __future__ import annotations

import errno
import os
import zlib
from dataclasses import dataclass

AF_UNIX = 1
AF_INET = 2
AF_INET6 = 10
AF_PACKET = 17
AF_VSOCK = 40
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
CLONE_NEWUSER = 0x10000000
LOW32 = 0xFFFFFFFF

ALWAYS_DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd",
    "mount", "umount2", "pivot_root", "setns",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "acct", "swapon", "swapoff", "reboot", "syslog",
)
# Only a backend whose matrix asks for nested namespaces (its own native sandbox) gets these.
NAMESPACE_SYSCALLS = ("unshare",)


@dataclass(frozen=True)
class SeccompPolicy:
    """What the filter refuses; rendered into the plan so `--dry-run` shows it."""

    denied_syscalls: tuple[str, ...]
    deny_af_unix_socket: bool = True
    deny_af_vsock: bool = True
    deny_tty_injection: bool = True
    deny_new_userns: bool = True
    deny_network: bool = False
    native_arch_only: bool = True

    def summary(self) -> list[str]:
        rules = [f"{name}: EPERM" for name in self.denied_syscalls]
        if self.deny_af_unix_socket:
            rules.append("socket(AF_UNIX): EPERM (socketpair allowed)")
        if self.deny_af_vsock:
            rules.append("socket(AF_VSOCK): EPERM")
        if self.deny_tty_injection:
            rules.append("ioctl(TIOCSTI|TIOCLINUX): EPERM")
        if self.deny_new_userns:
            rules.append("clone(CLONE_NEWUSER): EPERM; clone3: ENOSYS")
        if self.deny_network:
            rules.append("socket(AF_INET|AF_INET6|AF_PACKET): EPERM (no network)")
        if self.native_arch_only:
            rules.append("foreign arch and x32 ABI: killed")
        return rules


def policy_for(nested_userns: bool, deny_network: bool = False) -> SeccompPolicy:
    denied = ALWAYS_DENIED if nested_userns else ALWAYS_DENIED + NAMESPACE_SYSCALLS
    return SeccompPolicy(denied_syscalls=denied, deny_new_userns=not nested_userns, deny_network=deny_network)


def build_filter(policy: SeccompPolicy):  # -> pyseccomp.SyscallFilter
    """Compile the policy with libseccomp; unknown syscall names on this arch are skipped."""
    import pyseccomp as sc

    eperm = sc.ERRNO(errno.EPERM)
    flt = sc.SyscallFilter(sc.ALLOW)
    # The native arch only: x32 and i386 entry points are a classic filter bypass.
    flt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    for name in policy.denied_syscalls:
        _add(flt, eperm, name)
    if policy.deny_af_unix_socket:
        _add(flt, eperm, "socket", sc.Arg(0, sc.EQ, AF_UNIX))
    if policy.deny_af_vsock:
        _add(flt, eperm, "socket", sc.Arg(0, sc.EQ, AF_VSOCK))
    if policy.deny_network:
        for family in (AF_INET, AF_INET6, AF_PACKET):
            _add(flt, eperm, "socket", sc.Arg(0, sc.EQ, family))
    if policy.deny_tty_injection:
        for request in (TIOCSTI, TIOCLINUX):
            _add(flt, eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, LOW32, request))
    if policy.deny_new_userns:
        _add(flt, eperm, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
        # clone3 passes flags in memory the filter cannot read; ENOSYS makes libc fall back to clone.
        _add(flt, sc.ERRNO(errno.ENOSYS), "clone3")
    return flt


def _add(flt, action: int, name: str, *args) -> None:
    try:
        flt.add_rule(action, name, *args)
    except (OSError, ValueError, RuntimeError):
        # libseccomp raises when a syscall does not exist on this architecture.
        pass


def _cache_file(policy: SeccompPolicy, cache: str) -> str:
    """BPF depends on the policy, the architecture and libseccomp; importing and running libseccomp
    is ~15 ms of a launch, so the exported program is cached per (policy, arch, library file)."""
    lib = next((p for p in ("/usr/lib/x86_64-linux-gnu/libseccomp.so.2", "/usr/lib/aarch64-linux-gnu/libseccomp.so.2",
                            "/lib/x86_64-linux-gnu/libseccomp.so.2") if os.path.exists(p)), "")
    stamp = os.stat(lib).st_mtime_ns if lib else 0
    key = repr((policy, os.uname().machine, lib, stamp)).encode()
    return os.path.join(cache, f"seccomp-{zlib.crc32(key):08x}-{len(key)}.bpf")


def compile_bpf(policy: SeccompPolicy, cache: str | None = None) -> bytes:
    if cache:
        path = _cache_file(policy, cache)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
            if data and len(data) % 8 == 0:
                return data
        except OSError:
            pass
    import tempfile

    with tempfile.TemporaryFile() as out:
        build_filter(policy).export_bpf(out)
        out.seek(0)
        data = out.read()
    if cache:
        try:
            os.makedirs(cache, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except OSError:
            pass
    return data


def compile_to_memfd(policy: SeccompPolicy, cache: str | None = None) -> int:
    """The BPF program in an anonymous memfd, rewound, ready for `bwrap --seccomp FD`."""
    data = compile_bpf(policy, cache)
    fd = os.memfd_create("hive-relay-seccomp", 0)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
