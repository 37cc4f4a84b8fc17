"""`invoke bench` rows for the tunnel checks (relay/egress/tlspeek.py): what reading the ClientHello costs.

Measured on the real proxy (EgressProxy, in this process, on loopback) against baselines taken in
the same run, round by round, so that a busy shared machine hits both sides alike:
- CONNECT throughput of a TLS download through the proxy with the SNI check, against the same
  TLS download direct (the ratio the issue bounds at >= 0.8x);
- the time to the first response byte of a new TLS tunnel with the check against the same tunnel
  under a `tls=false` rule (no check): the added median;
- 10k tunnels opened and closed (ClientHello, echo, close): threads and RSS before and after.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import statistics
import subprocess
import tempfile
import threading
import time

MB = 1 << 20


def _tls_server(directory: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server context for bench.test, client context trusting it)."""
    key, cert = os.path.join(directory, "k.pem"), os.path.join(directory, "c.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=bench.test", "-addext", "subjectAltName=DNS:bench.test",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=cert)
    return server, client


# The upstream for the throughput rows, in a process of its own (its TLS work must not share this
# process's GIL with the client and the proxy it is measured against): argv cert key blob, prints its port.
_SERVER = """
import socket, ssl, sys, threading
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
blob, chunk = int(sys.argv[3]), b"x" * (1 << 18)
lst = socket.socket()
lst.bind(("127.0.0.1", 0))
lst.listen(64)
print(lst.getsockname()[1], flush=True)
def one(conn):
    try:
        with ctx.wrap_socket(conn, server_side=True) as tls:
            tls.recv(4096)
            tls.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n" % blob)
            left = blob
            while left:
                n = min(left, len(chunk))
                tls.sendall(chunk[:n])
                left -= n
    except OSError:
        pass
while True:
    c, _ = lst.accept()
    threading.Thread(target=one, args=(c,), daemon=True).start()
"""


def _serve(listener: socket.socket, ctx: ssl.SSLContext, blob: int) -> None:
    """Each connection: TLS, read one request line, answer 16 bytes (the time-to-first-byte and churn rows)."""
    chunk = b"x" * (1 << 18)

    def one(conn: socket.socket) -> None:
        try:
            with ctx.wrap_socket(conn, server_side=True) as tls:
                head = tls.recv(4096)
                size = blob if blob and head.startswith(b"GET /big") else 16
                tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
                left = size
                while left:
                    n = min(left, len(chunk))
                    tls.sendall(chunk[:n])
                    left -= n
        except OSError:
            pass

    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=one, args=(conn,), daemon=True).start()


