"""Agent sockets and git over ssh (`--allow-socket`, `--allow-ssh`), against a real ssh-agent and a
real sshd started by the test, each opt-in beside its denial twin.

- `--allow-socket ssh-agent`: `ssh-add -l` in the box lists the test's key; without it the box has
  no agent, and `socket(AF_UNIX)` is still EPERM.
- Even with the opt-in on, a listening fake docker.sock in the host's /tmp, /run, /dev/shm and
  ~/.docker stays unreachable: only the one named socket is bound in.
- A socket inside a denied dir (~/.ssh) enters alone; the key file beside it does not.
- `--allow-ssh HOST`: `git ls-remote`/`git push` over ssh to a local sshd through the proxy; a host
  not allowed is refused by the proxy with a line that names the fix.
- Commit signing with the agent's key (`gpg.format ssh`), verified on the host.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.render.seccomp_bpf import AF_UNIX, AF_VSOCK, policy_for
from relay.render.seccomp_oci import render

from ..conftest import REPO, Sandbox, require_tool
from .conftest import Report

AGENT_PROBE = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b"\\0\\0\\0\\1\\x0b")  # SSH2_AGENTC_REQUEST_IDENTITIES
head = s.recv(5)
print("agent-answer", head[4])
"""
CONNECT_PROBE = """
import socket, sys
for path in sys.argv[1:]:
    try:
        s = socket.socket(socket.AF_UNIX)
    except OSError as err:
        print(path, "socket", err.errno); continue
    try:
        s.connect(path); print(path, "CONNECTED")
    except OSError as err:
        print(path, "connect", err.errno)
"""


class Agent:
    """A real ssh-agent on a socket of the test's own, holding one throwaway ed25519 key."""

    def __init__(self, base: Path, sock: Path | None = None) -> None:
        self.sock = sock or base / "agent" / "agent.sock"
        self.sock.parent.mkdir(parents=True, exist_ok=True)
        self.key = base / "keys" / "id_test"
        self.key.parent.mkdir(exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hive-relay-test", "-f", str(self.key)],
                       check=True)
        self.proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(self.sock)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.sock.exists():
            assert time.monotonic() < deadline, "ssh-agent did not create its socket"
            time.sleep(0.02)
        subprocess.run(["ssh-add", "-q", str(self.key)], env={**os.environ, "SSH_AUTH_SOCK": str(self.sock)},
                       check=True, capture_output=True)
        self.pub = (self.key.with_suffix(".pub")).read_text().strip()
        self.fingerprint = subprocess.run(["ssh-keygen", "-lf", str(self.key)], capture_output=True, text=True,
                                          check=True).stdout.split()[1]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def agent(box: Sandbox) -> Iterator[Agent]:
    require_tool("ssh-agent")
    found = Agent(box.root)
    yield found
    found.stop()


def run(s: Sandbox, script: str, *flags: str, sock: Path | None = None, mode: str = "local",
        timeout: float = 120) -> subprocess.CompletedProcess:
    env = {"SSH_AUTH_SOCK": str(sock)} if sock else {}
    return s.relay("shell", mode, "--quiet", "--prompt", script, *flags, extra_env=env, timeout=timeout)


# --- the agent socket ---------------------------------------------------------------------------

def test_ssh_add_lists_the_key_only_with_the_opt_in(box: Sandbox, agent: Agent, report: Report) -> None:
    on = run(box, "ssh-add -l; echo sock=$SSH_AUTH_SOCK", "--allow-socket", "ssh-agent", sock=agent.sock)
    report.legit(on.returncode == 0 and agent.fingerprint in on.stdout)
    assert on.returncode == 0, on.stderr
    assert agent.fingerprint in on.stdout and "sock=/run/hive-relay/sockets/ssh-agent" in on.stdout
    off = run(box, f"ssh-add -l; echo rc=$?; SSH_AUTH_SOCK={agent.sock} ssh-add -l; echo rc=$?", sock=agent.sock)
    report.attack(agent.fingerprint not in off.stdout)
    assert agent.fingerprint not in off.stdout, off.stdout
    assert off.stdout.count("rc=2") == 2, off.stdout + off.stderr


