"""The compat ABIs (i386's `int 0x80`, x32) are refused in container mode as in local mode.

The engine's default seccomp profile lets each host arch's compat ABIs in (x86_64: i386 and x32).
Through i386 the argument rules do not hold: socketcall(SYS_SOCKET) takes the family from memory,
which no seccomp filter reads, so a container box made an AF_UNIX socket that its own socket(2) rule
refuses. The profile we render is native only (relay/render/seccomp_oci.py), so a compat call meets
the engine's bad-arch action, SIGSYS, as in the local box. The twin: the native calls work.
"""

from __future__ import annotations

import platform

import pytest

from relay.render.seccomp_bpf import policy_for
from relay.render.seccomp_oci import render

from .conftest import Sandbox

# i386 socketcall(SYS_SOCKET, [AF_UNIX, SOCK_STREAM, 0]) and i386 getpid (nr 20), each through `int
# 0x80` from a page below 4 GiB (i386 pointers are 32 bits); x32 getpid (39 | __X32_SYSCALL_BIT).
COMPAT = r'''
import ctypes, struct, sys
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
low = libc.mmap(None, 4096, 7, 0x22 | 0x40, -1, 0)  # rwx, MAP_PRIVATE|MAP_ANONYMOUS|MAP_32BIT
ctypes.memmove(low, (ctypes.c_uint32 * 3)(1, 1, 0), 12)
calls = {
    "i386-socketcall-unix": bytes([0xb8, 102, 0, 0, 0, 0xbb, 1, 0, 0, 0, 0xb9]) + struct.pack("<I", low),
    "i386-getpid": bytes([0xb8, 20, 0, 0, 0]),
}
which = sys.argv[1]
if which == "x32-getpid":
    print("RAN", which, libc.syscall(0x40000000 | 39), flush=True)
else:
    code = calls[which] + bytes([0xcd, 0x80, 0xc3])
    ctypes.memmove(low + 64, code, len(code))
    print("RAN", which, ctypes.CFUNCTYPE(ctypes.c_int)(low + 64)(), flush=True)
'''
NATIVE = ("import os, socket; socket.socket(socket.AF_INET).close(); print('NATIVE-OK', os.getpid() > 0); "
          "socket.socket(socket.AF_UNIX)")
CALLS = ("i386-socketcall-unix", "i386-getpid", "x32-getpid")
SIGSYS_EXIT = 128 + 31

# The probes' machine code is x86_64's compat entry points; the renderer's test runs on every host.
x86_64_only = pytest.mark.skipif(platform.machine() != "x86_64",
                                 reason="LOUD SKIP: the i386 and x32 entry points probed exist on x86_64 hosts only")


def test_the_rendered_profile_is_native_only() -> None:
    """Every arch entry of the engine's default keeps its own arch and loses its compat ABIs."""
    base = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [],
            "archMap": [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]},
                        {"architecture": "SCMP_ARCH_AARCH64", "subArchitectures": ["SCMP_ARCH_ARM"]}]}
    profile = render(policy_for(nested_userns=False), base)
    assert profile["archMap"] == [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": []},
                                  {"architecture": "SCMP_ARCH_AARCH64", "subArchitectures": []}]
    assert base["archMap"][0]["subArchitectures"] == ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]  # the base is not touched


def _killed(s: Sandbox, mode: str, which: str) -> None:
    """The compat call WHICH, made in MODE's box, never returns: the filter kills it (SIGSYS)."""
    (s.workdir / "compat.py").write_text(COMPAT)
    proc = s.relay("shell", mode, "--quiet", "--", "/usr/bin/python3", str(s.workdir / "compat.py"), which)
    assert "RAN" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == SIGSYS_EXIT, (proc.returncode, proc.stderr[-2000:])


@x86_64_only
@pytest.mark.container
@pytest.mark.parametrize("which", CALLS)
def test_a_compat_abi_call_is_killed_in_the_container(csandbox: Sandbox, which: str) -> None:
    _killed(csandbox, "container", which)


@pytest.mark.container
def test_native_calls_still_work_in_the_container(csandbox: Sandbox) -> None:
    """The twin: AF_INET and getpid work natively, and native AF_UNIX is still EPERM (not SIGSYS)."""
    proc = csandbox.relay("shell", "container", "--quiet", "--", "/usr/bin/python3", "-c", NATIVE)
    assert "NATIVE-OK True" in proc.stdout, proc.stderr[-2000:]
    assert "PermissionError" in proc.stderr and proc.returncode == 1, proc.stderr[-2000:]


@x86_64_only
@pytest.mark.box
@pytest.mark.parametrize("which", CALLS)
def test_a_compat_abi_call_is_killed_in_the_local_box(box_sandbox: Sandbox, which: str) -> None:
    _killed(box_sandbox, "local", which)