def _connect(proxy: tuple[str, int] | None, port: int, name: str) -> socket.socket:
    if proxy is None:
        return socket.create_connection(("127.0.0.1", port))
    sock = socket.create_connection(proxy)
    sock.sendall(f"CONNECT {name}:{port} HTTP/1.1\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(1)
        if not data:
            raise OSError("the proxy closed the tunnel")
        head += data
    if not head.startswith(b"HTTP/1.1 200"):
        raise OSError(head.split(b"\r\n")[0].decode("latin-1"))
    return sock


def _fetch(client: ssl.SSLContext, proxy: tuple[str, int] | None, port: int, path: str,
           name: str = "bench.test") -> tuple[float, float, int]:
    """(seconds to the first response byte, seconds in all, bytes), from before the connect."""
    start = time.perf_counter()
    with client.wrap_socket(_connect(proxy, port, name), server_hostname="bench.test") as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: bench.test\r\n\r\n".encode())
        first = tls.recv(1 << 16)
        ttfb = time.perf_counter() - start
        total = len(first)
        buf = bytearray(1 << 18)
        while n := tls.recv_into(buf):
            total += n
    return ttfb, time.perf_counter() - start, total


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(quick: bool = False) -> dict:
    from relay.egress.decision_log import DecisionLog
    from relay.egress.proxy import EgressProxy
    from relay.model.allow_rules import parse_rule

    work = tempfile.mkdtemp(prefix="hive-relay-bench-tls-")
    server_ctx, client = _tls_server(work)
    upstream = socket.socket()
    upstream.bind(("127.0.0.1", 0))
    upstream.listen(256)
    port = upstream.getsockname()[1]
    blob = (32 if quick else 200) * MB
    threading.Thread(target=_serve, args=(upstream, server_ctx, 0), daemon=True).start()
    import sys

    big = subprocess.Popen([sys.executable, "-c", _SERVER, os.path.join(work, "c.pem"), os.path.join(work, "k.pem"),
                            str(blob)], stdout=subprocess.PIPE, text=True)
    assert big.stdout is not None
    big_port = int(big.stdout.readline())
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    rules = (parse_rule(f"bench.test:{port}=127.0.0.1:{port}"), parse_rule(f"nocheck.test:{port}=127.0.0.1:{port},tls=false"),
             parse_rule(f"bench.test:{big_port}=127.0.0.1:{big_port}"))
    proxy = EgressProxy(listener, rules, DecisionLog(None, "bench"), notify=None)
    proxy.start()
    addr = listener.getsockname()
    out: dict = {}
    try:
        # Throughput: direct TLS and TLS through the checked tunnel, paired rounds.
        direct, tunnel = [], []
        for r in range(3 if quick else 5):
            for which in (("direct", "tunnel") if r % 2 == 0 else ("tunnel", "direct")):
                _, seconds, size = _fetch(client, None if which == "direct" else addr, big_port, "/big")
                (direct if which == "direct" else tunnel).append(size / seconds / MB)
        out["throughput_MBps"] = {"direct TLS": statistics.median(direct), "CONNECT with SNI check": statistics.median(tunnel)}
        out["throughput_ratio"] = statistics.median(t / d for t, d in zip(tunnel, direct, strict=True))
        # Time to first byte: the same new tunnel with and without the check, paired rounds.
        checked, unchecked = [], []
        for r in range(100 if quick else 300):
            for name in (("bench.test", "nocheck.test") if r % 2 == 0 else ("nocheck.test", "bench.test")):
                ttfb = _fetch(client, addr, port, "/small", name)[0]
                (checked if name == "bench.test" else unchecked).append(ttfb)
        out["ttfb_ms"] = {"tls=false (no check) p50": statistics.median(unchecked) * 1000,
                          "SNI check p50": statistics.median(checked) * 1000}
        out["ttfb_added_ms"] = out["ttfb_ms"]["SNI check p50"] - out["ttfb_ms"]["tls=false (no check) p50"]
        # 10k tunnels opened and closed: a ClientHello judged, echoed by nobody (the upstream answers
        # TLS), closed at once. Threads and RSS after a warm-up, and after all of them.
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = client.wrap_bio(incoming, outgoing, server_hostname="bench.test")
        try:
            obj.do_handshake()
        except ssl.SSLWantReadError:
            pass
        hello = outgoing.read()
        total = 10_000

        def churn(n: int) -> int:
            errors = 0
            for _ in range(n):
                try:
                    sock = _connect(addr, port, "bench.test")
                    sock.sendall(hello)
                    sock.recv(1)  # the upstream's ServerHello began: the tunnel was judged and spliced
                    sock.close()
                except OSError:
                    errors += 1
            return errors

        errors = churn(500)
        settle = time.monotonic() + 10
        while proxy.open_connections and time.monotonic() < settle:
            time.sleep(0.05)
        threads0, rss0 = threading.active_count(), _rss()
        start = time.perf_counter()
        errors += churn(total - 500)
        seconds = time.perf_counter() - start
        settle = time.monotonic() + 10
        while (proxy.open_connections or threading.active_count() > threads0) and time.monotonic() < settle:
            time.sleep(0.05)
        out["churn"] = {"tunnels": total, "seconds": seconds, "errors": errors,
                        "threads_before": threads0, "threads_after": threading.active_count(),
                        "rss_before_MiB": rss0 / MB, "rss_after_MiB": _rss() / MB,
                        "open_after": proxy.open_connections}
    finally:
        proxy.stop()
        upstream.close()
        big.kill()
        big.wait()
        shutil.rmtree(work, ignore_errors=True)  # the throwaway CA and server keys
    return out


def rows(r: dict) -> tuple[list[str], dict[str, tuple[str, bool]]]:
    """The report's rows and targets for `measure`'s result."""
    lines = []
    for name, v in r["throughput_MBps"].items():
        lines.append(f"| tunnel check: throughput, {name} | {v:.0f} MB/s | |")
    lines.append(f"| tunnel check: CONNECT with SNI check / direct TLS | {r['throughput_ratio']:.2f}× | paired rounds |")
    for name, v in r["ttfb_ms"].items():
        lines.append(f"| tunnel check: time to first byte, {name} | {v:.2f} ms | |")
    c = r["churn"]
    lines.append(f"| tunnel check: {c['tunnels']} tunnels opened and closed | {c['seconds']:.1f} s, {c['errors']} errors | "
                 f"threads {c['threads_before']} → {c['threads_after']}, RSS {c['rss_before_MiB']:.1f} → "
                 f"{c['rss_after_MiB']:.1f} MiB |")
    grew = c["rss_after_MiB"] - c["rss_before_MiB"]
    targets = {
        "CONNECT throughput with the SNI check ≥ 0.8× direct TLS": (f"{r['throughput_ratio']:.2f}×",
                                                                    r["throughput_ratio"] >= 0.8),
        "SNI check: added time to first byte < 1 ms (median)": (f"{r['ttfb_added_ms']:.2f} ms", r["ttfb_added_ms"] < 1),
        "10k tunnels: no thread or memory growth (≤ 8 MiB)": (
            f"threads +{c['threads_after'] - c['threads_before']}, RSS {grew:+.1f} MiB",
            c["threads_after"] <= c["threads_before"] and grew <= 8 and c["open_after"] == 0),
    }
    return lines, targets


# --- TLS inspection (relay/egress/inspect.py) --------------------------------------------------------

def _serve_sse(listener: socket.socket, ctx: ssl.SSLContext) -> None:
    """Each connection: TLS, then requests one by one (keep-alive), each answered with a chunked SSE
    stream whose first event goes at once."""

    def one(conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with ctx.wrap_socket(conn, server_side=True) as tls:
                buf = b""
                while True:
                    while b"\r\n\r\n" not in buf:
                        data = tls.recv(4096)
                        if not data:
                            return
                        buf += data
                    buf = buf.partition(b"\r\n\r\n")[2]
                    event = b"data: first\n\n"
                    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                                + b"%x\r\n%s\r\n" % (len(event), event))
                    tls.sendall(b"0\r\n\r\n")
        except OSError:
            pass

    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=one, args=(conn,), daemon=True).start()


