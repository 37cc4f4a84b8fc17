"""TLS inspection (issue 29.3) with a real bwrap box: curl, Python and node inside trust the run CA
through the variables the plan sets, the host-side proxy terminates their TLS for the inspected host
in front of the TLS fake API (its own throwaway CA, trusted by the launcher via SSL_CERT_FILE).

Attack and twin in each test: a Host changed mid-connection is refused while a keep-alive sequence
works; the route's placeholder becomes the key on the route's own host only; a real secret pasted
into a body is refused while the body without it goes; the run CA's key is nowhere the box can read
while its certificate is; an uninspected host is still a tunnel (its SNI checked, its certificate the
upstream's own); a client that does not trust the run CA fails, with no fallback.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .. import fake_api
from ..conftest import Sandbox, require_box
from ..fixtures import API_NAMES  # noqa: F401 - the names the shared CA serves (chatgpt.com among them)
from ..test_gvisor import runsc_ok  # noqa: F401 - the fixture: a working runsc, or a loud skip (a failure under CI)

REAL = "sk-ant-api03-REALkeyONtheHOSTonly0123456789abcdefXYZ"
PLACEHOLDER = "hive-relay-placeholder"

# An HTTP/1.1 client on one inspected connection: a normal keep-alive sequence, then another origin's
# Host on the same connection; then an SNI that is not the CONNECT name on an uninspected host.
CLIENT = r'''
import os, socket, ssl, sys
proxy = os.environ["HTTPS_PROXY"].rsplit("/", 1)[-1].rstrip("/")
phost, pport = proxy.rsplit(":", 1)

def tunnel(host, sni=None, cafile=None):
    s = socket.create_connection((phost, int(pport)), timeout=20)
    s.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    ctx = ssl.create_default_context(cafile=cafile)  # cafile None: SSL_CERT_FILE, the run's bundle
    return ctx.wrap_socket(s, server_hostname=sni or host)

def answer(t):
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = t.recv(65536)
        if not d:
            return "closed", b""
        buf += d
    head, _, rest = buf.partition(b"\r\n\r\n")
    n = int([l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0])
    while len(rest) < n:
        rest += t.recv(65536)
    return head.split(b" ")[1].decode(), rest[:n]

t = tunnel("api.openai.com")
for i in range(3):
    t.sendall(f"GET /v1/keep/{i} HTTP/1.1\r\nHost: api.openai.com\r\n\r\n".encode())
    print("keep", i, answer(t)[0])
t.sendall(b"GET /v1/fronted HTTP/1.1\r\nHost: chatgpt.com\r\n\r\n")
print("fronted", answer(t)[0], "then", answer(t)[0])
try:
    tunnel("chatgpt.com", sni="api.openai.com", cafile=sys.argv[1])
    print("sni-mismatch passed")
except (ssl.SSLError, OSError) as e:
    print("sni-mismatch refused", type(e).__name__)
'''

NODE = r'''
fetch("https://api.openai.com/v1/node").then(r => r.text()).then(t => console.log("node " + t.length + " " + t.slice(0, 8)))
  .catch(e => console.log("node failed " + e));
'''


MODES = [pytest.param("local", marks=pytest.mark.box), pytest.param("gvisor", marks=pytest.mark.box),
         pytest.param("container", marks=pytest.mark.container)]


@pytest.fixture
def mode_box(request: pytest.FixtureRequest) -> tuple[Sandbox, str]:
    mode = request.node.callspec.params["mode"]
    if mode == "container":
        return request.getfixturevalue("csandbox"), mode
    require_box()
    if mode == "gvisor":
        request.getfixturevalue("runsc_ok")
    return request.getfixturevalue("sandbox"), mode


def _where(mode: str) -> list[str]:
    """The launch words of a mode: gvisor is local mode's --isolation gvisor."""
    return ["local", "--isolation", "gvisor"] if mode == "gvisor" else [mode]


def _setup(s: Sandbox, ca: Path) -> None:
    (s.workdir / "client.py").write_text(CLIENT)
    (s.workdir / "fetch.mjs").write_text(NODE)
    (s.workdir / "upstream-ca.pem").write_bytes(ca.read_bytes())  # the fake API's own CA, for the tunnel twin
    for name in ("client.py", "fetch.mjs", "upstream-ca.pem"):
        (s.workdir / name).chmod(0o644)


