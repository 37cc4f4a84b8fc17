"""The proxy's reactor: one thread that accepts a box's connections and reads their request heads.

Its own part because it is what a hostile box attacks first with numbers: many connections, slow heads,
every descriptor taken. One selector thread holds every connection that is still sending its head (an
idle connection costs a socket, not a thread), expires the slow ones (HEAD_TIMEOUT), caps how many are
open at once (MAX_CONNECTIONS: past it, 503), keeps one spare descriptor to answer a client even when
the process is out of them (EMFILE), and hands each complete head to a worker thread (`serve`). It
never blocks: everything it writes is one small non-blocking answer (relay/egress/answers.py).

What it shares with the workers is the count of open connections, under its lock: a worker gives its
slot back with `close`. Everything else here is the reactor thread's alone.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable

from relay.egress.answers import discard_pending, refuse, response, unavailable
from relay.egress.http_head import HEAD_TIMEOUT, MAX_HEAD
from relay.policy.egress import Decision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from relay.egress.decision_log import DecisionLog

MAX_CONNECTIONS = 256  # concurrent connections per box (reading a head, or being served)



UNIX_BUFFER = 4 << 20


def _big_buffers(sock: socket.socket) -> None:
    """A gvisor box's connection (the init's relay on a unix socket): each read and write there is a
    host call the Sentry makes, so larger socket buffers mean fewer (measured: the relay's ceiling
    ~650 -> ~900-1600 MB/s). The kernel caps them at net.core.[rw]mem_max; a refusal changes nothing."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, UNIX_BUFFER)
        except OSError:
            pass

class _Pending:
    """A connection still sending its request head: held by the reactor, no thread of its own."""

    __slots__ = ("sock", "buf", "deadline")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.deadline = deadline


_LISTENER, _WAKE, _CONTROL = object(), object(), object()


