"""The gvisor tier for real: runsc, the Sentry's kernel, the same policy as the supervised box.

Each attack beside its legitimate twin; run as root and as an unprivileged user (runsc --rootless).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pexpect
import pytest

from .conftest import Sandbox, require_box
from .servers import start_http

pytestmark = pytest.mark.box

PY = "/usr/bin/python3"
GV = ("--isolation", "gvisor")


def _runsc_problem() -> str | None:
    from relay.host import runsc_host

    got = runsc_host.facts(os.environ, use_cache=False)
    return got["runsc_error"]


@pytest.fixture(scope="module")
def runsc_ok() -> None:
    problem = _runsc_problem()
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the gvisor tests (.ci/run installs runsc), but: {problem}")
    pytest.skip(f"LOUD SKIP: no working runsc here: {problem}")


@pytest.fixture(params=["compiled", "python"])
def gv(request: pytest.FixtureRequest, box_sandbox: Sandbox, runsc_ok: None) -> Sandbox:
    """Each test on each init: the compiled one (relay/box/gvisor_init.c, the default where cc links
    statically) and the Python one (its fallback, HIVE_RELAY_GVISOR_INIT=python)."""
    if request.param == "python":
        box_sandbox.env["HIVE_RELAY_GVISOR_INIT"] = "python"
    return box_sandbox


def box(s: Sandbox, script: str, backend: str = "shell", *args: str, **kw) -> subprocess.CompletedProcess:
    return s.box(script, backend, *GV, *args, **kw)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout={proc.stdout}\nstderr={proc.stderr}"
    return proc.stdout


def test_the_kernel_is_gvisors_not_the_hosts(gv: Sandbox) -> None:
    out = ok(box(gv, "uname -r; echo sys=$(uname -s)"))
    assert out.splitlines()[0] != os.uname().release, out  # the Sentry answers, not the host kernel
    assert "sys=Linux" in out  # an ordinary Linux to the agent all the same
    plan = json.loads(gv.relay("shell", "local", *GV, "--dry-run", "--json").stdout)
    assert plan["tier"] == "gvisor" and plan["gvisor"]["platform"] in ("systrap", "ptrace")


def test_denied_secret_unreadable_granted_state_readable_and_writable(gv: Sandbox) -> None:
    out = ok(box(gv, 'cat ~/.ssh/id_rsa 2>&1 && echo LEAKED; cat ~/.aws/credentials 2>&1 | grep -c SECRET; '
                     'cat ~/.claude/settings.json; echo \'{"theme": "light"}\' > ~/.claude/settings.json && echo WROTE; '
                     'cat ~/notes.txt 2>&1 || echo NO-NOTES', "claude"))
    assert "PRIVATE-KEY" not in out and "LEAKED" not in out and "aws_secret" not in out
    assert '"theme": "dark"' in out and "WROTE" in out and "NO-NOTES" in out
    assert (gv.home / ".claude" / "settings.json").read_text().strip() == '{"theme": "light"}'


def test_workdir_write_lands_in_the_staged_layer_not_on_the_host(gv: Sandbox) -> None:
    proc = box(gv, "echo from-box > made.txt; echo more >> README.md; cat made.txt", "shell", "--staged")
    assert ok(proc).strip() == "from-box"
    assert not (gv.workdir / "made.txt").exists()  # the checkout is the lower layer: untouched
    assert (gv.workdir / "README.md").read_text() == "hello from the workdir\n"
    assert "staged: 2 changed" in proc.stderr, proc.stderr
    live = box(gv, "echo live > live.txt")  # the twin: live (this suite's config) writes the checkout
    assert live.returncode == 0, live.stderr
    assert (gv.workdir / "live.txt").read_text() == "live\n"


def test_git_hooks_cannot_be_planted_but_git_works(gv: Sandbox) -> None:
    subprocess.run(["git", "init", "-q", str(gv.workdir)], check=True)
    out = ok(box(gv, "echo evil > .git/hooks/pre-commit 2>&1 || echo HOOK-REFUSED; git status --short | head -3; "
                     "echo GIT-OK"))
    assert "HOOK-REFUSED" in out and "GIT-OK" in out
    assert not (gv.workdir / ".git" / "hooks" / "pre-commit").exists()


TRUNCATE = r'''
import os, sys
for p in sys.argv[1:]:
    for flags in (os.O_RDONLY | os.O_TRUNC, os.O_WRONLY | os.O_TRUNC, os.O_WRONLY | os.O_CREAT | os.O_TRUNC):
        try:
            os.close(os.open(p, flags, 0o600))
            print("OPENED", p)
        except OSError as err:
            print("REFUSED", p, err.errno)
'''


def test_a_file_in_a_read_only_directory_bind_is_never_truncated(gv: Sandbox) -> None:
    """runsc's directfs truncated a file inside a read-only directory bind on open(O_TRUNC), then
    answered EROFS: a box could empty a sample hook or our own memos. The run uses the gofer
    (--directfs=false), which checks the mount first. Twin: a workdir file truncates as usual."""
    subprocess.run(["git", "init", "-q", str(gv.workdir)], check=True)
    hook = gv.workdir / ".git" / "hooks" / "pre-commit.sample"
    before = hook.read_bytes()
    (gv.workdir / "mine.txt").write_text("box may empty this\n")
    out = ok(box(gv, f"{PY} -c '{TRUNCATE}' .git/hooks/pre-commit.sample mine.txt"))
    assert out.count("REFUSED .git/hooks/pre-commit.sample 30") == 3, out
    assert hook.read_bytes() == before and before
    assert "OPENED mine.txt" in out and (gv.workdir / "mine.txt").read_bytes() == b""


SOCKETS = r'''
import socket, errno
try:
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); print("UNIX-OK")
except OSError as e: print("UNIX-ERR", errno.errorcode[e.errno])
a, b = socket.socketpair(); a.sendall(b"ping"); print("PAIR", b.recv(4).decode())
try:
    open("/proc/1/mem", "r+b"); print("INIT-MEM-OPEN")
except OSError as e: print("INIT-MEM", errno.errorcode[e.errno])
import fcntl, termios, pty
m, sl = pty.openpty()
try:
    fcntl.ioctl(sl, termios.TIOCSTI, b"x"); print("STI-ALLOWED")
except OSError as e: print("STI", errno.errorcode[e.errno])
print("WINSZ", len(fcntl.ioctl(sl, termios.TIOCGWINSZ, b"\0" * 8)))
'''


def test_our_seccomp_holds_in_the_sentry(gv: Sandbox) -> None:
    """The agent's filter is loaded inside gVisor: no AF_UNIX socket (so no host socket, however the
    gofer would reach it), no TIOCSTI, and the init (which keeps AF_UNIX) cannot be written through
    /proc/1/mem; socketpair and ordinary tty ioctls work."""
    out = ok(box(gv, f"{PY} -c '{SOCKETS}'"))
    assert "UNIX-ERR EPERM" in out and "PAIR ping" in out
    assert "INIT-MEM-OPEN" not in out and "INIT-MEM" in out
    assert "STI EPERM" in out and "WINSZ 8" in out


@pytest.fixture(scope="module")
def upstream():
    server, port, _ = start_http()
    yield port
    server.shutdown()


def test_egress_only_through_the_proxy(gv: Sandbox, upstream: int) -> None:
    script = (f"curl -sS http://plain.test:{upstream}/hello; "
              "curl -s -o /dev/null -w 'denied=%{http_code}\\n' http://denied.test/; "
              f"{PY} -c 'import socket\ntry:\n socket.create_connection((\"127.0.0.1\", {upstream}), timeout=3); "
              "print(\"DIRECT\")\nexcept OSError as e: print(\"NODIRECT\", e.errno)'; "
              f"{PY} -c 'import socket\ntry:\n socket.getaddrinfo(\"example.com\", 443); print(\"RESOLVED\")\n"
              "except OSError: print(\"NODNS\")'")
    out = ok(box(gv, script, "shell", "--allow-host", f"plain.test:{upstream}=127.0.0.1:{upstream}"))
    assert "hello from the fake upstream" in out  # the allowed host answers through the proxy
    assert "denied=403" in out  # the proxy refuses the rest
    assert "NODIRECT" in out and "DIRECT\n" not in out  # the host's loopback is not the box's
    assert "NODNS" in out


def renamed_run_dir_attack(run: Callable[..., subprocess.CompletedProcess], workdir: Path, upstream: int,
                           can_rename: bool = True) -> None:
    """The red team's hole: /run is the box's to write, so the agent renamed /run/hive-relay away and put a
    link to a host socket of its choosing (here one in the workdir, which the box sees) where the proxy's
    socket was; the init connected by path, with AF_UNIX, and reached it. Now the init holds the socket's
    directory from before the agent started: the planted socket gets nothing, and the twin, a request
    through the proxy after the rename, still works. `run(script, *args)` runs a box; `can_rename`: the
    box's user owns /run/hive-relay (uid 0 in the Sentry; not a rootless container's keep-id user,
    where the rename itself is refused)."""
    import socket
    import threading

    planted = workdir / "host.sock"
    got: list[bytes] = []
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(planted))
    planted.chmod(0o777)
    listener.listen(4)
    listener.settimeout(60)

    def serve() -> None:
        try:
            conn, _ = listener.accept()
            got.append(conn.recv(100))
            conn.sendall(b"HOST-SOCKET-REACHED\n")
            conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        script = ("mv /run/hive-relay /run/old && mkdir /run/hive-relay && "
                  f"ln -s {planted} /run/hive-relay/proxy.sock && echo PLANTED; "
                  "exec 3<>/dev/tcp/127.0.0.1/3128 && printf 'PING\\r\\n\\r\\n' >&3 && timeout 5 head -c 200 <&3; echo; "
                  f"curl -sS -m 20 http://plain.test:{upstream}/hello")
        proc = run(script, "--allow-host", f"plain.test:{upstream}=127.0.0.1:{upstream}")
        out = ok(proc)
    finally:
        listener.close()
        thread.join(5)
        planted.unlink(missing_ok=True)
    if can_rename:
        assert "PLANTED" in out, out  # the attack ran as written
    else:
        assert "PLANTED" not in out and "cannot move '/run/hive-relay'" in proc.stderr, proc.stderr[-1500:]
    assert not got and "HOST-SOCKET-REACHED" not in out, (got, out)
    assert "hello from the fake upstream" in out, out


def test_a_renamed_run_dir_cannot_steer_the_relay_to_another_host_socket(gv: Sandbox, upstream: int) -> None:
    renamed_run_dir_attack(lambda script, *args: box(gv, script, "shell", *args), gv.workdir, upstream)


def test_the_init_is_the_compiled_one_unless_the_python_one_is_asked_for(gv: Sandbox) -> None:
    dry = gv.relay("shell", "local", *GV, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    command = json.loads(dry.stdout)["command"]
    if gv.env.get("HIVE_RELAY_GVISOR_INIT") == "python":
        assert "/run/hive-relay/gvisor-init.py" in command and "/run/hive-relay/gvisor-init" not in command
    else:
        assert "/run/hive-relay/gvisor-init" in command and "/run/hive-relay/gvisor-init.py" not in command


def test_the_agent_starts_with_every_signal_at_its_default(gv: Sandbox) -> None:
    """python3 ignores SIGPIPE and SIGXFSZ at startup; the agent must not inherit that (`yes | head`
    would write into a closed pipe for ever). The twin: the box's own keyboard handling still works
    (tests below); here, a pipe closed early ends its writer."""
    out = ok(box(gv, 'yes | head -c 3 >/dev/null; echo "yes=${PIPESTATUS[0]}"; '
                     '(ulimit -f 1; head -c 4096 /dev/zero > /tmp/big); echo "xfsz=$?"'))
    assert "yes=141" in out, out  # killed by SIGPIPE (128+13), not "yes: Broken pipe" (1)
    assert "xfsz=153" in out, out  # killed by SIGXFSZ (128+25), not "File too large" (1)


def test_exit_codes_and_timeout_pass_through(gv: Sandbox) -> None:
    assert box(gv, "exit 7").returncode == 7
    assert box(gv, "kill -TERM $$").returncode == 128 + signal.SIGTERM
    assert box(gv, "kill -KILL $$").returncode == 128 + signal.SIGKILL  # the Python init said 1 (no SIG_DFL for KILL)
    proc = box(gv, "sleep 100", "shell", "--timeout", "2")
    assert proc.returncode == 124 and "timed out after 2 s" in proc.stderr


def test_a_box_whose_init_is_stopped_still_ends_on_the_launchers_signal(gv: Sandbox) -> None:
    """gVisor lets the agent SIGSTOP its own pid 1 (Linux would not); the init then never reaps, and the
    box never ends by itself. A SIGINT sent to the launcher alone (a supervisor, not the terminal) ends
    it after the grace the box gets to end on its own; nothing is left behind."""
    proc = subprocess.Popen([sys.executable, "-m", "relay", "shell", "local", "--quiet", *GV, "--prompt",
                             "kill -STOP 1; echo STOPPED; exit 0"], cwd=gv.workdir, env=gv.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "STOPPED"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, err)
    assert not list(Path(gv.env["XDG_RUNTIME_DIR"]).glob("hive-relay-*"))


def test_explicit_gvisor_without_runsc_refuses_and_never_falls_back(gv: Sandbox) -> None:
    proc = gv.box("echo RAN-ANYWAY", "shell", *GV, extra_env={"HIVE_RELAY_RUNSC": "/nonexistent"})
    assert proc.returncode == 3, proc.stderr
    assert "RAN-ANYWAY" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--isolation gvisor cannot be enforced" in lines[0], proc.stderr
    assert "apt-get install -t bookworm-backports runsc" in lines[0]
    plan = gv.relay("shell", "local", *GV, "--dry-run", "--json", extra_env={"HIVE_RELAY_RUNSC": "/nonexistent"})
    assert plan.returncode == 3 and not plan.stdout  # not even a plan of a weaker tier
    twin = gv.box("echo RAN", "shell", *GV)  # the twin: present, it runs (and in gvisor, not bwrap)
    assert twin.returncode == 0 and "RAN" in twin.stdout


def spawn(s: Sandbox) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, ["-m", "relay", "shell", "local", "--quiet", *GV], cwd=str(s.workdir),
                          env=s.env, encoding="utf-8", timeout=60, dimensions=(24, 80))
    child.sendline("echo READY$((40+2))")
    child.expect("READY42")
    return child


def check(child: pexpect.spawn, command: str, marker: str) -> str:
    child.sendline(f"{command}; echo {marker}$((1+1))")
    child.expect(f"{marker}2")
    return child.before


def test_a_terminal_session_job_control_ctrl_c_resize(gv: Sandbox) -> None:
    child = spawn(gv)
    out = check(child, "test -t 0 && echo tty-ok; echo term=$TERM; uname -r", "T")
    assert "tty-ok" in out and "term=xterm-256color" in out and os.uname().release not in out
    out = check(child, "sleep 100 & jobs", "J")
    assert "Running" in out and "sleep 100" in out
    child.sendline("fg")
    child.expect("sleep 100")
    child.expect(pexpect.TIMEOUT, timeout=1)  # let it own the (emulated) terminal
    child.sendcontrol("z")
    child.expect("Stopped")
    child.sendline("fg")
    child.expect("sleep 100")
    child.expect(pexpect.TIMEOUT, timeout=1)
    child.sendintr()  # Ctrl-C: the work dies, the shell and the box live on
    out = check(child, "echo last=$?; jobs; echo still-here", "L")
    assert "last=130" in out and "still-here" in out and "Stopped" not in out.split("L$((1+1))")[-1]
    assert child.isalive()
    child.sendline("trap 'echo GOT-WINCH' WINCH; sleep 5 & wait")
    child.expect("wait")
    child.expect(pexpect.TIMEOUT, timeout=1)
    child.setwinsize(40, 132)
    child.expect("GOT-WINCH")
    assert "40 132" in check(child, "stty size", "R")
    # TIOCSTI into the caller's own terminal (fd 0; this host allows it: dev.tty.legacy_tiocsti=1):
    # our filter refuses it in the Sentry; ordinary tty ioctls on it still work.
    inject = ("import fcntl, termios, errno, os\\n"
              "try:\\n fcntl.ioctl(0, termios.TIOCSTI, b\\\"X\\\"); print(\\\"INJ\\\" \\\"ECTED\\\")\\n"
              "except OSError as e: print(\\\"STI\\\", errno.errorcode[e.errno])\\n"
              "print(\\\"ROWS\\\", os.get_terminal_size(0).lines)")
    out = check(child, f'{PY} -c "$(printf \'{inject}\')"', "I")
    assert "STI EPERM" in out and "INJECTED" not in out and "ROWS 40" in out
    child.sendline("exit 5")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 5


def test_nothing_is_left_behind(gv: Sandbox) -> None:
    """The run dir (bundle, runsc state, proxy socket, filter) goes with the janitor; no runsc stays."""
    ok(box(gv, "true"))
    runs = [p for p in Path(gv.env["XDG_RUNTIME_DIR"]).glob("hive-relay-*")]
    assert not runs, runs
    mine = subprocess.run(["pgrep", "-f", f"runsc.*{gv.env['XDG_RUNTIME_DIR']}"], capture_output=True, text=True)
    assert not mine.stdout.strip(), mine.stdout


def test_require_box_for_the_twin() -> None:
    """The supervised tier stays what auto picks: gvisor only when asked."""
    require_box()
    from relay.model.host_facts import HostFacts
    from relay.policy.tiers import auto_pick

    facts = HostFacts(uid=1000, gid=1000, home="/h", user="u", shell="/bin/sh", tty=False, bwrap="/usr/bin/bwrap",
                      seccomp=True, runsc="/usr/bin/runsc", runsc_error=None)
    assert auto_pick(facts) == "agent at supervised"


def test_user_config_isolation_gvisor_is_the_default_and_the_flag_wins(gv: Sandbox) -> None:
    cfg = gv.home / ".config" / "hive-relay" / "config.yaml"
    cfg.write_text(cfg.read_text() + "isolation: gvisor\n")
    out = ok(gv.box("uname -r"))
    assert out.strip() != os.uname().release  # the Sentry: the config asked for gvisor
    flag = ok(gv.box("uname -r", "shell", "--isolation", "supervised"))
    assert flag.strip() == os.uname().release  # an explicit --isolation wins over the config


def test_config_isolations_are_the_tiers_words() -> None:
    from relay.config.load import CONFIG_ISOLATIONS
    from relay.policy.tiers import ISOLATIONS

    assert CONFIG_ISOLATIONS == ISOLATIONS


def test_a_repo_config_cannot_pick_the_tier(sandbox: Sandbox) -> None:
    (sandbox.workdir / ".hive-relay.yaml").write_text("isolation: process\n")
    proc = sandbox.relay("shell", "local", "--dry-run", "--json")
    assert proc.returncode != 0 and "isolation" in proc.stderr, proc.stderr


@pytest.mark.parametrize("backend", ["claude", "codex"])
def test_a_real_cli_turn_with_the_key_injected(gv: Sandbox, ca, tls_api, backend: str) -> None:  # noqa: ANN001
    """The real CLI (node, from npm) in the Sentry completes a turn against the fake API through the proxy,
    which adds the key: the box sees only the placeholder (tests/test_credential_turns.py's checks)."""
    import re

    from . import fake_api
    from .test_agents import TOOLS
    from .test_credential_turns import BACKENDS, PLACEHOLDER, REAL, files_holding, setup_home

    host_var, name, box_var = BACKENDS[backend]
    setup_home(gv, backend, box_var)
    tls_api.tool_command = "sh probe-creds.sh"
    tls_api.tool_name = "Bash"
    port = tls_api.server_address[1]
    proc = gv.relay(backend, "local", *GV, "--prompt", "say the answer", "--allow-host", f"{name}:443=127.0.0.1:{port}",
                    "--timeout", "240", timeout=300,
                    extra_env={host_var: REAL, "SSL_CERT_FILE": str(ca[0]), "HIVE_RELAY_TOOLS": TOOLS})
    assert proc.returncode == 0 and fake_api.ANSWER in proc.stdout, (proc.stdout[-1500:], proc.stderr[-3000:])
    assert f"{backend} · local · gvisor · " in proc.stderr
    keys = [v for h in tls_api.headers_seen for k, v in h.items() if k in ("x-api-key", "authorization")]
    assert keys and all(REAL in v for v in keys), keys
    bodies = "\n".join(r["body"] for r in tls_api.requests)
    assert REAL not in bodies
    probe = dict(re.findall(r"probe-(env|proc|seen|home)=([\w-]*)", bodies))
    probe.pop("seen", None)
    assert probe == {"env": PLACEHOLDER, "proc": "0", "home": "0"}, (probe, bodies[-2000:])
    assert REAL not in proc.stdout + proc.stderr
    assert files_holding(gv.home, REAL.encode()) == [] and files_holding(gv.workdir, REAL.encode()) == []


def _runsc_of(s: Sandbox) -> list[str]:
    """runsc, its sandbox and gofer processes of this sandbox's runs (their --root is in its run dirs)."""
    from .test_box import _cmdlines

    return [c for c in _cmdlines() if "runsc" in c.split(" ")[0] and s.env["XDG_RUNTIME_DIR"] in c]


def test_kill_9_of_the_launcher_leaves_no_runsc_and_no_run_dir(gv: Sandbox) -> None:
    """The janitor knows runsc's process group; runsc's sandbox and gofer die with it (attached)."""
    import time

    from .test_box import _eventually

    launcher = subprocess.Popen([sys.executable, "-m", "relay", "shell", "--quiet", *GV, "--prompt", "sleep 301; true"],
                                cwd=gv.workdir, env=gv.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # the run's own sandbox, not the verification run's (`RUN-verify`, over in a moment)
        assert _eventually(lambda: any(" boot " in c and "-verify" not in c for c in _runsc_of(gv)), 60), \
            "the gvisor box never started"
        time.sleep(1)
    finally:
        launcher.kill()
        launcher.wait()
    assert _eventually(lambda: not _runsc_of(gv) and not list(Path(gv.env["XDG_RUNTIME_DIR"]).iterdir()), 20), \
        (_runsc_of(gv), list(Path(gv.env["XDG_RUNTIME_DIR"]).iterdir()))


def test_selftest_probes_the_gvisor_box(gv: Sandbox) -> None:
    """`selftest --isolation gvisor`: the real escape probes in the runsc box, with the supervised tier's
    expected results (secrets, writes outside, AF_UNIX, TIOCSTI, host pids, egress)."""
    proc = gv.relay("selftest", "-b", "shell", "--isolation", "gvisor", "--json", timeout=300)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    rows = json.loads(proc.stdout)
    assert rows and all(r["tier"] == "gvisor" and r["ok"] for r in rows), rows
    assert {"AF_UNIX socket()", "TIOCSTI injection", "direct connect skipping the proxy", "read ~/.ssh"} <= \
        {r["probe"] for r in rows}
