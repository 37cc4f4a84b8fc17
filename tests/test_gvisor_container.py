"""Container mode on gVisor for real: `podman --runtime runsc` with the image built from
Dockerfile.contributor, the Sentry's kernel under container mode's policy (issue 31).

Each attack beside its legitimate twin; run as root and as an unprivileged user (rootless podman,
runsc with ignore-cgroups).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from .conftest import Sandbox
from .test_container import containers
from .test_gvisor import SOCKETS, check, renamed_run_dir_attack, runsc_ok, upstream  # noqa: F401 - fixtures, shared with local mode

pytestmark = pytest.mark.container

GV = ("--isolation", "gvisor")
PY = "/usr/bin/python3"  # the image's


@pytest.fixture
def gc(csandbox: Sandbox, runsc_ok: None) -> Sandbox:  # noqa: F811
    return csandbox


def cbox(s: Sandbox, script: str, backend: str = "shell", *args: str, **kw) -> subprocess.CompletedProcess:
    return s.relay(backend, "container", "--quiet", "--prompt", script, *GV, *args, **kw)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout={proc.stdout}\nstderr={proc.stderr[-3000:]}"
    return proc.stdout


def test_the_kernel_is_gvisors_and_the_plan_says_runsc(gc: Sandbox) -> None:
    before = containers(workdir=gc.workdir)
    out = ok(cbox(gc, "uname -r; cat /proc/version; id -u"))
    lines = out.splitlines()
    assert lines[0] != os.uname().release, out  # the Sentry answers, not the host
    assert lines[1] != Path("/proc/version").read_text().strip(), out
    assert lines[2] == str(os.getuid())  # the caller's uid (rootless keep-id; root: 0 without capabilities)
    plan = json.loads(gc.relay("shell", "container", *GV, "--dry-run", "--json").stdout)
    run = plan["container"]
    assert plan["tier"] == "container" and run["runtime"].endswith("runsc")
    flags = run["runtime_flags"][1::2]
    assert {"network=none", "directfs=false", "host-uds=open"} <= set(flags)
    assert any(f in flags for f in ("platform=systrap", "platform=ptrace")) and "platform=kvm" not in flags
    assert ("ignore-cgroups" in flags) == (os.getuid() != 0)
    assert not any(a.startswith("seccomp=") for a in plan["command"])  # the Sentry holds ours (see the init)
    assert containers(workdir=gc.workdir) == before  # nothing left
    twin = ok(gc.relay("shell", "container", "--quiet", "--prompt", "uname -r"))  # without it: the host's kernel
    assert twin.strip() == os.uname().release


def test_secrets_are_hidden_and_grants_work(gc: Sandbox) -> None:
    out = ok(cbox(gc, 'cat ~/.ssh/id_rsa 2>&1 || echo SSH-REFUSED; cat ~/.aws/credentials 2>&1 || echo AWS-REFUSED; '
                      'cat ~/.netrc 2>&1 || echo NETRC-REFUSED; cat ~/notes.txt 2>&1 || echo NOTES-HIDDEN; '
                      'wc -c < /etc/shadow; cat ~/.claude/settings.json; git config user.name', "claude"))
    assert "PRIVATE-KEY" not in out and "SSH-REFUSED" in out
    assert "SECRET" not in out and "AWS-REFUSED" in out and "NETRC-REFUSED" in out and "NOTES-HIDDEN" in out
    assert "0" in out.splitlines()  # /etc/shadow: masked by /dev/null
    assert '"theme": "dark"' in out and "Test User" in out  # the twin: the backend's state and the git identity


def test_nothing_persists_outside_the_workdir_and_protected_paths_hold(gc: Sandbox) -> None:
    subprocess.run(["git", "init", "-q", str(gc.workdir)], check=True)
    out = ok(cbox(gc, "echo evil > .git/hooks/pre-commit 2>/dev/null || echo HOOK-REFUSED; "
                      "echo '[core]' >> .git/config 2>/dev/null || echo CONFIG-REFUSED; "
                      "echo evil > .bashrc 2>/dev/null || echo RC-REFUSED; "
                      "echo x > /usr/x 2>/dev/null || echo USR-READONLY; "
                      "echo x > ~/scratch && echo HOME-WRITABLE; echo made > made.txt; git status --short | head -1"))
    for word in ("HOOK-REFUSED", "CONFIG-REFUSED", "RC-REFUSED", "USR-READONLY", "HOME-WRITABLE"):
        assert word in out, out
    assert not (gc.workdir / ".git" / "hooks" / "pre-commit").exists()
    assert "[core]\n[core]" not in (gc.workdir / ".git" / "config").read_text()
    assert not (gc.home / "scratch").exists()  # $HOME is the box's own tmpfs
    assert (gc.workdir / "made.txt").read_text() == "made\n"  # the twin: the workdir is writable (live here)
    assert sorted(p.name for p in gc.workdir.iterdir()) == [".git", "README.md", "made.txt"]  # no placeholders left


def test_staged_is_refused_not_run_on_an_empty_workdir(gc: Sandbox) -> None:
    """podman hands its overlay volume to runsc as an OCI `overlay` mount, which runsc does not mount: the
    box saw no workdir. Refused with the fix (exit 3), nothing run; the twin: --live works."""
    proc = cbox(gc, "echo RAN-ANYWAY > ran.txt", "shell", "--staged")
    assert proc.returncode == 3 and "--live" in proc.stderr and "--mode local --isolation gvisor" in proc.stderr
    assert not (gc.workdir / "ran.txt").exists()
    assert ok(cbox(gc, "cat README.md", "shell", "--live")) == "hello from the workdir\n"


def test_our_seccomp_holds_in_the_sentry(gc: Sandbox) -> None:
    """The agent's filter, loaded by the init inside gVisor: no AF_UNIX socket, no TIOCSTI, the init's
    memory closed; socketpair and ordinary tty ioctls work."""
    out = ok(cbox(gc, f"{PY} -c '{SOCKETS}'"))
    assert "UNIX-ERR EPERM" in out and "PAIR ping" in out
    assert "INIT-MEM-OPEN" not in out and "INIT-MEM" in out
    assert "STI EPERM" in out and "WINSZ 8" in out


def test_egress_only_through_the_proxy(gc: Sandbox, upstream: int) -> None:  # noqa: F811
    script = (f"curl -sS http://plain.test:{upstream}/hello; "
              "curl -s -o /dev/null -w 'denied=%{http_code}\\n' http://denied.test/; "
              f"{PY} -c 'import socket\ntry:\n socket.create_connection((\"127.0.0.1\", {upstream}), timeout=3); "
              "print(\"DIRECT\")\nexcept OSError as e: print(\"NODIRECT\", e.errno)'; "
              f"{PY} -c 'import socket\ntry:\n socket.getaddrinfo(\"example.com\", 443); print(\"RESOLVED\")\n"
              "except OSError: print(\"NODNS\")'")
    out = ok(cbox(gc, script, "shell", "--allow-host", f"plain.test:{upstream}=127.0.0.1:{upstream}"))
    assert "hello from the fake upstream" in out  # the allowed host answers through the proxy
    assert "denied=403" in out  # the proxy refuses the rest
    assert "NODIRECT" in out and "DIRECT\n" not in out  # the host's loopback is not the box's
    assert "NODNS" in out
    logs = "".join(p.read_text() for p in (gc.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    assert "denied.test" in logs and "plain.test" in logs  # every decision in the run's log


def test_a_renamed_run_dir_cannot_steer_the_relay_to_another_host_socket(gc: Sandbox, upstream: int) -> None:  # noqa: F811
    renamed_run_dir_attack(lambda script, *args: cbox(gc, script, "shell", *args, timeout=240), gc.workdir, upstream,
                           can_rename=os.getuid() == 0)


def test_exit_codes_and_timeout_pass_through(gc: Sandbox) -> None:
    assert cbox(gc, "exit 7").returncode == 7
    assert cbox(gc, "kill -TERM $$").returncode == 128 + signal.SIGTERM
    before = containers(workdir=gc.workdir)
    proc = cbox(gc, "sleep 100", "shell", "--timeout", "3")
    assert proc.returncode == 124 and "timed out after 3 s" in proc.stderr, proc.stderr[-2000:]
    assert containers(workdir=gc.workdir) == before


FAILING_RUNSC = "#!/bin/sh\necho 'runsc: this build cannot start a sandbox here' >&2\nexit 1\n"


def test_an_explicit_gvisor_that_cannot_run_refuses_and_never_falls_back(gc: Sandbox, tmp_path: Path) -> None:
    """No runsc at HIVE_RELAY_RUNSC, or one that fails its probe run: exit 3, one line with the fix, no
    plan of a weaker tier, no container. The twin: present, it runs, and on gVisor (not runc)."""
    broken = tmp_path / "runsc"
    broken.write_text(FAILING_RUNSC)
    broken.chmod(0o755)
    before = containers(workdir=gc.workdir)
    for runsc, why in (("/nonexistent/runsc", "is not an executable file"), (str(broken), "failed its probe run")):
        env = {"HIVE_RELAY_RUNSC": runsc}
        proc = gc.relay("shell", "container", "--prompt", "echo RAN-ANYWAY", *GV, extra_env=env)
        assert proc.returncode == 3 and "RAN-ANYWAY" not in proc.stdout, (proc.stdout, proc.stderr)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "--isolation gvisor cannot be enforced in container mode" in lines[0], proc.stderr
        assert why in lines[0] and "fix:" in lines[0]
        plan = gc.relay("shell", "container", *GV, "--dry-run", "--json", extra_env=env)
        assert plan.returncode == 3 and not plan.stdout
    assert containers(workdir=gc.workdir) == before
    twin = ok(cbox(gc, "uname -r; echo RAN"))
    assert "RAN" in twin and twin.splitlines()[0] != os.uname().release


def test_a_terminal_session_job_control_ctrl_c_resize(gc: Sandbox) -> None:
    child = pexpect.spawn(sys.executable, ["-m", "relay", "shell", "container", "--quiet", *GV], cwd=str(gc.workdir),
                          env=gc.env, encoding="utf-8", timeout=120, dimensions=(24, 80))
    try:
        child.sendline("echo READY$((40+2))")
        child.expect("READY42")
        out = check(child, "test -t 0 && echo tty-ok; echo term=$TERM; uname -r", "T")
        assert "tty-ok" in out and "term=xterm-256color" in out and os.uname().release not in out
        out = check(child, "sleep 100 & jobs", "J")
        assert "Running" in out and "sleep 100" in out
        child.sendline("fg")
        child.expect("sleep 100")
        child.expect(pexpect.TIMEOUT, timeout=1)
        child.sendcontrol("z")
        child.expect("Stopped")
        child.sendline("fg")
        child.expect("sleep 100")
        child.expect(pexpect.TIMEOUT, timeout=1)
        child.sendintr()  # Ctrl-C: the job dies, the shell and the box live on
        out = check(child, "echo last=$?; echo still-here", "L")
        assert "last=130" in out and "still-here" in out and child.isalive()
        child.sendline("trap 'echo GOT-WINCH' WINCH; sleep 5 & wait")
        child.expect("wait")
        child.expect(pexpect.TIMEOUT, timeout=1)
        child.setwinsize(40, 132)
        child.expect("GOT-WINCH")
        assert "40 132" in check(child, "stty size", "R")
        inject = ("import fcntl, termios, errno\\n"
                  "try:\\n fcntl.ioctl(0, termios.TIOCSTI, b\\\"X\\\"); print(\\\"INJ\\\" \\\"ECTED\\\")\\n"
                  "except OSError as e: print(\\\"STI\\\", errno.errorcode[e.errno])")
        out = check(child, f'{PY} -c "$(printf \'{inject}\')"', "I")
        assert "STI EPERM" in out and "INJECTED" not in out
        child.sendline("exit 5")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 5


@pytest.mark.parametrize("backend", ["claude", "codex"])
def test_a_real_cli_turn_with_the_key_injected(gc: Sandbox, ca, tls_api, backend: str) -> None:  # noqa: ANN001
    """The image's real CLI in the Sentry completes a turn against the fake API through the proxy, which
    adds the key: the box sees only the placeholder (tests/test_credential_turns.py's checks)."""
    from . import fake_api
    from .test_credential_turns import BACKENDS, PLACEHOLDER, REAL, files_holding, setup_home

    host_var, name, box_var = BACKENDS[backend]
    setup_home(gc, backend, box_var)
    tls_api.tool_command = "sh probe-creds.sh"
    tls_api.tool_name = "Bash"
    port = tls_api.server_address[1]
    proc = gc.relay(backend, "container", *GV, "--live", "--prompt", "say the answer", "--allow-host",
                    f"{name}:443=127.0.0.1:{port}", "--timeout", "240", timeout=300,
                    extra_env={host_var: REAL, "SSL_CERT_FILE": str(ca[0])})
    assert proc.returncode == 0 and fake_api.ANSWER in proc.stdout, (proc.stdout[-1500:], proc.stderr[-3000:])
    assert f"{backend} · container · " in proc.stderr and "gvisor: the container runs on runsc" in proc.stderr
    keys = [v for h in tls_api.headers_seen for k, v in h.items() if k in ("x-api-key", "authorization")]
    assert keys and all(REAL in v for v in keys), keys
    bodies = "\n".join(r["body"] for r in tls_api.requests)
    assert REAL not in bodies
    probe = dict(re.findall(r"probe-(env|proc|seen|home)=([\w-]*)", bodies))
    probe.pop("seen", None)
    assert probe == {"env": PLACEHOLDER, "proc": "0", "home": "0"}, (probe, bodies[-2000:])
    assert REAL not in proc.stdout + proc.stderr
    assert files_holding(gc.home, REAL.encode()) == [] and files_holding(gc.workdir, REAL.encode()) == []


def test_selftest_probes_the_gvisor_container(gc: Sandbox) -> None:
    """`selftest --mode container --isolation gvisor`: the real escape probes (secrets, writes outside,
    AF_UNIX, TIOCSTI, host pids, egress) in the runsc container, with container mode's expected results."""
    proc = gc.relay("selftest", "-b", "shell", "-b", "claude", "--mode", "container", "--isolation", "gvisor", "--json",
                    timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-2000:])
    rows = json.loads(proc.stdout)
    assert rows and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert {"AF_UNIX socket()", "TIOCSTI injection", "direct connect skipping the proxy", "read ~/.ssh",
            "write outside the workdir"} <= {r["probe"] for r in rows}
