"""TLS inspection (issue 29.3), below the box: the plan's surface, the run CA, and the real proxy
terminating TLS for an inspected host in front of the TLS fake API, driven by Python's own TLS client.

Each attack has its twin: a Host header changed mid-connection is refused while a keep-alive sequence
works; a placeholder sent to a host no route holds stays a placeholder while the route's own host gets
the real key; a real secret pasted into a body is refused while the same body without it goes; an SNI
that is not the CONNECT name is refused while the right one works; a client that does not trust the
run CA fails (nothing falls back to a tunnel). The box tests are tests/escape/test_inspect_box.py.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relay.egress.decision_log import DecisionLog
from relay.egress.inspect import host_problem
from relay.egress.proxy import EgressProxy
from relay.egress.secret_scan import HostSecrets, secret_forms
from relay.host import run_ca
from relay.model.allow_rules import parse_rule
from relay.model.backend import CredentialRoute
from relay.model.errors import RefusedError, UsageError
from relay.policy import inspection

from . import fake_api

REPO = Path(__file__).resolve().parent.parent
REAL = "sk-ant-api03-REALKEYonTHEhostONLY0123456789abcdef"
PLACEHOLDER = "hive-relay-placeholder"


# --- the surface -------------------------------------------------------------------------------------

def test_inspect_targets_parse_and_refuse_what_no_leaf_can_name() -> None:
    assert inspection.parse_target("API.Example.com") == ("api.example.com", 443)
    assert inspection.parse_target("api.example.com:8443") == ("api.example.com", 8443)
    for bad in ("*.example.com", "1.2.3.4", "[::1]:443", "api.example.com=1.2.3.4:443", "https://api.example.com/",
                "api.example.com,tls=false", "", "a b", "api.example.com:0"):
        with pytest.raises(UsageError) as err:
            inspection.parse_target(bad)
        assert "\n" not in str(err.value) and "--inspect" in str(err.value)
    rules = (parse_rule("api.example.com"), parse_rule("ssh.example.com:22,tls=false"), parse_rule("b.example.com,inspect=true"))
    assert inspection.inspected_targets(["api.example.com"], rules, (), True, "local") == (
        ("api.example.com", 443), ("b.example.com", 443))
    with pytest.raises(UsageError, match="not allowed in this run"):
        inspection.inspected_targets(["other.example.com"], rules, (), True, "local")
    with pytest.raises(UsageError, match="tls=false"):
        inspection.inspected_targets(["ssh.example.com:22"], rules, (), True, "local")
    with pytest.raises(RefusedError, match="kube"):
        inspection.inspected_targets(["api.example.com"], rules, (), True, "kube")
    with pytest.raises(RefusedError, match="no network"):
        inspection.inspected_targets(["api.example.com"], rules, (), False, "local")
    route = CredentialRoute("gh", ("GH_TOKEN",), "github.com", 443, "authorization-bearer", inspect=True)
    assert inspection.route_rules((route,), rules) == (parse_rule("github.com:443,inspect=true"),)
    assert inspection.inspected_targets([], rules + inspection.route_rules((route,), rules), (route,), True, "local")[-1] == ("github.com", 443)


def test_inspect_rule_option_round_trips_and_is_refused_where_it_cannot_mean_anything() -> None:
    rule = parse_rule("api.example.com:443=127.0.0.1:9,inspect=true,method=GET")
    assert rule.inspect and parse_rule(rule.render()) == rule and "inspected" in rule.tunnel()
    for bad in ("*.example.com,inspect=true", "1.2.3.4,inspect=true", "api.example.com,inspect=true,tls=false",
                "api.example.com,inspect=maybe"):
        with pytest.raises(UsageError):
            parse_rule(bad)
    from relay.egress import control

    with pytest.raises(UsageError, match="chosen at launch"):
        control.apply((), "allow", "api.example.com,inspect=true")


def _relay(*args: str, home: Path, config: str = "{}\n", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "CI": "true", "LANG": "C.UTF-8",
           **(env or {})}
    (home / ".config" / "hive-relay").mkdir(parents=True, exist_ok=True)
    (home / ".config" / "hive-relay" / "config.yaml").write_text(config)
    (home / "work").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "relay", *args], cwd=home / "work", env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_plan_and_the_banner_say_which_hosts_are_inspected(tmp_path: Path) -> None:
    proc = _relay("shell", "--dry-run", "--json", "--allow-host", "api.example.com", "--inspect", "api.example.com",
                  home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["inspected_hosts"] == ["api.example.com:443"]
    assert all(plan["env_set"][v] == inspection.BOX_CA_BUNDLE for v in inspection.TRUST_VARIABLES)
    bundle = [m for m in plan["mounts"] if m["dst"] == inspection.BOX_CA_BUNDLE]
    assert len(bundle) == 1 and bundle[0]["kind"] == "ro-bind" and bundle[0]["src"].endswith("/ca-bundle.pem")
    text = _relay("shell", "--dry-run", "--allow-host", "api.example.com", "--inspect", "api.example.com", home=tmp_path)
    assert "inspect  api.example.com:443: TLS terminated on the host" in text.stdout
    plain = json.loads(_relay("shell", "--dry-run", "--json", home=tmp_path).stdout)
    assert plain["inspected_hosts"] == [] and "SSL_CERT_FILE" not in plain["env_set"]


GRANT = """auth:
  gh:
    host: github.com
    secret: {env: [GH_TOKEN]}
    send: authorization-bearer
    inspect: INSPECT
