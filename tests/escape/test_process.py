"""Process and kernel-surface attacks, and host secrets in the environment, in every backend's box."""

from __future__ import annotations

import subprocess

from ..conftest import Sandbox

PY = "/usr/bin/python3"
SYSCALLS = r'''
import ctypes, errno, os, socket, fcntl, termios, pty
libc = ctypes.CDLL(None, use_errno=True)
def sc(name, nr, *args):
    r = libc.syscall(nr, *args)
    print(name, "OK" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), "?"))
kid = os.fork()
if kid == 0:
    import time; time.sleep(5); os._exit(0)
sc("ptrace-attach-child", 101, 16, kid, 0, 0)
buf = ctypes.create_string_buffer(8)
class IOV(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
iov = IOV(ctypes.cast(buf, ctypes.c_void_p), 8)
sc("process_vm_readv", 310, kid, ctypes.byref(iov), 1, ctypes.byref(iov), 1, 0)
sc("unshare-user", 272, 0x10000000)
sc("unshare-mount", 272, 0x00020000)
sc("setns", 308, 0, 0)
sc("io_uring_setup", 425, 8, ctypes.create_string_buffer(120))
sc("bpf", 321, 0, 0, 0)
sc("perf_event_open", 298, 0, 0, -1, -1, 0)
sc("keyctl", 250, 0, 0)
try:
    socket.socket(40, socket.SOCK_STREAM); print("vsock OK")
except OSError as e: print("vsock", errno.errorcode[e.errno])
try:
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect("/run/docker.sock"); print("unix OK")
except OSError as e: print("unix", errno.errorcode[e.errno])
m, s = pty.openpty()
for name, req in (("TIOCSTI", termios.TIOCSTI), ("TIOCLINUX", 0x541C)):
    try:
        fcntl.ioctl(s, req, b"x"); print(name, "OK")
    except OSError as e: print(name, errno.errorcode[e.errno])
# legitimate neighbours
os.kill(kid, 9); os.waitpid(kid, 0); print("LEGIT kill-own-child")
a, b = socket.socketpair(); print("LEGIT socketpair")
socket.socket(socket.AF_INET, socket.SOCK_STREAM).close(); print("LEGIT inet-socket")
fcntl.ioctl(s, termios.TIOCGWINSZ, b"\0" * 8); print("LEGIT winsize")
print("LEGIT getpid", os.getpid())
'''


def run(s: Sandbox, backend: str, script: str, *args: str) -> subprocess.CompletedProcess:
    return s.box(script, backend, *args)


def test_kernel_surfaces_are_refused(box: Sandbox, backend: str, report) -> None:
    (box.workdir / "sys.py").write_text(SYSCALLS)
    out = run(box, backend, f"{PY} sys.py").stdout
    attacks = ["ptrace-attach-child", "process_vm_readv", "unshare-user", "unshare-mount", "setns", "io_uring_setup",
               "bpf", "perf_event_open", "keyctl", "vsock", "unix", "TIOCSTI", "TIOCLINUX"]
    refused = {a: f"{a} EPERM" in out for a in attacks}
    for ok in refused.values():
        report.attack(ok)
    legit = ["kill-own-child", "socketpair", "inet-socket", "winsize", "getpid"]
    for name in legit:
        report.legit(f"LEGIT {name}" in out)
    assert all(refused.values()), (refused, out)
    assert all(f"LEGIT {n}" in out for n in legit), out


def test_x32_syscalls_are_killed(box: Sandbox, backend: str, report) -> None:
    out = run(box, backend, f"{PY} -c 'import ctypes; ctypes.CDLL(None).syscall(0x40000000 | 39); print(\"X32-RAN\")'; "
                            f"echo x32=$?; {PY} -c 'import os; print(\"NATIVE\", os.getpid())'").stdout
    report.attack("X32-RAN" not in out and "x32=159" in out)
    report.legit("NATIVE" in out)
    assert "X32-RAN" not in out and "x32=159" in out and "NATIVE" in out