def _log(s: Sandbox) -> list[dict]:
    logs = sorted((s.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    return [json.loads(line) for p in logs for line in p.read_text().splitlines()]


def _pins(port: int, *names: str) -> list[str]:
    return [a for n in names for a in ("--allow-host", f"{n}:443=127.0.0.1:{port}")]


@pytest.mark.parametrize("mode", MODES)
def test_curl_python_and_node_through_an_inspected_host(mode_box, ca, tls_api, mode: str) -> None:  # noqa: ANN001
    s, _ = mode_box
    _setup(s, ca[0])
    port = tls_api.server_address[1]
    script = ("curl -sS -o /dev/null -w 'curl %{http_code} connects=%{num_connects}\\n' https://api.openai.com/v1/a "
              "-o /dev/null https://api.openai.com/v1/b; "
              "curl -sS -N -X POST -d '{\"stream\": true}' https://api.openai.com/v1/messages | grep -c '^event: ' | "
              "sed 's/^/sse-events /'; "
              "python3 client.py upstream-ca.pem; node fetch.mjs 2>&1 | tail -c 600; "
              "curl -sS -o /dev/null -w 'tunnel %{http_code}\\n' --cacert upstream-ca.pem https://chatgpt.com/x; "
              "curl -sS -o /dev/null https://chatgpt.com/y 2>/dev/null; echo \"tunnel-with-run-ca rc=$?\"; "
              "curl -sS -o /dev/null --cacert /etc/ssl/certs/ca-certificates.crt https://api.openai.com/z 2>/dev/null; "
              "echo \"untrusting rc=$?\"; "
              # One more request: the box's exit waits for it, not for the refused handshake's log line.
              "curl -sS -o /dev/null -w 'last %{http_code}\\n' https://api.openai.com/v1/last")
    proc = s.relay("shell", *_where(mode), "--prompt", script, *_pins(port, "api.openai.com", "chatgpt.com"),
                   "--inspect", "api.openai.com", extra_env={"SSL_CERT_FILE": str(ca[0])}, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, (out, proc.stderr[-3000:])
    assert ("shell · local · gvisor" if mode == "gvisor" else f"shell · {mode}") in proc.stderr
    assert "TLS inspected (this run's CA, trusted in the box): api.openai.com:443" in proc.stderr  # never silent
    # curl: two requests on one connection, SSE event by event.
    assert "curl 200 connects=1" in out and "curl 200 connects=0" in out, out
    assert re.search(r"sse-events ([6-9]|\d\d)", out), out
    # Python: the keep-alive sequence works; the attack (another origin's Host mid-connection) is refused and closed.
    assert "keep 0 200" in out and "keep 1 200" in out and "keep 2 200" in out, out
    assert "fronted 421 then closed" in out, out
    assert "sni-mismatch refused" in out, out
    # node's fetch (through the box's preload) trusts the run CA too, in every tier: undici's Wasm reserves
    # ~10 GiB of address space, so the gvisor tier's memory rlimit is RLIMIT_DATA (under RLIMIT_AS, run
    # unprivileged, node said "Cannot allocate Wasm memory").
    assert "node 26 {\"data\"" in out, out
    # The uninspected host is a tunnel: the upstream's own certificate, which the run's bundle does not hold.
    assert "tunnel 200" in out and "tunnel-with-run-ca rc=60" in out, out
    # A client that does not trust the run CA fails, and nothing falls back to a tunnel.
    assert "untrusting rc=60" in out and "last 200" in out, out
    paths = [r["path"] for r in tls_api.requests]
    assert "/v1/fronted" not in paths and "/v1/z" not in paths
    assert {"/v1/a", "/v1/b", "/v1/messages", "/v1/keep/0", "/v1/keep/2", "/x", "/v1/node"} <= \
        set(paths), paths
    log = _log(s)
    decisions = {ln["decision"] for ln in log}
    assert {"host-mismatch", "sni-mismatch", "inspect-handshake"} <= decisions, decisions
    assert not any(ln.get("inspected") for ln in log if ln["host"] == "chatgpt.com")


@pytest.mark.parametrize("mode", MODES)
def test_the_route_key_is_added_on_its_own_host_and_a_pasted_secret_is_refused(mode_box, ca, tls_api, mode: str) -> None:  # noqa: ANN001
    s, _ = mode_box
    port = tls_api.server_address[1]
    script = (  # the route's placeholder, as the box holds it, to the route's host and to another inspected host
        'curl -sS -o /dev/null -w "pinned %{http_code}\\n" -H "x-api-key: $ANTHROPIC_API_KEY" '
        "https://api.anthropic.com/v1/models; "
        'curl -sS -o /dev/null -w "elsewhere %{http_code}\\n" -H "x-api-key: $ANTHROPIC_API_KEY" '
        "https://api.openai.com/v1/models; "
        "curl -sS -o /dev/null -w 'body %{http_code}\\n' -H 'content-type: application/json' "
        "-d '{\"note\": \"nothing secret\"}' https://api.openai.com/v1/upload; "
        f"curl -sS -o /dev/null -w 'pasted %{{http_code}}\\n' -d '{{\"note\": \"{REAL}\"}}' "
        "https://api.openai.com/v1/upload")
    proc = s.relay("claude", *_where(mode), "--quiet", "--prompt", script, *_pins(port, "api.anthropic.com", "api.openai.com"),
                   "--inspect", "api.anthropic.com", "--inspect", "api.openai.com",
                   extra_env={"SSL_CERT_FILE": str(ca[0]), "ANTHROPIC_API_KEY": REAL}, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, (out, proc.stderr[-3000:])
    assert "pinned 200" in out and "elsewhere 200" in out and "body 200" in out and "pasted 403" in out, out
    seen = {(h["host"], r["path"]): h.get("x-api-key") for h, r in zip(tls_api.headers_seen, tls_api.requests, strict=True)}
    assert seen[("api.anthropic.com", "/v1/models")] == REAL  # swapped on the pinned host only
    assert seen[("api.openai.com", "/v1/models")] == PLACEHOLDER  # the attack: it stays a placeholder
    assert [r["body"] for r in tls_api.requests if r["path"] == "/v1/upload"] == ['{"note": "nothing secret"}']
    assert REAL not in out and REAL not in proc.stderr
    log = _log(s)
    assert any(ln["decision"] == "secret" and ln.get("inspected") for ln in log)
    assert not any(REAL in json.dumps(ln) for ln in log)


@pytest.mark.parametrize("mode", MODES)
def test_the_run_ca_key_is_unreachable_from_the_box(mode_box, ca, tls_api, mode: str) -> None:  # noqa: ANN001
    s, _ = mode_box
    port = tls_api.server_address[1]
    base = s.env["XDG_RUNTIME_DIR"]
    script = (  # every path a box could try: the host's run dirs, its own mounts, every readable file near them
        f"for d in {base}/hive-relay-* /tmp/hive-relay-* /run/hive-relay; do ls -la \"$d\" \"$d/inspect\" 2>&1; "
        "cat \"$d/inspect/ca.key\" \"$d\"/inspect/leaf-*.key 2>&1; done; "
        f"grep -rl 'PRIVATE KEY-----' \"$HOME\" /tmp /run /var/tmp /dev/shm /etc/ssl {base} 2>/dev/null "
        "| sed 's/^/keyfile /'; "
        "grep -c 'BEGIN CERTIFICATE' /run/hive-relay/ca-bundle.pem | sed 's/^/bundle-certs /'; "
        "grep -c 'PRIVATE KEY' /run/hive-relay/ca-bundle.pem | sed 's/^/bundle-keys /'; "
        "cat /proc/1/environ 2>&1 | head -c 0; ls /proc | grep -c '^[0-9]' | sed 's/^/pids /'; "
        "echo test > /run/hive-relay/ca-bundle.pem 2>/dev/null && echo bundle-written || echo bundle-read-only; "
        "curl -sS -o /dev/null -w 'legit %{http_code}\\n' https://api.openai.com/v1/x")
    proc = s.relay("shell", *_where(mode), "--quiet", "--prompt", script, *_pins(port, "api.openai.com"),
                   "--inspect", "api.openai.com", extra_env={"SSL_CERT_FILE": str(ca[0])}, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, (out, proc.stderr[-3000:])
    assert "BEGIN" not in out and "PRIVATE KEY" not in out.replace("keyfile", ""), out  # no key's bytes printed
    home_keys = [ln for ln in out.splitlines() if ln.startswith("keyfile ")]
    assert not [k for k in home_keys if "hive-relay" in k or "inspect" in k or k.endswith(".key")], home_keys
    assert re.search(r"bundle-certs ([2-9]|\d\d+)", out) and "bundle-keys 0" in out, out  # the twin: the cert is there
    assert "bundle-read-only" in out and "legit 200" in out, out
    # On the host, this run's dir (leaf keys and all) is gone with the run (its id names the run's log).
    logs = list((s.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    run = logs[0].stem.split("-shell-", 1)[1]
    assert len(logs) == 1 and not (Path(base) / f"hive-relay-{run}").exists(), (logs, run)
    assert fake_api.ANSWER  # the shared fake API served the twin's request
