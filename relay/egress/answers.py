"""What the proxy itself says to a client: every refusal and failure it answers, in one shape, sent one way.

The parts of the proxy (the reactor, the workers, kube mode's in-pod relay) each used to write their own
refusals, and the same 503 was spelt out five times. Here is the one shape (`response`: status, the
`X-Hive-Relay-*` header with the reason, a one-line body; `policy`: the refusal sentence of
relay/model/refusal.py), and the one way to send it (`refuse`), so that no answer is lost to a reset:
the client reads the answer, then a FIN, never a RST that can destroy what it has not read yet.

It also keeps, per serving thread, whether the client has begun to hear an answer (`reply_begins`,
`reply_begun`): a worker that fails before that still owes its client one (`unanswered`).
"""

from __future__ import annotations

import socket
import threading
import time

from relay.egress.http_head import MAX_HEAD
from relay.model import refusal as denial
from relay.model.allow_rules import fmt_hostport
from relay.policy.egress import Decision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from relay.egress.decision_log import DecisionLog


def response(status: str, host: str, port: int, reason: str, hint: str, header: str = "Denied",
             phrase: str = "", rule: str | None = None) -> bytes:
    """`phrase` is added to the status line's reason phrase: a client that shows nothing of a refused
    CONNECT but its status line (pip: "Tunnel connection failed: 403 ...") then shows why, too."""
    reason = "".join(c if " " <= c <= "~" else "?" for c in reason)
    phrase = "".join(c if " " <= c <= "~" else "?" for c in phrase)
    body = f"hive-relay: {status.split(' ', 1)[1].lower()} {host}:{port}: {reason}. {hint}\n".encode()
    head = (
        f"HTTP/1.1 {status}{' ' + phrase if phrase else ''}\r\nX-Hive-Relay-{header}: {host}:{port}; {reason}\r\n"
        + (f"X-Hive-Relay-Rule: {denial.printable(rule or 'none')}\r\n" if rule is not None else "") +
        f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1", "replace") + body


def policy(status: str, host: str, port: int, reason: str, rule: str, fix: str, hint: str = "") -> bytes:
    """A refusal in the one shape (relay/model/refusal.py): the status, the policy sentence (in the reason
    phrase and the body), the rule that applies (also as `X-Hive-Relay-Rule`), and the fix."""
    said = denial.sentence(fmt_hostport(host, port), reason, rule, fix)
    return response(status, host, port, reason, f"{said}. {hint}".rstrip(), phrase=said, rule=rule)


def unavailable(host: str, reason: str, hint: str = "Retry shortly.", header: str = "Error") -> bytes:
    """The 503: the proxy cannot take this connection now (no descriptor, no thread, no epoll watch, the
    connection cap, an unreachable proxy pod). A failure, not a policy: the client may retry."""
    return response("503 Service Unavailable", host, 0, reason, hint, header=header)


def refuse(client: socket.socket, answer: bytes, *, wait: bool = True) -> None:
    """Send `answer` (a `response`) and half-close, so that the close is a FIN the client reads after it.

    `wait` (a worker's way): blocking, then read (briefly, boundedly) what the client still sends; an
    OSError is the caller's (the worker's handler knows the client is gone). Not `wait` (the reactor's
    and an accept loop's way, which must never block): one non-blocking send of the small answer, then
    what the client already sent is discarded without waiting; never raises."""
    reply_begins()
    if not wait:
        try:
            client.setblocking(False)
            client.send(answer)
            client.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        discard_pending(client)
        return
    client.sendall(answer)
    client.shutdown(socket.SHUT_WR)
    client.settimeout(1.0)
    deadline, drained = time.monotonic() + 1.0, 0
    try:
        while drained < MAX_HEAD * 32 and time.monotonic() < deadline:
            data = client.recv(65536)
            if not data:
                return
            drained += len(data)
    except OSError:
        pass


def discard_pending(sock: socket.socket) -> None:
    """Read (without waiting, boundedly) what the client already sent and we will not use: closing a
    socket with unread data sends a reset, which can destroy the answer before the client reads it."""
    try:
        sock.setblocking(False)
        for _ in range(16):
            if not sock.recv(65536):
                return
    except OSError:
        pass


def unanswered(log: DecisionLog, client: socket.socket, host: str, port: int, method: str, reason: str,
               status: str = "502 Bad Gateway", header: str = "Unreachable") -> None:
    """A request nobody answered: the upstream said nothing, or the proxy itself failed to serve it.
    One decision line, and a 502/503 with the reason, so the client never sees an empty reply."""
    log.record(Decision(False, host, port, reason, unreachable=True, cause="failed"), method)
    try:
        refuse(client, response(status, host, port, reason, "A failure, not a denial: retrying may work.",
                                header=header))
    except OSError:
        pass  # the client is gone: nobody to tell


# Whether the serving thread has begun answering its client (a refusal, a 200 to a CONNECT, a forward):
# a failure before that still owes the client an answer (EgressProxy._serve).
_REPLY = threading.local()


def new_reply() -> None:
    """A worker starts serving a request: nothing said to its client yet."""
    _REPLY.begun = False


def reply_begins() -> None:
    """From here on the client is hearing an answer (ours or the upstream's)."""
    _REPLY.begun = True


def reply_begun() -> bool:
    return bool(getattr(_REPLY, "begun", False))
