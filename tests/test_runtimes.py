"""Real clients in the box reach an allowed local host through the proxy, and a denied one gets a clear error.

One local server plays every ecosystem's registry (a static dir): a file, an npm package document, a PyPI
simple index, and a bare git repo served over git's dumb HTTP protocol. The box reaches it only as
`reg.test:PORT`, pinned with --allow-host; `denied.test:PORT` is the same server under a name the
policy does not list. Node's fetch goes through the proxy on Node 20 too (relay/box/nodeproxy.py), Java through
JAVA_TOOL_OPTIONS, npm through npm_config_proxy, pip, git, curl and Python through the proxy variables.
"""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import subprocess
import threading
import zipfile
from pathlib import Path

import pytest

from .conftest import Sandbox, require_tool
from .servers import Server

pytestmark = pytest.mark.box
HELLO = "hello-from-the-local-registry"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("registry")
    server = Server(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    port = server.server_address[1]
    (root / "hello.txt").write_text(HELLO + "\n")
    (root / "hive-test-pkg").write_text(json.dumps({
        "name": "hive-test-pkg", "dist-tags": {"latest": "1.0.0"},
        "versions": {"1.0.0": {"name": "hive-test-pkg", "version": "1.0.0", "dist": {
            "tarball": f"http://reg.test:{port}/hive-test-pkg/-/hive-test-pkg-1.0.0.tgz",
            "shasum": "0" * 40}}}}))
    simple = root / "simple" / "hive-test-pkg"
    simple.mkdir(parents=True)
    wheel = "hive_test_pkg-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(simple / wheel, "w") as whl:
        info = "hive_test_pkg-1.0.0.dist-info"
        whl.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: hive-test-pkg\nVersion: 1.0.0\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    (simple / "index.html").write_text(f'<!DOCTYPE html><html><body><a href="{wheel}">{wheel}</a></body></html>\n')
    work = root / "src"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q", str(work)], check=True)
    (work / "f").write_text("x\n")
    subprocess.run([*git, "-C", str(work), "add", "f"], check=True)
    subprocess.run([*git, "-C", str(work), "commit", "-qm", "one"], check=True)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(root / "repo.git")], check=True)
    subprocess.run(["git", "-C", str(root / "repo.git"), "update-server-info"], check=True)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield port
    server.shutdown()


FETCH_JAVA = """
import java.io.*; import java.net.*;
public class Fetch { public static void main(String[] a) throws Exception {
  HttpURLConnection c = (HttpURLConnection) new URL(a[0]).openConnection();
  int code = c.getResponseCode();
  InputStream in = code < 400 ? c.getInputStream() : c.getErrorStream();
  System.out.println("status=" + code + " " + new String(in.readAllBytes()).trim()); } }
"""

# client: (tool, command for URL base, what the allowed run prints, what the denied run prints)
CLIENTS = {
    "curl": ("curl", "curl -sS {base}/hello.txt 2>&1", HELLO, "policy, not an outage"),
    "python-urllib": ("python3", "python3 -c \"import urllib.request as u, urllib.error as e\n"
                      "try: print(u.urlopen('{base}/hello.txt').read().decode())\n"
                      "except e.HTTPError as x: print(x.code, x.read().decode())\"",
                      HELLO, "403 hive-relay: forbidden denied.test"),
    "node-fetch": ("node", "node -e \"fetch('{base}/hello.txt').then(r => r.text()).then(t => console.log(t.trim()),"
                   " e => console.log('ERR', e.cause && e.cause.message))\"",
                   HELLO, "egress policy, not an outage"),
    "node-fetch-https": ("node", "node -e \"fetch('{sbase}/hello.txt').then(r => r.text()).then(t => console.log(t),"
                         " e => console.log('ERR', e.cause && e.cause.message))\"",
                         "ERR", "the proxy refused denied.test:443: HTTP/1.1 403 Forbidden"),
    "git": ("git", "git ls-remote {base}/repo.git 2>&1", "refs/heads/main", "returned error: 403"),
    "npm": ("npm", "npm view hive-test-pkg version --registry {base}/ --fetch-retries 0 2>&1", "1.0.0", "403 Forbidden"),
    "pip": ("pip", "python3 -m pip download hive-test-pkg --no-deps -d /tmp/dl --index-url {base}/simple/ "
            "--trusted-host {host} --retries 0 --timeout 10 --disable-pip-version-check -vv 2>&1",
            "Saved /tmp/dl/hive_test_pkg-1.0.0-py3-none-any.whl",
            "403 Client Error: Forbidden"),  # pip names the status only with -vv
    "java": ("java", "java /tmp/Fetch.java {base}/hello.txt 2>&1", f"status=200 {HELLO}",
             "status=403 hive-relay: forbidden denied.test"),
}
# What the project's image holds (Dockerfile.contributor): no pip, no Java.
IMAGE_HAS = {"curl", "python3", "node", "git", "npm"}
CASES = [pytest.param(name, mode, id=f"{name}-{mode}") for name in CLIENTS for mode in ("local", "container")
         if mode == "local" or CLIENTS[name][0] in IMAGE_HAS]