def test_af_unix_socket_is_eperm_without_the_opt_in(box: Sandbox, agent: Agent, report: Report) -> None:
    script = f"python3 -c '{CONNECT_PROBE}' {agent.sock} /run/hive-relay/sockets/ssh-agent"
    off = run(box, script, sock=agent.sock)
    report.attack(off.stdout.count("socket 1") == 2)
    assert off.stdout.count("socket 1") == 2, off.stdout + off.stderr  # EPERM at socket(), before any path
    on = run(box, script, "--allow-socket", "ssh-agent", sock=agent.sock)
    report.legit("/run/hive-relay/sockets/ssh-agent CONNECTED" in on.stdout)
    assert "/run/hive-relay/sockets/ssh-agent CONNECTED" in on.stdout, on.stdout + on.stderr
    assert f"{agent.sock} connect 2" in on.stdout  # the host path itself is not in the box (private /tmp)


def _listening(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    os.chmod(path, 0o777)
    srv.listen(8)
    return srv


def test_a_fake_docker_sock_stays_unreachable_with_the_agent_opt_in(box: Sandbox, agent: Agent,
                                                                    report: Report) -> None:
    tag = uuid.uuid4().hex[:8]
    places = [box.root / "dock" / "docker.sock", box.home / ".docker" / "run" / "docker.sock",
              Path(f"/dev/shm/hive-relay-test-{tag}/docker.sock")]
    if os.getuid() == 0:
        places.append(Path(f"/run/hive-relay-test-{tag}/docker.sock"))
    servers = [_listening(p) for p in places]
    try:
        for p in places:  # each one is a live socket on the host
            probe = socket.socket(socket.AF_UNIX)
            probe.connect(str(p))
            probe.close()
        proc = run(box, f"python3 -c '{CONNECT_PROBE}' {' '.join(map(str, places))} "
                        "/run/hive-relay/sockets/ssh-agent", "--allow-socket", "ssh-agent", sock=agent.sock)
    finally:
        for srv, p in zip(servers, places, strict=True):
            srv.close()
            shutil.rmtree(p.parent, ignore_errors=True)
    reached = [str(p) for p in places if f"{p} CONNECTED" in proc.stdout]
    report.attack(not reached)
    assert not reached, proc.stdout
    assert all(f"{p} connect 2" in proc.stdout for p in places), proc.stdout + proc.stderr  # not there at all
    report.legit("/run/hive-relay/sockets/ssh-agent CONNECTED" in proc.stdout)
    assert "/run/hive-relay/sockets/ssh-agent CONNECTED" in proc.stdout, proc.stdout + proc.stderr


def test_a_socket_in_a_denied_dir_enters_alone(box: Sandbox, report: Report) -> None:
    require_tool("ssh-agent")
    inner = Agent(box.root, sock=box.home / ".ssh" / "agent.sock")
    try:
        proc = run(box, f"ls -A ~/.ssh; cat ~/.ssh/id_rsa; SSH_AUTH_SOCK={inner.sock} ssh-add -l",
                   "--allow-socket", str(inner.sock))
        bad = run(box, "true", "--allow-socket", str(inner.sock.parent))
    finally:
        inner.stop()
    report.attack("PRIVATE-KEY" not in proc.stdout)
    assert "PRIVATE-KEY" not in proc.stdout and "id_rsa" not in proc.stdout.split("No such")[0], proc.stdout
    assert proc.stdout.split()[0] == "agent.sock", proc.stdout
    # PATH is bound where it is, and SSH_AUTH_SOCK (named by the caller) points there.
    report.legit(inner.fingerprint in proc.stdout)
    assert inner.fingerprint in proc.stdout, proc.stdout + proc.stderr
    report.attack(bad.returncode == 2)
    assert bad.returncode == 2 and "is a dir, not a socket" in bad.stderr, bad.stderr


def test_the_agents_path_is_the_agent(box: Sandbox, agent: Agent) -> None:
    """--allow-socket $SSH_AUTH_SOCK is --allow-socket ssh-agent: the box's SSH_AUTH_SOCK is set."""
    proc = run(box, "ssh-add -l", "--allow-socket", str(agent.sock), sock=agent.sock)
    assert proc.returncode == 0 and agent.fingerprint in proc.stdout, proc.stdout + proc.stderr


def test_bad_socket_requests_are_one_line_and_leave_nothing(box: Sandbox, agent: Agent, tmp_path: Path) -> None:
    link = tmp_path / "link.sock"
    link.symlink_to(agent.sock)
    plain = tmp_path / "plain"
    plain.write_text("x")
    cases = [(["--allow-socket", str(link)], 2, "symbolic link"),
             (["--allow-socket", str(plain)], 2, "not a socket"),
             (["--allow-socket", str(tmp_path / "missing.sock")], 2, "no such socket"),
             (["--allow-socket", "relative.sock"], 2, "absolute PATH"),
             (["--allow-socket", "ssh-agent"], 2, "SSH_AUTH_SOCK is not set"),
             (["--allow-ssh", "not a host"], 2, "not a host name")]
    if os.getuid() != 0:  # (the process tier refuses a root caller before anything else)
        cases.append((["--allow-socket", "ssh-agent", "--isolation", "process", "--profile", "default"], 3,
                      "need the supervised box or a container"))
    if os.getuid() == 0:
        theirs = tmp_path / "theirs" / "s.sock"
        srv = _listening(theirs)
        os.chown(theirs, 12345, 12345)
        cases.append((["--allow-socket", str(theirs)], 3, "owned by uid 12345"))
    runs = Path(box.env["XDG_RUNTIME_DIR"])
    before = set(os.listdir(runs))
    for flags, code, words in cases:
        sock = agent.sock if "process" in flags else None
        proc = run(box, "true", *flags, sock=sock)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == code and len(lines) == 1 and words in lines[0], (flags, proc.stderr)
        assert lines[0].startswith("hive-relay: error: ") and "fix:" in lines[0], lines
    assert set(os.listdir(runs)) == before
    if os.getuid() == 0:
        srv.close()


def test_the_plan_shows_the_socket_and_the_filter_allows_af_unix(box: Sandbox, agent: Agent) -> None:
    proc = box.relay("shell", "--dry-run", "--json", "--allow-socket", "ssh-agent", "--allow-ssh", "git.test",
                     extra_env={"SSH_AUTH_SOCK": str(agent.sock)})
    plan = json.loads(proc.stdout)
    assert plan["sockets"] == [{"name": "ssh-agent", "host": str(agent.sock), "box": "/run/hive-relay/sockets/ssh-agent"}]
    assert plan["ssh"] == ["git.test:22"] and "git.test:22,tls=false" in plan["egress"]  # ssh is not TLS
    assert plan["seccomp_policy"]["deny_af_unix_socket"] is False and plan["seccomp_policy"]["deny_af_vsock"] is True
    assert any("HOST SOCKET IN THE BOX" in n for n in plan["notes"])
    mounts = [m for m in plan["mounts"] if m["dst"] == "/run/hive-relay/sockets/ssh-agent"]
    assert mounts == [{"kind": "ro-bind", "dst": "/run/hive-relay/sockets/ssh-agent", "src": str(agent.sock)}]
    assert not any(m.get("src") == str(agent.sock.parent) for m in plan["mounts"])  # never the dir around it
    plain = json.loads(box.relay("shell", "--dry-run", "--json").stdout)
    assert plain["sockets"] == [] and plain["seccomp_policy"]["deny_af_unix_socket"] is True
    banner = box.relay("shell", "--allow-socket", "ssh-agent", "--prompt", "true",
                       extra_env={"SSH_AUTH_SOCK": str(agent.sock)})
    assert "WARNING: host sockets in this box (AF_UNIX allowed): ssh-agent" in banner.stderr, banner.stderr


def test_the_oci_profile_allows_af_unix_only_with_the_opt_in() -> None:
    base = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["socket", "read"], "action": "SCMP_ACT_ALLOW"}]}

    def refused(policy) -> set[int]:  # noqa: ANN001
        return {r["args"][0]["valueTwo"] for r in render(policy, base)["syscalls"]
                if r["names"] == ["socket"] and r["action"] == "SCMP_ACT_ERRNO"}

    assert refused(policy_for(nested_userns=False)) == {AF_UNIX, AF_VSOCK}
    assert refused(policy_for(nested_userns=False, unix_sockets=True)) == {AF_VSOCK}


