"""The box's seccomp filter, built with libseccomp (pyseccomp) and handed to bwrap as BPF.

Default allow, with targeted EPERM rules: the box must run node, python and git
unchanged, so we deny the kernel surfaces an agent never needs (other processes' memory,
new namespaces, mounts, io_uring) and the two attacks an allowlisted filesystem does not
stop (AF_UNIX sockets towards host daemons, TIOCSTI injection into the caller's tty).

Every argument comparison masks the register to its low 32 bits: `socket`'s domain, `ioctl`'s
request and `clone`'s flags are 32-bit in the kernel, and a rule on the full 64-bit register is
bypassed by setting bit 32 (libseccomp checks the high word too, so `EQ 1` misses `1 | 1 << 32`).

The BPF is compiled from the policy by libseccomp, and memoized only in the cache dir, which no
box can write (relay/host/memo.py): a compiled filter in a box-writable cache would let one box
choose the next box's filter (tests/test_memo.py plants one from a box whose workdir is ~/.cache).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping

from relay.host import memo
from relay.host.paths import LIBSECCOMP_DIRS
from relay.model.record import record

AF_UNIX = 1
AF_INET = 2
AF_INET6 = 10
AF_PACKET = 17
AF_VSOCK = 40
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
TIOCSETD = 0x5423  # sets the line discipline: N_NULL would kill the caller's terminal for good
# The ioctls on the caller's terminal that outlive or reach beyond the box: injection (STI), console
# tricks (LINUX) and the line discipline (SETD, which also autoloads ldisc modules).
TTY_DENIED = (TIOCSTI, TIOCLINUX, TIOCSETD)
CLONE_NEWUSER = 0x10000000
LOW32 = 0xFFFFFFFF

ALWAYS_DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    # Another process's fds (pid 1, bwrap's init, holds the eventfd its exit status goes out by).
    "pidfd_getfd",
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


@record
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
        if self.deny_network:
            rules.append("socket: EPERM for every family (no network); socketpair: AF_UNIX only")
        else:
            if self.deny_af_unix_socket:
                rules.append("socket(AF_UNIX): EPERM (socketpair allowed)")
            else:
                rules.append("socket(AF_UNIX): ALLOWED (--allow-socket; the box sees only the sockets bound in)")
            if self.deny_af_vsock:
                rules.append("socket(AF_VSOCK): EPERM")
        if self.deny_tty_injection:
            rules.append("ioctl(TIOCSTI|TIOCLINUX|TIOCSETD): EPERM")
        if self.deny_new_userns:
            rules.append("clone(CLONE_NEWUSER): EPERM; clone3: ENOSYS")
        if self.native_arch_only:
            rules.append("foreign arch and x32 ABI: killed")
        return rules


def policy_for(nested_userns: bool, deny_network: bool = False, unix_sockets: bool = False) -> SeccompPolicy:
    """`unix_sockets`: the box was given host sockets (--allow-socket), so it may create AF_UNIX
    sockets to reach them; AF_VSOCK and the rest stay as they are."""
    denied = ALWAYS_DENIED if nested_userns else ALWAYS_DENIED + NAMESPACE_SYSCALLS
    return SeccompPolicy(denied_syscalls=denied, deny_new_userns=not nested_userns, deny_network=deny_network,
                         deny_af_unix_socket=not unix_sockets)


def _pyseccomp():  # noqa: ANN202 - the pyseccomp module
    """pyseccomp, imported without its two `ctypes.util.find_library` calls, each of which runs
    `ldconfig -p` in a subprocess (milliseconds on every launch): the sonames are tried with dlopen
    first, which finds them through the same ld.so cache; anything else asks find_library as before."""
    import sys

    if "pyseccomp" in sys.modules:
        return sys.modules["pyseccomp"]
    import ctypes
    import ctypes.util

    real = ctypes.util.find_library
    sonames = {"c": "libc.so.6", "seccomp": "libseccomp.so.2"}

    def find_library(name: str) -> str | None:
        soname = sonames.get(name)
        if soname:
            try:
                ctypes.CDLL(soname)
                return soname
            except OSError:
                pass
        return real(name)

    ctypes.util.find_library = find_library
    try:
        import pyseccomp
    finally:
        ctypes.util.find_library = real
    return pyseccomp


def build_filter(policy: SeccompPolicy):  # -> pyseccomp.SyscallFilter
    """Compile the policy with libseccomp; unknown syscall names on this arch are skipped."""
    sc = _pyseccomp()

    eperm = sc.ERRNO(errno.EPERM)
    flt = sc.SyscallFilter(sc.ALLOW)
    # The native arch only: x32 and i386 entry points are a classic filter bypass.
    flt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    for name in policy.denied_syscalls:
        _add(flt, eperm, name)
    if policy.deny_network:
        # No network at all: every socket() is refused, whatever the family (high bits included,
        # as there is no argument to compare). socketpair() keeps working for AF_UNIX, the only
        # family that needs it; any other family would still create (and autoload the module
        # of) a network socket, so it is refused too.
        _add(flt, eperm, "socket")
        for arg in _low32_not_equal(0, AF_UNIX):
            _add(flt, eperm, "socketpair", arg)
    else:
        if policy.deny_af_unix_socket:
            _add(flt, eperm, "socket", _low32_eq(0, AF_UNIX))
        if policy.deny_af_vsock:
            _add(flt, eperm, "socket", _low32_eq(0, AF_VSOCK))
    if policy.deny_tty_injection:
        for request in TTY_DENIED:
            _add(flt, eperm, "ioctl", _low32_eq(1, request))
    if policy.deny_new_userns:
        # The mask is inside the low word, so high bits (which the kernel drops) never matter.
        _add(flt, eperm, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
        # clone3 passes flags in memory the filter cannot read; ENOSYS makes libc fall back to clone.
        _add(flt, sc.ERRNO(errno.ENOSYS), "clone3")
    return flt


def _low32_eq(index: int, value: int):  # -> pyseccomp.Arg
    """Argument INDEX equals VALUE in the low 32 bits the kernel reads, whatever the high bits."""
    sc = _pyseccomp()
    return sc.Arg(index, sc.MASKED_EQ, LOW32, value & LOW32)


def _low32_not_equal(index: int, value: int) -> list:  # -> list[pyseccomp.Arg]
    """Comparisons whose union (one rule each) is "argument INDEX differs from VALUE in its low
    32 bits": some bit that VALUE has clear is set, or some bit that VALUE has set is clear."""
    sc = _pyseccomp()
    return [sc.Arg(index, sc.MASKED_EQ, 1 << bit, (value & (1 << bit)) ^ (1 << bit)) for bit in range(32)]


