"""The host-side egress proxy: CONNECT and absolute-URI HTTP, pinned to an allowlist.

It accepts on a listening socket that lives in the box's network namespace (handed over by
the in-box init), so the box reaches exactly this proxy and nothing else. Allowed streams
are spliced byte for byte, unbuffered, so SSE and websockets flow as they are produced.
Every decision is one JSON line in the run's log.

What is allowed is not decided here: `egress.decide` judges each request, and this module only
does the I/O around it (parse, resolve when asked, connect, splice, log).
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import json
import os
import re
import selectors
import socket
import struct
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from relay.egress import tlspeek
from relay.host import safefs
from relay.model import http_rules
from relay.model import refusal as denial
from relay.model.allow_rules import HostRule, _fmt_hostport, find_rule, normalize_host, split_hostport
from relay.model.errors import UsageError
from relay.policy import egress
from relay.policy.egress import NOT_LISTED, Decision

TYPE_CHECKING = False
if TYPE_CHECKING:
    import ssl  # at run time only when a credential route is used (importing it costs ~5 ms per launch)

    from relay.model.backend import CredentialRoute

MAX_HEAD = 32 * 1024
HEAD_TIMEOUT = 30.0  # a whole request head must arrive within this, however it trickles in
BODY_TIMEOUT = 60.0  # a request body may pause this long between reads
MAX_CONNECTIONS = 256  # concurrent connections per box (reading a head, or being served)
MAX_TOLD = 20  # denied hosts announced on the caller's terminal, one line each
ASK_TIMEOUT = 30.0  # --ask: how long a denied request waits for `invoke ask` to answer
CONNECT_TIMEOUT = 15.0
CHUNK = 1 << 20
F_SETPIPE_SZ = 1031
Resolver = Callable[[str, int], list[str]]


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


# An allowed host that keeps failing: FAIL_COUNT failures within FAIL_WINDOW seconds, none answered.
FAIL_COUNT = 5
FAIL_WINDOW = 30.0
MAX_WATCHED = 4096  # host:port keys the watch remembers at once
# What a failure most likely means, by its short cause (the summary and the stuck line use these).
LIKELY = {
    "cannot resolve": "DNS does not answer for it: is this machine offline, or the name misspelt?",
    "no address": "DNS has no address for it: is the name misspelt?",
    "refused": "nothing listens there: is the service (or the pinned address) up?",
    "timed out": "no answer at all: is this machine offline, or a firewall dropping the traffic?",
    "no route": "no route to it: is this machine offline?",
    "failed": "the connection failed",
}


class RequestError(Exception):
    """The client sent something that is not a proxy request we accept (answered 400, logged)."""

    def __init__(self, reason: str, host: str = "-", port: int = 0) -> None:
        super().__init__(reason)
        self.host = host
        self.port = port


@dataclass(frozen=True)
class Request:
    """A parsed request head. `head` is the canonical head to send upstream (None for CONNECT, and for an
    origin-form request, whose head `route_head` builds once its route is known); `framing` is "none",
    "length" (with `length`) or "chunked". An origin-form request (`origin`, target `path`) is a box's
    CLI talking to its credential route `http://127.0.0.1:3128/<route>/...` as if the proxy were the API."""

    method: str
    host: str
    port: int
    head: bytes | None
    framing: str = "none"
    length: int = 0
    expect_continue: bool = False
    origin: bool = False
    path: str = ""
    version: str = "HTTP/1.1"
    kept: tuple[str, ...] = ()


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_TARGET = re.compile(r"[\x21-\x7e]+")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_CHUNK_EXT = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones this proxy writes itself; any Proxy-* goes too.
_DROPPED = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade",
                      "transfer-encoding", "content-length", "host", "expect"})


def parse_head(head: bytes) -> Request:
    """Parse a request head (without its final blank line), strictly: anything an upstream could read
    differently from us (bare CR/LF, obs-fold, conflicting or duplicate framing, odd encodings) is refused."""
    text = head.decode("latin-1")
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0") or not _TARGET.fullmatch(parts[1]):
        raise RequestError("malformed request line")
    method, target, version = parts
    if not method.isalpha() or not method.isupper() or len(method) > 16:
        raise RequestError("malformed method")
    if method == "CONNECT":
        try:
            host, port = split_hostport(target, target)
        except UsageError:
            raise RequestError("bad CONNECT target") from None
        if port is None:
            raise RequestError("CONNECT target needs host:port")
        return Request(method, _norm(host), port, None)
    origin = target.startswith("/")
    if origin:
        host, port, path = "-", 0, target.partition("#")[0]
    else:
        scheme, sep, rest = target.partition("://")
        if not sep or scheme.lower() != "http":
            raise RequestError("only absolute http:// URIs (or CONNECT) are proxied")
        cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
        authority, path = rest[:cut], rest[cut:].partition("#")[0]
        if "@" in authority:
            raise RequestError("credentials in the URI are not allowed")
        try:
            host, port = split_hostport(authority, authority)
        except UsageError:
            raise RequestError("bad host in URI") from None
        host, port = _norm(host), port or 80
        path = path if path.startswith("/") else "/" + path
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if "\r" in line or "\n" in line:
            raise RequestError("bare CR or LF in the request head", host, port)
        if line[:1] in (" ", "\t"):
            raise RequestError("obsolete line folding in the request head", host, port)
        name, colon, value = line.partition(":")
        value = value.strip(" \t")
        if not colon or not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise RequestError(f"malformed header line {line[:40]!r}", host, port)
        headers.append((name, value))

    def values(field: str) -> list[str]:
        return [v for n, v in headers if n.lower() == field]

    lengths, codings = values("content-length"), values("transfer-encoding")
    framing, length = "none", 0
    if lengths and codings:
        raise RequestError("both Content-Length and Transfer-Encoding", host, port)
    if codings:
        if len(codings) > 1 or codings[0].lower() != "chunked" or version != "HTTP/1.1":
            raise RequestError("only one 'Transfer-Encoding: chunked' (HTTP/1.1) is accepted", host, port)
        framing = "chunked"
    elif lengths:
        if len(lengths) > 1:
            raise RequestError("duplicate Content-Length", host, port)
        if not lengths[0].isdigit() or not lengths[0].isascii() or len(lengths[0]) > 15:
            raise RequestError("invalid Content-Length", host, port)
        framing, length = "length", int(lengths[0])
    expects = values("expect")
    if expects and [e.lower() for e in expects] != ["100-continue"]:
        raise RequestError("unsupported Expect", host, port)
    if origin and len(values("host")) > 1:
        raise RequestError("more than one Host header", host, port)
    # An absolute-URI request's own Host header is never sent on: the upstream gets the URI's
    # (canonical, judged) authority as Host instead, so the two cannot disagree upstream.
    listed = {t.strip().lower() for v in values("connection") for t in v.split(",")}
    kept = [f"{n}: {v}" for n, v in headers
            if n.lower() not in _DROPPED and n.lower() not in listed and not n.lower().startswith("proxy-")]
    if framing == "chunked":
        kept.append("Transfer-Encoding: chunked")
    elif framing == "length":
        kept.append(f"Content-Length: {length}")
    if origin:
        return Request(method, host, port, None, framing, length, bool(expects), True, path, version, tuple(kept))
    authority = _fmt_hostport(host, None if port == 80 else port)
    out = "\r\n".join([f"{method} {path} {version}", f"Host: {authority}", *kept, "Connection: close", "", ""])
    return Request(method, host, port, out.encode("latin-1"), framing, length, bool(expects), path=path)


def route_head(req: Request, path: str, host: str, port: int, credential: tuple[str, str] | None) -> bytes:
    """The head an origin-form request goes upstream with: its path on the route's host, every
    credential header the client sent dropped, then the real one added (None: the key is in `path`).
    The answer is asked for uncompressed (`Accept-Encoding: identity`), so that the proxy can scrub
    the key from it should the upstream echo it (`Redactor`); a compressed echo would pass unseen."""
    authority = _fmt_hostport(host, None if port == 443 else port)
    # `X_Api_Key` counts as x-api-key: CGI-style servers fold `_` and `-` into one name.
    kept = [line for line in req.kept if line.partition(":")[0].strip().lower().replace("_", "-")
            not in egress.CREDENTIAL_HEADERS | {"accept-encoding"}]
    added = [f"{credential[0]}: {credential[1]}"] if credential is not None else []
    out = "\r\n".join([f"{req.method} {path} {req.version}", f"Host: {authority}", *kept,
                        *added, "Accept-Encoding: identity", "Connection: close", "", ""])
    return out.encode("latin-1")


class Body:
    """Incremental request-body framing: feed() what the client sent, get back what to send upstream
    (chunks re-serialized canonically, trailers dropped). `done` once the body ended; `extra` is
    anything the client sent after it (a pipelined request: never forwarded)."""

    MAX_LINE = 4096
    MAX_TRAILERS = 16 * 1024

    def __init__(self, req: Request) -> None:
        self.host, self.port = req.host, req.port
        self.chunked = req.framing == "chunked"
        self.left = req.length
        self.done = not self.chunked and self.left == 0
        self.extra = b""
        self._buf = b""
        self._state = "size"
        self._trailers = 0

    def want(self) -> int:
        """How much to recv next: never past a Content-Length body's end."""
        return min(self.left, 1 << 16) if not self.chunked else 1 << 16

    def feed(self, data: bytes) -> bytes:
        try:
            return self._feed(data)
        except RequestError as err:
            raise RequestError(str(err), self.host, self.port) from None

    def _feed(self, data: bytes) -> bytes:
        if self.done:
            self.extra += data
            return b""
        if not self.chunked:
            out, self.extra = data[: self.left], data[self.left :]
            self.left -= len(out)
            self.done = self.left == 0
            return out
        self._buf += data
        out: list[bytes] = []
        while not self.done:
            if self._state == "data":
                if not self._buf:
                    break
                piece, self._buf = self._buf[: self.left], self._buf[self.left :]
                out.append(piece)
                self.left -= len(piece)
                if self.left == 0:
                    self._state = "crlf"
                continue
            if self._state == "crlf":
                if len(self._buf) < 2:
                    if self._buf not in (b"", b"\r"):
                        raise RequestError("chunk data not followed by CRLF")
                    break
                if self._buf[:2] != b"\r\n":
                    raise RequestError("chunk data not followed by CRLF")
                self._buf = self._buf[2:]
                out.append(b"\r\n")
                self._state = "size"
                continue
            line = self._line()
            if line is None:
                break
            if self._state == "size":
                size, _, ext = line.partition(b";")
                if not _HEX.fullmatch(size) or not _CHUNK_EXT.fullmatch(ext):
                    raise RequestError("invalid chunk size line")
                self.left = int(size, 16)
                if self.left:
                    out.append(b"%x\r\n" % self.left)
                    self._state = "data"
                else:
                    self._state = "trailer"
            elif line:  # a trailer field: checked, counted, dropped
                self._trailers += len(line) + 2
                name, colon, value = line.decode("latin-1").partition(":")
                if (not colon or not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value.strip(" \t"))
                        or self._trailers > self.MAX_TRAILERS):
                    raise RequestError("invalid chunked trailer")
            else:
                out.append(b"0\r\n\r\n")
                self.done = True
                self.extra, self._buf = self._buf, b""
        return b"".join(out)

    def _line(self) -> bytes | None:
        end = self._buf.find(b"\n")
        if end < 0:
            if len(self._buf) > self.MAX_LINE or b"\r" in self._buf[:-1]:
                raise RequestError("invalid chunk size line")
            return None
        if end == 0 or self._buf[end - 1] != 13 or b"\r" in self._buf[: end - 1]:
            raise RequestError("bare CR or LF in the chunked body")
        line, self._buf = self._buf[: end - 1], self._buf[end + 1 :]
        return line