# --- git over ssh through the proxy ---------------------------------------------------------------

class Sshd:
    """A real sshd on 127.0.0.1, run as the test user with its own host key and authorized_keys."""

    def __init__(self, base: Path, pub: str) -> None:
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not os.path.exists(sshd):
            require_tool("sshd")
        d = base / "sshd"
        d.mkdir()
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key")], check=True)
        (d / "authorized_keys").write_text(pub + "\n")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        (d / "sshd_config").write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\n"
            f"AuthorizedKeysFile {d / 'authorized_keys'}\nPidFile {d / 'pid'}\nUsePAM no\nStrictModes no\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n")
        if os.getuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        self.proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(d / "sshd_config")], stdout=subprocess.DEVNULL,
                                     stderr=open(d / "log", "w"))
        self.log = d / "log"
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert self.proc.poll() is None, self.log.read_text()
                assert time.monotonic() < deadline, "sshd did not listen"
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def remote(box: Sandbox, agent: Agent) -> Iterator[tuple[Sshd, Path]]:
    srv = Sshd(box.root, agent.pub)
    bare = box.root / "remote.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(bare)], check=True)
    seed = box.root / "seed"
    subprocess.run(["git", "init", "-q", "-b", "main", str(seed)], check=True)
    git = ["git", "-C", str(seed), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "seed"], check=True)
    subprocess.run([*git, "push", "-q", str(bare), "main"], check=True)
    os.system(f"chmod -R a+rwX {bare}")
    yield srv, bare
    srv.stop()


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _git_over_ssh(s: Sandbox, agent: Agent, srv: Sshd, bare: Path, report: Report, mode: str) -> None:
    url = f"ssh://{_user()}@git.test{bare}"
    pin = ["--allow-host", f"git.test:22=127.0.0.1:{srv.port}", "--allow-socket", "ssh-agent"]
    script = (f"git ls-remote {url} && git clone -q {url} /tmp/c && cd /tmp/c && "
              f"git -c user.name=box -c user.email=box@example.com commit -q --allow-empty -m from-the-{mode} && "
              "git push -q origin main && echo pushed")
    on = run(s, script, "--allow-ssh", "git.test", *pin, sock=agent.sock, mode=mode, timeout=300)
    head = subprocess.run(["git", "-C", str(bare), "log", "-1", "--format=%s", "main"], capture_output=True,
                          text=True).stdout.strip()
    report.legit(on.returncode == 0 and head == f"from-the-{mode}")
    assert on.returncode == 0 and "pushed" in on.stdout, on.stdout + on.stderr + srv.log.read_text()[-2000:]
    assert "refs/heads/main" in on.stdout and head == f"from-the-{mode}"
    # The twin: the same box without --allow-ssh for git.test; the proxy refuses and says how to allow it.
    off = run(s, f"git ls-remote {url}", "--allow-ssh", "other.test", "--allow-socket", "ssh-agent",
              sock=agent.sock, mode=mode, timeout=300)
    report.attack(off.returncode != 0)
    assert off.returncode != 0 and "refs/heads" not in off.stdout
    assert "hive-relay: ssh to git.test:22 refused by the egress proxy" in off.stderr, off.stderr
    assert "fix: --allow-ssh git.test" in off.stderr
    # Without any --allow-ssh, a pinned port-443 rule for the name does not carry ssh either.
    bare_off = run(s, f"git ls-remote {url}", "--allow-host", f"git.test=127.0.0.1:{srv.port}",
                   "--allow-socket", "ssh-agent", sock=agent.sock, mode=mode, timeout=300)
    report.attack(bare_off.returncode != 0)
    assert bare_off.returncode != 0 and "refused by the egress proxy" in bare_off.stderr, bare_off.stderr


