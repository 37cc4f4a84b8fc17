"""A TLS upstream for the credential-route benchmark, standing in for an API: `GET /sse` answers an
SSE head and its first event at once (then two more), `GET /big` streams N MB (of seeded random bytes; `GET /text` of SSE text). Runs in its own
process so the proxy under test does not share its GIL.

    tlsserver.py CERT KEY MEGABYTES   (prints its port, then serves until killed)
"""

import socket
import ssl
import sys
import threading

# A binary download: 1 MiB of seeded random bytes, the same every run. (It was one byte repeated, "x":
# with a realistic key, which has an "x", every read's end could begin a key run and was held back,
# a worst case no real download makes; and a run of one byte is the best case for `bytes.find`.)
CHUNK = __import__("random").Random(7).randbytes(1 << 20)


def _text_chunk() -> bytes:
    """1 MiB of what an API streams (SSE events of JSON with words), the same every run: the scan's
    `bytes.find` skips through a run of one byte far faster than through text, so both are measured."""
    import random

    rng = random.Random(29)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(500)]
    out = bytearray()
    while len(out) < 1 << 20:
        text = " ".join(rng.choice(words) for _ in range(12))
        out += b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"%s"}}\n\n' % text.encode()
    return bytes(out[:1 << 20])


TEXT = _text_chunk()


def serve(conn: socket.socket, ctx: ssl.SSLContext, megabytes: int) -> None:
    try:
        with ctx.wrap_socket(conn, server_side=True) as tls:
            head = b""
            while b"\r\n\r\n" not in head:
                data = tls.recv(65536)
                if not data:
                    return
                head += data
            if head.split(b" ")[1].endswith(b"/sse"):
                tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                            b"event: message_start\ndata: {}\n\n")
                for _ in range(2):
                    tls.sendall(b"event: content_block_delta\ndata: {\"text\": \"hi\"}\n\n")
                return
            tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (megabytes << 20))
            chunk = TEXT if head.split(b" ")[1].endswith(b"/text") else CHUNK
            for _ in range(megabytes):
                tls.sendall(chunk)
    except OSError:
        pass


def main() -> None:
    cert, key, megabytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    print(sock.getsockname()[1], flush=True)
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=serve, args=(conn, ctx, megabytes), daemon=True).start()


if __name__ == "__main__":
    main()