def _norm(host: str) -> str:
    try:
        return normalize_host(host)
    except ValueError as err:  # hostname.HostError: the reason in words
        raise RequestError(f"invalid host: {err}") from None


def decide(rules: tuple[HostRule, ...], host: str, port: int, resolver: Resolver) -> Decision:
    """`egress.decide` with the DNS lookup done: the resolver is asked only when the verdict depends
    on the name's addresses, and a failed lookup is an I/O outcome (unreachable, "cannot resolve")."""
    decision = egress.decide(rules, host, port)
    if not decision.needs_dns:
        return decision
    try:
        addrs = resolver(host, port)
    except (OSError, UnicodeError) as err:
        detail = getattr(err, "strerror", None) or str(err)
        return Decision(False, host, port, f"cannot resolve {host}: {detail}", unreachable=True, cause="cannot resolve")
    return egress.decide(rules, host, port, tuple(addrs))


# One run's decision log; a box that floods refusals is summarized, not logged line by line.
MAX_LOG_BYTES = 64 << 20


def _open_log(path: str):  # noqa: ANN202 - a text file object
    """Create the run's log beneath the logs dir with no link followed and never blocking; the name
    carries the run id, so an existing entry there is not ours and is refused (O_EXCL)."""
    logs = os.path.dirname(path)
    os.makedirs(logs, mode=0o700, exist_ok=True)
    with safefs.base_dir(logs) as dfd:
        fd = safefs.open_beneath(dfd, os.path.basename(path),
                                 os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NONBLOCK, 0o600)
    return os.fdopen(fd, "a", buffering=1, encoding="utf-8")


class DecisionLog:
    """Append-only JSON-lines log; a write failure (full disk) is counted, never fatal."""

    def __init__(self, path: str | None, backend: str) -> None:
        self.path = path
        self.backend = backend
        self.lock = threading.Lock()
        self.denied: Counter[str] = Counter()
        self.unreachable: Counter[str] = Counter()
        self.causes: dict[str, Counter[str]] = {}
        self.allowed = 0
        self.write_errors = 0
        self._fh = None
        self.written = 0
        self.truncated = 0
        self._opened = False  # opened on the first decision: a run without traffic leaves no empty log

    def record(self, decision: Decision, method: str, extra: Mapping[str, object] | None = None) -> None:
        """One line; `extra` (a credential route's name, path and status) is added to it. Never a key."""
        entry = {
            "time": round(time.time(), 3), "backend": self.backend, "host": decision.host,
            "port": decision.port, "method": method,
            "decision": decision.kind, "reason": decision.reason,
        }
        if extra:
            entry.update(extra)
        if decision.unreachable:
            entry["cause"] = decision.cause
        with self.lock:
            key = f"{_fmt_hostport(decision.host, None)}:{decision.port}"
            if decision.allowed:
                self.allowed += 1
            elif decision.unreachable:
                self.unreachable[key] += 1
                self.causes.setdefault(key, Counter())[decision.cause] += 1
            else:
                self.denied[f"{decision.host}:{decision.port}"] += 1
            self._write(entry)

    def event(self, entry: dict[str, object]) -> None:
        """A line that is not a proxy decision (a live allow or deny): written, never counted."""
        with self.lock:
            self._write({"time": round(time.time(), 3), "backend": self.backend, **entry})

    def _write(self, entry: dict[str, object]) -> None:
        """Append one line (the caller holds the lock); the file is opened on the first line."""
        if not self._opened and self.path:
            self._opened = True
            try:
                self._fh = _open_log(self.path)
            except OSError:
                self.write_errors += 1
        if self._fh is not None:
            line = json.dumps(entry) + "\n"
            if self.written + len(line) > MAX_LOG_BYTES:
                self.truncated += 1  # a flood of refusals must not fill the disk
                return
            try:
                self._fh.write(line)
                self.written += len(line)
            except OSError:
                self.write_errors += 1

    def close(self) -> None:
        with self.lock:
            if self._fh is not None:
                try:
                    self._fh.close()
                except OSError:
                    self.write_errors += 1
                self._fh = None

    def summary(self) -> str | None:
        """The refusals' line (hosts the policy denied), or None."""
        if not self.denied:
            return None
        top = ", ".join(f"{h} ×{n}" for h, n in self.denied.most_common(5))
        more = len(self.denied) - 5
        cut = f"; the log stopped at {MAX_LOG_BYTES >> 20} MiB ({self.truncated} lines not written)" if self.truncated else ""
        return f"egress denied: {top}" + (f" and {more} more" if more > 0 else "") + cut

    def unreachable_summary(self) -> str | None:
        """Allowed hosts that could not be reached, each with its most frequent cause, or None."""
        if not self.unreachable:
            return None
        top = ", ".join(f"{h} ×{n} ({self.causes[h].most_common(1)[0][0]})" for h, n in self.unreachable.most_common(5))
        more = len(self.unreachable) - 5
        return f"unreachable (allowed, but failed): {top}" + (f" and {more} more" if more > 0 else "")

    def summary_lines(self) -> list[str]:
        """Every summary line for the end of a run: unreachable first (it is what broke the run), then denied."""
        return [line for line in (self.unreachable_summary(), self.summary()) if line]


