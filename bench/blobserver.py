"""A minimal HTTP server for the benchmark: `GET /big` and `GET /mid` stream a file with sendfile (zero-copy),
`GET /small` answers a few bytes. Runs in its own process so the proxy under test does not share
its GIL. Prints its port on stdout, then serves until killed."""

import os
import socket
import sys
import threading


def serve(conn: socket.socket, blob: str, mid: str) -> None:
    with conn:
        f = conn.makefile("rb")
        while True:
            line = f.readline()
            if not line:
                return
            path = line.split()[1].decode() if len(line.split()) > 1 else "/"
            keep = True
            while (h := f.readline()) not in (b"\r\n", b"\n", b""):
                if h.lower().startswith(b"connection: close"):
                    keep = False
            if path.startswith("/big") or path.startswith("/mid"):
                name = blob if path.startswith("/big") else mid
                size = os.path.getsize(name)
                conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode())
                with open(name, "rb") as fh:
                    conn.sendfile(fh)
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
            if not keep:
                return


def main() -> None:
    blob, mid = sys.argv[1], sys.argv[2]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    print(sock.getsockname()[1], flush=True)
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=serve, args=(conn, blob, mid), daemon=True).start()


if __name__ == "__main__":
    main()