def test_host_pids_are_invisible_and_unsignalable(box: Sandbox, backend: str, report) -> None:
    victim = subprocess.Popen(["sleep", "60"])
    try:
        out = run(box, backend, f"kill -9 {victim.pid} 2>&1 || echo KILL-REFUSED; ls /proc | grep -c '^[0-9]'; "
                                f"sleep 5 & kill $! && echo OWN-KILL-OK").stdout
        alive = victim.poll() is None
        report.attack(alive and "KILL-REFUSED" in out)
        report.legit("OWN-KILL-OK" in out)
        assert alive and "KILL-REFUSED" in out and "OWN-KILL-OK" in out
    finally:
        victim.kill()
        victim.wait()


def test_fork_memory_and_disk_bombs_are_contained(box: Sandbox, backend: str, report) -> None:
    script = (
        f"{PY} -c 'import os, time\nn = 0\ntry:\n for _ in range(500):\n  if os.fork() == 0:\n   time.sleep(3); os._exit(0)\n"
        f"  n += 1\nexcept OSError: print(\"FORK-LIMITED at\", n)'; "
        f"{PY} -c 'b = bytearray(2 << 30)' 2>/dev/null || echo MEMORY-LIMITED; "
        "head -c 200000000 /dev/zero > /tmp/fill 2>/dev/null || echo DISK-LIMITED; rm -f /tmp/fill; "
        f"{PY} -c 'b = bytearray(32 << 20); print(\"SMALL-ALLOC-OK\")'; head -c 1000000 /dev/zero > /tmp/small && echo SMALL-WRITE-OK"
    )
    proc = run(box, backend, script, "--profile", "tight", "--timeout", "60")
    out = proc.stdout
    contained = all(m in out for m in ("FORK-LIMITED", "MEMORY-LIMITED", "DISK-LIMITED"))
    report.attack(contained)
    report.legit("SMALL-ALLOC-OK" in out and "SMALL-WRITE-OK" in out)
    assert contained, out + proc.stderr
    assert "SMALL-ALLOC-OK" in out and "SMALL-WRITE-OK" in out
    assert subprocess.run(["true"]).returncode == 0  # the host still forks


def test_host_secrets_never_reach_environment_or_argv(box: Sandbox, backend: str, report) -> None:
    secrets = {"AWS_SECRET_ACCESS_KEY": "AKIA-HOST-SECRET", "GITHUB_TOKEN": "ghp_HOSTSECRET", "NPM_TOKEN": "npm_HOSTSECRET",
               "SSH_AUTH_SOCK": "/tmp/ssh-agent.sock", "ANTHROPIC_API_KEY": "sk-ant-PASSED-BY-NAME"}
    proc = box.box("env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; cat /proc/*/cmdline 2>/dev/null | tr '\\0' ' '",
                   backend, extra_env=secrets)
    out = proc.stdout
    leaked = [v for k, v in secrets.items() if k != "ANTHROPIC_API_KEY" and v in out]
    report.attack(not leaked)
    assert not leaked, leaked
    # A backend's own key reaches its own box only (opencode uses Anthropic's, passed by name), and
    # never where a credential route keeps it on the host (claude: the box holds a placeholder).
    from relay.config.load import load_shipped

    shipped = load_shipped()[backend]
    routed = any("ANTHROPIC_API_KEY" in route.secret_env for route in shipped.credentials)
    expected = "ANTHROPIC_API_KEY" in shipped.env_pass and not routed
    report.legit(("sk-ant-PASSED-BY-NAME" in out) == expected)
    assert ("sk-ant-PASSED-BY-NAME" in out) == expected
    if routed:
        assert "ANTHROPIC_API_KEY=hive-relay-placeholder" in out
    launcher_argv = " ".join(proc.args)
    assert "sk-ant-PASSED-BY-NAME" not in launcher_argv