def test_git_over_ssh_through_the_proxy(box: Sandbox, agent: Agent, remote: tuple[Sshd, Path],
                                        report: Report) -> None:
    require_tool("git")
    _git_over_ssh(box, agent, *remote, report, "local")


def test_git_over_ssh_through_the_proxy_in_a_container(csandbox: Sandbox, agent: Agent,
                                                       remote: tuple[Sshd, Path], report: Report) -> None:
    require_tool("git")
    _git_over_ssh(csandbox, agent, *remote, report, "container")


def test_commits_are_signed_with_the_agents_key(box: Sandbox, agent: Agent, report: Report) -> None:
    require_tool("git")
    work = box.workdir
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True)
    key = f"key::{agent.pub}"
    script = (f"git -c gpg.format=ssh -c 'user.signingkey={key}' -c user.name=box -c user.email=box@example.com "
              "commit -q -S --allow-empty -m signed && echo committed")
    on = run(box, script, "--allow-socket", "ssh-agent", sock=agent.sock)
    assert on.returncode == 0 and "committed" in on.stdout, on.stdout + on.stderr
    signers = box.root / "allowed_signers"
    signers.write_text(f"box@example.com {agent.pub}\n")
    check = subprocess.run(["git", "-C", str(work), "-c", f"gpg.ssh.allowedSignersFile={signers}", "verify-commit",
                            "HEAD"], capture_output=True, text=True)
    report.legit(check.returncode == 0)
    assert check.returncode == 0 and "Good" in check.stderr, check.stderr
    off = run(box, script.replace("-m signed", "-m unsigned"), sock=agent.sock)
    report.attack(off.returncode != 0)
    assert off.returncode != 0, off.stdout  # no agent in the box: nothing signs


