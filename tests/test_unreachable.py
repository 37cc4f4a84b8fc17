"""Unreachable is not denied: an allowed host that cannot be reached gets its own answer (502/504),
its own log decision and its own summary line, never the "--allow-host" hint. An agent stuck
reconnecting is named once on stderr, and a --prompt run fails fast with exit 69.

Real sockets on 127.0.0.1 only: a closed port is "refused", a resolver that fails is "cannot resolve".
"""

from __future__ import annotations

import errno
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from relay.egress.forward import _cause
from relay.egress.proxy import EgressProxy
from relay.egress.watch import UpstreamWatch
from relay.model.errors import EXIT_UPSTREAM

from .conftest import Sandbox, require_tool
from .servers import start_echo, start_http

HINT = "To allow it: --allow-host {host}:{port} (or add it to your user config)."


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def make_proxy(proxies) -> Callable:  # noqa: ANN001 - tests/fixtures.py Proxies
    def make(*entries: str, **kw) -> tuple[EgressProxy, int, list[str]]:  # noqa: ANN003
        said: list[str] = []
        return (*proxies(*entries, hint=HINT, notify=said.append, **kw), said)

    return make


def ask(port: int, line: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(line.encode() + b"\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def entries(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "egress.jsonl").read_text().splitlines()]


def test_allowed_pinned_host_with_a_closed_port_is_unreachable_not_denied(make_proxy, tmp_path: Path) -> None:
    port = closed_port()
    proxy, pport, said = make_proxy(f"svc.test:{port}=127.0.0.1:{port}")
    connect = ask(pport, f"CONNECT svc.test:{port} HTTP/1.1")
    get = ask(pport, f"GET http://svc.test:{port}/x HTTP/1.1\r\nHost: svc.test")
    for out in (connect, get):
        assert out.startswith(b"HTTP/1.1 502 Bad Gateway\r\n"), out
        assert f"X-Hive-Relay-Unreachable: svc.test:{port}; upstream refused the connection".encode() in out
        assert b"--allow-host" not in out and b"Denied" not in out and b"is allowed, but" in out
    (a, b) = entries(tmp_path)
    assert a["decision"] == b["decision"] == "unreachable" and a["cause"] == "refused"
    assert "upstream refused" in a["reason"]
    proxy.stop()
    assert proxy.log.summary() is None  # nothing was denied
    assert proxy.log.summary_lines() == [f"unreachable (allowed, but failed): svc.test:{port} ×2 (refused)"]
    assert said == []  # two failures are not "stuck"


def test_a_name_that_does_not_resolve_is_unreachable(make_proxy, tmp_path: Path) -> None:
    def resolver(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    proxy, pport, _ = make_proxy("api.openai.com", "other.test:80", resolver=resolver)
    out = ask(pport, "CONNECT api.openai.com:443 HTTP/1.1")
    assert out.startswith(b"HTTP/1.1 502 "), out
    assert b"cannot resolve api.openai.com: Name or service not known" in out and b"--allow-host" not in out
    denied = ask(pport, "CONNECT evil.test:443 HTTP/1.1")  # the twin that is really denied keeps its hint
    assert denied.startswith(b"HTTP/1.1 403 ") and b"--allow-host evil.test:443" in denied
    kinds = [(e["host"], e["decision"], e.get("cause")) for e in entries(tmp_path)]
    assert kinds == [("api.openai.com", "unreachable", "cannot resolve"), ("evil.test", "deny", None)]
    proxy.stop()
    assert proxy.log.summary_lines() == [
        "unreachable (allowed, but failed): api.openai.com:443 ×1 (cannot resolve)",
        "egress denied: evil.test:443 ×1"]


def test_an_allowed_name_resolving_internally_is_denied_without_the_allow_host_hint(make_proxy) -> None:
    _, pport, _ = make_proxy("rebind.test", resolver=lambda h, p: ["127.0.0.1"])
    out = ask(pport, "CONNECT rebind.test:443 HTTP/1.1")
    assert out.startswith(b"HTTP/1.1 403 ") and b"internal address" in out and b"--allow-host" not in out


def test_an_allowed_host_failing_repeatedly_is_announced_once_and_gives_up(make_proxy) -> None:
    port = closed_port()
    proxy, pport, said = make_proxy(f"svc.test:{port}=127.0.0.1:{port}")
    for _ in range(4):
        ask(pport, f"CONNECT svc.test:{port} HTTP/1.1")
    assert said == [] and proxy.gave_up() is None
    for _ in range(6):
        ask(pport, f"CONNECT svc.test:{port} HTTP/1.1")
    assert len(said) == 1, said
    assert f"svc.test:{port} is allowed but failed 5 times" in said[0] and "(refused)" in said[0]
    assert "nothing listens there" in said[0] and "stuck reconnecting" in said[0]
    # Nothing ever answered: the line says for how long that really was, never the 30 s window.
    said_up = proxy.gave_up()
    assert said_up.startswith(f"svc.test:{port} keeps failing (refused) and no allowed host has answered in the ")
    assert said_up.endswith(" s since the box started") and "30 s" not in said_up
    assert float(said_up.split("answered in the ", 1)[1].split(" s ")[0]) < 30


def test_a_working_host_keeps_the_run_going_while_another_fails(make_proxy) -> None:
    server, ok_port = start_echo()
    dead = closed_port()
    try:
        proxy, pport, said = make_proxy(f"ok.test:{ok_port}=127.0.0.1:{ok_port}", f"dead.test:{dead}=127.0.0.1:{dead}")
        with socket.create_connection(("127.0.0.1", pport), timeout=5) as s:
            s.sendall(f"CONNECT ok.test:{ok_port} HTTP/1.1\r\n\r\n".encode())
            assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
        for _ in range(6):
            ask(pport, f"CONNECT dead.test:{dead} HTTP/1.1")
        assert len(said) == 1 and f"dead.test:{dead}" in said[0]  # still said once
        assert proxy.gave_up() is None  # ok.test answered within the window
    finally:
        server.close()


def test_the_watch_counts_within_its_window_and_a_success_resets_it() -> None:
    now = [0.0]
    said: list[str] = []
    watch = UpstreamWatch(said.append, count=5, window=30.0, clock=lambda: now[0])
    for _ in range(4):
        watch.failed("a.test", 443, "timed out")
        now[0] += 10.0  # spread over 40 s: never 5 within 30 s
    watch.failed("a.test", 443, "timed out")
    assert said == []
    now[0] = 100.0
    for _ in range(4):
        watch.failed("b.test", 443, "no route")
    watch.ok("b.test", 443)
    watch.failed("b.test", 443, "no route")
    assert said == []  # a success inside the window: not stuck
    for _ in range(5):
        now[0] += 1.0
        watch.failed("b.test", 443, "no route")
    assert len(said) == 1 and "b.test:443" in said[0] and "no route" in said[0]
    assert watch.gave_up() is None  # b.test answered 5 s ago
    now[0] += 30.0
    assert watch.gave_up() and "b.test:443 keeps failing (no route)" in watch.gave_up()


@pytest.mark.parametrize(("err", "cause"), [
    (TimeoutError("timed out"), "timed out"), (OSError(errno.ECONNREFUSED, "x"), "refused"),
    (OSError(errno.ENETUNREACH, "x"), "no route"), (OSError(errno.EHOSTUNREACH, "x"), "no route"),
    (OSError(errno.EACCES, "x"), "failed")])
def test_connect_errors_map_to_causes(err: OSError, cause: str) -> None:
    assert _cause(err) == cause


# Through a real box.


def log_entries(s: Sandbox) -> list[dict]:
    logs = sorted((s.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    assert logs, "no egress log written"
    return [json.loads(line) for line in logs[-1].read_text().splitlines()]


@pytest.mark.box
def test_curl_in_a_box_against_a_closed_pinned_port(box_sandbox: Sandbox) -> None:
    require_tool("curl")
    s, port = box_sandbox, closed_port()
    proc = s.box(f"curl -s -o /dev/null -w 'connect=%{{http_connect}}\\n' https://svc.test:{port}/; "
                 f"curl -s -D - http://svc.test:{port}/; true",
                 "shell", "--allow-host", f"svc.test:{port}=127.0.0.1:{port}")
    assert proc.returncode == 0, proc.stderr
    assert "connect=502" in proc.stdout and "HTTP/1.1 502 Bad Gateway" in proc.stdout
    assert f"X-Hive-Relay-Unreachable: svc.test:{port}; upstream refused the connection" in proc.stdout
    assert "--allow-host" not in proc.stdout
    assert f"hive-relay: unreachable (allowed, but failed): svc.test:{port} ×2 (refused)" in proc.stderr
    assert "egress denied" not in proc.stderr and "stuck" not in proc.stderr
    records = [(e["host"], e["decision"], e["cause"]) for e in log_entries(s)]
    assert records == [("svc.test", "unreachable", "refused")] * 2


LOOP = "i=0; while [ $i -lt 300 ]; do curl -s -o /dev/null {url}; i=$((i+1)); sleep 0.05; done; echo FINISHED"


@pytest.mark.box
def test_a_prompt_run_stuck_on_an_unreachable_host_fails_fast(box_sandbox: Sandbox) -> None:
    require_tool("curl")
    s, port = box_sandbox, closed_port()
    start = time.monotonic()
    proc = s.box(LOOP.format(url=f"http://svc.test:{port}/"), "shell", "--allow-host", f"svc.test:{port}=127.0.0.1:{port}",
                 "--timeout", "120")
    took = time.monotonic() - start
    assert proc.returncode == EXIT_UPSTREAM == 69, proc.stderr
    assert took < 20, took  # 300 tries × 50 ms would be 15 s plus curl: it stopped at the fifth
    assert "FINISHED" not in proc.stdout
    assert proc.stderr.count("is allowed but failed 5 times") == 1, proc.stderr
    assert f"svc.test:{port} keeps failing (refused)" in proc.stderr and "exit 69" in proc.stderr
    assert f"unreachable (allowed, but failed): svc.test:{port} ×" in proc.stderr
    assert "egress denied" not in proc.stderr


@pytest.mark.box
def test_a_prompt_run_against_a_reachable_host_exits_0(box_sandbox: Sandbox) -> None:
    require_tool("curl")
    server, port, _ = start_http()
    try:
        proc = box_sandbox.box(LOOP.replace("300", "10").format(url=f"http://up.test:{port}/"), "shell",
                               "--allow-host", f"up.test:{port}=127.0.0.1:{port}")
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr
    assert "FINISHED" in proc.stdout and "unreachable" not in proc.stderr and "stuck" not in proc.stderr
