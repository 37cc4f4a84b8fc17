"""kube mode's workspace server: the git bundle of the checkout, served to the run's box pods from the
proxy pod, so that no object in the API server carries it (a ConfigMap holds at most 1 MiB, and a
real checkout with history is tens or hundreds of MiB).

Two roles, both stdlib only (this file goes into the proxy image):

- `receive`: the launcher streams the bundle in through `kubectl exec -i` (the API server relays the
  stream; nothing is stored in etcd). It is written under a temporary name, bounded by the size the
  launcher announced, checked against the sha256 the launcher computed, and only then renamed to
  its served name: a box never sees half a bundle.
- `serve`: GET of the one path `/workspace.bundle`, 503 until the bundle is complete, 404 for
  anything else; no listing, no other file. The box's init container fetches it, checks the same
  sha256 (the Job carries it in an annotation and an env var) and clones it with no other network.

Why the proxy pod: the box pods already reach it and nothing else (their NetworkPolicy), so the
workspace adds no route. Why not a PVC: a ReadWriteOnce volume pins every box to one node, and
ReadOnlyMany is not offered by most storage classes.
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import os
import sys
import threading

NAME = "workspace.bundle"
PATH = "/" + NAME
PORT = 3129
CHUNK = 1 << 20
# A box can open connections and send nothing: each holds a thread (~33 KiB) until it ends, and 128 MiB
# of them OOM-kill this container, whose restarts back off past the other boxes' 300 s fetch. Idle
# connections time out, and past PER_CLIENT from one address (each box pod has its own) a new one
# is closed at once: a box can only crowd out itself.
IDLE_S = 30
PER_CLIENT = 8


def receive(directory: str, digest: str, size: int, stream=None) -> int:  # noqa: ANN001 - a binary file object
    """Stdin to DIR/workspace.bundle, all or nothing. Exit 0, or 65 with one line on stderr."""
    stream = stream or sys.stdin.buffer
    tmp = os.path.join(directory, f".incoming-{os.getpid()}")
    h, got = hashlib.sha256(), 0
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
    try:
        while chunk := stream.read(CHUNK):
            got += len(chunk)
            if got > size:
                break
            h.update(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    if got != size or h.hexdigest() != digest:
        os.unlink(tmp)
        print(f"hive-relay bundle: received {got} bytes that do not match the announced {size} bytes and sha256; "
              "nothing is served", file=sys.stderr)
        return 65
    os.rename(tmp, os.path.join(directory, NAME))
    return 0


def handler_for(directory: str) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "hive-relay-bundle"
        sys_version = ""
        timeout = IDLE_S

        def _send(self, code: int, text: str) -> None:
            body = (text + "\n").encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path != PATH:
                self._send(404, "hive-relay bundle: only /workspace.bundle is served here")
                return
            try:
                fd = os.open(os.path.join(directory, NAME), os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                self._send(503, "hive-relay bundle: not received yet; retry")
                return
            with os.fdopen(fd, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                if self.command == "HEAD":
                    return
                while chunk := fh.read(CHUNK):
                    self.wfile.write(chunk)

        do_HEAD = do_GET  # noqa: N815 - http.server's name

        def log_message(self, fmt: str, *args: object) -> None:
            print(f"hive-relay bundle: {self.address_string()} {fmt % args}", file=sys.stderr, flush=True)

    return Handler


class BoundedServer(http.server.ThreadingHTTPServer):
    """At most PER_CLIENT connections at once from one address; one more is closed unanswered."""

    daemon_threads = True

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - ThreadingHTTPServer's
        super().__init__(*args, **kwargs)
        self.lock = threading.Lock()
        self.active: dict[str, int] = {}

    def process_request(self, request, client_address) -> None:  # noqa: ANN001 - socketserver's
        with self.lock:
            n = self.active.get(client_address[0], 0)
            if n >= PER_CLIENT:
                self.shutdown_request(request)
                return
            self.active[client_address[0]] = n + 1
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:  # noqa: ANN001
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                left = self.active.pop(client_address[0], 1) - 1
                if left:
                    self.active[client_address[0]] = left

    def handle_error(self, request, client_address) -> None:  # noqa: ANN001 - a client gone is no error to print
        pass


def serve(directory: str, listen: str) -> int:
    host, _, port = listen.rpartition(":")
    server = BoundedServer((host or "0.0.0.0", int(port)), handler_for(directory))
    server.daemon_threads = True
    server.serve_forever()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m relay.modes.kube_bundle", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)
    r = sub.add_parser("receive", help="stdin to DIR/workspace.bundle, checked against --sha256 and --bytes")
    r.add_argument("--dir", required=True)
    r.add_argument("--sha256", required=True)
    r.add_argument("--bytes", type=int, required=True)
    s = sub.add_parser("serve", help="serve DIR/workspace.bundle at /workspace.bundle")
    s.add_argument("--dir", required=True)
    s.add_argument("--listen", default=f"0.0.0.0:{PORT}")
    args = ap.parse_args(argv)
    if args.role == "receive":
        return receive(args.dir, args.sha256, args.bytes)
    return serve(args.dir, args.listen)


if __name__ == "__main__":
    sys.exit(main())
