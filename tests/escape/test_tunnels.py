"""The proxy sees what it allows: a tunnel's TLS must name its CONNECT host (SNI), a tunnel that is
not TLS is refused unless its rule says `tls=false`, and each refusal says it is the policy's.

Each attack has its twin, through the real proxy (in-process, for the byte-level cases) and from
inside a real box, local and container (the SNI and opaque cases)."""

from __future__ import annotations

import json
import socket
import ssl
import struct
from pathlib import Path

import pytest

from relay.egress.decision_log import DecisionLog
from relay.egress.proxy import EgressProxy
from relay.egress.tlspeek import parse_client_hello, sni_problem
from relay.model.allow_rules import parse_rule

from ..conftest import Sandbox
from ..servers import start_echo, start_http

PY = "/usr/bin/python3"
POLICY = "by the hive-relay egress policy"


@pytest.fixture(scope="module")
def tls_upstream(tmp_path_factory: pytest.TempPathFactory):
    tls_dir = tmp_path_factory.mktemp("tls")
    tls_dir.chmod(0o755)
    server, port, cert = start_http(tls_dir)  # a certificate for fake.test
    cert.chmod(0o644)
    echo_sock, echo = start_echo()
    yield {"port": port, "cert": cert, "echo": echo}
    server.shutdown()
    echo_sock.close()


class _Proxy:
    def __init__(self, tmp_path: Path, entries: list[str]) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.log_path = tmp_path / "egress.jsonl"
        self.told: list[str] = []
        self.proxy = EgressProxy(self.listener, tuple(parse_rule(e) for e in entries),
                                 DecisionLog(str(self.log_path), "test"), notify=self.told.append, run_id="RUN-ID")
        self.proxy.start()
        self.port = self.listener.getsockname()[1]

    def tunnel(self, target: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=20)
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            data = sock.recv(1)
            assert data, head
            head += data
        assert head.startswith(b"HTTP/1.1 200"), head
        return sock

    def entries(self) -> list[dict]:
        self.proxy.log.close()
        return [json.loads(line) for line in self.log_path.read_text().splitlines()] if self.log_path.exists() else []

    def stop(self) -> None:
        self.proxy.stop()


@pytest.fixture
def proxy_for(tmp_path: Path):
    made: list[_Proxy] = []

    def make(*entries: str) -> _Proxy:
        where = tmp_path / f"proxy{len(made)}"
        where.mkdir()
        made.append(_Proxy(where, list(entries)))
        return made[-1]

    yield make
    for p in made:
        p.stop()


def _tls_get(sock: socket.socket, cert: Path, sni: str | None) -> bytes:
    ctx = ssl.create_default_context(cafile=str(cert))
    if sni is None:
        ctx.check_hostname = False
    with ctx.wrap_socket(sock, server_hostname=sni) as tls:
        tls.sendall(b"GET /hello HTTP/1.1\r\nHost: fake.test\r\nConnection: close\r\n\r\n")
        out = b""
        while data := tls.recv(65536):
            out += data
        return out


def _client_hello(sni: str | None, ech: bool = False) -> bytes:
    """A real ClientHello from Python's TLS stack, with an ECH-shaped extension added when asked
    (the proxy must judge the outer server_name, which is the one in the clear)."""
    ctx = ssl.create_default_context()
    if sni is None:
        ctx.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=sni)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    record = outgoing.read()
    if not ech:
        return record
    body = record[9:]  # after the record head (5) and the handshake head (4)
    ext = struct.pack("!HH", 0xFE0D, 8) + b"\x00" * 8
    at = 2 + 32
    at += 1 + body[at]
    at += 2 + int.from_bytes(body[at:at + 2], "big")
    at += 1 + body[at]
    ext_len = int.from_bytes(body[at:at + 2], "big") + len(ext)
    body = body[:at] + ext_len.to_bytes(2, "big") + body[at + 2:] + ext
    hs = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + len(hs).to_bytes(2, "big") + hs


