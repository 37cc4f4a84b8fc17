"""Benchmark client, run inside the box (through the proxy) and on the host (direct).

    client.py latency HOST PORT N [proxy]      -> JSON list of per-request seconds
    client.py get|connect HOST PORT N [proxy]  -> JSON [[bytes, seconds], ...] for N sequential /big downloads
    client.py tunnels HOST PORT N [proxy]      -> JSON {"bytes", "seconds", "errors"} for N concurrent /mid
"""

import json
import socket
import sys
import threading
import time


def request(host: str, port: int, path: str, proxy: str | None, tunnel: bool) -> tuple[socket.socket, bytes]:
    if proxy:
        phost, pport = proxy.rsplit(":", 1)
        s = socket.create_connection((phost, int(pport)))
        if tunnel:
            s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(1)
            target = path
        else:
            target = f"http://{host}:{port}{path}"
    else:
        s = socket.create_connection(("127.0.0.1", port))
        target = path
    s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    return s, b""


def drain(s: socket.socket) -> int:
    total = 0
    buf = bytearray(1 << 20)
    while n := s.recv_into(buf):
        total += n
    s.close()
    return total


def latency(host: str, port: int, n: int, proxy: str | None) -> None:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        s, _ = request(host, port, "/small", proxy, tunnel=False)
        drain(s)
        times.append(time.perf_counter() - start)
    print(json.dumps(times))


def get(host: str, port: int, n: int, proxy: str | None, path: str = "/big", tunnel: bool = False) -> None:
    """n sequential downloads; prints per-download (bytes, seconds)."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        s, _ = request(host, port, path, proxy, tunnel=tunnel)
        size = drain(s)
        out.append([size, time.perf_counter() - start])
    print(json.dumps(out))


def connect(host: str, port: int, n: int, proxy: str | None) -> None:
    get(host, port, n, proxy, tunnel=True)


def tunnels(host: str, port: int, n: int, proxy: str | None) -> None:
    results, errors = [], []
    barrier = threading.Barrier(n)

    def one() -> None:
        try:
            barrier.wait(timeout=60)
            s, _ = request(host, port, "/mid", proxy, tunnel=True)
            results.append(drain(s))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"bytes": sum(results), "seconds": time.perf_counter() - start, "errors": len(errors)}))


if __name__ == "__main__":
    mode, host, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    proxy = sys.argv[5] if len(sys.argv) > 5 else None
    {"latency": latency, "tunnels": tunnels, "get": get, "connect": connect}[mode](host, port, n, proxy)
