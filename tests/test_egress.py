"""Egress through the real host-side proxy, from inside a real box: allowed, denied, streamed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import Sandbox, require_tool
from .netnames import internal_name
from .servers import Handler, start_echo, start_http

pytestmark = pytest.mark.box

PY = "/usr/bin/python3"


def log_entries(s: Sandbox) -> list[dict]:
    logs = sorted((s.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    assert logs, "no egress log written"
    return [json.loads(line) for line in logs[-1].read_text().splitlines()]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory):
    tls_dir = tmp_path_factory.mktemp("tls")
    tls_dir.chmod(0o755)
    http_server, http_port, _ = start_http()
    https_server, https_port, cert = start_http(tls_dir)
    cert.chmod(0o644)
    echo_sock, echo_port = start_echo()
    yield {"http": http_port, "https": https_port, "cert": cert, "echo": echo_port}
    http_server.shutdown()
    https_server.shutdown()
    echo_sock.close()


def test_allowed_pinned_host_reached_with_curl_and_python(box_sandbox: Sandbox, upstream: dict) -> None:
    require_tool("curl")
    s = box_sandbox
    cert = s.workdir / "cert.pem"
    cert.write_bytes(Path(upstream["cert"]).read_bytes())
    https, http = upstream["https"], upstream["http"]
    script = (
        f"curl -sS --cacert cert.pem https://fake.test:{https}/hello; "
        f"curl -sS http://plain.test:{http}/hello; "
        f"{PY} -c 'import urllib.request; print(\"PY\", urllib.request.urlopen(\"http://plain.test:{http}/x\").read().decode())'"
    )
    proc = s.box(script, "shell", "--allow-host", f"fake.test:{https}=127.0.0.1:{https}",
                 "--allow-host", f"plain.test:{http}=127.0.0.1:{http}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("hello from the fake upstream") == 3
    entries = log_entries(s)
    allowed = [(e["host"], e["port"], e["method"]) for e in entries if e["decision"] == "allow"]
    assert ("fake.test", https, "CONNECT") in allowed
    assert ("plain.test", http, "GET") in allowed
    assert all(e["backend"] == "shell" for e in entries)


def test_plain_http_reaches_upstream_with_the_uri_host_only(box_sandbox: Sandbox, upstream: dict) -> None:
    """curl's own Host header (here a lie) is replaced by the URI's authority; a second, pipelined
    request on the same connection never reaches the upstream."""
    require_tool("curl")
    s = box_sandbox
    http = upstream["http"]
    Handler.requests.clear()
    (s.workdir / "pipelined.py").write_text(
        "import socket, sys\n"
        "port = sys.argv[1]\n"
        "s = socket.create_connection(('127.0.0.1', 3128))\n"
        "s.sendall(''.join(f'GET http://plain.test:{port}/{p} HTTP/1.1\\r\\nHost: plain.test\\r\\n\\r\\n'\n"
        "                  for p in ('one', 'two')).encode())\n"
        "print(s.recv(65536).decode().splitlines()[0])\n")
    script = (f"curl -sS -H 'Host: evil.test' -H 'Proxy-Authorization: Basic eA==' http://plain.test:{http}/lied; "
              f"{PY} pipelined.py {http}")
    proc = s.box(script, "shell", "--allow-host", f"plain.test:{http}=127.0.0.1:{http}")
    assert "hello from the fake upstream" in proc.stdout and "HTTP/1.1 200 OK" in proc.stdout, proc.stdout + proc.stderr
    assert f"GET /lied host=plain.test:{http}" in Handler.requests
    assert f"GET /one host=plain.test:{http}" in Handler.requests
    assert not any("/two" in r or "evil.test" in r for r in Handler.requests), Handler.requests


def test_non_allowed_host_gets_403_with_reason_and_is_logged(box_sandbox: Sandbox, upstream: dict) -> None:
    s = box_sandbox
    https = upstream["https"]
    proc = s.box("curl -sS -o /dev/null -w 'connect=%{http_connect}\\n' https://example.com/ 2>&1; "
                 "curl -s -D - http://denied.test/ ; true",
                 "shell", "--allow-host", f"fake.test:{https}=127.0.0.1:{https}")
    assert "connect=403" in proc.stdout
    assert "X-Hive-Relay-Denied: denied.test:80; not in the egress allowlist" in proc.stdout
    assert "--allow-host denied.test:80" in proc.stdout
    denied = [(e["host"], e["port"]) for e in log_entries(s) if e["decision"] == "deny"]
    assert ("example.com", 443) in denied and ("denied.test", 80) in denied
    assert "egress denied: " in proc.stderr and "example.com:443" in proc.stderr


CONNECT = r'''
import socket, sys
def connect(target):
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    return s.recv(4096).decode(errors="replace").splitlines()[0]
for target in sys.argv[1:]:
    print(target, "->", connect(target))
'''


def test_ip_literals_and_names_resolving_to_loopback_are_refused(box_sandbox: Sandbox, upstream: dict) -> None:
    s = box_sandbox
    echo = upstream["echo"]
    name = internal_name()
    (s.workdir / "connect.py").write_text(CONNECT)
    proc = s.box(f"{PY} connect.py 127.0.0.1:{echo} {name}:{echo} 169.254.169.254:80 [::1]:{echo} "
                 f"pinned.test:{echo}",
                 "shell", "--allow-host", f"{name}:{echo}", "--allow-host", f"pinned.test:{echo}=127.0.0.1:{echo}")
    out = proc.stdout
    assert f"127.0.0.1:{echo} -> HTTP/1.1 403" in out
    assert f"{name}:{echo} -> HTTP/1.1 403" in out  # allowlisted name, but it resolves to an internal address
    assert "169.254.169.254:80 -> HTTP/1.1 403" in out
    assert f"[::1]:{echo} -> HTTP/1.1 403" in out
    assert f"pinned.test:{echo} -> HTTP/1.1 200" in out  # the legitimate pinned twin
    reasons = {e["host"]: e["reason"] for e in log_entries(s)}
    assert "IP literals" in reasons["127.0.0.1"]
    assert "internal address" in reasons[name]


def test_wildcard_matches_subdomains_only(box_sandbox: Sandbox, upstream: dict) -> None:
    s = box_sandbox
    (s.workdir / "connect.py").write_text(CONNECT)
    s.box(f"{PY} connect.py wild.test:443 api.wild.test:443 deep.api.wild.test:443 api.wild.test:80",
          "shell", "--allow-host", "*.wild.test")
    reasons = {(e["host"], e["port"]): e["reason"] for e in log_entries(s)}
    assert reasons[("wild.test", 443)] == "not in the egress allowlist"  # the apex is not matched
    assert reasons[("api.wild.test", 443)].startswith("cannot resolve")  # matched; .test has no DNS
    assert reasons[("deep.api.wild.test", 443)].startswith("cannot resolve")
    assert reasons[("api.wild.test", 80)] == "not in the egress allowlist"  # default port is 443 only


SSE = r'''
import socket, time, sys
port = int(sys.argv[1])
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(f"GET http://sse.test:{port}/sse HTTP/1.1\r\nHost: sse.test:{port}\r\n\r\n".encode())
start = time.monotonic(); buf = b""
while b"event2" not in buf:
    chunk = s.recv(4096)
    if not chunk: break
    buf += chunk
    for i in range(3):
        if f"event{i}".encode() in chunk:
            print(f"event{i} at {time.monotonic() - start:.2f}")
'''


def test_server_sent_events_arrive_incrementally(box_sandbox: Sandbox, upstream: dict) -> None:
    s = box_sandbox
    http = upstream["http"]
    (s.workdir / "sse.py").write_text(SSE)
    proc = s.box(f"{PY} sse.py {http}", "shell", "--allow-host", f"sse.test:{http}=127.0.0.1:{http}")
    times = {line.split()[0]: float(line.split()[2]) for line in proc.stdout.splitlines() if line.startswith("event")}
    assert set(times) == {"event0", "event1", "event2"}, proc.stdout + proc.stderr
    # The server waits 1 s between events; unbuffered relaying shows that spacing.
    assert times["event1"] - times["event0"] > 0.5 and times["event2"] - times["event1"] > 0.5


WEBSOCKET = r'''
import base64, os, socket, sys
port = int(sys.argv[1])
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(f"CONNECT ws.test:{port} HTTP/1.1\r\n\r\n".encode())
assert s.recv(4096).startswith(b"HTTP/1.1 200"), "tunnel refused"
key = base64.b64encode(os.urandom(16)).decode()
s.sendall(f"GET /ws HTTP/1.1\r\nHost: ws.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
          f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
head = b""
while b"\r\n\r\n" not in head:
    head += s.recv(1)
print(head.split(b"\r\n")[0].decode())
payload, mask = b"ping through the tunnel", os.urandom(4)
s.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
frame = s.recv(4096)
print("ECHO", frame[2:].decode())
'''


def test_websocket_upgrade_through_connect(box_sandbox: Sandbox, upstream: dict) -> None:
    s = box_sandbox
    http = upstream["http"]
    (s.workdir / "ws.py").write_text(WEBSOCKET)
    proc = s.box(f"{PY} ws.py {http}", "shell", "--allow-host", f"ws.test:{http}=127.0.0.1:{http},tls=false")
    assert "HTTP/1.1 101" in proc.stdout, proc.stdout + proc.stderr
    assert "ECHO ping through the tunnel" in proc.stdout


CONCURRENT = r'''
import socket, sys, threading
port, n = int(sys.argv[1]), int(sys.argv[2])
ok = []; errors = []
barrier = threading.Barrier(n)
def one(i):
    try:
        s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
        s.sendall(f"CONNECT echo.test:{port} HTTP/1.1\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        barrier.wait(timeout=30)  # all tunnels open at once
        msg = (f"tunnel-{i}-" * 1000).encode()
        s.sendall(msg); s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        assert got == msg
        ok.append(i)
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
[t.start() for t in threads]; [t.join() for t in threads]
print("OK", len(ok), "ERRORS", len(errors), errors[:3])
'''


def test_200_concurrent_tunnels(box_sandbox: Sandbox, upstream: dict) -> None:
    s = box_sandbox
    echo = upstream["echo"]
    (s.workdir / "many.py").write_text(CONCURRENT)
    proc = s.box(f"{PY} many.py {echo} 200", "shell", "--allow-host", f"echo.test:{echo}=127.0.0.1:{echo},tls=false")
    assert "OK 200 ERRORS 0" in proc.stdout, proc.stdout + proc.stderr


def test_default_profile_has_no_network_at_all(box_sandbox: Sandbox, upstream: dict) -> None:
    s = box_sandbox
    proc = s.box(f"{PY} -c 'import socket\ntry:\n socket.create_connection((\"127.0.0.1\", 3128), timeout=3); print(\"PROXY\")\n"
                 f"except OSError as e: print(\"NOPROXY\", e.errno)'; env | cut -d= -f1 | grep -ci proxy; true", "shell", "--profile", "default")
    assert "NOPROXY" in proc.stdout and "PROXY\n" not in proc.stdout
    assert proc.stdout.strip().endswith("0")  # no *proxy* variable (the names only: a checkout path may hold the word)