"""


def test_inspect_true_on_a_grant_inspects_its_host_and_lets_the_box_reach_it(tmp_path: Path) -> None:
    proc = _relay("shell", "--dry-run", "--json", home=tmp_path, config=GRANT.replace("INSPECT", "true"),
                  env={"GH_TOKEN": "ghp_" + "x" * 36})
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["inspected_hosts"] == ["github.com:443"]
    assert [c.get("inspect") for c in plan["credentials"] if c["route"] == "gh"] == [True]
    assert any(r["host"] == "github.com:443" and "inspected" in r["tunnel"] for r in plan["egress_rules"])
    twin = json.loads(_relay("shell", "--dry-run", "--json", home=tmp_path, config=GRANT.replace("INSPECT", "false"),
                             env={"GH_TOKEN": "ghp_" + "x" * 36}).stdout)
    assert twin["inspected_hosts"] == [] and not any(r["host"] == "github.com:443" for r in twin["egress_rules"])
    bad = _relay("shell", "--dry-run", home=tmp_path, config=GRANT.replace("INSPECT", "maybe"))
    assert bad.returncode == 2 and "auth.gh.inspect" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_bad_inspect_input_is_one_line_and_exit_2_and_an_unkeepable_one_exit_3(tmp_path: Path) -> None:
    for args in (["--inspect", "*.example.com"], ["--inspect", "nothere.example.com"],
                 ["--allow-host", "*.example.com,inspect=true"]):
        proc = _relay("shell", "--dry-run", *args, home=tmp_path)
        assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
    proc = _relay("shell", "kube", "--dry-run", "--allow-host", "api.example.com", "--inspect", "api.example.com",
                  home=tmp_path)
    assert proc.returncode == 3 and "kube" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_host_header_must_name_the_connection() -> None:
    assert host_problem(["api.example.com"], "api.example.com", 443) == ""
    assert host_problem(["API.example.com:443"], "api.example.com", 443) == ""
    assert host_problem(["api.example.com:8443"], "api.example.com", 8443) == ""
    for bad in ([], ["a", "b"], ["evil.example.com"], ["api.example.com:80"], ["api.example.com:x"],
                ["[::1]:443"], ["api.example.com.evil.com"]):
        assert host_problem(bad, "api.example.com", 443), bad
    assert host_problem(["api.example.com"], "api.example.com", 8443)  # the port is the connection's too


# --- the run CA --------------------------------------------------------------------------------------

def test_run_ca_leaves_verify_only_for_their_names_and_its_key_is_gone(tmp_path: Path) -> None:
    leaves = run_ca.make(str(tmp_path), ["api.example.com", "b.example.com"], "bundle.pem", "RUN")
    assert not (tmp_path / "inspect" / "ca.key").exists()  # the CA signs nothing after the leaves
    assert oct((tmp_path / "inspect").stat().st_mode & 0o777) == "0o700"
    assert all(oct(os.stat(leaf.key).st_mode & 0o777) == "0o600" for leaf in leaves)
    bundle = (tmp_path / "bundle.pem").read_bytes()
    assert b"PRIVATE KEY" not in bundle and bundle.count(b"BEGIN CERTIFICATE") > 1  # system roots + the run CA
    text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", str(tmp_path / "inspect" / "ca.pem")],
                          capture_output=True, text=True, check=True).stdout
    assert "Name Constraints: critical" in text and "DNS:api.example.com" in text and "DNS:b.example.com" in text
    ok = subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "inspect" / "ca.pem"), "-verify_hostname",
                         "api.example.com", leaves[0].cert], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    wrong = subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "inspect" / "ca.pem"), "-verify_hostname",
                            "api.example.com", leaves[1].cert], capture_output=True, text=True)
    assert wrong.returncode != 0


# --- the real proxy in front of the TLS fake API -----------------------------------------------------

class Inspecting:
    """A real EgressProxy (listening on the host's loopback) that inspects api.openai.com and
    api.anthropic.com (a route holds the latter), both pinned to the TLS fake API, and tunnels
    chatgpt.com as it is."""

    def __init__(self, tmp_path: Path, ca: tuple[Path, ssl.SSLContext], api: fake_api.Server) -> None:
        port = api.server_address[1]
        hosts = ["api.openai.com", "api.anthropic.com"]
        self.leaves = run_ca.make(str(tmp_path), hosts, "bundle.pem")
        self.bundle = tmp_path / "bundle.pem"
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.log = tmp_path / "egress.jsonl"
        route = CredentialRoute("anthropic", ("ANTHROPIC_API_KEY",), "api.anthropic.com", 443, "x-api-key")
        rules = tuple(parse_rule(f"{h}:443=127.0.0.1:{port}") for h in (*hosts, "chatgpt.com"))
        self.proxy = EgressProxy(self.listener, rules, DecisionLog(str(self.log), "t"), notify=None, routes=(route,),
                                 keys={"anthropic": REAL}, tls=ssl.create_default_context(cafile=str(ca[0])),
                                 secrets=HostSecrets([secret_forms("the anthropic route's key", REAL)]),
                                 inspect={(h, 443): (leaf.cert, leaf.key) for h, leaf in zip(hosts, self.leaves, strict=True)})
        self.proxy.start()

    def tunnel(self, host: str, sni: str | None = None, cafile: Path | None = None,
               alpn: list[str] | None = None) -> ssl.SSLSocket:
        sock = socket.create_connection(self.listener.getsockname(), timeout=20)
        sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 200"), head
        ctx = ssl.create_default_context(cafile=str(cafile or self.bundle))
        if alpn:
            ctx.set_alpn_protocols(alpn)
        return ctx.wrap_socket(sock, server_hostname=sni or host)

    def settled(self, decision: str, count: int = 1) -> list[dict]:
        """The log once `count` lines with `decision` are in it (the proxy writes after the client hears)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lines = self.lines()
            if sum(ln["decision"] == decision for ln in lines) >= count:
                return lines
            time.sleep(0.05)
        return self.lines()

    def lines(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def stop(self) -> None:
        self.proxy.stop()


@pytest.fixture
def inspecting(tmp_path: Path, ca, tls_api):  # noqa: ANN001, ANN201
    proxy = Inspecting(tmp_path, ca, tls_api)
    yield proxy
    proxy.stop()


def read_answer(sock: ssl.SSLSocket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer (Content-Length, chunked or to the close), read exactly."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            raise EOFError(buf)
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    status = int(lines[0].split(" ")[1])
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            rest += sock.recv(65536)
        return status, headers, rest[:n]
    if headers.get("transfer-encoding") == "chunked":
        out = b""
        while True:
            while b"\r\n" not in rest:
                rest += sock.recv(65536)
            size, _, rest = rest.partition(b"\r\n")
            size_n = int(size, 16)
            while len(rest) < size_n + 2:
                rest += sock.recv(65536)
            out, rest = out + rest[:size_n], rest[size_n + 2:]
            if size_n == 0:
                return status, headers, out
    while data := sock.recv(65536):
        rest += data
    return status, headers, rest


def request(sock: ssl.SSLSocket, method: str, path: str, host: str, headers: dict[str, str] | None = None,
            body: bytes = b"", chunked: bool = False) -> None:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
        payload = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7)) + b"0\r\n\r\n"
    else:
        lines.append(f"Content-Length: {len(body)}") if body or method == "POST" else None
        payload = body
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)