class Reactor:
    """Accept on `listener` (and `control`, `invoke allow|deny|ask`, each answered by `on_control` on a
    thread of its own), read heads, and start `serve(client, head, rest)` on a worker per complete head.
    The worker owns the client from then on, and calls `close` when it is done with it."""

    def __init__(self, listener: socket.socket, log: DecisionLog, serve: Callable[[socket.socket, bytes, bytes], None],
                 control: socket.socket | None = None, on_control: Callable[[socket.socket], None] | None = None,
                 max_connections: int = MAX_CONNECTIONS, head_timeout: float = HEAD_TIMEOUT) -> None:
        self.listener = listener
        self.log = log
        self.serve = serve
        self.control = control  # `invoke allow|deny` (relay/egress/control.py): a listening Unix socket in the run dir
        self.on_control = on_control
        self.max_connections = max_connections
        self.head_timeout = head_timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards `_open`, the one count the workers share
        self._open = 0
        self._pending: dict[int, _Pending] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        # Held in reserve, for answering a client when every other descriptor is taken (EMFILE).
        self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return self._open

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hive-relay-proxy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting (the listener and the control socket are closed); `join` waits for the thread."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        if self.control is not None:
            self.control.close()

    def join(self) -> None:
        if self._thread is None:
            for sock in (self._wake_r, self._wake_w):
                sock.close()
            self._close_spare()
        elif self._thread is not threading.current_thread():
            self._thread.join(timeout=1)

    def close(self, *socks: socket.socket | None) -> None:
        """Close a served connection (and its upstream), giving its slot back."""
        for sock in socks:
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
        with self._lock:
            self._open -= 1

    # The reactor thread: accept, read heads, expire slow ones, hand complete ones to workers.

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            self.listener.setblocking(False)
            sel.register(self.listener, selectors.EVENT_READ, _LISTENER)
            sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
            if self.control is not None:
                self.control.setblocking(False)
                sel.register(self.control, selectors.EVENT_READ, _CONTROL)
            tick = min(0.5, self.head_timeout / 4)
            next_sweep = time.monotonic() + tick
            while not self._stop.is_set():
                try:
                    events = sel.select(max(0.0, next_sweep - time.monotonic()))
                except OSError:
                    if self._stop.is_set():
                        return
                    raise
                for key, _ in events:
                    try:
                        if key.data is _LISTENER:
                            self._accept(sel)
                        elif key.data is _CONTROL:
                            self._accept_control()
                        elif key.data is not _WAKE:
                            self._read_head(sel, key.data)
                    except Exception:  # noqa: BLE001 - one bad connection must not stop the box's proxy
                        if isinstance(key.data, _Pending):
                            self._drop(sel, key.data, b"")
                now = time.monotonic()
                if now >= next_sweep:
                    next_sweep = now + tick
                    for pending in [p for p in self._pending.values() if p.deadline <= now]:
                        self._drop(sel, pending, response(
                            "408 Request Timeout", "-", 0,
                            f"the request head did not arrive within {self.head_timeout:g} s", ""))
        finally:
            for pending in list(self._pending.values()):
                self._drop(sel, pending, b"")
            sel.close()
            for sock in (self._wake_r, self._wake_w):
                sock.close()
            self._close_spare()

    def _close_spare(self) -> None:
        """The spare descriptor is the reactor's (it alone closes and retakes it while running)."""
        if self._spare >= 0:
            os.close(self._spare)
            self._spare = -1

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(64):  # a bounded burst, so heads in progress are read too
            try:
                client, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE) and self._refuse_without_fds():
                    continue
                if not self._stop.is_set():
                    time.sleep(0.01)  # back off rather than spin
                return
            with self._lock:
                full = self._open >= self.max_connections
                if not full:
                    self._open += 1
            if full:
                self._refuse_over_cap(client)
                continue
            if client.family == socket.AF_UNIX:
                _big_buffers(client)
            client.setblocking(False)
            pending = _Pending(client, time.monotonic() + self.head_timeout)
            self._pending[client.fileno()] = pending
            try:
                sel.register(client, selectors.EVENT_READ, pending)
            except (OSError, ValueError) as err:  # epoll out of memory (ENOMEM) or its watch limit (ENOSPC)
                del self._pending[client.fileno()]
                self._unavailable(client, "*", "the proxy could not watch the connection: "
                                  f"{getattr(err, 'strerror', None) or err}")
                self.close(client)

    def _accept_control(self) -> None:
        """One `invoke allow|deny` connection, answered on its own thread (it never blocks the reactor)."""
        assert self.control is not None and self.on_control is not None
        try:
            conn, _ = self.control.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(True)
        threading.Thread(target=self.on_control, args=(conn,), daemon=True).start()

    def _unavailable(self, client: socket.socket, host: str, reason: str, method: str = "-",
                     hint: str = "Retry shortly.", failure: bool = True) -> None:
        """The one 503 of the reactor: logged, then answered at once and without blocking. `failure`: the
        proxy's own (out of descriptors, threads, epoll watches), else the connection cap (a policy)."""
        decision = (Decision(False, host, 0, reason, unreachable=True, cause="failed") if failure
                    else Decision(False, host, 0, reason))
        self.log.record(decision, method)
        refuse(client, unavailable(host, reason, hint, header="Error" if failure else "Denied"), wait=False)

    def _refuse_without_fds(self) -> bool:
        """Out of file descriptors: give back the spare one, accept the waiting client with it and answer
        503 (it would otherwise sit unanswered in the backlog until its own timeout), then take the spare
        again. False when there is no spare (it is retaken for next time) or nobody waiting."""
        if self._spare < 0:
            self._retake_spare()
            return False
        os.close(self._spare)
        self._spare = -1
        try:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return False
            with client:
                self._unavailable(client, "*", "the proxy is out of file descriptors")
            return True
        finally:
            self._retake_spare()

    def _retake_spare(self) -> None:
        try:
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass  # still none free: the next EMFILE backs off and tries again

    def _refuse_over_cap(self, client: socket.socket) -> None:
        self._unavailable(client, "*", f"connection cap reached ({self.max_connections} concurrent connections "
                          "per box)", hint="Close idle connections and retry.", failure=False)
        client.close()

    def _read_head(self, sel: selectors.BaseSelector, pending: _Pending) -> None:
        try:
            chunk = pending.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(sel, pending, b"")
            return
        seen = len(pending.buf)
        pending.buf += chunk
        end = pending.buf.find(b"\r\n\r\n", max(0, seen - 3))
        if end < 0 or end + 4 > MAX_HEAD:
            if end >= 0 or len(pending.buf) > MAX_HEAD:
                self._drop(sel, pending, response("400 Bad Request", "-", 0, "request head too large", ""))
            return
        del self._pending[pending.sock.fileno()]
        sel.unregister(pending.sock)
        client, head, rest = pending.sock, bytes(pending.buf[: end + 4]), bytes(pending.buf[end + 4 :])
        try:
            client.setblocking(True)
            self._spawn(self.serve, client, head, rest)
        except Exception as err:  # noqa: BLE001 - no thread to be had: refuse this one, keep serving the others
            # the reactor never blocks: a fresh socket's buffer takes the answer
            self._unavailable(client, "-", f"the proxy could not start serving the request: {err or type(err).__name__}",
                              method=head.split(b" ", 1)[0][:16].decode("latin-1"))
            self.close(client)

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        """A worker thread (its own method, so a test can make it fail as a thread limit would)."""
        threading.Thread(target=target, args=args, daemon=True).start()

    def _drop(self, sel: selectors.BaseSelector, pending: _Pending, answer: bytes) -> None:
        if self._pending.pop(pending.sock.fileno(), None) is None:
            return  # already handed to a worker, or already dropped
        try:
            sel.unregister(pending.sock)
        except (KeyError, ValueError):
            pass
        if answer:
            refuse(pending.sock, answer, wait=False)
        else:
            discard_pending(pending.sock)
        self.close(pending.sock)
