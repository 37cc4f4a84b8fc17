"""pip says why the proxy refused it. pip shows nothing of a refused CONNECT but the status line (in its
"Retrying ... Tunnel connection failed: 403 ..." warnings), so the proxy's status line carries the policy's
reason and the `invoke allow` command; the user's terminal gets the denial line naming the same command.
The twin: pip through the proxy to an allowed index downloads the package."""

from __future__ import annotations

import functools
import http.server
import socket
import subprocess
import threading
import zipfile
from pathlib import Path

import pytest

from relay.egress.decision_log import DecisionLog
from relay.egress.proxy import EgressProxy
from relay.model.allow_rules import parse_rule
from relay.model.refusal import ENTRY

from .conftest import Sandbox, require_tool
from .servers import Server

WHEEL = "hive_test_pkg-1.0.0-py3-none-any.whl"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def _index(root: Path) -> Server:
    simple = root / "simple" / "hive-test-pkg"
    simple.mkdir(parents=True)
    with zipfile.ZipFile(simple / WHEEL, "w") as whl:
        info = "hive_test_pkg-1.0.0.dist-info"
        whl.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: hive-test-pkg\nVersion: 1.0.0\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    (simple / "index.html").write_text(f'<!DOCTYPE html><html><body><a href="{WHEEL}">{WHEEL}</a></body></html>\n')
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    server = Server(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


@pytest.mark.box
def test_pip_shows_the_policy_reason_and_the_terminal_the_allow_command(box_sandbox: Sandbox,
                                                                         tmp_path: Path) -> None:
    require_tool("python3")
    if subprocess.run(["/usr/bin/python3", "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.fail("/usr/bin/python3 has no pip: .ci/run installs python3-pip")
    server = _index(tmp_path / "index")
    port = server.server_address[1]
    pip = "python3 -m pip download hive-test-pkg --no-deps -d /tmp/dl --disable-pip-version-check --timeout 10"
    script = (f"{pip} --index-url http://reg.test:{port}/simple/ --trusted-host reg.test:{port} --retries 0 2>&1; "
              f"echo ===; {pip} --index-url https://pypi.test/simple/ --retries 1 2>&1; echo rc=$?")
    try:
        proc = box_sandbox.relay("shell", "local", "--quiet", "--prompt", script, "--allow-host",
                                 f"reg.test:{port}=127.0.0.1:{port}", timeout=240)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr[-2000:]
    allowed, denied = proc.stdout.split("===")
    assert f"Saved /tmp/dl/{WHEEL}" in allowed, allowed  # the twin: pip through the proxy works
    run = proc.stderr.split("--run ")[1].split()[0]
    # What pip prints, without -v: the policy's reason and the command, in its retry warning.
    assert ("Tunnel connection failed: 403 Forbidden by the hive-relay egress policy (pypi.test:443: not in the "
            f"egress allowlist; rule: none), not an outage; to allow it while the box runs: {ENTRY} allow pypi.test:443 --run {run}") in denied, denied
    assert "No matching distribution found for hive-test-pkg" in denied and "rc=1" in denied
    # The user's terminal: one line naming the host and the exact command.
    assert (f"hive-relay: egress denied pypi.test:443 (not in the egress allowlist); to allow it now: "
            f"{ENTRY} allow pypi.test:443 --run {run}") in proc.stderr, proc.stderr


def _status_line(tmp_path: Path, entries: list[str], head: bytes) -> str:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    proxy = EgressProxy(listener, tuple(parse_rule(e) for e in entries),
                        DecisionLog(str(tmp_path / "egress.jsonl"), "test"), notify=None, run_id="RUN-ID",
                        resolver=lambda host, port: ["10.1.2.3"])
    proxy.start()
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as sock:
            sock.sendall(head)
            return sock.makefile("rb").readline().decode("latin-1").rstrip("\r\n")
    finally:
        proxy.stop()


def test_the_status_line_carries_the_reason(tmp_path: Path) -> None:
    line = _status_line(tmp_path, [], b"CONNECT evil.test:443 HTTP/1.1\r\n\r\n")
    assert line == ("HTTP/1.1 403 Forbidden by the hive-relay egress policy (evil.test:443: not in the egress "
                    f"allowlist; rule: none), not an outage; to allow it while the box runs: {ENTRY} allow evil.test:443 --run RUN-ID")
    # A listed name that resolves to an internal address: the reason names the pinned form, and the
    # fix is the pinned allow (a plain allow would change nothing).
    line = _status_line(tmp_path, ["inside.test"], b"CONNECT inside.test:443 HTTP/1.1\r\n\r\n")
    assert line == ("HTTP/1.1 403 Forbidden by the hive-relay egress policy (inside.test:443: resolves to "
                    "internal address 10.1.2.3; pin it with NAME=ADDR:PORT; rule: inside.test), not an outage; "
                    f"to reach it on purpose, pin it: {ENTRY} allow inside.test:443=ADDR:443 --run RUN-ID"), line
