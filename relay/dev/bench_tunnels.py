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