def _need(tool: str) -> None:
    if tool == "pip":
        require_tool("python3")
        if subprocess.run(["/usr/bin/python3", "-m", "pip", "--version"], capture_output=True).returncode != 0:
            pytest.fail("/usr/bin/python3 has no pip: .ci/run installs python3-pip")
    else:
        require_tool(tool)


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_client_reaches_the_allowed_host_and_gets_a_clear_denial(request: pytest.FixtureRequest, registry: int,
                                                                 name: str, mode: str) -> None:
    tool, command, allowed_out, denied_out = CLIENTS[name]
    _need(tool)
    s: Sandbox = request.getfixturevalue("csandbox" if mode == "container" else "box_sandbox")
    port = registry
    (s.workdir / "Fetch.java").write_text(FETCH_JAVA)
    runs = {}
    for which in ("reg", "denied"):
        host = f"{which}.test:{port}"
        cmd = command.format(base=f"http://{host}", sbase=f"https://{which}.test", host=host)
        script = ("cp Fetch.java /tmp/Fetch.java; " if name == "java" else "") + cmd
        runs[which] = s.relay("shell", mode, "--quiet", "--prompt", script, "--allow-host",
                              f"reg.test:{port}=127.0.0.1:{port}", timeout=240)
    allowed, denied = runs["reg"], runs["denied"]
    assert allowed_out in allowed.stdout, allowed.stdout[-2000:] + allowed.stderr[-2000:]
    assert denied_out in denied.stdout, denied.stdout[-2000:] + denied.stderr[-2000:]
    assert HELLO not in denied.stdout
    logs = sorted((s.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    entries = [json.loads(line) for path in logs for line in path.read_text().splitlines()]
    if name != "node-fetch-https":
        assert any(e["host"] == "reg.test" and e["decision"] == "allow" for e in entries), entries
    assert any(e["host"] == "denied.test" and e["decision"] == "deny" for e in entries), entries


def test_java_and_node_settings_are_in_the_plan(sandbox: Sandbox) -> None:
    proc = sandbox.relay("shell", "local", "--dry-run", "--json")
    env = json.loads(proc.stdout)["env_set"]
    assert env["JAVA_TOOL_OPTIONS"].split() == [
        "-Dhttp.proxyHost=127.0.0.1", "-Dhttp.proxyPort=3128", "-Dhttps.proxyHost=127.0.0.1", "-Dhttps.proxyPort=3128",
        "-Dhttp.nonProxyHosts=localhost|127.*|[::1]"]
    assert env["NODE_USE_ENV_PROXY"] == "1" and env["NODE_OPTIONS"].startswith("--import=data:text/javascript;base64,")
    assert " " not in env["NODE_OPTIONS"]
    assert env["npm_config_proxy"] == env["npm_config_https_proxy"] == env["PIP_PROXY"] == "http://127.0.0.1:3128"


def test_the_node_preload_keeps_loopback_direct_and_stands_aside_when_a_dispatcher_exists(tmp_path: Path) -> None:
    """Outside any box: with the preload, fetch to 127.0.0.1 (NO_PROXY) goes direct, not to the proxy."""
    require_tool("node")
    from relay.box.nodeproxy import node_options

    server = Server(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(tmp_path)))
    (tmp_path / "x.txt").write_text("direct\n")
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
               "NO_PROXY": "localhost,127.0.0.1,::1", "NODE_OPTIONS": node_options()}
        port = server.server_address[1]
        js = (f"fetch('http://127.0.0.1:{port}/x.txt').then(r => r.text()).then(t => console.log(t.trim()), "
              "e => console.log('ERR', e.cause && e.cause.message))")
        out = subprocess.run([shutil.which("node") or "node", "-e", js], env=env, capture_output=True, text=True,
                             timeout=30)
        assert out.stdout.strip() == "direct", out
    finally:
        server.shutdown()
