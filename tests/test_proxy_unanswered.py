"""No empty replies: a client that sent a whole request through the egress proxy always gets a status
line with the reason (502/503/504, an `X-Hive-Relay-*` header) and the run's log gets a decision line,
whatever failed: the upstream reset or closed without answering, the upstream stalled before its
head, the proxy ran out of threads or file descriptors, or something in the proxy itself raised.

Each failure is forced deterministically with real sockets on 127.0.0.1: an upstream that resets
(SO_LINGER 0) or closes after reading the request, a resolver that raises, a worker thread that
cannot start, and a proxy in a subprocess whose descriptors are all taken (a low RLIMIT_NOFILE, then
filled). Each has its twin: the same proxy serves a healthy request right after.
"""

from __future__ import annotations

import functools
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from relay.egress import forward as forward_mod
from relay.egress import reactor as reactor_mod

from .servers import start_http

ROOT = Path(__file__).resolve().parent.parent


def bad_upstream(behave: Callable[[socket.socket], None]) -> int:
    """A TCP server on 127.0.0.1 that reads each request and then does `behave` to it (never answers)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def loop() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(65536)
            behave(conn)

    threading.Thread(target=loop, daemon=True).start()
    return srv.getsockname()[1]


def reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def close(conn: socket.socket) -> None:
    conn.shutdown(socket.SHUT_RDWR)
    conn.close()


def get(pport: int, host: str, port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", pport), timeout=20) as s:
        s.sendall(f"GET http://{host}:{port}/hello HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


@pytest.fixture
def make_proxy(proxies) -> Callable:  # noqa: ANN001 - tests/fixtures.py Proxies
    return functools.partial(proxies, notify=None)


def log_lines(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "egress.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("behave", "reason"), [
    (reset, "the upstream reset the connection before answering"),
    (close, "the upstream closed the connection without answering"),
])
def test_an_upstream_that_says_nothing_gets_the_client_a_502(make_proxy, tmp_path: Path, behave, reason) -> None:
    bad = bad_upstream(behave)
    server, good, _ = start_http()
    try:
        _, pport = make_proxy(f"bad.test:{bad}=127.0.0.1:{bad}", f"good.test:{good}=127.0.0.1:{good}")
        out = get(pport, "bad.test", bad)
        assert out.startswith(b"HTTP/1.1 502 Bad Gateway\r\n"), out
        assert f"X-Hive-Relay-Unreachable: bad.test:{bad}; {reason}".encode() in out, out
        assert get(pport, "good.test", good).startswith(b"HTTP/1.1 200 "), "twin: a healthy upstream is relayed"
    finally:
        server.shutdown()
    lines = [e for e in log_lines(tmp_path) if e["host"] == "bad.test"]
    assert [e["decision"] for e in lines] == ["allow", "unreachable"], lines
    assert lines[1]["reason"] == reason and lines[1]["method"] == "GET"


def test_a_failure_inside_the_proxy_still_answers(make_proxy, tmp_path: Path) -> None:
    """An unexpected exception while serving (here the resolver raises something no code expects)
    used to end the worker thread with the client closed unanswered."""
    def broken(host: str, port: int) -> list[str]:
        raise RuntimeError("resolver exploded")

    server, good, _ = start_http()
    try:
        _, pport = make_proxy("odd.test:443", f"good.test:{good}=127.0.0.1:{good}", resolver=broken)
        out = get(pport, "odd.test", 443)
        assert out.startswith(b"HTTP/1.1 502 Bad Gateway\r\n"), out
        assert (b"X-Hive-Relay-Error: odd.test:443; the proxy failed to serve the request: resolver exploded"
                in out), out
        assert get(pport, "good.test", good).startswith(b"HTTP/1.1 200 "), "twin: the proxy keeps serving"
    finally:
        server.shutdown()
    (line,) = [e for e in log_lines(tmp_path) if e["host"] == "odd.test"]
    assert line["decision"] == "unreachable" and "resolver exploded" in line["reason"]


def test_no_thread_to_serve_gets_a_503(make_proxy, tmp_path: Path) -> None:
    """A worker thread that cannot start (a pids limit, as in a loaded kube proxy pod) used to close the
    client unanswered: curl's "Empty reply from server"."""
    server, good, _ = start_http()
    try:
        proxy, pport = make_proxy(f"good.test:{good}=127.0.0.1:{good}")

        def no_thread(*args: object) -> None:
            raise RuntimeError("can't start new thread")

        proxy.reactor._spawn = no_thread  # what threading.Thread.start raises at the limit
        out = get(pport, "good.test", good)
        assert out.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), out
        assert b"X-Hive-Relay-Error: -:0; the proxy could not start serving the request: can't start new thread" in out
        del proxy.reactor._spawn
        assert get(pport, "good.test", good).startswith(b"HTTP/1.1 200 "), "twin: with a thread, it is served"
        deadline = time.monotonic() + 5
        while proxy.open_connections and time.monotonic() < deadline:  # the twin's worker closes after its reply
            time.sleep(0.05)
        assert proxy.open_connections == 0, "the refused connection gave its slot back"
    finally:
        server.shutdown()
    first = log_lines(tmp_path)[0]
    assert first["decision"] == "unreachable" and "could not start serving" in first["reason"], first