def test_keep_alive_works_and_a_host_changed_mid_connection_is_refused(inspecting: Inspecting, tls_api) -> None:  # noqa: ANN001
    with inspecting.tunnel("api.openai.com") as tls:
        assert tls.selected_alpn_protocol() in (None, "http/1.1")
        for i in range(3):  # twin: one connection, several requests, each answered in full
            request(tls, "GET", f"/v1/models?n={i}", "api.openai.com")
            status, _, body = read_answer(tls)
            assert status == 200 and json.loads(body) == {"data": [], "models": []}
        request(tls, "POST", "/v1/chunked", "api.openai.com", body=b'{"hello": "chunked body in 7-byte chunks"}',
                chunked=True)
        assert read_answer(tls)[0] == 200
        request(tls, "GET", "/v1/fronted", "chatgpt.com")  # the attack: another origin on the same connection
        status, headers, body = read_answer(tls)
        assert status == 421 and b"Host header names 'chatgpt.com'" in body
        assert tls.recv(1) == b""  # and the connection is closed
    paths = [r["path"] for r in tls_api.requests]
    assert paths == ["/v1/models?n=0", "/v1/models?n=1", "/v1/models?n=2", "/v1/chunked"]
    assert tls_api.requests[-1]["body"] == '{"hello": "chunked body in 7-byte chunks"}'
    assert all(h["host"] == "api.openai.com" for h in tls_api.headers_seen)
    log = inspecting.settled("allow", 5)
    assert [ln["decision"] for ln in log].count("allow") == 5  # the CONNECT and four requests
    assert log[-1]["decision"] == "host-mismatch" and log[-1]["inspected"] is True


