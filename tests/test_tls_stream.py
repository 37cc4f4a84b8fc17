"""relay/egress/tls_stream.py: the proxy's TLS through memory BIOs, against real OpenSSL peers on
loopback (Python's SSLSocket on the other end). What it must keep of SSLSocket's meanings (verification,
EOF, timeouts, the SNI callback) and what it is for: a read hands back every record that arrived."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from relay.egress.tls_stream import BATCH, TlsStream
from relay.host import run_ca


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[run_ca.Leaf, str]:
    work = tmp_path_factory.mktemp("tls")
    leaf = run_ca.make(str(work), ["api.example.test"], "bundle.pem")[0]
    return leaf, os.path.join(work, "bundle.pem")


def _server_ctx(leaf: run_ca.Leaf) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(leaf.cert, leaf.key)
    return ctx


@pytest.fixture
def peer(pki: tuple[run_ca.Leaf, str]) -> Iterator[Callable[[Callable[[ssl.SSLSocket], None]], int]]:
    """Start a one-connection TLS server running `act` on its SSLSocket; returns its port."""
    threads: list[threading.Thread] = []
    listeners: list[socket.socket] = []

    def start(act: Callable[[ssl.SSLSocket], None]) -> int:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def run() -> None:
            conn, _ = listener.accept()
            try:
                with _server_ctx(pki[0]).wrap_socket(conn, server_side=True) as tls:
                    act(tls)
            except (OSError, ssl.SSLError):
                pass

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
        return listener.getsockname()[1]

    yield start
    for listener in listeners:
        listener.close()
    for t in threads:
        t.join(5)


def _client(pki: tuple[run_ca.Leaf, str], port: int, name: str = "api.example.test", timeout: float = 5.0) -> TlsStream:
    return TlsStream.client(ssl.create_default_context(cafile=pki[1]), socket.create_connection(("127.0.0.1", port)),
                            name, timeout)


def test_a_read_hands_back_every_record_that_arrived_in_one_piece(pki, peer) -> None:  # noqa: ANN001
    """The reason it exists: 64 records of 16 KiB arrive; a read returns what has arrived, up to BATCH
    (an SSLSocket returns one record a read), and nothing is lost or reordered."""
    blob = os.urandom(64 * 16384)
    sent = threading.Event()

    def act(tls: ssl.SSLSocket) -> None:
        tls.sendall(blob)
        sent.set()
        tls.recv(1)  # until the client closes

    stream = _client(pki, peer(act))
    with stream:
        assert sent.wait(10)
        time.sleep(0.2)  # all of it in the socket's buffer
        got = [stream.recv()]
        while sum(map(len, got)) < len(blob):
            got.append(stream.recv())
        assert b"".join(got) == blob
        assert len(got[0]) > 16384  # all the records the socket held, in one read (an SSLSocket: one)
        assert max(map(len, got)) <= BATCH
        assert stream.version() in ("TLSv1.3", "TLSv1.2")


def test_writes_arrive_whole_at_an_sslsocket_peer(pki, peer) -> None:  # noqa: ANN001
    blob = os.urandom(3 * BATCH + 123)
    got: list[bytes] = []

    def act(tls: ssl.SSLSocket) -> None:
        while sum(map(len, got)) < len(blob):
            data = tls.recv(65536)
            if not data:
                break
            got.append(data)
        tls.sendall(b"ok")

    with _client(pki, peer(act)) as stream:
        stream.sendall(blob)
        assert stream.recv() == b"ok"
    assert b"".join(got) == blob


@pytest.mark.parametrize("how", ["close_notify", "plain close"])
def test_the_peers_close_reads_as_empty_with_or_without_close_notify(pki, peer, how: str) -> None:  # noqa: ANN001
    def act(tls: ssl.SSLSocket) -> None:
        tls.sendall(b"last words")
        if how == "close_notify":
            tls.unwrap().close()
        else:
            socket.socket.shutdown(tls, socket.SHUT_RDWR)

    with _client(pki, peer(act)) as stream:
        data = b""
        while True:
            piece = stream.recv()
            if not piece:
                break
            data += piece
        assert data == b"last words"
        assert stream.recv() == b""  # and stays so


def test_a_certificate_for_another_name_is_refused_and_the_alert_sent(pki, peer) -> None:  # noqa: ANN001
    alerted: list[object] = []
    port = socket.create_server(("127.0.0.1", 0))
    try:
        def run() -> None:
            conn, _ = port.accept()
            try:
                _server_ctx(pki[0]).wrap_socket(conn, server_side=True)
            except ssl.SSLError as err:
                alerted.append(err.reason)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        with pytest.raises(ssl.SSLCertVerificationError):
            _client(pki, port.getsockname()[1], name="other.example.test")
        t.join(5)
    finally:
        port.close()
    assert alerted and "ALERT" in str(alerted[0]).upper()  # the server heard why, as from an SSLSocket


def test_a_silent_or_trickling_peer_cannot_stretch_the_handshake(pki) -> None:  # noqa: ANN001
    """The timeout bounds the whole handshake, not each read: a server that sends one byte every
    0.2 s would keep a per-read timeout of 1 s waiting for ever."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)  # the ClientHello
            conn.sendall(b"\x16\x03\x03\x40\x00")  # a handshake record of 16 KiB is coming...
            while not stop.is_set():
                try:
                    conn.sendall(b"\x02")  # ...a byte at a time
                except OSError:
                    return
                stop.wait(0.2)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            _client(pki, listener.getsockname()[1], timeout=1.0)
        assert time.monotonic() - began < 5  # bounded (generously: a busy machine is slow, never unbounded)
    finally:
        stop.set()
        listener.close()
        t.join(5)