def _served(up: socket.socket, out: list[bytes]) -> None:
    with socket.socket() as lis:
        lis.bind(("127.0.0.1", 0))
        lis.listen(1)
        down = socket.create_connection(lis.getsockname())
        client, _ = lis.accept()
        with down, client:
            forward_mod.relay_response(up, client)
            client.close()
            data = b""
            while chunk := down.recv(65536):
                data += chunk
            out.append(data)


def test_a_credential_routes_upstream_failing_before_its_head_is_answered(monkeypatch) -> None:
    """The TLS route's relay (`relay_response`, which splice cannot replace): a reset before the head
    is a 502, a head that never comes a 504 (HEAD_TIMEOUT, shortened here), a head that comes is relayed."""
    monkeypatch.setattr(forward_mod, "HEAD_TIMEOUT", 0.5)
    results: dict[str, bytes] = {}
    for name, behave in (("reset", reset), ("stall", lambda c: None), ("answer", lambda c: (
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"), c.close()))):
        port = bad_upstream(behave)
        up = socket.create_connection(("127.0.0.1", port))
        up.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        out: list[bytes] = []
        _served(up, out)
        up.close()
        results[name] = out[0]
    assert results["reset"].startswith(b"HTTP/1.1 502 Bad Gateway\r\n"), results
    assert b"the upstream failed before answering" in results["reset"]
    assert results["stall"].startswith(b"HTTP/1.1 504 Gateway Timeout\r\n"), results
    assert b"the upstream sent no response head within 0.5 s" in results["stall"]
    assert results["answer"].startswith(b"HTTP/1.1 200 OK\r\n") and results["answer"].endswith(b"ok"), results


CHILD = r"""
import os, resource, socket, sys, time
from relay.model.allow_rules import parse_rule
from relay.egress.decision_log import DecisionLog
from relay.egress.proxy import EgressProxy

resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(16)
proxy = EgressProxy(listener, (parse_rule(sys.argv[2]),), DecisionLog(sys.argv[1], "test"), notify=None)
proxy.start()
print(listener.getsockname()[1], flush=True)
fillers = []
for line in sys.stdin:
    cmd = line.strip()
    deadline = time.monotonic() + 5  # the last request's worker and the spare settle first
    while (proxy.open_connections or proxy.reactor._spare < 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    if cmd == "fill":
        try:
            while True:
                fillers.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
    elif cmd == "one" and fillers:
        os.close(fillers.pop())
    elif cmd == "free":
        while fillers:
            os.close(fillers.pop())
    print("ok", flush=True)
"""


def test_out_of_file_descriptors_accept_and_connect_are_answered(tmp_path: Path) -> None:
    """A proxy with every descriptor taken: the waiting client is accepted with the spare descriptor and
    gets a 503 (it used to sit unanswered in the backlog); with one free, accept works and the upstream
    connect fails EMFILE, a 502; with descriptors back, the same request is served (the twin)."""
    server, good, _ = start_http()
    log = tmp_path / "egress.jsonl"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(log), f"good.test:{good}=127.0.0.1:{good}"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdin is not None and child.stdout is not None
        pport = int(child.stdout.readline())

        def say(cmd: str) -> None:
            child.stdin.write(cmd + "\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "ok"

        assert get(pport, "good.test", good).startswith(b"HTTP/1.1 200 "), "served before (and the log is open)"
        say("fill")
        out = get(pport, "good.test", good)
        assert out.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), out
        assert b"X-Hive-Relay-Error: *:0; the proxy is out of file descriptors" in out, out
        say("one")
        out = get(pport, "good.test", good)
        assert out.startswith(b"HTTP/1.1 502 Bad Gateway\r\n"), out
        assert b"Too many open files" in out, out
        say("free")
        assert get(pport, "good.test", good).startswith(b"HTTP/1.1 200 "), "twin: descriptors back, served again"
    finally:
        child.kill()
        child.wait()
        server.shutdown()
    kinds = [(e["decision"], e["reason"]) for e in map(json.loads, log.read_text().splitlines())]
    assert kinds[0][0] == "allow" and kinds[-1][0] == "allow", kinds
    assert ("unreachable", "the proxy is out of file descriptors") in kinds, kinds
    assert any(k == "unreachable" and "Too many open files" in r for k, r in kinds), kinds


def test_the_proxy_pod_holds_many_tunnels_under_its_memory_rlimit(tmp_path: Path) -> None:
    """kube mode's proxy process (relay.egress.proxy_main) under the proxy pod's 256 MiB limit as the hard
    RLIMIT_DATA it becomes rootless on cgroup v1: at the default 8 MiB thread stack it ran out of
    threads at about 30, two per CONNECT tunnel, and then answered nothing (now, a 503). With its small
    worker stacks it holds 60 open tunnels at once, each echoing through (and the pod is no bigger)."""
    import resource

    from .servers import start_echo

    _, echo = start_echo()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        listen = s.getsockname()[1]
    config = tmp_path / "proxy.json"
    config.write_text(json.dumps({"listen": f"127.0.0.1:{listen}", "backend": "shell",
                                  "egress": [f"echo.test:{echo}=127.0.0.1:{echo},tls=false"]}))

    def pod_limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (256 << 20, 256 << 20))

    proc = subprocess.Popen([sys.executable, "-m", "relay.egress.proxy_main", "--config", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=pod_limit)
    tunnels: list[socket.socket] = []
    try:
        assert proc.stderr is not None and b"listening" in proc.stderr.readline()
        for i in range(60):
            t = socket.create_connection(("127.0.0.1", listen), timeout=20)
            tunnels.append(t)
            t.sendall(f"CONNECT echo.test:{echo} HTTP/1.1\r\nHost: echo.test\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = t.recv(4096)
                assert chunk, f"tunnel {i}: closed with {head!r}"
                head += chunk
            assert head.startswith(b"HTTP/1.1 200 "), f"tunnel {i}: {head!r}"
        for i, t in enumerate(tunnels):  # every one still open and carrying bytes
            t.sendall(b"ping %d" % i)
            assert t.recv(64) == b"ping %d" % i
    finally:
        for t in tunnels:
            t.close()
        proc.terminate()
        proc.wait(10)


def test_the_kube_forwarder_answers_when_the_proxy_pod_does_not(make_proxy, tmp_path: Path) -> None:
    """kube mode's way out of a box pod (kube_podman._forward: accept in the pod's namespace, connect to
    the proxy pod) used to close the box's connection unanswered when the proxy pod did not answer: a
    502 with the reason now. The twin: with the proxy up, the same forwarder carries the request through.
    The listener is on 127.0.0.1 here rather than in a pod's namespace (test_kube_podman plays that)."""
    from relay.modes import kube_podman

    server, good, _ = start_http()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nothing listens: the proxy pod is not up
    _, live = make_proxy(f"good.test:{good}=127.0.0.1:{good}")
    played = kube_podman.Played(work=str(tmp_path), env={}, podman=[])
    forwarders = []
    try:
        for port in (dead, live):
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(8)
            t = threading.Thread(target=kube_podman._forward, args=(played, listener, port), daemon=True)
            t.start()
            forwarders.append((listener.getsockname()[1], t))
        out = get(forwarders[0][0], "good.test", good)
        assert out.startswith(b"HTTP/1.1 502 Bad Gateway\r\n"), out
        assert f"the egress proxy pod does not answer on port {dead}: Connection refused".encode() in out, out
        assert get(forwarders[1][0], "good.test", good).startswith(b"HTTP/1.1 200 "), "twin: through the proxy"
    finally:
        played.stop.set()
        for _, t in forwarders:
            t.join(5)
        server.shutdown()


def test_a_connection_the_reactor_cannot_watch_gets_a_503(make_proxy, tmp_path: Path, monkeypatch) -> None:
    """epoll refusing one more socket (ENOSPC: the user's epoll watch limit, or ENOMEM) used to leave the
    client unanswered and its slot taken. The fault is injected in the reactor's real selector, for the
    proxy's client connections only; the twin, once epoll takes it again, is served."""
    import errno
    import selectors

    failing = threading.Event()
    failing.set()

    class Selector(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
        def register(self, fileobj, events, data=None):  # noqa: ANN001, ANN201
            if failing.is_set() and isinstance(data, reactor_mod._Pending):
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().register(fileobj, events, data)

    monkeypatch.setattr(selectors, "DefaultSelector", Selector)
    server, good, _ = start_http()
    try:
        proxy, pport = make_proxy(f"good.test:{good}=127.0.0.1:{good}")
        out = get(pport, "good.test", good)
        assert out.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), out
        assert b"X-Hive-Relay-Error: *:0; the proxy could not watch the connection: No space left on device" in out
        failing.clear()
        assert get(pport, "good.test", good).startswith(b"HTTP/1.1 200 "), "twin: watched, served"
        deadline = time.monotonic() + 5
        while proxy.open_connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.open_connections == 0, "the refused connection gave its slot back"
    finally:
        server.shutdown()
    assert "could not watch" in log_lines(tmp_path)[0]["reason"]