def _read_answer(tls: ssl.SSLSocket) -> int:
    """Read one answer by its Content-Length: the bytes of its body."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += tls.recv(1 << 16)
    head, _, body = buf.partition(b"\r\n\r\n")
    fields = {ln.partition(b":")[0].strip().lower(): ln.partition(b":")[2].strip() for ln in head.split(b"\r\n")[1:]}
    if b"content-length" in fields:
        want, got = int(fields[b"content-length"]), len(body)
        view = bytearray(1 << 18)
        while got < want:
            got += tls.recv_into(view, min(len(view), want - got))
        return got
    raise OSError("an answer without Content-Length")


# The inspecting proxy, in a process of its own as in a run (the launcher's, not the box client's):
# argv root ca cert key port..., prints its port.
_INSPECTING = """
import socket, ssl, sys, time
sys.path.insert(0, sys.argv[1])
from relay.egress.decision_log import DecisionLog
from relay.egress.proxy import EgressProxy
from relay.model.allow_rules import parse_rule
ca, cert, key, ports = sys.argv[2], sys.argv[3], sys.argv[4], [int(p) for p in sys.argv[5:]]
lst = socket.socket()
lst.bind(("127.0.0.1", 0))
lst.listen(256)
EgressProxy(lst, tuple(parse_rule(f"bench.test:{p}=127.0.0.1:{p}") for p in ports), DecisionLog(None, "bench"),
            notify=None, tls=ssl.create_default_context(cafile=ca),
            inspect={("bench.test", p): (cert, key) for p in ports}).start()
print(lst.getsockname()[1], flush=True)
while True:
    time.sleep(3600)
