"""HTTP/1.1 request heads and bodies, parsed strictly: pure functions of the bytes the box sent.

Split from the proxy's I/O so that the one place where a box could smuggle a request (a head or a
body an upstream would read differently from us) is small, has no sockets and no state, and is
tested as properties (tests/test_proxy_parser_props.py). Anything ambiguous is refused here, never
repaired: the proxy answers 400 with the reason.
"""

from __future__ import annotations

import re

from relay.model.allow_rules import fmt_hostport, normalize_host, split_hostport
from relay.model.errors import UsageError
from relay.model.record import record
from relay.policy import egress

MAX_HEAD = 32 * 1024
HEAD_TIMEOUT = 30.0  # a whole head must arrive within this, however it trickles in (a request's, an upstream's)


class RequestError(Exception):
    """The client sent something that is not a proxy request we accept (answered 400, logged)."""

    def __init__(self, reason: str, host: str = "-", port: int = 0) -> None:
        super().__init__(reason)
        self.host = host
        self.port = port


@record
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
    authority = fmt_hostport(host, None if port == 80 else port)
    out = "\r\n".join([f"{method} {path} {version}", f"Host: {authority}", *kept, "Connection: close", "", ""])
    return Request(method, host, port, out.encode("latin-1"), framing, length, bool(expects), path=path)


def route_head(req: Request, path: str, host: str, port: int, credential: tuple[str, str] | None) -> bytes:
    """The head an origin-form request goes upstream with: its path on the route's host, every
    credential header the client sent dropped, then the real one added (None: the key is in `path`).
    The answer is asked for uncompressed (`Accept-Encoding: identity`), so that the proxy can scrub
    the key from it should the upstream echo it (`Redactor`); a compressed echo would pass unseen."""
    authority = fmt_hostport(host, None if port == 443 else port)
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
        self.payload: list[bytes] = []  # the body's bytes as the upstream reads them, since the last take()
        self._buf = b""
        self._state = "size"
        self._trailers = 0

    def take(self) -> bytes:
        """The payload (chunked framing undone) fed since the last take: what the secret scan reads."""
        out, self.payload = b"".join(self.payload), []
        return out

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
            self.payload.append(out)
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
                self.payload.append(piece)
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