def test_sni_must_name_the_connect_host(proxy_for, tls_upstream: dict) -> None:
    port, cert = tls_upstream["port"], tls_upstream["cert"]
    p = proxy_for(f"fake.test:{port}=127.0.0.1:{port}")
    # The twin: the TLS names the CONNECT host; the handshake is the client's own (verified end to end).
    assert b"hello from the fake upstream" in _tls_get(p.tunnel(f"fake.test:{port}"), cert, "fake.test")
    # Domain fronting: CONNECT to the allowed name, TLS to another.
    with pytest.raises(ssl.SSLError, match="ACCESS_DENIED|access denied"):
        _tls_get(p.tunnel(f"fake.test:{port}"), cert, "other.test")
    # No SNI at all.
    with pytest.raises(ssl.SSLError):
        _tls_get(p.tunnel(f"FAKE.test.:{port}"), cert, None)
    entries = p.entries()
    kinds = [(e["decision"], e.get("sni")) for e in entries]
    assert kinds == [("allow", "fake.test"), ("sni-mismatch", None), ("sni-mismatch", None)], kinds
    assert "names other.test, not the CONNECT host fake.test" in entries[1]["reason"]
    assert "SNI missing" in entries[2]["reason"]
    assert all(f"fake.test:{port}=127.0.0.1:{port}" == e["rule"] for e in entries[1:])
    assert any(POLICY in line and "names other.test" in line for line in p.told), p.told


def test_ech_outer_sni_is_judged_and_bytes_are_forwarded_unchanged(proxy_for, tls_upstream: dict) -> None:
    echo = tls_upstream["echo"]
    p = proxy_for(f"front.test:{echo}=127.0.0.1:{echo}")
    hello = _client_hello("front.test", ech=True)
    assert parse_client_hello(hello).ech and parse_client_hello(hello).sni == "front.test"
    # The twin: the outer name matches; the echo upstream returns the very bytes the client sent.
    sock = p.tunnel(f"front.test:{echo}")
    sock.sendall(hello[:7])  # trickled: the peek waits for the whole record
    sock.sendall(hello[7:])
    got = b""
    while len(got) < len(hello):
        got += sock.recv(65536)
    assert got == hello
    sock.close()
    # The attack: an ECH ClientHello whose outer name is another tenant's.
    sock = p.tunnel(f"front.test:{echo}")
    sock.sendall(_client_hello("tenant.other.test", ech=True))
    assert sock.recv(64) == b"\x15\x03\x03\x00\x02\x02\x31"  # a fatal access_denied alert, nothing forwarded
    entries = p.entries()
    assert [e["decision"] for e in entries] == ["allow", "sni-mismatch"]
    assert "the ECH outer server_name" in entries[1]["reason"]


def test_opaque_tunnels_are_refused_unless_the_rule_says_tls_false(proxy_for, tls_upstream: dict) -> None:
    echo = tls_upstream["echo"]
    p = proxy_for(f"echo.test:{echo}=127.0.0.1:{echo}", f"raw.test:{echo}=127.0.0.1:{echo},tls=false",
                  f"web.test:443=127.0.0.1:{echo}")
    # An SSH session inside a 443-style tunnel: refused, told why in a line it can show.
    sock = p.tunnel(f"echo.test:{echo}")
    sock.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
    said = sock.recv(4096)
    assert POLICY.encode() in said and b"an SSH session" in said and b"tls=false" in said, said
    # Plain HTTP inside a tunnel to 443 (TLS's port): a 403 in HTTP, with the sentence.
    sock = p.tunnel("web.test:443")
    sock.sendall(b"GET / HTTP/1.1\r\nHost: web.test\r\n\r\n")
    said = sock.recv(4096)
    assert said.startswith(b"HTTP/1.1 403 Forbidden " + POLICY.encode()) and b"X-Hive-Relay-Rule" in said, said
    # The twin: plain HTTP to an HTTP port (Node 20's fetch tunnels http://) flows, as absolute URIs do.
    sock = p.tunnel(f"echo.test:{echo}")
    sock.sendall(b"GET / HTTP/1.1\r\nHost: echo.test\r\n\r\n")
    assert sock.recv(4096) == b"GET / HTTP/1.1\r\nHost: echo.test\r\n\r\n"
    sock.close()
    # The twin: the same bytes under a tls=false rule flow both ways.
    sock = p.tunnel(f"raw.test:{echo}")
    sock.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
    assert sock.recv(4096) == b"SSH-2.0-OpenSSH_9.2\r\n"
    sock.close()
    decisions = [(e["decision"], e["host"]) for e in p.entries()]
    assert decisions == [("opaque-tunnel", "echo.test"), ("opaque-tunnel", "web.test"), ("allow", "echo.test"),
                         ("allow", "raw.test")], decisions