"""


# The floor any Python proxy stands on for an inspected request: a minimal relay that answers the
# CONNECT, terminates TLS with the same leaf, re-originates it to the same upstream and pumps the
# plaintext both ways (a thread each, SSLSocket reads and writes as they come), with no HTTP parsing,
# no rules, no scan, no log. argv: ca cert key upstream_port, prints its port.
_FLOOR = """
import select, socket, ssl, sys, threading
ca, cert, key, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
server.load_cert_chain(cert, key)
client = ssl.create_default_context(cafile=ca)
def one(conn):
    head = b""
    while b"\\r\\n\\r\\n" not in head:
        data = conn.recv(4096)
        if not data:
            return
        head += data
    conn.sendall(b"HTTP/1.1 200 Connection Established\\r\\n\\r\\n")
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    up = socket.create_connection(("127.0.0.1", port))
    up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with server.wrap_socket(conn, server_side=True) as a, client.wrap_socket(up, server_hostname="bench.test") as b:
        other = {a: b, b: a}
        while True:  # one thread per connection: an SSL object is not for two threads at once
            for s in [s for s in (a, b) if s.pending()] or select.select([a, b], [], [])[0]:
                data = s.recv(1 << 16)
                if not data:
                    return
                other[s].sendall(data)
lst = socket.socket()
lst.bind(("127.0.0.1", 0))
lst.listen(256)
print(lst.getsockname()[1], flush=True)
while True:
    c, _ = lst.accept()
    threading.Thread(target=one, args=(c,), daemon=True).start()
