"""Landlock filesystem confinement for the `process` tier (hosts where bwrap cannot run).

Applied in the launched child just before exec, after PR_SET_NO_NEW_PRIVS. Landlock can only
allow, never carve out, so the read roots are the top-level directories of / minus the ones
that hold user data ($HOME's top level, /home, /root, /tmp, /run, /mnt, /media); the workdir
and a private temp dir are then granted back.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Iterable

SYS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1, 2, 4, 8
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG = 16, 32, 64, 128, 256
MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 512, 1024, 2048, 4096
REFER, TRUNCATE, IOCTL_DEV = 8192, 16384, 32768
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1, 2
PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1
HIDDEN_TOPS = ("/home", "/root", "/tmp", "/var/tmp", "/run", "/mnt", "/media", "/proc", "/sys", "/dev", "/lost+found")
READ = EXECUTE | READ_FILE | READ_DIR


def fs_rights(abi: int) -> int:
    rights = (1 << 13) - 1  # v1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


def read_roots(home: str, names: Iterable[str] | None = None) -> list[str]:
    """Top-level entries of / that hold no user data; $HOME's top level is always excluded.
    `names` is the listing of / (the planner passes its FsView's, so it reads nothing itself)."""
    home_top = "/" + home.strip("/").split("/")[0] if home.strip("/") else "/"
    roots = []
    for name in sorted(os.listdir("/") if names is None else names):
        path = "/" + name
        if path in HIDDEN_TOPS or path == home_top:
            continue
        roots.append(path)
    return roots + ["/proc/self", "/proc/meminfo", "/proc/cpuinfo", "/sys/devices/system/cpu"]


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def apply(read: list[str], write: list[str], abi: int, deny_network: bool) -> None:
    """Restrict this process (and its future children) to the given paths. Raises OSError."""
    libc = ctypes.CDLL(None, use_errno=True)
    create, add, restrict = SYS[platform.machine()]
    handled = fs_rights(abi)
    attr = _RulesetAttr(handled, NET_BIND_TCP | NET_CONNECT_TCP if (deny_network and abi >= 4) else 0,
                        SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(create, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for paths, rights in ((read, READ & handled), (write, handled)):
            for path in paths:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    is_dir = os.path.isdir(path)
                    allowed = rights if is_dir else rights & (EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV)
                    rule = _PathBeneath(allowed, fd)
                    if libc.syscall(add, ruleset, 1, ctypes.byref(rule), 0) < 0:
                        raise OSError(ctypes.get_errno(), f"landlock_add_rule {path} failed")
                finally:
                    os.close(fd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
        if libc.syscall(restrict, ruleset, 0) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)


def die_with_parent() -> None:
    """The process tier has no bwrap to tie the agent to its launcher: SIGKILL it when we die."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
