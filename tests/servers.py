"""Real local servers for the egress tests: HTTP, HTTPS, SSE, websocket echo and a TCP echo.

They listen on 127.0.0.1 on the host; the box reaches them only through the proxy, via a
pinned `--allow-host NAME:PORT=127.0.0.1:PORT` entry.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import socket
import socketserver
import ssl
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    requests: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        type(self).requests.append(f"{self.command} {self.path} host={self.headers.get('Host')}")
        if self.path.startswith("/sse"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(3):
                self.wfile.write(f"data: event{i}\n\n".encode())
                self.wfile.flush()
                time.sleep(1.0)
            return
        if self.path.startswith("/ws") and self.headers.get("Upgrade", "").lower() == "websocket":
            accept = base64.b64encode(hashlib.sha1((self.headers["Sec-WebSocket-Key"] + WS_GUID).encode()).digest())
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", accept.decode())
            self.end_headers()
            self._ws_echo()
            return
        if self.path.startswith("/big"):
            size = int(self.path.split("=")[1]) if "=" in self.path else 1 << 20
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            chunk = b"x" * (1 << 20)
            left = size
            while left:
                n = min(left, len(chunk))
                self.wfile.write(chunk[:n])
                left -= n
            return
        body = b"hello from the fake upstream\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _ws_echo(self) -> None:
        head = self.rfile.read(2)
        length = head[1] & 0x7F
        mask = self.rfile.read(4)
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
        self.wfile.write(bytes([0x81, len(payload)]) + payload)
        self.wfile.flush()


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512


def start_http(tls_dir: Path | None = None) -> tuple[Server, int, Path | None]:
    server = Server(("127.0.0.1", 0), Handler)
    cert = None
    if tls_dir is not None:
        cert = tls_dir / "cert.pem"
        key = tls_dir / "key.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=fake.test",
             "-addext", "subjectAltName=DNS:fake.test", "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True,
        )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, server.server_address[1], cert


def start_tcp(handle: Callable[[socket.socket, int], None]) -> tuple[socket.socket, int]:
    """A raw TCP server on loopback: `handle(conn, n)` runs in its own thread for the n-th connection."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)

    def loop() -> None:
        n = 0
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            n += 1
            threading.Thread(target=handle, args=(conn, n), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return sock, sock.getsockname()[1]


def start_echo() -> tuple[socket.socket, int]:
    """Each connection echoes until EOF."""

    def echo(conn: socket.socket, _n: int) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    return start_tcp(echo)


def make_ca(directory: Path, names: tuple[str, ...]) -> tuple[Path, ssl.SSLContext]:
    """A throwaway CA and a server certificate for `names`, signed by it: (the CA file for clients,
    a server context with the certificate). Used to serve a TLS upstream under a real API name."""
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    ext = directory / "srv.ext"
    ext.write_text("subjectAltName=" + ",".join(f"DNS:{n}" for n in names) + "\nextendedKeyUsage=serverAuth\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=hive relay test CA",
            "-keyout", str(ca_key), "-out", str(ca))
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={names[0]}", "-keyout", str(key), "-out", str(csr))
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-days", "2",
            "-extfile", str(ext), "-out", str(cert))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return ca, ctx