"""


def measure_inspection(quick: bool = False) -> dict:
    """Inspected TLS (the proxy, in a process of its own, terminates the tunnel with a run CA's leaf,
    re-originates TLS upstream, relays HTTP/1.1) against TLS straight to the same upstream, paired rounds: the first SSE event of a
    new connection (both handshakes and the request), of a request on a kept-alive connection, and a
    32 MB download's throughput."""
    from relay.host import run_ca

    work = tempfile.mkdtemp(prefix="hive-relay-bench-inspect-")
    server_ctx, direct_client = _tls_server(work)
    blob = 32 * MB
    import sys

    big = subprocess.Popen([sys.executable, "-c", _SERVER, os.path.join(work, "c.pem"), os.path.join(work, "k.pem"),
                            str(blob)], stdout=subprocess.PIPE, text=True)
    assert big.stdout is not None
    big_port = int(big.stdout.readline())
    sse = socket.socket()
    sse.bind(("127.0.0.1", 0))
    sse.listen(256)
    sse_port = sse.getsockname()[1]
    threading.Thread(target=_serve_sse, args=(sse, server_ctx), daemon=True).start()
    leaf = run_ca.make(work, ["bench.test"], "bundle.pem")[0]
    inspected_client = ssl.create_default_context(cafile=os.path.join(work, "bundle.pem"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proxy = subprocess.Popen([sys.executable, "-c", _INSPECTING, root, os.path.join(work, "c.pem"), leaf.cert, leaf.key,
                              str(big_port), str(sse_port)], stdout=subprocess.PIPE, text=True)
    assert proxy.stdout is not None
    addr = ("127.0.0.1", int(proxy.stdout.readline()))
    floor = subprocess.Popen([sys.executable, "-c", _FLOOR, os.path.join(work, "c.pem"), leaf.cert, leaf.key, str(sse_port)],
                             stdout=subprocess.PIPE, text=True)
    assert floor.stdout is not None
    floor_addr = ("127.0.0.1", int(floor.stdout.readline()))

    def open_tls(inspected: bool, port: int, via: tuple[str, int] | None = None) -> ssl.SSLSocket:
        sock = _connect(via or (addr if inspected else None), port, "bench.test")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(60)  # a stuck relay is a failed bench, never a hung one
        return (inspected_client if inspected else direct_client).wrap_socket(sock, server_hostname="bench.test")

    req = b"GET /stream HTTP/1.1\r\nHost: bench.test:%d\r\n\r\n" % sse_port  # the port: not 443
    out: dict = {}
    try:
        fresh: dict[bool, list[float]] = {False: [], True: []}
        kept: dict[bool, list[float]] = {False: [], True: []}
        for r in range(30 if quick else 100):
            for inspected in ((False, True) if r % 2 == 0 else (True, False)):
                start = time.perf_counter()
                with open_tls(inspected, sse_port) as tls:
                    fresh[inspected].append(_sse_once(tls, req, start))
                    for _ in range(3):  # the same connection again: what a streaming agent's next turn costs
                        kept[inspected].append(_sse_once(tls, req, time.perf_counter()))
        out["sse_first_event_ms"] = {
            "new connection, direct TLS": statistics.median(fresh[False]) * 1000,
            "new connection, inspected": statistics.median(fresh[True]) * 1000,
            "kept-alive connection, direct TLS": statistics.median(kept[False]) * 1000,
            "kept-alive connection, inspected": statistics.median(kept[True]) * 1000}
        out["sse_ratio_new"] = statistics.median(fresh[True]) / statistics.median(fresh[False])
        out["sse_ratio_kept"] = statistics.median(kept[True]) / statistics.median(kept[False])
        # The floor: the minimal relay (_FLOOR) against direct TLS, in rounds of its own, alternating.
        floor_kept: dict[bool, list[float]] = {False: [], True: []}
        for r in range(30 if quick else 100):
            for relayed in ((False, True) if r % 2 == 0 else (True, False)):
                with open_tls(relayed, sse_port, floor_addr if relayed else None) as tls:
                    _sse_once(tls, req, time.perf_counter())
                    for _ in range(3):
                        floor_kept[relayed].append(_sse_once(tls, req, time.perf_counter()))
        out["sse_first_event_ms"]["kept-alive connection, minimal Python relay"] = statistics.median(floor_kept[True]) * 1000
        out["sse_ratio_kept_floor"] = statistics.median(floor_kept[True]) / statistics.median(floor_kept[False])
        direct, inspected_mbps = [], []
        for r in range(3 if quick else 5):
            for inspected in ((False, True) if r % 2 == 0 else (True, False)):
                start = time.perf_counter()
                with open_tls(inspected, big_port) as tls:
                    tls.sendall(b"GET /big HTTP/1.1\r\nHost: bench.test:%d\r\n\r\n" % big_port)
                    size = _read_answer(tls)
                (inspected_mbps if inspected else direct).append(size / (time.perf_counter() - start) / MB)
        out["throughput_MBps"] = {"direct TLS": statistics.median(direct), "inspected": statistics.median(inspected_mbps)}
        out["throughput_ratio"] = statistics.median(i / d for i, d in zip(inspected_mbps, direct, strict=True))
    finally:
        for p in (proxy, floor):
            p.kill()
            p.wait()
        sse.close()
        big.kill()
        big.wait()
        shutil.rmtree(work, ignore_errors=True)  # the run CA's leaf and the server keys
    return out


def _sse_once(tls: ssl.SSLSocket, req: bytes, start: float) -> float:
    """Send one request, read its SSE answer to the last chunk: seconds from `start` to the first event."""
    tls.sendall(req)
    buf, first = b"", 0.0
    while not buf.endswith(b"0\r\n\r\n"):
        data = tls.recv(1 << 16)
        if not data:
            raise OSError("the stream ended early")
        buf += data
        if not first and b"data: first" in buf:
            first = time.perf_counter() - start
    return first


def inspection_rows(r: dict) -> tuple[list[str], dict[str, tuple[str, bool]]]:
    """The report's rows and targets for `measure_inspection`'s result."""
    lines = [f"| inspected TLS: first SSE event, {name} | {v:.2f} ms | |" for name, v in r["sse_first_event_ms"].items()]
    lines.append(f"| inspected TLS: first SSE event / direct TLS, new connection | {r['sse_ratio_new']:.2f}× | "
                 "two handshakes (overlapped) against one; a CPU-bound loopback |")
    lines.append(f"| inspected TLS: first SSE event / direct TLS, kept-alive connection | {r['sse_ratio_kept']:.2f}× | |")
    if "sse_ratio_kept_floor" in r:
        lines.append(f"| the floor: a minimal Python TLS relay (no HTTP, no rules, no scan) / direct TLS, kept-alive | "
                     f"{r['sse_ratio_kept_floor']:.2f}× | the same rounds' kind; below it no Python proxy goes |")
    for name, v in r["throughput_MBps"].items():
        lines.append(f"| inspected TLS: 32 MB, {name} | {v:.0f} MB/s | |")
    lines.append(f"| inspected TLS: 32 MB / direct TLS | {r['throughput_ratio']:.2f}× | paired rounds |")
    targets = {
        "inspected stream: first SSE event ≤ 1.5× direct TLS (kept-alive)": (f"{r['sse_ratio_kept']:.2f}×",
                                                                             r["sse_ratio_kept"] <= 1.5),
        "inspected throughput at 32 MB ≥ 0.5× direct TLS": (f"{r['throughput_ratio']:.2f}×", r["throughput_ratio"] >= 0.5),
    }
    return lines, targets
