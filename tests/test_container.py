"""Container mode with the real engine (podman here) and the real image built from
Dockerfile.contributor on an offline base: the same policy as the local box, checked from inside.

The image is built once per session (`python -m relay build-image`, cached by content in the
engine's storage, so later sessions reuse it); an unprivileged user builds the base rootless.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import PODMAN, UID, Sandbox, podman_env
from .servers import start_http

pytestmark = pytest.mark.container

def cbox(s: Sandbox, script: str, backend: str = "shell", *args: str, **kw) -> subprocess.CompletedProcess:
    return s.relay(backend, "container", "--quiet", "--prompt", script, *args, **kw)


def containers(label: str = "hive-relay.backend", workdir: Path | None = None) -> list[str]:
    """Our containers; with `workdir`, only those mounting that (per-test) workdir: the engine is
    shared by everything on this machine, and another run's container coming or going between a
    test's two censuses is not this test's leftover."""
    out = subprocess.run([PODMAN, "ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}}|{{.Mounts}}"],
                         capture_output=True, text=True, env=podman_env()).stdout
    names = []
    for line in out.splitlines():
        name, _, mounts = line.partition("|")
        if name.startswith("hive-relay-") and (workdir is None or re.search(re.escape(str(workdir)) + r"[\] /]",
                                                                              mounts + " ")):
            names.append(name)
    return names


def test_shell_runs_in_the_container_with_the_caller_uid_and_the_workdir(csandbox: Sandbox) -> None:
    s = csandbox
    before = containers(workdir=s.workdir)
    proc = cbox(s, "id -u; cat README.md; echo made > made.txt; pwd; cat /etc/os-release | head -1; "
                   "test -w /usr && echo USR-WRITABLE; echo x > /usr/x 2>/dev/null || echo USR-READONLY")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == str(UID)  # rootless: keep-id; root callers: uid 0 without capabilities
    assert "hello from the workdir" in proc.stdout and str(s.workdir) in lines
    assert "USR-READONLY" in proc.stdout and "USR-WRITABLE" not in proc.stdout
    assert (s.workdir / "made.txt").read_text() == "made\n"
    # Nothing left: no container, no run dir, no placeholder files in the checkout.
    assert containers(workdir=s.workdir) == before
    assert sorted(p.name for p in s.workdir.iterdir()) == ["README.md", "made.txt"]


def test_home_is_private_and_secrets_are_not_there_but_grants_are(csandbox: Sandbox) -> None:
    s = csandbox
    proc = cbox(s, 'cat ~/.ssh/id_rsa 2>&1 || echo SSH-REFUSED; cat ~/.aws/credentials 2>&1 || echo AWS-REFUSED; '
                   'cat ~/notes.txt 2>&1 || echo NOTES-HIDDEN; cat ~/.codex/auth.json; git config user.name; '
                   'echo x > ~/scratch && echo HOME-WRITABLE; wc -c < /etc/shadow', "codex")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "PRIVATE-KEY" not in out and "SSH-REFUSED" in out
    assert "SECRET" not in out and "AWS-REFUSED" in out and "NOTES-HIDDEN" in out
    # codex's own state (its auth.json's key a placeholder of the same shape) and the git identity
    assert '"OPENAI_API_KEY": "sk-' in out and "sk-test" not in out and "Test User" in out
    assert "HOME-WRITABLE" in out and out.splitlines()[-1].strip() == "0"
    assert not (s.home / "scratch").exists()


def test_protected_paths_are_read_only_and_created_paths_do_not_leak(csandbox: Sandbox) -> None:
    s = csandbox
    subprocess.run(["git", "init", "-q", str(s.workdir)], check=True)
    proc = cbox(s, "echo evil > .git/hooks/pre-commit 2>/dev/null || echo HOOK-REFUSED; "
                   "echo '[core]' >> .git/config 2>/dev/null || echo CONFIG-REFUSED; "
                   "echo x > .envrc; echo envrc=$(wc -c < .envrc); echo ok > kept.txt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for word in ("HOOK-REFUSED", "CONFIG-REFUSED", "envrc=0"):  # .envrc is /dev/null, as in local mode
        assert word in proc.stdout
    assert not (s.workdir / ".git" / "hooks" / "pre-commit").exists()
    assert not (s.workdir / ".envrc").exists()
    assert (s.workdir / "kept.txt").exists()


def test_exit_code_passes_through_and_the_timeout_kills_the_container(csandbox: Sandbox) -> None:
    s = csandbox
    before = containers(workdir=s.workdir)
    assert cbox(s, "exit 7").returncode == 7
    started = time.monotonic()
    proc = cbox(s, "sleep 60", "shell", "--timeout", "3")
    assert proc.returncode == 124, proc.stderr[-2000:]
    assert "timed out after 3 s" in proc.stderr
    assert time.monotonic() - started < 45
    assert containers(workdir=s.workdir) == before


@pytest.mark.parametrize("mode", ["local", "container"])
def test_egress_rules_are_the_same_in_both_modes(csandbox: Sandbox, mode: str) -> None:
    """One allowed pinned host reached through the proxy; other hosts 403; no direct route."""
    s = csandbox
    server, port, _ = start_http()
    try:
        script = (f"curl -s http://allowed.test:{port}/x; echo; "
                  f"curl -s -o /dev/null -w 'other=%{{http_code}}\\n' http://other.test:{port}/x; "
                  "curl -s -o /dev/null -w 'tls=%{http_connect}\\n' https://example.com/; "
                  f"curl -s --noproxy '*' -m 3 http://127.0.0.1:{port}/x || echo DIRECT-FAILED; "
                  f"curl -s --noproxy '' -o /dev/null -w 'ipliteral=%{{http_code}}\\n' http://127.0.0.1:{port}/x; "
                  f"curl -s -o /dev/null -w 'otherport=%{{http_code}}\\n' http://allowed.test:{port + 1}/x")
        proc = s.relay("shell", mode, "--quiet", "--prompt", script, "--allow-host",
                       f"allowed.test:{port}=127.0.0.1:{port}")
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "hello from the fake upstream" in out
    assert "other=403" in out and "tls=403" in out and "DIRECT-FAILED" in out
    assert "ipliteral=403" in out and "otherport=403" in out
    logs = sorted((s.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    entries = [json.loads(line) for p in logs for line in p.read_text().splitlines()]
    decisions = {(e["host"], e["decision"]) for e in entries}
    assert ("allowed.test", "allow") in decisions
    assert ("other.test", "deny") in decisions and ("example.com", "deny") in decisions


SECCOMP_PROBE = r"""
use Socket;
socket(my $u, AF_UNIX, SOCK_STREAM, 0) ? print "unix=ok\n" : print "unix=$!\n";
socket(my $i, AF_INET, SOCK_STREAM, 0) ? print "inet=ok\n" : print "inet=$!\n";
socketpair(my $a, my $b, AF_UNIX, SOCK_STREAM, 0) ? print "pair=ok\n" : print "pair=$!\n";
open(my $t, "+<", "/dev/tty") or die "no tty: $!";
my $c = "x"; ioctl($t, 0x5412, $c) ? print "tiocsti=ok\n" : print "tiocsti=$!\n";
my $w = " " x 8; ioctl($t, 0x5413, $w) ? print "winsz=ok\n" : print "winsz=$!\n";
"""


def test_seccomp_refuses_af_unix_and_tiocsti_while_their_twins_work(csandbox: Sandbox) -> None:
    """Needs a tty for the TIOCSTI pair: the container gets -t only from a terminal, so run under pexpect."""
    import pexpect
    s = csandbox
    (s.workdir / "probe.pl").write_text(SECCOMP_PROBE)
    env = {**s.env}
    child = pexpect.spawn(sys.executable, ["-m", "relay", "shell", "container", "--quiet"], cwd=str(s.workdir),
                          env=env, encoding="utf-8", timeout=120, dimensions=(30, 100))
    try:
        child.sendline("perl probe.pl; unshare -U true 2>/dev/null && echo userns=ok || echo userns=refused; exit 0")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    out = child.before
    assert "unix=Operation not permitted" in out and "inet=ok" in out and "pair=ok" in out
    assert "tiocsti=Operation not permitted" in out and "winsz=ok" in out
    assert "userns=refused" in out


FORKS = """my @kids; for (1..150) { my $p = fork(); last unless defined $p; if ($p == 0) { sleep 30; exit 0 } push @kids, $p }
print "started=" . scalar(@kids) . "\\n"; kill 'KILL', @kids; waitpid($_, 0) for @kids;
"""


def test_limits_are_enforced(csandbox: Sandbox) -> None:
    """The tight profile: 64 processes and 256 MiB. Within them works, beyond them fails."""
    s = csandbox
    ok = cbox(s, "for i in $(seq 10); do sleep 1 & done; wait; echo TEN-OK; "
                 "node -e 'const b = Buffer.alloc(64 << 20, 1); console.log(\"SMALL-OK\", b.length)'",
              "shell", "--profile", "tight")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "TEN-OK" in ok.stdout and "SMALL-OK" in ok.stdout
    (s.workdir / "forks.pl").write_text(FORKS)
    forks = cbox(s, "perl forks.pl", "shell", "--profile", "tight")
    assert "started=" in forks.stdout, forks.stderr[-2000:]
    started = int(forks.stdout.split("started=")[1].split()[0])
    assert 10 < started < 64, forks.stdout
    big = cbox(s, "node -e 'const a = []; for (let i = 0; i < 40; i++) a.push(Buffer.alloc(32 << 20, 1)); "
                  "console.log(\"BIG-OK\")'", "shell", "--profile", "tight")
    assert big.returncode != 0 and "BIG-OK" not in big.stdout


def test_the_entrypoint_guard_trips_when_a_denied_path_is_mounted(csandbox: Sandbox, image: str) -> None:
    """Run the image directly, as a careless hand-written `podman run -v ~/.ssh:...` would."""
    s = csandbox
    home = "/home/contributor"
    base = [PODMAN, "run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=512:512",
            "-e", f"HOME={home}", "-e", "HIVE_RELAY_BACKEND=shell"]
    if UID:
        base += ["--userns", "keep-id"]
    env = podman_env()
    leaked = s.root / "leaked-ssh"  # readable by the container user, as a careless copy would be
    leaked.mkdir(mode=0o755)
    (leaked / "id_ed25519").write_text("PRIVATE\n")
    (leaked / "id_ed25519").chmod(0o644)
    tripped = subprocess.run([*base, "-v", f"{leaked}:{home}/.ssh:ro", image, "true"],
                             capture_output=True, text=True, env=env, timeout=120)
    assert tripped.returncode == 3, tripped.stderr
    assert f"deny-listed path readable in the container: {home}/.ssh" in tripped.stderr
    clean = subprocess.run([*base, "-v", f"{s.workdir}:/work:rw", image, "sh", "-c", "cat /work/README.md"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert clean.returncode == 0, clean.stderr
    assert "hello from the workdir" in clean.stdout


def _start_sleeper(s: Sandbox) -> subprocess.Popen:
    launcher = subprocess.Popen([sys.executable, "-m", "relay", "shell", "container", "--quiet", "--prompt",
                                 "echo STARTED > started.txt; sleep 120"], cwd=s.workdir, env=s.env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (s.workdir / "started.txt").exists():
        assert launcher.poll() is None, launcher.stderr.read().decode()[-2000:] if launcher.stderr else ""
        assert time.monotonic() < deadline, "the container never started"
        time.sleep(0.1)
    return launcher


def test_sigterm_to_the_launcher_removes_the_container(csandbox: Sandbox) -> None:
    s = csandbox
    before = containers(workdir=s.workdir)
    launcher = _start_sleeper(s)
    assert len(containers(workdir=s.workdir)) == len(before) + 1
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err.decode()
    assert containers(workdir=s.workdir) == before


def test_kill_9_of_the_launcher_leaves_no_container(csandbox: Sandbox) -> None:
    s = csandbox
    before = containers(workdir=s.workdir)
    launcher = _start_sleeper(s)
    assert len(containers(workdir=s.workdir)) == len(before) + 1
    base = Path(s.env["XDG_RUNTIME_DIR"])

    def run_dirs() -> list[Path]:
        return [p for p in base.iterdir() if p.name.startswith(f"hive-relay-{launcher.pid}-")]

    assert run_dirs(), "the run dir was not where the test looks"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 60
    while (containers(workdir=s.workdir) != before or run_dirs()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert containers(workdir=s.workdir) == before, "the container outlived its launcher"
    assert not run_dirs()
    assert sorted(p.name for p in s.workdir.iterdir()) == ["README.md", "started.txt"]


@pytest.mark.parametrize("backend", ["codex", "claude"])
def test_real_cli_completes_a_turn_in_the_container(csandbox: Sandbox, backend: str) -> None:
    """The image's own pinned CLI, through the fake API pinned with --allow-host, with a tool call
    that probes the box from the agent's side."""
    from .fake_api import ANSWER, start
    from .test_agents import PROBE, setup_agent_home

    s = csandbox
    server, port = start()
    try:
        setup_agent_home(s, port)
        server.tool_command = "sh probe.sh"
        proc = s.relay(backend, "container", "--prompt", "run the probe", "--allow-host",
                       f"fake-api.test:{port}=127.0.0.1:{port}", "--timeout", "240", timeout=300)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"{backend} · container · profile agent" in proc.stderr and "container · container" not in proc.stderr
    assert ANSWER in proc.stdout
    bodies = "\n".join(r["body"] for r in server.requests)
    # Staged (the default, podman's overlay volume): the real CLI's write is in the layer, and lands on apply.
    assert PROBE and "WORKDIR-WRITE-OK" in bodies and not (s.workdir / "made-by-agent.txt").exists()
    applied = s.relay("apply", "last")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert (s.workdir / "made-by-agent.txt").read_text() == "made-by-agent\n"
    assert "OUTSIDE-WRITE-REFUSED" in bodies and "SSH-REFUSED" in bodies
    assert "PRIVATE-KEY-DO-NOT-LEAK" not in bodies
    assert "example.com connect=403" in bodies
    assert any(r["auth"] for r in server.requests)
    if backend == "claude":  # ~/.claude.json is a copy in the run dir, synced back at exit
        assert json.loads((s.home / ".claude.json").read_text()).get("numStartups", 0) >= 1
        assert (s.home / ".claude.json").read_text() != '{"numStartups": 1}\n'
    else:  # codex keeps its sessions in its granted ~/.codex
        assert list((s.home / ".codex" / "sessions").rglob("*.jsonl"))