def test_a_pinned_name_is_checked_against_the_name_and_an_ip_needs_no_sni(proxy_for, tls_upstream: dict) -> None:
    echo = tls_upstream["echo"]
    p = proxy_for(f"pinned.test:{echo}=127.0.0.1:{echo}")
    sock = p.tunnel(f"pinned.test:{echo}")
    sock.sendall(_client_hello("127.0.0.1"))  # the pin's address is not the name the rule allows
    assert sock.recv(64) == b"\x15\x03\x03\x00\x02\x02\x31"
    sock = p.tunnel(f"pinned.test:{echo}")
    hello = _client_hello("pinned.test")
    sock.sendall(hello)
    assert sock.recv(65536) == hello  # the twin: the name itself
    # An IP-literal target: clients send no SNI for an address (RFC 6066), and none is asked for.
    assert sni_problem(parse_client_hello(_client_hello(None)), "93.184.216.34") == ""
    assert sni_problem(parse_client_hello(_client_hello("evil.test")), "93.184.216.34") != ""


@pytest.mark.box
@pytest.mark.parametrize("mode", ["local", "container"])
def test_from_the_box_sni_and_opaque_are_refused_and_tls_works(request: pytest.FixtureRequest, mode: str,
                                                               tls_upstream: dict) -> None:
    s: Sandbox = request.getfixturevalue("csandbox" if mode == "container" else "box_sandbox")
    port, echo = tls_upstream["port"], tls_upstream["echo"]
    (s.workdir / "cert.pem").write_bytes(Path(tls_upstream["cert"]).read_bytes())
    (s.workdir / "probe.py").write_text(
        "import os, socket, ssl, sys\n"
        "proxy = os.environ['HTTPS_PROXY'].rsplit('/', 1)[-1].rsplit(':', 1)\n"
        "def tunnel(target):\n"
        "    s = socket.create_connection((proxy[0], int(proxy[1])), timeout=30)\n"
        "    s.sendall(f'CONNECT {target} HTTP/1.1\\r\\n\\r\\n'.encode())\n"
        "    head = b''\n"
        "    while not head.endswith(b'\\r\\n\\r\\n'):\n"
        "        head += s.recv(1)\n"
        "    return s\n"
        "def tls(target, sni):\n"
        "    ctx = ssl.create_default_context(cafile='cert.pem')\n"
        "    try:\n"
        "        with ctx.wrap_socket(tunnel(target), server_hostname=sni) as t:\n"
        "            t.sendall(b'GET /hello HTTP/1.1\\r\\nHost: fake.test\\r\\nConnection: close\\r\\n\\r\\n')\n"
        "            return t.recv(4096).split(b'\\r\\n')[0].decode()\n"
        "    except (ssl.SSLError, OSError) as err:\n"
        "        return 'refused ' + type(err).__name__\n"
        f"print('match', tls('fake.test:{port}', 'fake.test'))\n"
        f"print('front', tls('fake.test:{port}', 'evil.test'))\n"
        f"s = tunnel('echo.test:{echo}'); s.sendall(b'SSH-2.0-x\\r\\n'); print('ssh', s.recv(4096)[:80])\n"
        f"s = tunnel('raw.test:{echo}'); s.sendall(b'SSH-2.0-x\\r\\n'); print('raw', s.recv(4096))\n")
    proc = s.relay("shell", mode, "--quiet", "--prompt", f"{PY} probe.py",
                   "--allow-host", f"fake.test:{port}=127.0.0.1:{port}",
                   "--allow-host", f"echo.test:{echo}=127.0.0.1:{echo}",
                   "--allow-host", f"raw.test:{echo}=127.0.0.1:{echo},tls=false", timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-2000:]
    assert "match HTTP/1.1 200 OK" in out, out  # the twin: TLS to the CONNECT host
    assert "front refused SSLError" in out, out
    assert "ssh b'hive-relay: refused by the hive-relay egress policy" in out, out
    assert "raw b'SSH-2.0-x\\r\\n'" in out, out  # the twin: tls=false
    # The caller's terminal hears why (a TLS client in the box gets only an alert).
    assert "the TLS ClientHello names evil.test, not the CONNECT host fake.test" in proc.stderr, proc.stderr
