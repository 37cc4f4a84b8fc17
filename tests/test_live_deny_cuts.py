"""A live `deny` takes effect on what is already open: a CONNECT tunnel (or a streaming plain-HTTP forward)
to a host the new rules no longer allow is cut at once, both ends, and the cut is a JSON line; the twin,
a tunnel to a host still allowed, stays open and keeps flowing. End to end in a real box (curl holding
a tunnel to a slow streaming server), and on the real proxy in-process for the finer cases."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relay.egress.decision_log import DecisionLog
from relay.egress.proxy import EgressProxy
from relay.egress.rulebook import still_allowed
from relay.model.allow_rules import parse_rule

from .conftest import Sandbox, require_tool
from .servers import start_tcp


def _ticker(conn: socket.socket, _n: int) -> None:
    """A slow streaming answer: an HTTP head (no length: the body ends at close), then a line every 0.1 s
    until the client goes away. Read the request head first (a CONNECT client sends it after the 200)."""
    with conn:
        conn.settimeout(30)
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
            for i in range(6000):
                conn.sendall(b"tick %d\n" % i)
                time.sleep(0.1)
        except OSError:
            return


def _wait(predicate, timeout: float, what: str) -> float:  # noqa: ANN001
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout} s")


# In the box: two curls hold a tunnel each (-p: CONNECT even for http://), writing the ticks to files the
# host watches; the loop says when each curl ended.
SCRIPT = """
curl -sN -p -o a.out http://cut.test:{a}/ & A=$!
curl -sN -p -o b.out http://kept.test:{b}/ & B=$!
ae=; be=
while [ ! -e stop ]; do
  if [ -z "$ae" ] && ! kill -0 $A 2>/dev/null; then echo a-ended; ae=1; fi
  if [ -z "$be" ] && ! kill -0 $B 2>/dev/null; then echo b-ended; be=1; fi
  sleep 0.05
