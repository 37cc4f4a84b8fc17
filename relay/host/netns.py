"""Open the proxy listener *inside* the box's network namespace, from outside the box.

bwrap starts the box blocked (`--block-fd`) and tells us its child pid (`--info-fd`). A forked
helper joins the child's user namespace (unprivileged callers need that for the capability)
and network namespace, binds 127.0.0.1:PORT there, and sends the listening socket back over a
socketpair (SCM_RIGHTS). The host-side proxy accepts on it; the box can then only reach the
proxy, needs no AF_UNIX socket of its own, and runs no code of ours before the agent.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import time

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
BIND_WAIT = 5.0


NS_GET_USERNS = 0xB701


def _setns(fd: int, nstype: int, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns {what}: {os.strerror(err)}")


def _bind(host: str, port: int) -> socket.socket:
    deadline = time.monotonic() + BIND_WAIT
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1024)
            return sock
        except OSError as err:
            sock.close()
            # The box brings `lo` up itself; until then 127.0.0.1 does not exist in its namespace.
            if err.errno != errno.EADDRNOTAVAIL or time.monotonic() > deadline:
                raise
            time.sleep(0.001)


def listen_in(child_pid: int, listen: str, join_userns: bool) -> socket.socket:
    """Return a socket listening on `listen` inside the network namespace of `child_pid`."""
    host, port = listen.rsplit(":", 1)
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the forked helper
        code = 1
        try:
            parent.close()
            net = os.open(f"/proc/{child_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            if join_userns:
                # Join the user namespace that *owns* the box's netns. It is not always the child's
                # own: with --dev, bwrap maps us to root first and later nests a second userns,
                # where we would lack the capability over the netns (a race, seen in CI).
                owner = fcntl.ioctl(net, NS_GET_USERNS)
                _setns(owner, CLONE_NEWUSER, "user namespace owning the box's network")
            _setns(net, CLONE_NEWNET, f"/proc/{child_pid}/ns/net")
            sock = _bind(host, int(port))
            socket.send_fds(child, [b"L"], [sock.fileno()])
            code = 0
        except OSError as err:
            try:
                child.sendall(f"E{err.strerror or err}".encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    child.close()
    try:
        msg, fds, _, _ = socket.recv_fds(parent, 512, 1)
    finally:
        parent.close()
        os.waitpid(pid, 0)
    if msg == b"L" and fds:
        return socket.socket(fileno=fds[0])
    reason = msg[1:].decode(errors="replace") if msg.startswith(b"E") else "the helper died"
    raise OSError(f"cannot open the proxy listener in the box: {reason}")
