"""A real git smart-HTTP server for tests: `git http-backend` (CGI) behind a small TLS server that
requires one credential (Basic `x-access-token:TOKEN`, as GitHub takes a token), under a real name
(github.com) with a throwaway CA (servers.make_ca). It records every request head it was sent."""

from __future__ import annotations

import base64
import os
import shutil
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class GitServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, token: str, ctx: ssl.SSLContext) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.expected = "Basic " + base64.b64encode(f"x-access-token:{token}".encode()).decode()
        self.heads: list[str] = []
        self.ctx = ctx
        self.socket = ctx.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> GitServer:
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self


class _Handler(BaseHTTPRequestHandler):
    server: GitServer
    protocol_version = "HTTP/1.0"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        self._cgi(b"")

    def do_POST(self) -> None:  # noqa: N802
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                body += self.rfile.read(size)
                self.rfile.readline()
            data = bytes(body)
        else:
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._cgi(data)

    def _cgi(self, body: bytes) -> None:
        self.server.heads.append(self.requestline + "\r\n" + str(self.headers))
        if self.headers.get("Authorization") != self.server.expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="test"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path, _, query = self.path.partition("?")
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_PROJECT_ROOT": str(self.server.root),
            "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": self.command,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
            "REMOTE_USER": "x-access-token", "REMOTE_ADDR": "127.0.0.1",
            "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
            "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""),
        }
        git = shutil.which("git") or "git"
        out = subprocess.run([git, "http-backend"], input=body, env=env, capture_output=True, timeout=60).stdout
        head, _, payload = out.partition(b"\r\n\r\n")
        if not _:
            head, _, payload = out.partition(b"\n\n")
        status = 200
        headers = []
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def bare_repo(root: Path, name: str = "o/r.git") -> Path:
    """A bare repo under `root` with one commit on main (made on the host), pushable over HTTP."""
    bare = root / name
    seed = root / "seed"

    def git(*args: str, cwd: Path | None = None) -> str:
        return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q", "--bare", "-b", "main", str(bare))
    git("config", "http.receivepack", "true", cwd=bare)
    git("init", "-q", "-b", "main", str(seed))
    (seed / "README").write_text("seed\n")
    git("add", "README", cwd=seed)
    git("-c", "user.name=host", "-c", "user.email=host@example.com", "commit", "-qm", "seed", cwd=seed)
    git("push", "-q", str(bare), "main", cwd=seed)
    shutil.rmtree(seed)
    return bare