done
kill $A $B 2>/dev/null; wait; echo bye
"""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@pytest.mark.box
@pytest.mark.parametrize("mode", ["local", "container"])
def test_deny_cuts_the_open_tunnel_and_keeps_the_twin(request: pytest.FixtureRequest, mode: str) -> None:
    require_tool("curl")
    s: Sandbox = request.getfixturevalue("csandbox" if mode == "container" else "box_sandbox")
    s.env["XDG_RUNTIME_DIR"] = str(s.root / "run")  # this test's run alone in it
    srv_a, a = start_tcp(_ticker)
    srv_b, b = start_tcp(_ticker)
    box = subprocess.Popen(
        [sys.executable, "-m", "relay", "shell", mode, "--quiet", "--allow-host", f"cut.test:{a}=127.0.0.1:{a},tls=false",
         "--allow-host", f"kept.test:{b}=127.0.0.1:{b},tls=false", "--prompt", SCRIPT.format(a=a, b=b)],
        cwd=s.workdir, env=s.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out_a, out_b = s.workdir / "a.out", s.workdir / "b.out"
    try:
        _wait(lambda: _size(out_a) > 20 and _size(out_b) > 20, 90, "both tunnels streaming")
        denied = subprocess.run([sys.executable, "-m", "relay", "deny", f"cut.test:{a}"], cwd=s.workdir, env=s.env,
                                capture_output=True, text=True, timeout=60)
        cut_at = time.monotonic()
        assert denied.returncode == 0, denied.stderr
        assert f"denied cut.test:{a}" in denied.stdout and "cut 1 open connection it no longer allows" in denied.stdout
        # The client sees its tunnel end: curl exits, and the file stops growing.
        _wait(lambda: not _grows(out_a), 5, "the denied tunnel ending")
        took = time.monotonic() - cut_at
        print(f"deny cut the box's tunnel: its growth stopped within {took:.2f} s of the deny's answer")
        assert took < 3, took
        # The twin still flows.
        before = _size(out_b)
        time.sleep(1.0)
        assert _size(out_b) > before, "the tunnel to the host still allowed was cut too"
    finally:
        (s.workdir / "stop").write_text("")
        try:
            stdout, err = box.communicate(timeout=120)
        finally:
            box.kill()
            srv_a.close()
            srv_b.close()
    assert box.returncode == 0, err[-2000:]
    lines = stdout.split()
    assert "a-ended" in lines and lines.index("a-ended") < lines.index("bye"), stdout
    assert "b-ended" not in lines[: lines.index("bye")] or lines.index("b-ended") > lines.index("a-ended"), stdout
    logs = sorted((s.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    entries = [json.loads(line) for line in logs[-1].read_text().splitlines()]
    cuts = [e for e in entries if e["decision"] == "live-cut"]
    assert [(e["host"], e["port"], e["method"]) for e in cuts] == [("cut.test", a, "CONNECT")], cuts
    assert f"127.0.0.1:{a} cut" in cuts[0]["reason"]
    kinds = [e["decision"] for e in entries]
    assert kinds.index("live-deny") < kinds.index("live-cut")


def _grows(path: Path) -> bool:
    """Whether the file grows over 0.4 s (four ticks of the server)."""
    before = _size(path)
    time.sleep(0.4)
    return _size(path) > before


# --- the real proxy in-process ------------------------------------------------------------------------

def _proxy(tmp_path: Path, entries: list[str]) -> tuple[EgressProxy, int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    proxy = EgressProxy(listener, tuple(parse_rule(e) for e in entries),
                        DecisionLog(str(tmp_path / "egress.jsonl"), "test"), notify=None)
    proxy.start()
    return proxy, listener.getsockname()[1]


def _open(proxy_port: int, head: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy_port), timeout=10)
    sock.sendall(head)
    return sock


def _reads_until_eof(sock: socket.socket, timeout: float) -> float:
    """Seconds until the peer closes (reading and dropping what flows meanwhile)."""
    sock.settimeout(timeout)
    start = time.monotonic()
    while sock.recv(65536):
        pass
    return time.monotonic() - start


def test_deny_cuts_tunnels_and_forwards_but_not_the_twin_or_an_unrelated_allow(tmp_path: Path) -> None:
    srv, port = start_tcp(_ticker)
    proxy, pport = _proxy(tmp_path, [f"cut.test:{port}=127.0.0.1:{port},tls=false", f"kept.test:{port}=127.0.0.1:{port},tls=false"])
    try:
        tunnel = _open(pport, f"CONNECT cut.test:{port} HTTP/1.1\r\n\r\n".encode())
        forward = _open(pport, f"GET http://cut.test:{port}/ HTTP/1.1\r\nHost: cut.test\r\n\r\n".encode())
        twin = _open(pport, f"CONNECT kept.test:{port} HTTP/1.1\r\n\r\n".encode())
        for sock in (tunnel, twin):
            assert sock.recv(64).startswith(b"HTTP/1.1 200 Connection Established")
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        for sock in (tunnel, forward, twin):
            sock.settimeout(10)
            assert b"tick" in sock.recv(4096) + sock.recv(4096)
        _wait(lambda: len(proxy.book._tunnels) == 3, 5, "three connections listed")
        # An allow of something else cuts nothing.
        reply = proxy.change_rules("allow", "other.test", 0)
        assert reply["ok"] and "cut" not in reply["message"]
        reply = proxy.change_rules("deny", f"cut.test:{port}", 0)
        assert reply["ok"] and "cut 2 open connections" in reply["message"], reply
        ends = [_reads_until_eof(tunnel, 3), _reads_until_eof(forward, 3)]
        print(f"cut connections ended {ends[0]:.3f} s and {ends[1]:.3f} s after the deny answered")
        assert max(ends) < 2, ends
        twin.settimeout(3)
        assert b"tick" in twin.recv(4096) + twin.recv(4096)  # still flowing
        _wait(lambda: len(proxy.book._tunnels) == 1, 5, "the cut connections unlisted")
        for sock in (tunnel, forward, twin):
            sock.close()
    finally:
        proxy.stop()
        srv.close()
    entries = [json.loads(line) for line in (tmp_path / "egress.jsonl").read_text().splitlines()]
    cuts = sorted((e["method"], e["host"]) for e in entries if e["decision"] == "live-cut")
    assert cuts == [("CONNECT", "cut.test"), ("GET", "cut.test")]


def test_still_allowed_judges_where_the_bytes_go() -> None:
    pinned = (parse_rule("svc.test:8080=127.0.0.1:8080"),)
    assert still_allowed(pinned, "svc.test", 8080, ("127.0.0.1", 8080))
    assert not still_allowed(pinned, "svc.test", 8080, ("127.0.0.2", 8080))  # the pin moved: cut
    assert not still_allowed((), "svc.test", 8080, ("127.0.0.1", 8080))  # no rule left: cut
    named = (parse_rule("example.org"),)
    assert still_allowed(named, "example.org", 443, ("93.184.216.34", 443))
    assert not still_allowed(named, "example.org", 443, ("10.0.0.7", 443))  # an internal address: never
    assert not still_allowed(named, "example.org", 443, ("::1", 443))
    assert still_allowed((parse_rule("*.example.org"),), "a.example.org", 443, ("2606:2800:220:1::1", 443))


def test_deny_cuts_a_streaming_credential_route_request(tmp_path: Path) -> None:
    """A backend's credential route goes through the egress policy as it is: denying its upstream cuts a
    request streaming through the route (a model's answer), and the route's TLS reader ends cleanly."""
    import ssl

    from relay.model.backend import CredentialRoute

    from .servers import make_ca

    (tmp_path / "ca").mkdir()
    ca_file, server_ctx = make_ca(tmp_path / "ca", ("api.example",))

    def tls_ticker(conn: socket.socket, n: int) -> None:
        try:
            conn = server_ctx.wrap_socket(conn, server_side=True)
        except OSError:
            conn.close()
            return
        _ticker(conn, n)

    srv, port = start_tcp(tls_ticker)
    plain, plain_port = start_tcp(_ticker)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    route = CredentialRoute("r", ("K",), "api.example", port, "x-api-key")
    proxy = EgressProxy(listener, (parse_rule(f"api.example:{port}=127.0.0.1:{port}"),
                                   parse_rule(f"kept.test:{plain_port}=127.0.0.1:{plain_port},tls=false")),
                        DecisionLog(str(tmp_path / "egress.jsonl"), "test"), notify=None, routes=(route,),
                        keys={"r": "sk-secret"}, tls=ssl.create_default_context(cafile=str(ca_file)))
    proxy.start()
    pport = listener.getsockname()[1]
    try:
        streaming = _open(pport, b"GET /r/v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        twin = _open(pport, f"CONNECT kept.test:{plain_port} HTTP/1.1\r\n\r\n".encode())
        assert twin.recv(64).startswith(b"HTTP/1.1 200 Connection Established")
        twin.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        for sock in (streaming, twin):
            sock.settimeout(10)
            assert b"tick" in sock.recv(4096) + sock.recv(4096)
        reply = proxy.change_rules("deny", f"api.example:{port}", 0)
        assert "cut 1 open connection" in reply["message"], reply
        assert _reads_until_eof(streaming, 3) < 2
        twin.settimeout(3)
        assert b"tick" in twin.recv(4096) + twin.recv(4096)
        for sock in (streaming, twin):
            sock.close()
    finally:
        proxy.stop()
        srv.close()
        plain.close()
    entries = [json.loads(line) for line in (tmp_path / "egress.jsonl").read_text().splitlines()]
    assert [(e["host"], e["method"]) for e in entries if e["decision"] == "live-cut"] == [("api.example", "GET")]