def test_the_repo_checkout_is_not_needed_for_the_proxy_command() -> None:
    """The ProxyCommand lives in the box's environment (bash /dev/tcp), not in a file of the checkout,
    so it works where only the image or the host's /bin/bash exists."""
    from relay.policy.sockets import connect_script, ssh_command

    assert "%" not in connect_script("127.0.0.1:3128")
    assert str(REPO) not in ssh_command() and "$HIVE_RELAY_SSH_CONNECT" in ssh_command()


# --- container mode ---------------------------------------------------------------------------------

def test_container_reaches_the_agent_only_with_the_opt_in(csandbox: Sandbox, report: Report) -> None:
    """podman: the socket file alone as a volume, the OCI profile with AF_UNIX allowed; the twin keeps
    socket(AF_UNIX) at EPERM. The image has python3, which speaks the agent protocol here."""
    require_tool("ssh-agent")
    s = csandbox
    found = Agent(s.root)
    dock = s.root / "dock" / "docker.sock"
    srv = _listening(dock)
    try:
        probe = (f"python3 -c '{AGENT_PROBE}' \"$SSH_AUTH_SOCK\"; "
                 f"python3 -c '{CONNECT_PROBE}' {dock} {found.sock}")
        on = run(s, probe, "--allow-socket", "ssh-agent", sock=found.sock, mode="container", timeout=300)
        off = run(s, f"python3 -c '{CONNECT_PROBE}' /run/hive-relay/sockets/ssh-agent {found.sock}", sock=found.sock,
                  mode="container", timeout=300)
    finally:
        found.stop()
        srv.close()
    report.legit("agent-answer 12" in on.stdout)  # SSH2_AGENT_IDENTITIES_ANSWER
    assert "agent-answer 12" in on.stdout, on.stdout + on.stderr
    report.attack(f"{dock} connect 2" in on.stdout and f"{found.sock} connect 2" in on.stdout)
    assert f"{dock} connect 2" in on.stdout and f"{found.sock} connect 2" in on.stdout, on.stdout
    report.attack(off.stdout.count("socket 1") == 2)
    assert off.stdout.count("socket 1") == 2, off.stdout + off.stderr


def test_gpg_agent_socket_enters_alone(box: Sandbox, report: Report) -> None:
    """--allow-socket gpg-agent: the box's gpg finds the host's agent through its restricted socket
    (S.gpg-agent.extra): it holds the test's key (HAVEKEY) but refuses to export it or list keys, and
    the box sees none of the keyrings beside the socket. Without the opt-in there is no agent."""
    require_tool("gpg-agent")
    require_tool("gpg")
    gnupg = box.root / "gnupg"
    gnupg.mkdir(mode=0o700)
    env = {**os.environ, "GNUPGHOME": str(gnupg)}
    subprocess.run(["gpg-agent", "--daemon"], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    try:
        subprocess.run(["gpg", "--batch", "--passphrase", "", "--quick-gen-key", "hive-relay-test@example.com",
                        "ed25519", "sign", "never"], env=env, check=True, capture_output=True)
        grip = next(line.split()[-1] for line in subprocess.run(
            ["gpg", "--with-keygrip", "-K"], env=env, capture_output=True, text=True, check=True).stdout.splitlines()
            if "Keygrip" in line)
        probe = (f"ls -A ~/.gnupg; gpg-connect-agent --no-autostart 'HAVEKEY {grip}' /bye; echo have=$?; "
                 "gpg-connect-agent --no-autostart 'KEYWRAP_KEY --export' 'KEYINFO --list' /bye")
        on = box.relay("shell", "local", "--quiet", "--prompt", probe, "--allow-socket", "gpg-agent",
                       extra_env={"GNUPGHOME": str(gnupg)})
        off = box.relay("shell", "local", "--quiet", "--prompt", probe, extra_env={"GNUPGHOME": str(gnupg)})
    finally:
        subprocess.run(["gpgconf", "--kill", "gpg-agent"], env=env, capture_output=True)
    lines = on.stdout.split()
    report.legit(lines[:2] == ["S.gpg-agent", "OK"])
    assert lines[:2] == ["S.gpg-agent", "OK"], on.stdout + on.stderr  # the agent holds the key
    assert "private-keys" not in on.stdout
    report.attack(on.stdout.count("Forbidden") == 2 and "\nD " not in on.stdout)
    assert on.stdout.count("Forbidden") == 2 and "\nD " not in on.stdout, on.stdout  # no wrap key, no key list
    report.attack("OK" not in off.stdout)
    assert "OK" not in off.stdout, off.stdout