def test_an_engine_that_does_not_answer_is_one_line_and_leaves_nothing(sandbox: Sandbox) -> None:
    """The real docker client with no daemon behind it (this machine type has exactly that)."""
    from .conftest import require_tool

    require_tool("docker")
    run_dir = Path(sandbox.env["XDG_RUNTIME_DIR"])
    proc = sandbox.relay("shell", "container", "--prompt", "true", extra_env={"HIVE_RELAY_ENGINE": "docker"})
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "docker does not answer" in lines[0] and "fix:" in lines[0]
    assert list(run_dir.iterdir()) == [] and sorted(p.name for p in sandbox.workdir.iterdir()) == ["README.md"]


def test_build_image_bad_archive_is_a_usage_error(sandbox: Sandbox) -> None:
    proc = sandbox.relay("build-image", "--base-archive", str(sandbox.root / "nope.tar"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"hive-relay: error: --base-archive {sandbox.root / 'nope.tar'}: no such file; "
                                   "fix: make it with --save-base FILE")


ESCAPES = r"""
ls /proc | grep -c '^[0-9]' | sed 's/^/pids=/'
cat /proc/1/root/etc/hostname >/dev/null 2>&1 && echo proc1root=readable
ls /proc/1/root"$HOME"/.ssh 2>/dev/null && echo HOST-SSH-VISIBLE
echo x > /etc/evil 2>/dev/null || echo etc=refused
mkdir -p /tmp/m && (mount -t tmpfs none /tmp/m 2>/dev/null && echo MOUNTED || echo mount=refused)
curl -s -m 3 --noproxy '*' http://169.254.169.254/ >/dev/null 2>&1 || echo metadata=unreachable
getent hosts example.com >/dev/null 2>&1 && echo DNS-WORKS || echo dns=none
cat /sys/class/net/*/address 2>/dev/null | grep -v 00:00:00:00:00:00 | grep -q . && echo HAS-NIC || echo nic=loopback-only
grep -q 'CapEff:\s*0000000000000000' /proc/self/status && echo caps=none
grep -q 'NoNewPrivs:\s*1' /proc/self/status && echo nnp=on
grep -q 'Seccomp:\s*2' /proc/self/status && echo seccomp=filter
echo twin > /tmp/ok && cat /tmp/ok
"""


def test_escape_attempts_fail_in_the_container_and_their_twins_work(csandbox: Sandbox) -> None:
    s = csandbox
    (s.workdir / "escapes.sh").write_text(ESCAPES)
    proc = cbox(s, "sh escapes.sh")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    pids = int(out.split("pids=")[1].split()[0])
    assert pids < 10, out  # a pid namespace: the host's processes are not there
    for word in ("etc=refused", "mount=refused", "metadata=unreachable", "dns=none", "nic=loopback-only",
                 "caps=none", "nnp=on", "seccomp=filter", "twin"):
        assert word in out, out
    for word in ("HOST-SSH-VISIBLE", "MOUNTED", "DNS-WORKS", "HAS-NIC"):
        assert word not in out


def test_kill_9_while_the_engine_is_still_creating_the_container(csandbox: Sandbox) -> None:
    """The launcher dies right after starting the engine client: the janitor keeps removing the
    container until that client is gone, so one created a moment later does not survive."""
    s = csandbox
    before = containers(workdir=s.workdir)
    launcher = subprocess.Popen([sys.executable, "-m", "relay", "shell", "container", "--quiet", "--prompt",
                                 "sleep 120"], cwd=s.workdir, env=s.env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pidfile = None
    deadline = time.monotonic() + 60
    while pidfile is None and time.monotonic() < deadline:  # the janitor and the control dir exist, the go is near
        found = list(Path(s.env["XDG_RUNTIME_DIR"]).glob(f"hive-relay-{launcher.pid}-*/ctl/go"))
        pidfile = found[0].parent if found else None
        time.sleep(0.005)
    assert pidfile is not None and not (pidfile.parent / "pid").exists(), "too late: the container already ran"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 90
    while containers(workdir=s.workdir) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # a container created after the janitor's first removal would show up by now
    assert containers(workdir=s.workdir) == before
    # The janitor removes the run dir once the engine client is gone: it keeps force-removing the
    # container for up to 60 s while the client lives (each `rm -f` may take up to 30 s), then kills
    # the client and tears down. So wait for that (bounded) instead of expecting it at once.
    deadline = time.monotonic() + 240
    while pidfile.parent.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pidfile.parent.exists()


def test_codex_tui_works_interactively_in_the_container(csandbox: Sandbox) -> None:
    """The issue's finish line: `contribute-hive codex container` in a real terminal: the TUI
    renders, the trust dialog and a turn against the fake API work, Ctrl-C ends it with 0."""
    import pexpect

    from .fake_api import ANSWER, start
    from .test_agents import setup_agent_home

    s = csandbox
    server, port = start()
    seen: list[str] = []
    try:
        setup_agent_home(s, port)
        child = pexpect.spawn(sys.executable, ["-m", "relay", "codex", "container", "--quiet", "--allow-host",
                                               f"fake-api.test:{port}=127.0.0.1:{port}"],
                              cwd=str(s.workdir), env=s.env, encoding="utf-8", timeout=90, dimensions=(40, 120))
        child.logfile_read = type("Tee", (), {"write": lambda self, d: seen.append(d), "flush": lambda self: None})()
        child.expect("Trust this folder|Trust and continue")
        child.send("\r")
        child.expect("Ask Codex")
        child.send("say the answer")
        child.expect("answer")
        child.send("\r")
        child.expect(ANSWER)
        # Ctrl-C first ends a turn still wrapping up, then exits (codex's own behaviour).
        for _ in range(3):
            child.sendcontrol("c")
            if child.expect([pexpect.EOF, pexpect.TIMEOUT], timeout=10) == 0:
                break
        child.close()
    finally:
        server.shutdown()
    assert child.exitstatus == 0, "".join(seen)[-2000:]
    assert any("/v1/responses" in r["path"] for r in server.requests)
    assert containers("hive-relay.backend=codex", workdir=s.workdir) == []


def test_stdin_is_passed_to_prompt_runs(csandbox: Sandbox) -> None:
    proc = cbox(csandbox, "tr a-z A-Z", input="piped into the container\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "PIPED INTO THE CONTAINER\n"


def test_superseded_images_are_removed_but_the_current_one_stays(csandbox: Sandbox, image: str) -> None:
    from relay.config.load import load_shipped
    from relay.modes import image as image_mod

    env = podman_env()
    old = f"{image_mod.IMAGE_REPO}:000000000000-u{UID or 1000}"
    other_user = f"{image_mod.IMAGE_REPO}:000000000000-u4242"
    for ref in (old, other_user):
        subprocess.run([PODMAN, "tag", image, ref], check=True, env=env)
    try:
        spec = image_mod.spec_from_env(load_shipped(), UID, os.getgid(), env)
        assert spec.tag == image
        said: list[str] = []
        image_mod._remove_superseded([PODMAN], image, spec, said.append)
        refs = subprocess.run([PODMAN, "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                              text=True, env=env).stdout.split()
        assert old not in refs and image in refs and spec.base in refs
        assert other_user in refs  # another uid's image is not ours to remove
        assert said and old in said[0]
    finally:
        subprocess.run([PODMAN, "rmi", old, other_user], capture_output=True, env=env)