def _response(status: str, host: str, port: int, reason: str, hint: str, header: str = "Denied",
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


def _policy(status: str, host: str, port: int, reason: str, rule: str, fix: str, hint: str = "") -> bytes:
    """A refusal in the one shape (relay/model/refusal.py): the status, the policy sentence (in the reason
    phrase and the body), the rule that applies (also as `X-Hive-Relay-Rule`), and the fix."""
    said = denial.sentence(_fmt_hostport(host, port), reason, rule, fix)
    return _response(status, host, port, reason, f"{said}. {hint}".rstrip(), phrase=said, rule=rule)


def pump(src: socket.socket, dst: socket.socket, close: bool = True) -> tuple[int, OSError | None]:
    """Copy src → dst until EOF, then half-close dst (unless `close` is False); splice keeps the bytes
    out of Python. Returns the bytes copied and the error that ended the copy (None: a clean EOF), so
    that a forward whose upstream said nothing can still be answered (a 502, not an empty reply)."""
    copied, failure = 0, None
    try:
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, CHUNK)
        except OSError:
            pass
    except OSError:
        r = w = -1
    try:
        if r >= 0 and hasattr(os, "splice"):
            sfd, dfd = src.fileno(), dst.fileno()
            while True:
                n = os.splice(sfd, w, CHUNK)
                if n == 0:
                    break
                copied += n
                while n:
                    n -= os.splice(r, dfd, n)
        else:  # pragma: no cover - every supported Linux has splice
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                copied += n
                dst.sendall(view[:n])
    except OSError as err:
        failure = err
    finally:
        if r >= 0:
            os.close(r)
            os.close(w)
        if close:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
    return copied, failure


class Redactor:
    """Scrubs a route's key (each spelling it was sent in, `egress.key_forms`) from the answer, byte for
    byte in place (same length, so Content-Length and chunk sizes stay true): an upstream that echoes
    the request (a redirect or 404 page repeating the URL with `?key=`, a debug endpoint, an error
    quoting the header) must not hand the key to the box. A partial echo is scrubbed too: any run of
    MIN_RUN or more bytes of a key spelling (an error page that cuts a long URL short would otherwise
    give the box all of the key but its last characters). Found by the spelling's aligned BLOCK-byte
    pieces (any run of 2*BLOCK-1 bytes holds one whole), each grown to the whole matching run.

    Every piece is looked for in the head and in a non-2xx answer (redirects and error pages, where
    URLs are echoed); a 2xx body (a large download, a stream) is searched for the first and last piece
    of each spelling only (`full` False): a whole key, and any echo cut at one end, are still found
    (a run of MIN_RUN bytes at the key's start or end holds one of them), for a fraction of the cost.

    A stream is scrubbed as it flows: only a tail that could continue into a key run in the next read
    is held back until then (an SSE event ends in a blank line, which no key holds, so events are
    never held); at the end it is let go, as it is at most MIN_RUN - 1 bytes of key."""

    BLOCK = 8
    MIN_RUN = 2 * BLOCK - 1

    def __init__(self, forms: tuple[str, ...]) -> None:
        self.forms = [f.encode("latin-1") for f in forms if len(f) >= 6]
        # (spelling, where its block starts, the block, the shortest run scrubbed)
        self.blocks = [(form, at, form[at:at + min(self.BLOCK, len(form))], min(self.MIN_RUN, len(form)))
                       for form in self.forms for at in range(0, len(form) - min(self.BLOCK, len(form)) + 1, self.BLOCK)]
        self.ends = [b for b in self.blocks if b[1] == 0 or b[1] + len(b[2]) == len(b[0])]
        self.ends += [(form, len(form) - self.BLOCK, form[-self.BLOCK:], self.MIN_RUN) for form in self.forms
                      if len(form) > self.BLOCK and len(form) % self.BLOCK]  # the last piece, aligned to the end
        self.full = True
        self.held = b""
        self.count = 0

    def scrub(self, data: bytes, full: bool | None = None) -> bytes:
        runs = []
        for form, at, block, least in self.blocks if (self.full if full is None else full) else self.ends:
            p = data.find(block)
            while p >= 0:
                lo, hi, a, b = p, p + len(block), at, at + len(block)
                while lo > 0 and a > 0 and data[lo - 1] == form[a - 1]:
                    lo, a = lo - 1, a - 1
                while hi < len(data) and b < len(form) and data[hi] == form[b]:
                    hi, b = hi + 1, b + 1
                if hi - lo >= least:
                    runs.append((lo, hi))
                p = data.find(block, max(hi, p + 1))
        if not runs:
            return data
        out = bytearray(data)
        last = -1
        for lo, hi in sorted(runs):
            self.count += lo > last  # runs that overlap or touch are one echo
            out[lo:hi] = b"*" * (hi - lo)
            last = max(last, hi)
        return bytes(out)

    def feed(self, data: bytes) -> bytes:
        data = self.scrub(self.held + data) if self.held else self.scrub(data)
        hold = self._tail(data)
        self.held = data[len(data) - hold:] if hold else b""
        return data[: len(data) - hold]

    def flush(self) -> bytes:
        held, self.held = self.held, b""
        return held

    def _tail(self, data: bytes) -> int:
        """The longest tail of `data` (under MIN_RUN bytes) that is a run of some spelling which the next
        read could continue (a complete spelling at the very end was scrubbed already)."""
        if not self.forms or not data or not any(data[-1:] in form for form in self.forms):
            return 0
        for n in range(min(self.MIN_RUN - 1, len(data)), 0, -1):
            tail = data[-n:]
            if any(tail in form[:-1] for form in self.forms):
                return n
        return 0


_RESPONSE_DROPPED = frozenset({b"connection", b"keep-alive", b"proxy-connection"})


def _relay_response(upstream: socket.socket, client: socket.socket, redact: Redactor | None = None) -> int:
    """Relay one response from a TLS upstream (splice cannot see through TLS): its head read boundedly
    and sent with `Connection: close` (one request per connection), interim 1xx heads passed on, then
    the body as it arrives, in small reads, so an SSE stream flows. Redirects are the client's to
    follow, through the proxy, without the key. Every byte passes `redact` (the key scrubbed) first.
    Returns the status (0: no valid answer, 502 sent; an upstream that reset or stalled before its head
    gets the client a 502 or 504 too, never an empty reply)."""
    buf, status, headed = b"", 0, False
    red = redact or Redactor(())
    try:
        upstream.settimeout(HEAD_TIMEOUT)
        for _ in range(8):
            while b"\r\n\r\n" not in buf and len(buf) <= MAX_HEAD:
                data = upstream.recv(65536)
                if not data:
                    break
                buf += data
            head, sep, buf = buf.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            parts = lines[0].split(b" ", 2)
            if (not sep or len(head) > MAX_HEAD or len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0")
                    or not (parts[1].isdigit() and len(parts[1]) == 3)):
                _answer(client, _response("502 Bad Gateway", "-", 0, "the upstream sent no valid response head", ""))
                return 0
            status = int(parts[1])
            if 100 <= status < 200 and status != 101:
                client.sendall(red.scrub(head + b"\r\n\r\n", full=True))
                continue
            listed = {t.strip().lower() for line in lines[1:] if line.partition(b":")[0].strip().lower() == b"connection"
                      for t in line.partition(b":")[2].split(b",")}
            kept = [line for line in lines[1:]
                    if line.partition(b":")[0].strip().lower() not in _RESPONSE_DROPPED | listed]
            red.full = not 200 <= status < 300  # a 2xx body: the ends of each spelling only (see Redactor)
            headed = True
            client.sendall(red.scrub(b"\r\n".join([lines[0], *kept, b"Connection: close", b"", b""]), full=True)
                           + red.feed(buf))
            break
        else:
            _answer(client, _response("502 Bad Gateway", "-", 0, "too many interim responses", ""))
            return 0
        upstream.settimeout(None)
        while True:
            data = upstream.recv(65536)
            if not data:
                break
            data = red.feed(data)
            if data:
                client.sendall(data)
        client.sendall(red.flush())
    except OSError as err:
        if not headed:
            timed_out = isinstance(err, TimeoutError)
            reason = (f"the upstream sent no response head within {HEAD_TIMEOUT:g} s" if timed_out
                      else f"the upstream failed before answering: {err.strerror or type(err).__name__}")
            try:
                _answer(client, _response("504 Gateway Timeout" if timed_out else "502 Bad Gateway", "-", 0, reason, ""))
            except OSError:
                pass
            return 0
    try:
        client.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    return status


