"""seccomp argument rules compare the low 32 bits the kernel reads (issue 13).

`socket`'s domain, `ioctl`'s request and `clone`'s flags are 32-bit in the kernel, so garbage in
bits 32-63 of the register must not turn a refused value into an allowed one. Each test loads the
real filter (`build_filter(policy).load()`) in a forked child, makes raw syscalls through ctypes
with hypothesis-drawn high bits, and checks the attack gets EPERM while its legitimate twin still
works. Then the same from python3 inside real boxes, and pid 1 (bwrap's init) out of the box's reach.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import socket
import struct
import tempfile
import termios
import zlib
from collections.abc import Callable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from relay.render.seccomp_bpf import (
    AF_INET,
    AF_INET6,
    AF_PACKET,
    AF_UNIX,
    AF_VSOCK,
    CLONE_NEWUSER,
    TIOCLINUX,
    TIOCSETD,
    TIOCSTI,
    TTY_DENIED,
    SeccompPolicy,
    build_filter,
    compile_bpf,
    compile_to_memfd,
    policy_for,
)

from ..conftest import Sandbox

# Raw syscall numbers per architecture; CI is x86_64. Another arch fails loudly (below), never skips.
SYSCALLS = {"x86_64": {"socket": 41, "socketpair": 53, "ioctl": 16, "clone": 56}}
MACHINE = platform.machine()
NR = SYSCALLS.get(MACHINE, SYSCALLS["x86_64"])
AF_NETLINK = 16
AF_TIPC = 30
AF_MAX = 64  # no family at or above this exists: the kernel answers EAFNOSUPPORT without loading a module
SIGCHLD = 17
U32 = (1 << 32) - 1
AGENT = policy_for(nested_userns=False)
NESTED = policy_for(nested_userns=True)
PROCESS = policy_for(nested_userns=False, deny_network=True)

HIGH = st.integers(min_value=0, max_value=U32)
FEW = settings(max_examples=50, deadline=None)  # every example forks a child or two
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


@pytest.fixture(autouse=True)
def _native_numbers() -> None:
    if MACHINE not in SYSCALLS:
        pytest.fail(f"tests/escape/test_seccomp_args.py knows the syscall numbers of {sorted(SYSCALLS)} only, "
                    f"not {MACHINE}: add them to SYSCALLS (the argument rules are untested here until then)")


def raw(name: str, *args: object) -> int:
    """syscall(NAME, ARGS...) with every int passed as a full 64-bit register: the result, or -errno."""
    regs = [ctypes.c_ulong(a & ((1 << 64) - 1)) if isinstance(a, int) else a for a in args]
    ctypes.set_errno(0)
    res = libc.syscall(ctypes.c_long(NR[name]), *regs)
    return res if res >= 0 else -ctypes.get_errno()


def close_if_fd(res: int) -> int:
    if res >= 0:
        os.close(res)
    return res


_FILTERS: dict[SeccompPolicy, object] = {}


def in_child(policy: SeccompPolicy | None, fn: Callable[[], object]) -> object:
    """fn()'s (JSON) result, computed in a forked child that first loads POLICY's real filter
    (None: no filter, the kernel's own answer). The filter never touches this process."""
    flt = None
    if policy is not None:
        flt = _FILTERS.get(policy) or _FILTERS.setdefault(policy, build_filter(policy))
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(rfd)
            if flt is not None:
                flt.load()
            out = {"ok": fn()}
        except BaseException as err:  # noqa: BLE001 - reported to the parent, which fails
            out = {"error": repr(err)}
        try:
            os.write(wfd, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    data = b""
    while chunk := os.read(rfd, 65536):
        data += chunk
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, f"the filtered child died: status {status:#x}"
    out = json.loads(data)
    assert "error" not in out, out["error"]
    return out["ok"]


def record(report, fn: Callable[[], None], kind: str) -> None:
    """Run a hypothesis property once; the summary counts it as one attack (or legitimate use)."""
    ok = False
    try:
        fn()
        ok = True
    finally:
        getattr(report, kind)(ok)


EPERM = -errno.EPERM


# ---------------------------------------------------------------- socket(domain)

@pytest.mark.parametrize("policy", [AGENT, NESTED], ids=["agent", "nested-userns"])
@pytest.mark.parametrize("family", [AF_UNIX, AF_VSOCK], ids=["AF_UNIX", "AF_VSOCK"])
def test_socket_refused_family_with_high_bits_gets_eperm(policy: SeccompPolicy, family: int, report) -> None:
    @FEW
    @given(high=HIGH)
    @example(high=1)
    @example(high=U32)
    def attack(high: int) -> None:
        res = in_child(policy, lambda: close_if_fd(raw("socket", family | high << 32, socket.SOCK_STREAM, 0)))
        assert res == EPERM, f"socket({family} | {high:#x} << 32) -> {res}"

    @FEW
    @given(high=HIGH)
    @example(high=1)
    def twin(high: int) -> None:
        def calls() -> list[int]:
            pair = (ctypes.c_int * 2)()
            made = raw("socketpair", AF_UNIX | high << 32, socket.SOCK_STREAM, 0, pair)
            if made == 0:
                os.close(pair[0])
                os.close(pair[1])
            return [close_if_fd(raw("socket", AF_INET | high << 32, socket.SOCK_STREAM, 0)), made]

        inet, pair = in_child(policy, calls)
        assert inet >= 0 and pair == 0, (high, inet, pair)

    record(report, attack, "attack")
    record(report, twin, "legit")


def test_socket_without_the_filter_reads_only_the_low_32_bits() -> None:
    """The control: the kernel itself takes socket(AF_UNIX | 1 << 32) as AF_UNIX, so the attack is real."""
    assert in_child(None, lambda: close_if_fd(raw("socket", AF_UNIX | 1 << 32, socket.SOCK_STREAM, 0))) >= 0


@given(domain=st.sampled_from([AF_INET, AF_NETLINK]) | st.integers(min_value=AF_MAX, max_value=U32), high=HIGH)
@FEW
def test_socket_other_families_get_the_kernels_own_answer(domain: int, high: int) -> None:
    """Only the named families are refused: any other low 32 bits (existing or not) reach the kernel."""
    def call() -> int:
        return close_if_fd(raw("socket", domain | high << 32, socket.SOCK_DGRAM, 0))

    filtered, kernel = in_child(AGENT, call), in_child(None, call)
    assert (filtered >= 0) == (kernel >= 0) and (filtered >= 0 or filtered == kernel), (domain, high, filtered, kernel)


# ---------------------------------------------------------------- process tier: no network at all

def test_process_tier_refuses_every_socket_and_keeps_socketpair(report) -> None:
    families = st.sampled_from([AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET, AF_TIPC, AF_VSOCK]) | st.integers(0, U32)

    @FEW
    @given(domain=families, high=HIGH, kind=st.sampled_from([socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW]))
    def attack(domain: int, high: int, kind: int) -> None:
        res = in_child(PROCESS, lambda: close_if_fd(raw("socket", domain | high << 32, kind, 0)))
        assert res == EPERM, f"process tier: socket({domain:#x} | {high:#x} << 32, {kind}) -> {res}"

    @FEW
    @given(domain=families.filter(lambda d: d != AF_UNIX), high=HIGH)
    def pair_attack(domain: int, high: int) -> None:
        def call() -> int:
            pair = (ctypes.c_int * 2)()
            res = raw("socketpair", domain | high << 32, socket.SOCK_STREAM, 0, pair)
            if res == 0:
                os.close(pair[0])
                os.close(pair[1])
            return res

        res = in_child(PROCESS, call)
        assert res == EPERM, f"process tier: socketpair({domain:#x} | {high:#x} << 32) -> {res}"

    @FEW
    @given(high=HIGH)
    @example(high=1)
    def twin(high: int) -> None:
        def call() -> str:
            pair = (ctypes.c_int * 2)()
            res = raw("socketpair", AF_UNIX | high << 32, socket.SOCK_STREAM, 0, pair)
            if res != 0:
                return f"socketpair {res}"
            a, b = socket.socket(fileno=pair[0]), socket.socket(fileno=pair[1])
            a.sendall(b"ping")
            got = b.recv(4).decode()
            a.close()
            b.close()
            c, d = socket.socketpair()  # what python (and node's child_process) do
            c.close()
            d.close()
            return got

        assert in_child(PROCESS, call) == "ping"

    record(report, attack, "attack")
    record(report, pair_attack, "attack")
    record(report, twin, "legit")


# ---------------------------------------------------------------- ioctl(request)

@pytest.mark.parametrize("request_", [TIOCSTI, TIOCLINUX, TIOCSETD], ids=["TIOCSTI", "TIOCLINUX", "TIOCSETD"])
@pytest.mark.parametrize("policy", [AGENT, PROCESS], ids=["agent", "process"])
def test_tty_injection_with_high_bits_gets_eperm(policy: SeccompPolicy, request_: int, report) -> None:
    def on_pty(req: int) -> Callable[[], int]:
        def call() -> int:
            master, slave = os.openpty()
            arg = ctypes.create_string_buffer(b"\x03" + b"\0" * 63)  # TIOCSTI: the byte; TIOCLINUX: subcode 3
            return raw("ioctl", slave, req, arg)
        return call

    @FEW
    @given(high=HIGH)
    @example(high=1)
    @example(high=U32)
    def attack(high: int) -> None:
        res = in_child(policy, on_pty(request_ | high << 32))
        assert res == EPERM, f"ioctl(pty, {request_:#x} | {high:#x} << 32) -> {res}"

    @FEW
    @given(high=HIGH)
    @example(high=1)
    def twin(high: int) -> None:
        def call() -> list[int]:
            master, slave = os.openpty()
            buf = ctypes.create_string_buffer(8)
            res = raw("ioctl", slave, termios.TIOCGWINSZ | high << 32, buf)
            return [res, *struct.unpack("HHHH", buf.raw)]

        res, *_ = in_child(policy, call)
        assert res == 0, f"ioctl(pty, TIOCGWINSZ | {high:#x} << 32) -> {res}"

    record(report, attack, "attack")
    record(report, twin, "legit")


@given(req=st.integers(min_value=0, max_value=U32).filter(lambda r: r not in TTY_DENIED), high=HIGH)
@FEW
def test_ioctl_other_requests_get_the_kernels_own_answer(req: int, high: int) -> None:
    """Only the TTY_DENIED requests are refused: any other request on a pipe gets the kernel's answer."""
    def call() -> int:
        rfd, wfd = os.pipe()
        return raw("ioctl", rfd, req | high << 32, 0)

    assert in_child(AGENT, call) == in_child(None, call), (hex(req), hex(high))


# ---------------------------------------------------------------- clone(flags)

def _clone(flags: int) -> Callable[[], int]:
    """clone(FLAGS) by raw syscall, fork-like (no new stack): the new process exits 7 at once."""
    def call() -> int:
        pid = raw("clone", flags, 0, 0, 0, 0)
        if pid == 0:
            os._exit(7)
        if pid < 0:
            return pid
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    return call


@pytest.mark.parametrize("policy", [AGENT, PROCESS], ids=["agent", "process"])
def test_clone_newuser_with_high_bits_gets_eperm(policy: SeccompPolicy, report) -> None:
    @FEW
    @given(high=HIGH)
    @example(high=1)
    @example(high=U32)
    def attack(high: int) -> None:
        res = in_child(policy, _clone(CLONE_NEWUSER | SIGCHLD | high << 32))
        assert res == EPERM, f"clone(CLONE_NEWUSER | {high:#x} << 32) -> {res}"

    @FEW
    @given(high=HIGH)
    @example(high=1)
    def twin(high: int) -> None:
        res = in_child(policy, _clone(SIGCHLD | high << 32))
        assert res == 7, f"clone(SIGCHLD | {high:#x} << 32) -> {res}"
        assert in_child(policy, lambda: os.waitstatus_to_exitcode(os.waitpid(_fork_exit(5), 0)[1])) == 5

    record(report, attack, "attack")
    record(report, twin, "legit")


def _fork_exit(code: int) -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(code)
    return pid


def test_nested_userns_backends_keep_clone_newuser() -> None:
    """A backend whose own sandbox needs user namespaces is not refused them."""
    assert in_child(NESTED, _clone(CLONE_NEWUSER | SIGCHLD)) == 7


# ---------------------------------------------------------------- the exported BPF

def _insns(policy: SeccompPolicy) -> list[tuple[int, int, int, int]]:
    data = compile_bpf(policy)
    assert data and len(data) % 8 == 0
    return [struct.unpack_from("<HBBI", data, at) for at in range(0, len(data), 8)]


@pytest.mark.parametrize("policy", [AGENT, NESTED, PROCESS], ids=["agent", "nested-userns", "process"])
def test_exported_bpf_ignores_every_high_argument_word(policy: SeccompPolicy) -> None:
    """libseccomp splits a 64-bit comparison into high and low words on x86_64. Every load of an
    argument's high word (seccomp_data.args[i] + 4) must be masked to nothing (`and #0`), so the
    filter's verdict never depends on bits the kernel drops."""
    insns = _insns(policy)
    high_words = {16 + 8 * i + 4 for i in range(6)}
    low_words = {16 + 8 * i for i in range(6)}
    loads = [(at, k) for at, (code, _, _, k) in enumerate(insns) if code == 0x20 and k in high_words | low_words]
    assert any(k in low_words for _, k in loads), "no argument comparison found: the rules are missing"
    for at, k in loads:
        if k in high_words:
            code, _, _, mask = insns[at + 1]
            assert (code, mask) == (0x54, 0), f"insn {at}: high word {k - 20 >> 3} compared unmasked ({insns[at + 1]})"


def test_summary_says_what_the_process_tier_refuses() -> None:
    assert "socket: EPERM for every family (no network); socketpair: AF_UNIX only" in PROCESS.summary()
    assert not any(rule.startswith("socket(") for rule in PROCESS.summary())
    assert "socket(AF_UNIX): EPERM (socketpair allowed)" in AGENT.summary()


# ---------------------------------------------------------------- no compiled filter from a file

def _old_cache_name(policy: SeccompPolicy, cache: str) -> str:
    """Where compile_bpf used to look for a compiled filter (before issue 13)."""
    lib = next((p for p in ("/usr/lib/x86_64-linux-gnu/libseccomp.so.2", "/usr/lib/aarch64-linux-gnu/libseccomp.so.2",
                            "/lib/x86_64-linux-gnu/libseccomp.so.2") if os.path.exists(p)), "")
    stamp = os.stat(lib).st_mtime_ns if lib else 0
    key = repr((policy, os.uname().machine, lib, stamp)).encode()
    return os.path.join(cache, f"seccomp-{zlib.crc32(key):08x}-{len(key)}.bpf")


def test_a_planted_filter_in_the_cache_dir_is_never_loaded(tmp_path, report) -> None:
    """A box that could write ~/.cache/hive-relay must not choose the next box's filter."""
    cache = tmp_path / "cache"
    cache.mkdir()
    allow_all = struct.pack("<HBBI", 0x06, 0, 0, 0x7FFF0000)  # ret SECCOMP_RET_ALLOW
    planted = _old_cache_name(AGENT, str(cache))
    with open(planted, "wb") as fh:
        fh.write(allow_all)
    fd = compile_to_memfd(AGENT, str(cache))
    try:
        with os.fdopen(os.dup(fd), "rb") as fh:
            served = fh.read()
    finally:
        os.close(fd)
    report.attack(served != allow_all)
    assert served != allow_all and len(served) > 64
    with tempfile.TemporaryFile() as out:
        build_filter(AGENT).export_bpf(out)
        out.seek(0)
        assert served == out.read()
    assert sorted(os.listdir(cache)) == [os.path.basename(planted)], "nothing is written to the cache either"


# ---------------------------------------------------------------- end to end, in real boxes

PY = "/usr/bin/python3"
IN_BOX = r'''
import ctypes, errno, os, socket, termios
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
H = 1 << 32
def sc(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_ulong(a) if isinstance(a, int) else a for a in args])
    return r if r >= 0 else -ctypes.get_errno()
def show(name, r):
    print(name, "OK" if r >= 0 else errno.errorcode.get(-r, r))
def sock(domain):
    r = sc(41, domain, socket.SOCK_STREAM, 0)
    if r >= 0: os.close(r)
    return r
m, s = os.openpty()
show("unix-high", sock(1 | H))
show("unix-all-high", sock(1 | 0xFFFFFFFF << 32))
show("vsock-high", sock(40 | H))
show("tiocsti-high", sc(16, s, termios.TIOCSTI | H, ctypes.create_string_buffer(b"x")))
show("tioclinux-high", sc(16, s, 0x541C | H, ctypes.create_string_buffer(b"\x03")))
show("LEGIT inet", sock(2))
show("LEGIT inet-high", sock(2 | H))
pair = (ctypes.c_int * 2)()
show("LEGIT socketpair-high", sc(53, 1 | H, socket.SOCK_STREAM, 0, pair))
show("LEGIT winsize-high", sc(16, s, termios.TIOCGWINSZ | H, ctypes.create_string_buffer(8)))
'''


def test_high_bit_attacks_in_a_real_box(box: Sandbox, backend: str, report) -> None:
    (box.workdir / "args.py").write_text(IN_BOX)
    proc = box.box(f"{PY} args.py", backend)
    out = proc.stdout
    attacks = ["unix-high", "unix-all-high", "vsock-high", "tiocsti-high", "tioclinux-high"]
    refused = {a: f"{a} EPERM" in out for a in attacks}
    for ok in refused.values():
        report.attack(ok)
    legit = ["inet", "inet-high", "socketpair-high", "winsize-high"]
    for name in legit:
        report.legit(f"LEGIT {name} OK" in out)
    assert all(refused.values()), (refused, out, proc.stderr)
    assert all(f"LEGIT {n} OK" in out for n in legit), (out, proc.stderr)


PID1 = r'''
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def err(e): return errno.errorcode.get(e.errno, e.errno)
def try_open(name, path, flags):
    try:
        os.close(os.open(path, flags)); print(name, "OPEN")
    except OSError as e: print(name, err(e))
print("pid", os.getpid())
try:
    text = next(l for l in open("/proc/1/maps") if " r-xp " in l or " r--p " in l)
    start = int(text.split("-")[0], 16)
    fd = os.open("/proc/1/mem", os.O_RDWR)
    data = os.pread(fd, 8, start)
    os.pwrite(fd, data, start)  # the same bytes back: proves the write, changes nothing
    print("mem-write WROTE")
except (OSError, StopIteration) as e: print("mem-write", err(e) if isinstance(e, OSError) else "no-maps")
try_open("task-mem", "/proc/1/task/1/mem", os.O_RDWR)
try:
    fds = os.listdir("/proc/1/fd")
except OSError as e: fds = []; print("fd-list", err(e))
opened = []
for n in fds:
    try:
        os.close(os.open(f"/proc/1/fd/{n}", os.O_RDONLY | os.O_NONBLOCK)); opened.append(n)
    except OSError: pass
print("fd-open", "OPEN " + ",".join(opened) if opened else "NONE")
pfd = libc.syscall(434, 1, 0)
stolen = [n for n in range(16) if pfd >= 0 and libc.syscall(438, pfd, n, 0) >= 0]
print("pidfd-getfd", "STOLE " + ",".join(map(str, stolen)) if stolen else "NONE")
print("LEGIT self-status", "OK" if "NoNewPrivs:\t1" in open("/proc/self/status").read() else "NO")
try:
    fd = os.open("/proc/self/mem", os.O_RDWR); os.close(fd); print("LEGIT self-mem OK")
except OSError as e: print("LEGIT self-mem", err(e))
'''


def _pid1_run(box: Sandbox) -> str:
    (box.workdir / "pid1.py").write_text(PID1)
    proc = box.box(f"{PY} pid1.py")
    assert "pid 2" in proc.stdout, ("the box's first command is expected as pid 2, under bwrap's init", proc.stdout,
                                    proc.stderr)
    return proc.stdout


def test_pid1_fds_cannot_be_taken_by_pidfd_getfd(box: Sandbox, report) -> None:
    """bwrap's init (pid 1 in the box) holds the eventfd the box's exit status leaves by."""
    out = _pid1_run(box)
    report.attack("pidfd-getfd NONE" in out)
    report.legit("LEGIT self-status OK" in out and "LEGIT self-mem OK" in out)
    assert "pidfd-getfd NONE" in out, out
    assert "LEGIT self-status OK" in out and "LEGIT self-mem OK" in out, out


def test_pid1_memory_and_fds_are_out_of_reach(box: Sandbox, report) -> None:
    out = _pid1_run(box)
    blocked = {
        "mem-write": "mem-write WROTE" not in out,
        "task-mem": "task-mem OPEN" not in out,
        "fd-open": "fd-open NONE" in out,
    }
    for ok in blocked.values():
        report.attack(ok)
    report.legit("LEGIT self-status OK" in out and "LEGIT self-mem OK" in out)
    assert "LEGIT self-status OK" in out and "LEGIT self-mem OK" in out, out
    assert all(blocked.values()), (blocked, out)
