"""A pinned `--allow-host` entry wins over the backend's own unpinned entry for the same name, through a
real box: the pin is honoured (the bytes reach the pinned address, never DNS), and it opens nothing else."""

from __future__ import annotations

import json

import pytest

from ..conftest import Sandbox
from ..servers import start_echo

PY = "/usr/bin/python3"
ECHO = r'''
import socket, ssl, sys
def hello(name):  # a real ClientHello naming the CONNECT host: the proxy checks its SNI, then splices
    i, o = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ssl.create_default_context().wrap_bio(i, o, server_hostname=name)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return o.read()
for target in sys.argv[1:]:
    s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    status = s.recv(4096).decode(errors="replace").splitlines()[0]
    echoed = ""
    if " 200 " in status:
        sent, got = hello(target.rsplit(":", 1)[0]), b""
        s.sendall(sent)
        while len(got) < len(sent) and (data := s.recv(65536)):
            got += data
        echoed = "ping-through-the-pin" if got == sent else repr(got[:40])
    print(target, "->", status, "::", echoed)
'''


@pytest.fixture(scope="module")
def echo():
    sock, port = start_echo()
    yield port
    sock.close()


@pytest.mark.parametrize("backend", ["claude", "opencode"])  # both list api.anthropic.com unpinned
def test_a_pin_for_a_backend_host_takes_precedence(box: Sandbox, backend: str, echo: int, report) -> None:
    (box.workdir / "echo.py").write_text(ECHO)
    proc = box.box(f"{PY} echo.py api.anthropic.com:443 api.openai.com:{echo}", backend,
                   "--allow-host", f"api.anthropic.com:443=127.0.0.1:{echo}")
    out = proc.stdout
    pinned = "api.anthropic.com:443 -> HTTP/1.1 200 Connection Established :: ping-through-the-pin" in out
    report.legit(pinned)
    report.attack(f"api.openai.com:{echo} -> HTTP/1.1 403" in out)  # the pin opens its own name only
    assert pinned, out + proc.stderr
    assert f"api.openai.com:{echo} -> HTTP/1.1 403" in out, out
    logs = sorted((box.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    entries = [json.loads(line) for line in logs[-1].read_text().splitlines()]
    reasons = {(e["host"], e["port"]): e["reason"] for e in entries}
    assert reasons[("api.anthropic.com", 443)] == f"pinned to 127.0.0.1:{echo}"
    assert "egress denied: api.anthropic.com" not in proc.stderr