def test_a_read_waits_with_the_sockets_timeout(pki, peer) -> None:  # noqa: ANN001
    done = threading.Event()
    with _client(pki, peer(lambda tls: done.wait(10))) as stream:
        stream.settimeout(0.3)
        with pytest.raises(TimeoutError):
            stream.recv()
    done.set()


def test_the_server_side_runs_the_sni_callback_on_its_sslobject(pki, tmp_path: Path) -> None:  # noqa: ANN001
    """inspect.py reads the name the box asked for from the SSLObject its callback was handed."""
    ctx = _server_ctx(pki[0])
    ctx.sni_callback = lambda obj, name, _ctx: setattr(obj, "hive_sni", name)
    a, b = socket.socketpair()
    out: list[object] = []

    def serve() -> None:
        stream = TlsStream.server(ctx, a, 5)
        out.append(getattr(stream.obj, "hive_sni", None))
        stream.sendall(b"hello " + stream.recv())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    client = ssl.create_default_context(cafile=pki[1]).wrap_socket(b, server_hostname="api.example.test")
    client.sendall(b"box")
    assert client.recv(100) == b"hello box"
    t.join(5)
    client.close()
    a.close()
    assert out == ["api.example.test"]


def test_a_record_trickled_a_byte_at_a_time_cannot_stretch_a_read(pki, peer) -> None:  # noqa: ANN001
    """The socket's timeout bounds the whole read, as SSLSocket's does, not each byte: a login refresh
    (30 s for the whole answer) would otherwise hold the host's login lock for hours (red team)."""
    stop = threading.Event()

    def act(tls: ssl.SSLSocket) -> None:
        raw = socket.socket(fileno=os.dup(tls.fileno()))
        with raw:
            raw.sendall(b"\x17\x03\x03\x40\x00")  # an application-data record of 16 KiB is coming...
            until = time.monotonic() + 8  # then the close: a read that outlived its timeout ends, and fails the test
            while not stop.is_set() and time.monotonic() < until:
                try:
                    raw.sendall(b"\x00")  # ...a byte every 0.2 s
                except OSError:
                    return
                stop.wait(0.2)

    try:
        with _client(pki, peer(act)) as stream:
            stream.settimeout(1.0)
            began = time.monotonic()
            with pytest.raises(TimeoutError):
                stream.recv()
            assert time.monotonic() - began < 5  # bounded (a per-byte timeout: ~3,000 s)
            assert stream.raw.gettimeout() == 1.0  # the socket's own timeout is as it was
    finally:
        stop.set()


def test_data_before_a_bad_record_is_handed_over_then_the_error(pki) -> None:  # noqa: ANN001
    """SSLSocket returns what decrypted and raises on the next read; so does this (red team: the
    first version dropped the data)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            stream = TlsStream.server(_server_ctx(pki[0]), conn, 5)
            stream.recv()
            stream.obj.write(b"last words")
            good = stream.out.read()
            stream.obj.write(b"more")
            bad = bytearray(stream.out.read())
            bad[-1] ^= 1  # the second record's tag no longer verifies
            conn.sendall(good + bytes(bad))
            time.sleep(1)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with _client(pki, listener.getsockname()[1]) as stream:
            stream.sendall(b"go")
            time.sleep(0.3)  # both records have arrived: one read sees them together
            assert stream.recv() == b"last words"
            with pytest.raises(ssl.SSLError):
                stream.recv()
    finally:
        t.join(5)
        listener.close()


def test_an_open_stream_holds_no_read_buffer_of_its_own(pki, peer) -> None:  # noqa: ANN001
    """A box may hold hundreds of connections open (MAX_CONNECTIONS): a batch-sized buffer per stream
    was 256 KiB each, ~128 MiB for a box that opens CONNECTs and stalls (red team; kube's proxy pod
    has 256 MiB). What Python allocates for 32 open, idle streams stays small."""
    import tracemalloc

    done = threading.Event()
    ports = [peer(lambda tls: done.wait(10)) for _ in range(32)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        streams = [_client(pki, port) for port in ports]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        done.set()
    for stream in streams:
        stream.close()
    assert held < 32 * 64 * 1024, held