def test_sse_streams_through_an_inspected_connection(inspecting: Inspecting) -> None:
    with inspecting.tunnel("api.openai.com") as tls:
        request(tls, "POST", "/v1/messages", "api.openai.com", body=b'{"stream": true, "model": "m"}')
        status, headers, body = read_answer(tls)
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert b"event: message_start" in body and fake_api.ANSWER.encode() in body and b"message_stop" in body


def test_the_key_is_added_on_the_routes_own_host_only(inspecting: Inspecting, tls_api) -> None:  # noqa: ANN001
    with inspecting.tunnel("api.anthropic.com") as tls:  # the route's host: the placeholder is swapped
        request(tls, "GET", "/v1/models", "api.anthropic.com", {"x-api-key": PLACEHOLDER})
        assert read_answer(tls)[0] == 200
    with inspecting.tunnel("api.openai.com") as tls:  # the attack: the placeholder sent elsewhere stays one
        request(tls, "GET", "/v1/models", "api.openai.com", {"x-api-key": PLACEHOLDER, "authorization": f"Bearer {PLACEHOLDER}"})
        assert read_answer(tls)[0] == 200
    anthropic, openai = tls_api.headers_seen
    assert anthropic["x-api-key"] == REAL and anthropic["host"] == "api.anthropic.com"
    assert openai["x-api-key"] == PLACEHOLDER and openai["authorization"] == f"Bearer {PLACEHOLDER}"
    assert REAL not in inspecting.log.read_text()
    assert [ln.get("route") for ln in inspecting.settled("allow", 4) if ln["method"] == "GET"] == ["anthropic", None]


def test_a_real_secret_pasted_into_an_inspected_body_is_refused(inspecting: Inspecting, tls_api) -> None:  # noqa: ANN001
    with inspecting.tunnel("api.openai.com") as tls:  # twin first: the same body without the key goes
        request(tls, "POST", "/v1/upload", "api.openai.com", body=b'{"file": "harmless"}', chunked=True)
        assert read_answer(tls)[0] == 200
        request(tls, "POST", "/v1/upload", "api.openai.com", body=('{"file": "' + REAL + '"}').encode(), chunked=True)
        status, _, body = read_answer(tls)
    assert status == 403 and b"secret of the host" in body and REAL.encode() not in body
    assert all(REAL not in r["body"] for r in tls_api.requests) and len(tls_api.requests) == 1
    assert inspecting.settled("secret")[-1]["decision"] == "secret" and REAL not in inspecting.log.read_text()


