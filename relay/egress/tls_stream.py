"""TLS over a plain socket through memory BIOs: the proxy's side of an upstream's TLS (and of an
inspected box's), read and written in large batches.

Why not `ssl.SSLSocket`: OpenSSL reads a socket one TLS record at a time, each as two `recv` calls
(its 5-byte header, then its body) and each record written as its own `send`, so a download costs
three syscalls and a Python round per 16 KiB record. Here one `recv` of up to `BATCH` bytes is
fed to OpenSSL, every whole record in it is decrypted at once, and the scrubber and the client's
socket see one large piece: measured on this machine type (2 cores), a bare relay of a 32 MB
download went from 0.59× direct TLS (SSLSocket) and 0.70× (SSLSocket drained without blocking) to
0.81–1.03× this way (docs/performance.md, `invoke bench`).

The surface is the part of a socket the proxy uses (recv, sendall, settimeout, setsockopt,
getpeername, shutdown, close, fileno) with SSLSocket's meanings: an EOF, with or without TLS's
close_notify, reads as b"" (SSLSocket's `suppress_ragged_eofs`); a timeout is `TimeoutError`; a
handshake or verification failure raises what `wrap_socket` raises. One thread uses a stream at a
time (the proxy's are per connection); another thread may only shut its socket down (`.raw`).
"""

from __future__ import annotations

import socket
import ssl
import time

BATCH = 1 << 18  # the most one recv hands back: 16 TLS records of 16 KiB
RECORD = 1 << 14  # a TLS record's most plaintext: one read's allocation, never BATCH's


class TlsStream:
    """A TLS connection on `raw`, driven through `obj` (an SSLObject over `inc`/`out` memory BIOs)."""

    def __init__(self, raw: socket.socket, obj: ssl.SSLObject, inc: ssl.MemoryBIO, out: ssl.MemoryBIO) -> None:
        self.raw, self.obj, self.inc, self.out = raw, obj, inc, out
        self.ended = False  # the peer's close (close_notify or EOF) has been read
        self.failed: OSError | None = None  # an error that came after data: raised on the next read

    # -- opening ---------------------------------------------------------------------------------

    @classmethod
    def client(cls, context: ssl.SSLContext, raw: socket.socket, server_hostname: str,
               timeout: float | None = None) -> TlsStream:
        """The client side, handshaken and verified for `server_hostname` (within `timeout` seconds)."""
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        stream = cls(raw, context.wrap_bio(inc, out, server_side=False, server_hostname=server_hostname), inc, out)
        stream.handshake(timeout)
        return stream

    @classmethod
    def server(cls, context: ssl.SSLContext, raw: socket.socket, timeout: float | None = None) -> TlsStream:
        """The server side (an inspected box's connection), handshaken within `timeout` seconds."""
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        stream = cls(raw, context.wrap_bio(inc, out, server_side=True), inc, out)
        stream.handshake(timeout)
        return stream

    def handshake(self, timeout: float | None) -> None:
        """The whole handshake within `timeout` (not per read: a peer trickling bytes cannot stretch it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        prior = self.raw.gettimeout()
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                pass
            except (OSError, ValueError):
                try:  # the alert OpenSSL wrote (a certificate that did not verify), as SSLSocket sends it
                    self._flush()
                except OSError:
                    pass
                raise
            self._flush()
            if not self._fill(deadline, RECORD + 512):  # handshake messages are small: no BATCH for a stalled peer
                raise ssl.SSLEOFError(ssl.SSL_ERROR_EOF, "the peer closed the connection during the TLS handshake")
        self._flush()
        self.raw.settimeout(prior)

    # -- reading and writing -----------------------------------------------------------------------

    def recv(self, most: int = BATCH) -> bytes:
        """Up to `most` bytes of plaintext: all that is decrypted or decryptable from what has arrived,
        waiting only while there is none, within the socket's timeout for the whole call (as SSLSocket:
        a peer sending a record a byte at a time cannot stretch it). b"": the peer closed."""
        most = max(1, min(most, BATCH))
        timeout = self.raw.gettimeout()
        deadline = time.monotonic() + timeout if timeout else None
        try:
            while True:
                got = self._decrypted(most)
                if got or self.ended:
                    return got
                self._fill(deadline)
        finally:
            if deadline is not None:
                self.raw.settimeout(timeout)

    def _fill(self, deadline: float | None, most: int = BATCH) -> bool:
        """One read of what the socket holds (up to `most`) into OpenSSL, within `deadline`; False: the
        peer closed. The buffer is the read's own, not the stream's: an idle or stalled connection
        holds none (a box may keep hundreds open; 256 KiB each would be its lever on the proxy's memory)."""
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("The read operation timed out")
            self.raw.settimeout(left)
        data = self.raw.recv(most)
        if data:
            self.inc.write(data)
        else:
            self.inc.write_eof()
        return bool(data)

    def _decrypted(self, most: int) -> bytes:
        """What OpenSSL can decrypt now, up to `most`. An error after some data (a bad record, an alert,
        a failed write of a KeyUpdate's answer) is raised on the next call, as SSLSocket does: the data
        before it is the peer's and goes on."""
        if self.failed is not None:
            failed, self.failed = self.failed, None
            raise failed
        parts: list[bytes] = []
        size = 0
        try:
            while size < most:
                piece = self.obj.read(min(most - size, RECORD))
                if not piece:
                    self.ended = True
                    break
                parts.append(piece)
                size += len(piece)
        except ssl.SSLWantReadError:
            pass
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            self.ended = True  # close_notify, or an EOF without it: b"", as SSLSocket reads both
        except OSError as err:  # ssl.SSLError is one
            if not parts:
                raise
            self.failed = err
        if self.out.pending:  # a TLS 1.3 KeyUpdate's answer, an alert
            try:
                self._flush()
            except OSError as err:
                if not parts:
                    raise
                self.failed = err
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        """All of `data`, encrypted, as few large writes to the socket."""
        view = memoryview(data).cast("B")
        timeout = self.raw.gettimeout()
        deadline = time.monotonic() + timeout if timeout else None
        try:
            while view:
                try:
                    n = self.obj.write(view[:BATCH])
                except ssl.SSLWantReadError:  # a renegotiation wants the peer's bytes first (TLS 1.2)
                    self._flush()
                    if self.ended:
                        raise ConnectionResetError("the peer closed the connection") from None
                    self._fill(deadline)
                    continue
                view = view[n:]
                self._flush()
        finally:
            if deadline is not None:
                self.raw.settimeout(timeout)

    def _flush(self) -> None:
        data = self.out.read()
        if data:
            self.raw.sendall(data)

    # -- the socket's own --------------------------------------------------------------------------

    def settimeout(self, timeout: float | None) -> None:
        self.raw.settimeout(timeout)

    def setblocking(self, flag: bool) -> None:
        self.raw.setblocking(flag)

    def setsockopt(self, *args: object) -> None:
        self.raw.setsockopt(*args)  # type: ignore[arg-type]

    def getpeername(self) -> object:
        return self.raw.getpeername()

    def fileno(self) -> int:
        return self.raw.fileno()

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()

    def selected_alpn_protocol(self) -> str | None:
        return self.obj.selected_alpn_protocol()

    def version(self) -> str | None:
        return self.obj.version()

    def __enter__(self) -> TlsStream:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

