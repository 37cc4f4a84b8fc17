"""Network attacks from inside every backend's box, each beside the legitimate route that must work.

What the proxy can and cannot see (documented in the README threat model): it decides on the CONNECT
target (or the absolute URI), and in a tunnel it reads the first TLS record: a ClientHello whose SNI
is not the CONNECT host, or bytes that are not TLS at all, are refused (tests/escape/test_tunnels.py).
What the TLS then carries (the HTTP Host header inside it) stays opaque; under a `tls=false` rule the
whole tunnel is. Either way the bytes go only to the allowed (or pinned) address: fronting cannot
reach another IP.
"""

from __future__ import annotations

import json

import pytest

from ..conftest import Sandbox
from ..netnames import internal_name
from ..servers import Handler, start_http

PY = "/usr/bin/python3"
CONNECT = r'''
import socket, sys
def via_proxy(first_line, extra=""):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
    s.sendall(first_line.encode() + b"\r\n\r\n" + extra.encode())
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
        if not extra and b"\r\n\r\n" in data:
            break  # a bare CONNECT: its status line is all there is to read
    return data.decode(errors="replace")
for arg in sys.argv[1:]:
    print("=>", arg.split("\\n")[0], "::", via_proxy(*arg.split("|", 1)) if "|" in arg else via_proxy(arg))
'''


@pytest.fixture(scope="module")
def upstream():
    server, port, _ = start_http()
    yield port
    server.shutdown()


def run(s: Sandbox, backend: str, script: str, *allow: str) -> str:
    args = [a for h in allow for a in ("--allow-host", h)]
    proc = s.box(script, backend, *args)
    return proc.stdout + proc.stderr