def _add(flt, action: int, name: str, *args) -> None:
    try:
        flt.add_rule(action, name, *args)
    except (OSError, ValueError, RuntimeError):
        # libseccomp raises when a syscall does not exist on this architecture.
        pass


_COMPILED: dict[SeccompPolicy, bytes] = {}


def compile_bpf(policy: SeccompPolicy, cache: str | None = None, env: Mapping[str, str] | None = None) -> bytes:
    """The BPF program for POLICY, compiled by libseccomp.

    `cache` is accepted for older callers and ignored. With `env`, the program is memoized in the
    cache dir (`relay.host.memo`: read-only in every box), named by the sha256 of the policy and of
    the identity (inode, size, ctime) of the pyseccomp and libseccomp that compiled it: a launch then
    skips loading libseccomp through ctypes (~18 ms), and a changed library or policy is a new name.
    A memo that is not a whole number of 8-byte BPF instructions is compiled again.
    """
    del cache
    data = _COMPILED.get(policy)
    if data is not None:
        return data
    key = _memo_key(policy) if env is not None else None
    if key is not None and env is not None:
        cached = memo.get(env, memo.MemoKind.SECCOMP_BPF, key, MAX_BPF_BYTES)
        if cached and len(cached) % 8 == 0:
            _COMPILED[policy] = cached
            return cached
    import tempfile  # only when compiling: a memoized launch never needs it (~5 ms with shutil)

    with tempfile.TemporaryFile() as out:
        build_filter(policy).export_bpf(out)
        out.seek(0)
        data = out.read()
    if not data or len(data) % 8 or len(data) > MAX_BPF_BYTES:
        raise RuntimeError(f"libseccomp exported a malformed BPF program ({len(data)} bytes)")
    _COMPILED[policy] = data
    if key is not None and env is not None:
        memo.put(env, memo.MemoKind.SECCOMP_BPF, key, data)
    return data


MAX_BPF_BYTES = 8 * 4096  # the kernel's BPF_MAXINSNS instructions of 8 bytes


def _memo_key(policy: SeccompPolicy) -> str | None:
    """The memo's name, or None when the compiler cannot be identified without loading it (then
    every launch compiles). It holds this module's own identity too: the rules a policy becomes are
    written here, so an upgrade that changes them never loads the old program."""
    module = memo.module_identity("pyseccomp")
    library = next((i for d in LIBSECCOMP_DIRS if (i := memo.file_identity(os.path.join(d, "libseccomp.so.2")))), None)
    if module is None or library is None:
        return None
    return memo.key_of("seccomp-bpf", repr(policy), os.uname().machine, module, library,
                       memo.file_identity(__file__) or "-")


def compile_to_memfd(policy: SeccompPolicy, cache: str | None = None, env: Mapping[str, str] | None = None) -> int:
    """The BPF program in an anonymous memfd, rewound, ready for `bwrap --seccomp FD`.
    `cache` is ignored; `env` names the memo's cache dir (see compile_bpf)."""
    data = compile_bpf(policy, env=env)
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