def test_an_sni_that_is_not_the_connect_name_is_refused(inspecting: Inspecting) -> None:
    with pytest.raises(ssl.SSLError):  # the attack: CONNECT api.openai.com, TLS for another name
        inspecting.tunnel("api.openai.com", sni="api.anthropic.com")
    with inspecting.tunnel("api.openai.com", sni="api.openai.com") as tls:  # the twin
        request(tls, "GET", "/v1/models", "api.openai.com")
        assert read_answer(tls)[0] == 200
    decisions = [ln["decision"] for ln in inspecting.settled("sni-mismatch")]
    assert decisions[0] == "sni-mismatch"


def test_a_client_that_does_not_trust_the_run_ca_fails_with_no_fallback(inspecting: Inspecting, ca, tls_api) -> None:  # noqa: ANN001
    with pytest.raises(ssl.SSLCertVerificationError):  # the upstream's own CA is not what the box is shown
        inspecting.tunnel("api.openai.com", cafile=ca[0])
    assert tls_api.requests == []
    assert inspecting.settled("inspect-handshake")[-1]["decision"] == "inspect-handshake"


def test_h2_only_and_websocket_upgrades_are_refused_clearly(inspecting: Inspecting, tls_api) -> None:  # noqa: ANN001
    with inspecting.tunnel("api.openai.com", alpn=["h2"]) as tls:
        assert tls.selected_alpn_protocol() is None  # only http/1.1 is offered: no h2 agreed
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        assert tls.recv(1) == b""
    with inspecting.tunnel("api.openai.com", alpn=["h2", "http/1.1"]) as tls:  # a client that offers both: 1.1
        assert tls.selected_alpn_protocol() == "http/1.1"
        request(tls, "GET", "/ws", "api.openai.com", {"Upgrade": "websocket", "Connection": "Upgrade",
                                                      "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
                                                      "Sec-WebSocket-Version": "13"})
        status, _, body = read_answer(tls)
    assert status == 501 and b"websocket" in body
    assert tls_api.requests == []
    assert [ln["decision"] for ln in inspecting.settled("inspect-upgrade") if ln["method"] != "CONNECT"] == [
        "inspect-h2", "inspect-upgrade"]


def test_an_uninspected_host_is_still_a_plain_tunnel_with_its_sni_checked(inspecting: Inspecting, ca, tls_api) -> None:  # noqa: ANN001
    with inspecting.tunnel("chatgpt.com", cafile=ca[0]) as tls:  # the upstream's own certificate, end to end
        assert "hive relay run CA" not in str(tls.getpeercert()["issuer"])
        request(tls, "GET", "/backend-api/x", "chatgpt.com")
        assert read_answer(tls)[0] == 200
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        inspecting.tunnel("chatgpt.com", sni="api.openai.com", cafile=ca[0])
    assert inspecting.settled("sni-mismatch")[-1]["decision"] == "sni-mismatch"
    assert not any(ln.get("inspected") for ln in inspecting.lines())


def test_nothing_after_an_answers_last_chunk_reaches_the_client(tmp_path: Path, ca) -> None:  # noqa: ANN001
    """An upstream that appends a forged second answer after its chunked one: the client gets the answer it
    asked for, and the connection ends there (the forged bytes never reach it as an answer to a next request)."""
    from .servers import start_tcp

    def forge(conn: socket.socket, _n: int) -> None:
        with ca[1].wrap_socket(conn, server_side=True) as tls:
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += tls.recv(4096)
            tls.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
                        b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged")

    sock, port = start_tcp(forge)

    class _Api:
        server_address = ("127.0.0.1", port)

    proxy = Inspecting(tmp_path, ca, _Api())  # type: ignore[arg-type]
    try:
        with proxy.tunnel("api.openai.com") as tls:
            request(tls, "GET", "/v1/x", "api.openai.com")
            raw = b""
            while data := tls.recv(65536):  # everything the client is sent, to the close
                raw += data
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n") and raw.endswith(b"5\r\nhello\r\n0\r\n\r\n"), raw  # the twin
        assert b"forged" not in raw  # the attack
    finally:
        proxy.stop()
        sock.close()