# Whether the serving thread has begun answering its client (`_answer`, a 200 to a CONNECT, a forward):
# a failure before that still owes the client an answer (EgressProxy._serve).
_REPLY = threading.local()


def _answer(client: socket.socket, response: bytes) -> None:
    """Send a refusal and half-close, then read (briefly, boundedly) what the client still sends, so
    that closing is a FIN it reads after the answer rather than a reset that could discard it."""
    _REPLY.begun = True
    client.sendall(response)
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


def _discard_pending(sock: socket.socket) -> None:
    """Read (without waiting, boundedly) what the client already sent and we will not use: closing a
    socket with unread data sends a reset, which can destroy the answer before the client reads it."""
    try:
        sock.setblocking(False)
        for _ in range(16):
            if not sock.recv(65536):
                return
    except OSError:
        pass


def _stderr_line(line: str) -> None:
    """One line on the terminal's stderr, readable in a raw-mode TUI too (CR before and after)."""
    try:
        sys.stderr.write(("\r" if sys.stderr.isatty() else "") + line + ("\r\n" if sys.stderr.isatty() else "\n"))
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class UpstreamWatch:
    """Notices an agent stuck reconnecting: an allowed host that failed `count` times within `window`
    seconds with no connection to it answered in that time. Each such host is announced once per run
    (`notify`); `gave_up()` says whether the run as a whole is cut off: some host is stuck and no
    allowed connection at all has succeeded for `window` seconds."""

    def __init__(self, notify: Callable[[str], None] | None, count: int = FAIL_COUNT, window: float = FAIL_WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.notify = notify
        self.count = count
        self.window = window
        self.clock = clock
        self.lock = threading.Lock()
        self.failures: dict[str, deque[float]] = {}
        self.last_ok: dict[str, float] = {}
        self.any_ok: float | None = None
        self.stuck: dict[str, str] = {}  # host:port -> its cause, once announced
        self.event = threading.Event()
        self.started = clock()  # "no allowed host answered for N s" must not claim more than the run lasted

    def ok(self, host: str, port: int) -> None:
        now = self.clock()
        with self.lock:
            self.last_ok[_key(host, port)] = now
            self.any_ok = now

    def failed(self, host: str, port: int, cause: str) -> None:
        key, now = _key(host, port), self.clock()
        with self.lock:
            if key not in self.failures and len(self.failures) >= MAX_WATCHED:
                self.failures.clear()  # a box inventing names (under a wildcard) must not grow this without bound
            times = self.failures.setdefault(key, deque(maxlen=self.count))
            times.append(now)
            if key in self.stuck or len(times) < self.count or now - times[0] > self.window:
                return
            if self.last_ok.get(key, -1e18) >= times[0]:
                return
            line = (f"hive-relay: {key} is allowed but failed {len(times)} times in {now - times[0]:.1f} s "
                    f"({cause}): {LIKELY.get(cause, LIKELY['failed'])} The agent may be stuck reconnecting.")
            self.stuck[key] = cause
        if self.notify is not None:
            self.notify(line)
        self.event.set()

    def gave_up(self) -> str | None:
        """`HOST:PORT keeps failing (CAUSE)` for the first stuck host when no allowed connection has
        answered for `window` s, else None."""
        if not self.event.is_set():
            return None
        with self.lock:
            if self.any_ok is not None and self.clock() - self.any_ok < self.window:
                return None
            key, cause = next(iter(self.stuck.items()))
            if self.any_ok is None:
                return (f"{key} keeps failing ({cause}) and no allowed host has answered in the "
                        f"{self.clock() - self.started:.1f} s since the box started")
            return f"{key} keeps failing ({cause}) and no allowed host answered for {self.window:g} s"


def _key(host: str, port: int) -> str:
    return f"{_fmt_hostport(host, None)}:{port}"


class _Pending:
    """A connection still sending its request head: held by the reactor, no thread of its own."""

    __slots__ = ("sock", "buf", "deadline")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.deadline = deadline


_LISTENER, _WAKE, _CONTROL = object(), object(), object()


@dataclass(frozen=True)
class _Tunnel:
    """An open upstream connection, with what it was allowed for and where it actually went."""

    client: socket.socket
    upstream: socket.socket
    host: str
    port: int
    peer: tuple[str, int]
    method: str
    route: CredentialRoute | None = None  # a credential route's request: judged by its route's rules


def _tls_required(rules: tuple[HostRule, ...], host: str, port: int) -> bool:
    """Whether a tunnel to host:port must open with a TLS ClientHello naming it: unless some rule that
    covers it says `tls=false` (an `--allow-ssh` rule, whose pin may be another, more specific, rule)."""
    return not any(not rule.tls and rule.matches(host, port) for rule in rules)


def still_allowed(rules: tuple[HostRule, ...], host: str, port: int, peer: tuple[str, int]) -> bool:
    """Would `rules` let a connection for host:port go to `peer` (the address it is connected to)? The
    peer stands in for DNS (no lookup: the verdict is on where the bytes flow now), so a pin that changed,
    a rule removed, or an address that is now internal all say no."""
    decision = egress.decide(rules, host, port, (peer[0],))
    if not decision.allowed:
        return False
    try:
        want = ipaddress.ip_address(peer[0])
        return any(ipaddress.ip_address(addr) == want and p == peer[1] for addr, p in decision.addrs)
    except ValueError:
        return False


class EgressProxy:
    """Serve one box: accept on its listener, decide, connect, splice. Lives as long as the launcher.

    One reactor thread accepts and reads request heads for every connection (an idle connection
    costs a socket, not a thread); a complete head is handed to a worker thread. At most
    `max_connections` connections are open at once (reading a head or being served); past that a
    new connection gets 503 and is closed. CONNECT tunnels are spliced both ways; an absolute-URI
    request is parsed strictly and sent upstream alone, with `Connection: close`."""

    def __init__(
        self,
        listener: socket.socket,
        rules: tuple[HostRule, ...],
        log: DecisionLog,
        resolver: Resolver = system_resolver,
        hint: str = "",
        max_connections: int = MAX_CONNECTIONS,
        head_timeout: float = HEAD_TIMEOUT,
        notify: Callable[[str], None] | None = _stderr_line,
        watch: UpstreamWatch | None = None,
        routes: tuple[CredentialRoute, ...] = (),
        keys: Mapping[str, str | Callable[[], str]] | None = None,
        tls: ssl.SSLContext | None = None,
        origins: Mapping[HostRule, str] | None = None,
        run_id: str = "",
        control: socket.socket | None = None,
        ask: bool = False,
    ) -> None:
        self.listener = listener
        self.run_id = run_id
        self.notify = notify
        self._told: set[str] = set()  # host:port the caller was told about (the first denial of each)
        self.control = control  # `invoke allow|deny` (relay/egress/control.py): a listening Unix socket in the run dir
        self.live: set[HostRule] = set()  # rules added by `invoke allow` while the box runs
        self._rules_lock = threading.Lock()  # serializes writers; readers take `self.rules` in one read
        self.ask = ask  # --ask: hold a denied request while `invoke ask` (a watcher) answers
        self._watchers: list[socket.socket] = []
        self._questions: dict[str, threading.Event] = {}
        self._refusals: dict[str, str] = {}  # question -> why its answer (an allow) was refused
        # Where a rule came from, for its decision lines: a preset's name (presets.origins), "live".
        self.origins = dict(origins or {})
        self.routes = routes
        self.keys = dict(keys or {})  # route name -> its key; only ever written into that route's upstream head
        self.tls = tls
        self.watch = watch or UpstreamWatch(notify)
        self.rules = rules
        self.log = log
        self.resolver = resolver
        self.hint = hint
        self.max_connections = max_connections
        self.head_timeout = head_timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._open = 0
        self._pending: dict[int, _Pending] = {}
        # Connections being served to an upstream (CONNECT tunnels and plain-HTTP forwards), so that a
        # live `deny` can cut those the new rules no longer allow. Guarded by `_lock`: a socket is
        # shut down only while it is listed, and unlisted before it is closed (no fd reuse race).
        self._tunnels: dict[int, _Tunnel] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        # Held in reserve, for answering a client when every other descriptor is taken (EMFILE).
        self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def gave_up(self) -> str | None:
        """For the runner's wait loop: why a non-interactive run should end now (an allowed host keeps
        failing and nothing allowed answers), or None."""
        return self.watch.gave_up()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return self._open

    def start(self) -> None:
        self._thread = threading.Thread(target=self._reactor, name="hive-relay-proxy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
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
        with self._lock:
            watchers, self._watchers = self._watchers, []
        for conn in watchers:
            conn.close()
        self._wake(None)
        if self._thread is None:
            for sock in (self._wake_r, self._wake_w):
                sock.close()
            self._close_spare()
        elif self._thread is not threading.current_thread():
            self._thread.join(timeout=1)
        self.log.close()

    # The reactor: accept, read heads, expire slow ones, hand complete ones to workers.

    def _reactor(self) -> None:
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
                        self._drop(sel, pending, _response(
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
            client.setblocking(False)
            pending = _Pending(client, time.monotonic() + self.head_timeout)
            self._pending[client.fileno()] = pending
            try:
                sel.register(client, selectors.EVENT_READ, pending)
            except (OSError, ValueError) as err:  # epoll out of memory (ENOMEM) or its watch limit (ENOSPC)
                del self._pending[client.fileno()]
                reason = f"the proxy could not watch the connection: {getattr(err, 'strerror', None) or err}"
                self.log.record(Decision(False, "*", 0, reason, unreachable=True, cause="failed"), "-")
                try:
                    client.send(_response("503 Service Unavailable", "*", 0, reason, "Retry shortly.", header="Error"))
                    client.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                _discard_pending(client)
                self._close(client)

    def _accept_control(self) -> None:
        """One `invoke allow|deny` connection, answered on its own thread (it never blocks the reactor)."""
        from relay.egress import control

        assert self.control is not None
        try:
            conn, _ = self.control.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(True)
        threading.Thread(target=control.serve, args=(conn, self.change_rules, self._watch if self.ask else None),
                         daemon=True).start()

    def _watch(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)  # a watcher that does not read its questions is dropped, never waited on
        with self._lock:
            self._watchers.append(conn)

    def _ask(self, host: str, port: int) -> tuple[bool, str]:
        """--ask: put the question to the watchers (once per host while it is open) and wait for an answer
        (an allow, a deny or a refusal of it), at most ASK_TIMEOUT. (answered, why the answer, an allow,
        was refused: "" when it was not); False when nobody watches or answered."""
        target = _fmt_hostport(host, port)
        with self._lock:
            if not self._watchers:
                return False, ""
            event = self._questions.get(target)
            fresh = event is None
            if event is None:
                event = self._questions[target] = threading.Event()
            watchers = list(self._watchers)
        if fresh:
            line = (json.dumps({"ask": target}) + "\n").encode()
            for conn in watchers:
                try:
                    conn.sendall(line)
                except OSError:
                    with self._lock:
                        if conn in self._watchers:
                            self._watchers.remove(conn)
                    conn.close()
            with self._lock:
                if not self._watchers:
                    self._questions.pop(target, None)
                    return False, ""
        answered = event.wait(ASK_TIMEOUT)
        with self._lock:
            if self._questions.get(target) is event:
                del self._questions[target]
            refused = self._refusals.pop(target, "") if answered else ""
        return answered, refused

    def _wake(self, target: str | None) -> None:
        """Answer the open questions: all of them after an allow (any new rule may cover them), else one."""
        with self._lock:
            events = list(self._questions.values()) if target is None else [self._questions.get(target)]
        for event in events:
            if event is not None:
                event.set()

    def change_rules(self, op: str, entry: str, uid: int, question: str = "") -> dict:
        """Add (`allow`) or remove (`deny`) a rule while the box runs: the new tuple replaces the old
        in one assignment, so a request is judged wholly by one of them. Logged as a JSON line.
        `question`: the held --ask request this answers; an allow refused here releases it at once,
        its 403 saying why (rather than after ASK_TIMEOUT)."""
        reply = self._change_rules(op, entry, uid)
        if question and op == "allow" and not reply.get("ok"):
            self._refuse_question(question, str(reply.get("error", "refused")), uid)
        return reply

    def _refuse_question(self, question: str, error: str, uid: int) -> None:
        with self._lock:
            if question not in self._questions:
                return  # not held (any more): nothing to release
            self._refusals[question] = error
        host, _, port = question.rpartition(":")
        self.log.event({"host": host.strip("[]"), "port": int(port) if port.isdigit() else 0, "method": "REFUSE",
                        "decision": "live-refuse", "reason": f"invoke ask by uid {uid}: the allow was refused: {error}"})
        self._wake(question)

    def _change_rules(self, op: str, entry: str, uid: int) -> dict:
        from relay.egress import control

        if op == "refuse":  # `invoke ask` said no: the held request gets its 403 now; the rules stay
            try:
                rule = control.parse_rule(entry)
            except UsageError as err:
                return {"ok": False, "error": err.message.removeprefix("--allow-host ")}
            self._wake(rule.target)
            self.log.event({"host": rule.name, "port": rule.port or 443, "method": "REFUSE", "decision": "live-refuse",
                            "reason": f"invoke ask by uid {uid}: refused"})
            return {"ok": True, "message": f"refused {rule.target}"}
        if op == "allow":
            error = self._useless_allow(entry)
            if error:
                return {"ok": False, "error": error}
        with self._rules_lock:
            try:
                rules, rule, message = control.apply(self.rules, op, entry)
            except UsageError as err:
                return {"ok": False, "error": err.message.removeprefix("--allow-host ")}
            self.rules = rules
            if op == "allow":
                self.live.add(rule)
            else:
                self.live = {r for r in self.live if r.target != rule.target}
        host, port = rule.name if not rule.wildcard else "*." + rule.name, rule.port or 443
        self.log.event({"host": host, "port": port, "method": op.upper(), "decision": f"live-{op}",
                        "reason": f"invoke {op} by uid {uid}: {message}", "rule": rule.render()})
        cut = self._cut(rules)  # what is already open is judged by the new rules too
        if cut:
            message += f"; cut {cut} open connection{'s' if cut > 1 else ''} it no longer allows"
        with self._lock:
            self._told.discard(_fmt_hostport(host, port))  # a later denial is announced again
        self._wake(None if op == "allow" else rule.target)
        return {"ok": True, "message": message, "rules": [r.render() for r in rules]}

    def _useless_allow(self, entry: str) -> str:
        """Why a live allow of an unpinned name would change nothing (the name resolves to an internal
        address, which an unpinned rule never reaches: the DNS-rebinding guard), with the pinned entry
        that does what was meant; "" when it would work, or cannot be told (a bad entry, a failed lookup:
        `apply` and the request's own decision report those). Asked with the proxy's own resolver."""
        from relay.egress import control
        from relay.model.allow_rules import is_internal_address, is_unspecified_target

        try:
            rule = control.parse_rule(entry)
        except UsageError:
            return ""
        if rule.pin_addr is not None or rule.is_ip or rule.wildcard:
            return ""
        port = rule.port or 443
        try:
            addrs = self.resolver(rule.name, port)
        except (OSError, UnicodeError):
            return ""
        internal = [a for a in addrs if is_internal_address(a)]
        if not internal:
            return ""
        pinnable = [a for a in internal if not is_unspecified_target(a)]
        fix = (f"fix: pin it to the address meant: {denial.ENTRY} allow {_fmt_hostport(rule.name, port)}="
               f"{_fmt_hostport(pinnable[0], port)} --run {self.run_id or 'RUN'}" if pinnable else
               "fix: pin it to a reachable address with NAME:PORT=ADDR:PORT")
        return (f"{rule.target} resolves to internal address {internal[0]}, which an unpinned name is never "
                f"connected to (DNS rebinding guard), so allowing it would still deny it; {fix}")

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
                reason = "the proxy is out of file descriptors"
                self.log.record(Decision(False, "*", 0, reason, unreachable=True, cause="failed"), "-")
                try:
                    client.setblocking(False)
                    client.send(_response("503 Service Unavailable", "*", 0, reason, "Retry shortly.", header="Error"))
                    client.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                _discard_pending(client)
            return True
        finally:
            self._retake_spare()

    def _retake_spare(self) -> None:
        try:
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass  # still none free: the next EMFILE backs off and tries again

    def _refuse_over_cap(self, client: socket.socket) -> None:
        reason = f"connection cap reached ({self.max_connections} concurrent connections per box)"
        self.log.record(Decision(False, "*", 0, reason), "-")
        try:
            client.setblocking(False)
            client.send(_response("503 Service Unavailable", "*", 0, reason, "Close idle connections and retry."))
            client.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        _discard_pending(client)
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
                self._drop(sel, pending, _response("400 Bad Request", "-", 0, "request head too large", ""))
            return
        del self._pending[pending.sock.fileno()]
        sel.unregister(pending.sock)
        client, head, rest = pending.sock, bytes(pending.buf[: end + 4]), bytes(pending.buf[end + 4 :])
        try:
            client.setblocking(True)
            self._spawn(self._serve, client, head, rest)
        except Exception as err:  # noqa: BLE001 - no thread to be had: refuse this one, keep serving the others
            reason = f"the proxy could not start serving the request: {err or type(err).__name__}"
            self.log.record(Decision(False, "-", 0, reason, unreachable=True, cause="failed"),
                            head.split(b" ", 1)[0][:16].decode("latin-1"))
            try:
                client.setblocking(False)  # the reactor never blocks: a fresh socket's buffer takes this
                client.send(_response("503 Service Unavailable", "-", 0, reason, "Retry shortly.", header="Error"))
                client.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            _discard_pending(client)
            self._close(client)

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
            try:
                pending.sock.send(answer)
                pending.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        _discard_pending(pending.sock)
        self._close(pending.sock)

    def _close(self, *socks: socket.socket | None) -> None:
        """Close a served connection (and its upstream), giving its slot back."""
        for sock in socks:
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
        with self._lock:
            self._open -= 1

    # Workers: one per connection being served.

    def _serve(self, client: socket.socket, head: bytes, rest: bytes) -> None:
        upstream = None
        tracked = None
        _REPLY.begun = False
        where: tuple[str, int, str] = ("-", 0, head.split(b" ", 1)[0][:16].decode("latin-1"))
        try:
            try:
                req = parse_head(head[:-4])
                body = Body(req) if req.method != "CONNECT" else None
                first = body.feed(rest) if body is not None else rest
            except RequestError as err:
                self.log.record(Decision(False, err.host, err.port, f"bad request: {err}"), head.split(b" ", 1)[0][:16].decode("latin-1"))
                _answer(client, _policy("400 Bad Request", err.host, err.port, str(err), "",
                                        denial.rule_fix("send CONNECT host:port or one plain http:// request per "
                                                        "connection, with a canonical host name")))
                return
            if req.origin:
                assert body is not None
                upstream = self._serve_route(client, req, body, first)
                return
            host, port, method = req.host, req.port, req.method
            where = (host, port, method)
            decision = decide(self.rules, host, port, self.resolver)
            if not decision.allowed and self.ask and decision.reason in (NOT_LISTED, egress.IP_NOT_LISTED):
                answered, refused = self._ask(host, port)
                if answered:
                    decision = decide(self.rules, host, port, self.resolver)  # judged by the rules now
                if refused and not decision.allowed:  # the answer was an allow the proxy could not make
                    decision = Decision(False, host, port, f"invoke ask's allow was refused: {refused}")
            rule = find_rule(self.rules, host, port) if decision.allowed else None
            if rule is not None:  # the rule's own limits (httprules), judged before any connect
                decision = self._within_rule(rule, req, decision)
            if decision.allowed:
                upstream, cause, detail = self._connect(decision)
                if upstream is None:
                    decision = Decision(False, host, port, detail, unreachable=True, cause=cause)
                else:
                    self.watch.ok(host, port)
            peek = body is None and decision.allowed and rule is not None and _tls_required(self.rules, host, port)
            if not peek:  # a tunnel that is peeked at is logged once its first flight is judged
                self.log.record(decision, method, self._logged(decision, rule))
            if not decision.allowed:
                self._refuse(client, decision)
                return
            assert upstream is not None
            tracked = self._track(client, upstream, host, port, method)
            if body is None:
                _REPLY.begun = True
                client.sendall(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                if peek:
                    assert rule is not None
                    first = self._first_flight(client, first, decision, rule)
                    if first is None:
                        return
                if first:
                    upstream.sendall(first)
                back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
                back.start()
                pump(client, upstream)
                back.join()
                return
            assert req.head is not None
            self._forward(client, upstream, req, body, first)
        except Exception as err:  # noqa: BLE001 - one failed request must not leave its client unanswered
            if not _REPLY.begun:  # whatever failed, the client sent a whole request and is owed an answer
                detail = getattr(err, "strerror", None) or str(err) or type(err).__name__
                self._unanswered(client, *where, f"the proxy failed to serve the request: {detail}",
                                 header="Error")
            elif not isinstance(err, OSError):  # answered already, but a bug is not to pass unseen
                self.log.event({"host": where[0], "port": where[1], "method": where[2], "decision": "error",
                                "reason": f"the proxy failed while serving: {type(err).__name__}: {err}"})
        finally:
            if tracked is not None:
                with self._lock:
                    self._tunnels.pop(tracked, None)
            self._close(client, upstream)

    def _track(self, client: socket.socket, upstream: socket.socket, host: str, port: int, method: str,
               route: CredentialRoute | None = None) -> int | None:
        """List an allowed connection as open; then judge it by the rules as they are now, so that a deny
        swapped in while it connected (after it was judged, before it was listed) cuts it too."""
        try:
            peer = upstream.getpeername()[:2]
        except OSError:
            return None
        tunnel = _Tunnel(client, upstream, host, port, (peer[0], peer[1]), method, route)
        key = id(tunnel)
        with self._lock:
            self._tunnels[key] = tunnel
        self._cut(self.rules, (key,))
        return key

    def _cut(self, rules: tuple[HostRule, ...], keys: tuple[int, ...] | None = None) -> int:
        """Shut down every open connection (or those of `keys`) that `rules` no longer allow; each cut is
        a JSON line. The serving worker then sees both ends end, and closes them. Returns how many."""
        cut: list[_Tunnel] = []
        with self._lock:
            for key in list(self._tunnels) if keys is None else keys:
                tunnel = self._tunnels.get(key)
                if tunnel is None:
                    continue
                judged = egress.route_rules(rules, tunnel.route) if tunnel.route is not None else rules
                if still_allowed(judged, tunnel.host, tunnel.port, tunnel.peer):
                    continue
                del self._tunnels[key]  # listed no more: the worker's close cannot race this shutdown
                for sock in (tunnel.client, tunnel.upstream):
                    try:  # the fd itself: an SSLSocket's own shutdown would unwrap it under its reader
                        socket.socket.shutdown(sock, socket.SHUT_RDWR)
                    except OSError:
                        pass
                cut.append(tunnel)
        for tunnel in cut:
            self.log.event({"host": tunnel.host, "port": tunnel.port, "method": tunnel.method, "decision": "live-cut",
                            "reason": f"open connection to {_fmt_hostport(*tunnel.peer)} cut: the rules no longer "
                                      "allow it"})
        return len(cut)

    def _logged(self, decision: Decision, rule: HostRule | None, **extra: object) -> dict[str, object] | None:
        """A decision line's extras: where its rule came from (`_origin`), the rule itself when it
        carries options (tls=false, methods, paths), and `extra`."""
        out: dict[str, object] = dict(self._origin(decision) or {})
        if rule is not None and rule.options():
            out["rule"] = rule.render()
        out.update(extra)
        return out or None

    def _within_rule(self, rule: HostRule, req: Request, decision: Decision) -> Decision:
        """`decision` unless the request breaks its rule's methods/paths (relay/model/http_rules.py): then a
        refusal labelled `http-rule`. A CONNECT under a rule with such limits is refused (the proxy
        cannot see the request inside the tunnel), and so is an absolute-URI request whose path is
        not normalised, whatever the rule."""
        host, port = decision.host, decision.port
        if req.method == "CONNECT":
            if rule.methods or rule.paths:
                return Decision(False, host, port, f"rule {rule.render()} limits methods or paths, which a tunnel hides; "
                                "send plain http:// requests", label="http-rule")
            return decision
        why = http_rules.refusal(http_rules.from_rule(rule.methods, rule.paths), req.method, req.path)
        return Decision(False, host, port, why, label="http-rule") if why else decision

    def _first_flight(self, client: socket.socket, first: bytes, decision: Decision, rule: HostRule) -> bytes | None:
        """Read the tunnel's first TLS record (relay/egress/tlspeek.py, bounded in time and size) and judge it:
        the bytes to forward unchanged, or None when the tunnel was refused (`sni-mismatch`, or
        `opaque-tunnel` for bytes that are not TLS at all; the client told why, as far as it can hear)."""
        host, port = decision.host, decision.port
        data, hello = tlspeek.read_client_hello(client, first)
        if not data and hello.kind == "bad":  # closed before its first byte: nothing to judge or forward
            self.log.record(decision, "CONNECT", self._logged(decision, rule, sni="-", closed="before the first byte"))
            return None
        problem = tlspeek.sni_problem(hello, host)
        if hello.kind == "opaque" and hello.reason == "plain HTTP" and port != 443:
            # Plain HTTP to an HTTP port (Node 20's fetch through relay/box/nodeproxy.py tunnels http://):
            # what an absolute-URI request could send, but for its Host header, which this proxy
            # rewrites there and cannot here (the README says so). TLS's port 443 never takes it.
            self.log.record(decision, "CONNECT", self._logged(decision, rule, sni="-", inner="plain HTTP"))
            return data
        if not problem:
            self.log.record(decision, "CONNECT", self._logged(decision, rule, sni=hello.sni or "-"))
            return data
        label = "opaque-tunnel" if hello.kind == "opaque" else "sni-mismatch"
        refused = Decision(False, host, port, problem, label=label)
        self.log.record(refused, "CONNECT", {**(self._logged(refused, rule) or {}), "rule": rule.render()})
        target = _fmt_hostport(host, port)
        fix = (denial.rule_fix(f"list it with ,tls=false (e.g. --allow-host {rule.render()},tls=false) if it is "
                               "not TLS on purpose") if label == "opaque-tunnel" else
               denial.rule_fix(f"CONNECT to the host the TLS names ({hello.sni or 'none'}) and allow that"))
        said = "hive-relay: refused " + denial.sentence(target, problem, rule.render(), fix)
        if self.notify is not None:
            self.notify(said)
        try:
            if hello.kind in ("tls", "bad") and data[:1] == b"\x16":
                client.sendall(tlspeek.ALERT_ACCESS_DENIED)  # a TLS client hears a fatal alert, not text
            elif hello.reason == "plain HTTP":
                client.sendall(_policy("403 Forbidden", host, port, problem, rule.render(), fix))
            else:
                client.sendall(said.encode("ascii", "replace") + b"\r\n")
            client.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        _discard_pending(client)
        return None

    def _origin(self, decision: Decision) -> dict[str, str] | None:
        """`{"preset": NAME}` when the rule that allowed this came from a preset (or a live allow)."""
        if not (self.origins or self.live) or not (decision.allowed or decision.unreachable):
            return None
        rule = find_rule(self.rules, decision.host, decision.port)
        if rule is not None and rule in self.live:
            return {"live": "allow"}
        origin = self.origins.get(rule) if rule is not None else None
        return {"preset": origin} if origin else None

    def _refuse(self, client: socket.socket, decision: Decision) -> None:
        """Answer a request the policy denied (403) or could not serve (502/504), with the reason."""
        host, port = decision.host, decision.port
        target = _fmt_hostport(host, port)
        if decision.unreachable:
            self.watch.failed(host, port, decision.cause)
            status = "504 Gateway Timeout" if decision.cause == "timed out" else "502 Bad Gateway"
            _answer(client, _response(status, host, port, decision.reason,
                                      f"{host}:{port} is allowed, but this machine cannot reach it: "
                                      f"{LIKELY.get(decision.cause, LIKELY['failed'])}", header="Unreachable"))
            return
        hint = ""
        rule = find_rule(self.rules, host, port)
        fix = denial.allow_fix(target, self.run_id)
        if decision.reason in (NOT_LISTED, egress.IP_NOT_LISTED):
            hint = self.hint.format(host=host, port=port, target=target, run=self.run_id or "RUN")
            self._tell(target, decision.reason)
        elif decision.label == "http-rule":
            fix = denial.rule_fix("widen the rule's ,method= / ,path= options in your config or --allow-host")
        elif decision.reason.startswith("resolves to internal address"):
            fix = f"to reach it on purpose, pin it: {denial.ENTRY} allow {target}=ADDR:{port} --run {self.run_id or 'RUN'}"
        _answer(client, _policy("403 Forbidden", host, port, decision.reason, rule.render() if rule else "", fix, hint))

    def _tell(self, target: str, reason: str) -> None:
        """The caller's terminal hears of the first denial of each host:port, with the command that
        allows it while the box runs (at most MAX_TOLD hosts; the rest are in the exit summary)."""
        with self._lock:
            if target in self._told or len(self._told) > MAX_TOLD or self.notify is None:
                return
            self._told.add(target)
            last = len(self._told) > MAX_TOLD
        if last:
            self.notify("hive-relay: more hosts denied; the exit summary and `invoke logs --denied` list them")
        else:
            self.notify(f"hive-relay: egress denied {target} ({reason}); to allow it now: "
                        f"{denial.ENTRY} allow {target} --run {self.run_id or 'RUN'}")

    def _serve_route(self, client: socket.socket, req: Request, body: Body, first: bytes) -> socket.socket | None:
        """An origin-form request to `/<route>/...`: to the route's one upstream (as the egress policy
        pins it), over TLS verified for that name, with the client's credential headers replaced by the
        real key; the response streamed back. Returns the upstream socket (closed by the caller)."""
        match = egress.match_route(self.routes, req.path)
        if match.route is None:
            self.log.record(Decision(False, "-", 0, f"bad request: {match.reason}"), req.method)
            _answer(client, _response("404 Not Found", "-", 0, match.reason,
                                      "Plain-HTTP requests to the proxy go to a credential route, /ROUTE/path."))
            return None
        route = match.route
        host, port = route.upstream_host, route.upstream_port
        extra: dict[str, object] = {"route": route.name, "path": match.path.partition("?")[0][:200]}
        if route.grant:
            extra["grant"] = True
        if req.method not in egress.ROUTE_METHODS:
            reason = f"method {req.method} is not carried on a credential route (it could echo the key back)"
            self.log.record(Decision(False, host, port, reason), req.method, extra)
            _answer(client, _response("405 Method Not Allowed", host, port, reason,
                                      f"Use one of {', '.join(sorted(egress.ROUTE_METHODS))}."))
            return None
        limits = route.http_rules()
        why = http_rules.refusal(limits, req.method, match.path)
        if why:  # the route's own methods/paths, git's push (relay/model/http_rules.py): before the key is read
            refused = Decision(False, host, port, why, label="http-rule")
            self.log.record(refused, req.method, {**extra, "rule": f"/{route.name}: {limits.describe()}"})
            _answer(client, _policy("403 Forbidden", host, port, why, f"/{route.name}: {limits.describe()}",
                                    denial.rule_fix(f"widen {'auth' if route.grant else 'credentials'}.{route.name}'s "
                                                    "methods/paths (or push: true) in your user config")))
            return None
        key = self.keys.get(route.name)
        try:
            if callable(key):  # a login's token (logins.LoginStore): read, and refreshed, on the host
                key = key()
            if key is None:
                raise ValueError(f"no key for route {route.name} on the host")
            path, credential = egress.apply_credential(route, key, match.path)
        except (ValueError, OSError) as err:  # OSError: a login's refresh that could not reach its host
            decision = Decision(False, host, port, str(err))
            self.log.record(decision, req.method, extra)
            _answer(client, _response("502 Bad Gateway", host, port, str(err), "Check the key's variable on the host."))
            return None
        decision, upstream = self._verified(egress.route_rules(self.rules, route), host, port)
        if not decision.allowed:
            self.log.record(decision, req.method, extra)
            self._refuse(client, decision)
            return None
        assert upstream is not None
        self.watch.ok(host, port)
        routed = replace(req, host=host, port=port, head=route_head(req, path, host, port, credential))
        redact = Redactor(egress.key_forms(route, key))
        tracked = self._track(client, upstream, host, port, req.method, route)
        try:
            status = self._forward(client, upstream, routed, body, first,
                                   relay=lambda up, down: _relay_response(up, down, redact))
        finally:
            if tracked is not None:
                with self._lock:
                    self._tunnels.pop(tracked, None)
        extra["status"] = status
        extra["rule"] = f"/{route.name}: {limits.describe()}"  # the route's methods/paths that let it through
        if redact.count:
            extra["redacted"] = redact.count  # the upstream echoed the key: scrubbed, and said so
        self.log.record(Decision(True, host, port, f"credential route {route.name}", decision.addrs), req.method, extra)
        return upstream

    def _verified(self, rules: tuple[HostRule, ...], host: str, port: int) -> tuple[Decision, ssl.SSLSocket | None]:
        """Decide `host:port` under `rules`, connect, and verify TLS for the name: the upstream of a
        credential route and of the host's own login refresh. Not allowed or not reachable: the
        decision says why and there is no socket."""
        decision = decide(rules, host, port, self.resolver)
        if not decision.allowed:
            return decision, None
        sock, cause, detail = self._connect(decision)
        if sock is None:
            return Decision(False, host, port, detail, unreachable=True, cause=cause), None
        upstream, detail = self._tls(sock, host)
        if upstream is None:
            return Decision(False, host, port, detail, unreachable=True, cause="failed"), None
        return decision, upstream

    def open_tls(self, host: str, port: int) -> ssl.SSLSocket:
        """A verified TLS connection to an allowed host (the egress rules and their pins apply), for a
        request the host side makes itself: a login's refresh (relay/trust/logins.py). Logged like any other."""
        decision, upstream = self._verified(self.rules, host, port)
        self.log.record(decision, "POST", {"login_refresh": True})
        if upstream is None:
            raise OSError(decision.reason)
        return upstream

    def _tls(self, sock: socket.socket, host: str) -> tuple[ssl.SSLSocket | None, str]:
        """TLS to the route's upstream, verified for its name (SNI), within CONNECT_TIMEOUT."""
        if self.tls is None:
            import ssl

            self.tls = ssl.create_default_context()
        context = self.tls
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            tls = context.wrap_socket(sock, server_hostname=host)
            tls.settimeout(None)
            return tls, ""
        except (OSError, ValueError) as err:
            sock.close()
            reason = getattr(err, "reason", None) or getattr(err, "strerror", None) or type(err).__name__
            return None, f"TLS to {host} failed: {reason}"

    def _forward(self, client: socket.socket, upstream: socket.socket, req: Request, body: Body, first: bytes,
                 relay: Callable[[socket.socket, socket.socket], int] | None = None) -> int:
        """Send the one request upstream (its body re-framed as it arrives), then relay the response and
        close. Whatever the client sent after the body (a pipelined request) is never forwarded: the
        upstream gets exactly one request, and a pipelining client retries the rest after our close."""
        assert req.head is not None
        _REPLY.begun = True  # from here on the answer is the upstream's (or a 400/502 sent below)
        try:
            upstream.sendall(req.head + first)
        except OSError:
            body.done = True  # the upstream stopped listening: relay whatever it answered
        if req.expect_continue and not body.done:
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        client.settimeout(BODY_TIMEOUT)
        while not body.done:
            try:
                data = client.recv(body.want())
                if not data:
                    raise RequestError("the connection closed before the request body ended", req.host, req.port)
                out = body.feed(data)
            except (RequestError, TimeoutError) as err:
                # Abort upstream with a reset: it never sees a complete request.
                upstream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                reason = str(err) if isinstance(err, RequestError) else "request body stalled"
                self.log.record(Decision(False, req.host, req.port, f"bad request: {reason}"), req.method)
                _answer(client, _response("400 Bad Request", req.host, req.port, reason,
                                          "Send a well-framed body (Content-Length or chunked)."))
                return 400
            try:
                upstream.sendall(out)
            except OSError:
                break
        if body.extra:
            self.log.record(Decision(False, req.host, req.port, "a pipelined request after the first was dropped "
                                     "(one request per connection)"), req.method)
        client.settimeout(None)
        status = 0
        if relay is None:
            copied, failure = pump(upstream, client, close=False)
            if copied == 0:  # the upstream said nothing: the client hears why, not an empty reply
                self._unanswered(client, req.host, req.port, req.method,
                                 "the upstream reset the connection before answering" if failure is not None
                                 else "the upstream closed the connection without answering")
                return 502
            try:
                client.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        else:
            status = relay(upstream, client)
        _discard_pending(client)
        return status

    def _unanswered(self, client: socket.socket, host: str, port: int, method: str, reason: str,
                    status: str = "502 Bad Gateway", header: str = "Unreachable") -> None:
        """A request nobody answered: the upstream said nothing, or the proxy itself failed to serve it.
        One decision line, and a 502/503 with the reason, so the client never sees an empty reply."""
        self.log.record(Decision(False, host, port, reason, unreachable=True, cause="failed"), method)
        try:
            _answer(client, _response(status, host, port, reason,
                                      "A failure, not a denial: retrying may work.", header=header))
        except OSError:
            pass  # the client is gone: nobody to tell

    def _connect(self, decision: Decision) -> tuple[socket.socket | None, str, str]:
        """(the upstream socket, "", "") or (None, short cause, reason): every address tried in turn."""
        cause, detail = "no address", f"{decision.host} has no address to connect to"
        for addr, port in decision.addrs:
            try:
                sock = socket.create_connection((addr, port), timeout=CONNECT_TIMEOUT)
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock, "", ""
            except OSError as err:
                cause = _cause(err)
                where = _fmt_hostport(addr, port)
                detail = {"refused": f"upstream refused the connection ({where})",
                          "timed out": f"upstream timed out after {CONNECT_TIMEOUT:g} s ({where})",
                          "no route": f"no route to the upstream ({where})"}.get(
                    cause, f"upstream connect failed ({where}): {err.strerror or err}")
        return None, cause, detail


def _cause(err: OSError) -> str:
    if isinstance(err, TimeoutError) or err.errno == errno.ETIMEDOUT:
        return "timed out"
    if err.errno == errno.ECONNREFUSED:
        return "refused"
    if err.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN, errno.EADDRNOTAVAIL):
        return "no route"
    return "failed"