def log(s: Sandbox) -> list[dict]:
    files = sorted((s.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def test_direct_connect_by_ip_and_ipv6(box: Sandbox, backend: str, upstream: int, report) -> None:
    script = (f"{PY} -c '\nimport socket\nfor a in [(\"93.184.216.34\", 443), (\"127.0.0.1\", {upstream}), "
              f"(\"2606:4700::1111\", 443), (\"::1\", {upstream})]:\n"
              " try:\n  socket.create_connection(a, timeout=3); print(\"CONNECTED\", a)\n"
              " except OSError as e: print(\"REFUSED\", a[0], e.errno)\n"
              "l = socket.socket(socket.AF_INET6); l.bind((\"::1\", 0)); l.listen()\n"
              "c = socket.create_connection((\"::1\", l.getsockname()[1])); print(\"LOCAL-V6-OK\")'")
    out = run(box, backend, script)
    blocked = "CONNECTED" not in out and out.count("REFUSED") == 4
    report.attack(blocked)
    report.legit("LOCAL-V6-OK" in out)  # the agent's own dev servers on loopback still work
    assert blocked and "LOCAL-V6-OK" in out, out


def test_dns_lookups_fail_fast(box: Sandbox, backend: str, report) -> None:
    out = run(box, backend, f"{PY} -c '\nimport socket\ntry:\n socket.getaddrinfo(\"example.com\", 443); print(\"RESOLVED\")\n"
                            "except OSError as e: print(\"NO-DNS\")\nprint(\"LOCALHOST\", socket.getaddrinfo(\"localhost\", 80)[0][4][0])'")
    report.attack("NO-DNS" in out and "RESOLVED" not in out)
    report.legit("LOCALHOST 127.0.0.1" in out or "LOCALHOST ::1" in out)
    assert "NO-DNS" in out and "RESOLVED" not in out and "LOCALHOST" in out


def test_connect_to_a_non_allowed_host_and_metadata(box: Sandbox, backend: str, upstream: int, report) -> None:
    (box.workdir / "c.py").write_text(CONNECT)
    out = run(box, backend, f"{PY} c.py 'CONNECT evil.example:443 HTTP/1.1' 'CONNECT 169.254.169.254:80 HTTP/1.1' "
                            f"'GET http://169.254.169.254/latest/meta-data/ HTTP/1.1' "
                            f"'CONNECT allowed.test:{upstream} HTTP/1.1'",
              f"allowed.test:{upstream}=127.0.0.1:{upstream}")
    denied = out.count("403 Forbidden") == 3
    report.attack(denied)
    report.legit(f"allowed.test:{upstream} HTTP/1.1 :: HTTP/1.1 200" in out)
    assert denied and f"allowed.test:{upstream} HTTP/1.1 :: HTTP/1.1 200" in out, out


def test_allowed_name_resolving_to_a_private_address(box: Sandbox, backend: str, upstream: int, report) -> None:
    name = internal_name()  # `localhost` itself is refused as an entry (NO_PROXY keeps it in the box)
    (box.workdir / "c.py").write_text(CONNECT)
    out = run(box, backend, f"{PY} c.py 'CONNECT {name}:{upstream} HTTP/1.1' 'CONNECT pinned.test:{upstream} HTTP/1.1'",
              f"{name}:{upstream}", f"pinned.test:{upstream}=127.0.0.1:{upstream}")
    report.attack(f"{name}:{upstream} HTTP/1.1 :: HTTP/1.1 403" in out)
    report.legit(f"pinned.test:{upstream} HTTP/1.1 :: HTTP/1.1 200" in out)
    assert f"{name}:{upstream} HTTP/1.1 :: HTTP/1.1 403" in out and "internal address" in out
    assert f"pinned.test:{upstream} HTTP/1.1 :: HTTP/1.1 200" in out


def test_domain_fronting_reaches_only_the_allowed_address(box: Sandbox, backend: str, upstream: int, report) -> None:
    Handler.requests.clear()
    (box.workdir / "c.py").write_text(CONNECT)
    fronted = "GET /fronted HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"
    out = run(box, backend, f"{PY} c.py 'CONNECT allowed.test:443 HTTP/1.1|{fronted}' "
                            f"'CONNECT raw.test:443 HTTP/1.1|{fronted}'",
              f"allowed.test:443=127.0.0.1:{upstream}", f"raw.test:443=127.0.0.1:{upstream},tls=false")
    entries = log(box)
    # Plain HTTP in a tunnel to 443, which must be TLS: refused before a byte is forwarded.
    opaque = [e for e in entries if e["host"] == "allowed.test" and e["decision"] == "opaque-tunnel"]
    # Under a tls=false rule the Host header is opaque inside the tunnel: it arrives at the allowed
    # upstream, nowhere else.
    reached = [r for r in Handler.requests if "/fronted" in r]
    report.attack(bool(opaque) and len(reached) == 1 and all("evil.example" in r for r in reached)
                  and not any(e["host"] == "evil.example" for e in entries))
    report.legit("hello from the fake upstream" in out)
    assert opaque and len(reached) == 1 and "hello from the fake upstream" in out, out
    assert "403 Forbidden by the hive-relay egress policy" in out, out
    assert not any(e["host"] == "evil.example" and e["decision"] == "allow" for e in entries)


def test_absolute_uri_smuggling(box: Sandbox, backend: str, upstream: int, report) -> None:
    Handler.requests.clear()
    (box.workdir / "c.py").write_text(CONNECT)
    smuggle = (f"GET http://allowed.test:{upstream}/first HTTP/1.1\r\nHost: allowed.test|"
               "GET http://evil.example/second HTTP/1.1\r\nHost: evil.example\r\n\r\n")
    out = run(box, backend, f"{PY} c.py '{smuggle}' 'GET http://evil.example@allowed.test:{upstream}/ HTTP/1.1' "
                            f"'GET http://evil.example/ HTTP/1.1'",
              f"allowed.test:{upstream}=127.0.0.1:{upstream}")
    entries = log(box)
    # The pipelined second request rides the same upstream connection (allowed.test) or is dropped
    # after `Connection: close`; it never opens a route to evil.example.
    never_evil = not any(e["host"] == "evil.example" and e["decision"] == "allow" for e in entries)
    report.attack(never_evil and "400 Bad Request" in out and "403 Forbidden" in out)
    report.legit(any("/first" in r for r in Handler.requests))
    assert never_evil and "400 Bad Request" in out and "403 Forbidden" in out, out
    assert any("/first" in r for r in Handler.requests)
