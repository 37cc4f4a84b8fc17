"""The outbound secret scan and the decoded view of an HTTP body: what the box sends is searched for the
host's real secrets, and what a route's upstream answers is scrubbed of its key, both on the body as
the other end reads it (after chunked framing and content-encoding), never on the wire bytes.

Its own part because every clear connection uses it the same way (plain-HTTP forwarding, credential
routes and grants, and later inspected TLS): pure bytes in, bytes out, no sockets, bounded memory.
The matching is relay/egress/redact.py's; what the secrets are is read on the host by
relay/egress/secret_source.py (`host_secrets`), never here.

- `Unchunk` takes chunked framing apart (any chunk size, extensions, trailers dropped), `Inflate`
  undoes `Content-Encoding` (gzip, deflate; nothing else has a decoder in the standard library, so
  `br` and `zstd` are refused, never passed unseen), each in bounded steps (a bomb inflates 64 KiB
  at a time, never all at once).
- `secret_forms` turns a host secret into what is searched for: only the part no placeholder of it
  shares (relay/model/credential_files.py keeps a key's prefix and a JWT's header and claims in the
  box's placeholder, so those parts are no secret), and an SSH private key into its body lines that
  hold private bytes (`ssh_key_lines`).
- `HostSecrets` is the set, shared by every connection of one proxy; `RequestScan` searches one
  request's head and decoded body, holding back only a tail that could begin a secret, so that no
  byte of a secret reaches the upstream before the request is refused.
"""

from __future__ import annotations

import re
import threading
import zlib
from collections.abc import Callable, Iterable

from relay.egress.redact import Redactor
from relay.model.record import record

STEP = 1 << 16  # the most a decoder produces from one step of input (a gzip bomb is read this much at a time)
MAX_LINE = 4096
MAX_TRAILERS = 16 * 1024
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
DECODABLE = frozenset({"gzip", "x-gzip", "deflate"})


class FramingError(ValueError):
    """The body's framing or encoding cannot be read: the message is cut there, never passed unread."""


class Unchunk:
    """Chunked transfer coding taken apart, incrementally: feed() the wire bytes, get the payload.
    Chunk extensions are ignored and trailers dropped (a trailer is never passed on, so it cannot carry
    what the body could not); `done` once the last chunk and trailers ended."""

    def __init__(self) -> None:
        self.buf = b""
        self.left = 0
        self.state = "size"
        self.trailers = 0
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out: list[bytes] = []
        while not self.done:
            if self.state == "data":
                if not self.buf:
                    break
                piece, self.buf = self.buf[:self.left], self.buf[self.left:]
                out.append(piece)
                self.left -= len(piece)
                if not self.left:
                    self.state = "crlf"
                continue
            if self.state == "crlf":
                if len(self.buf) < 2:
                    break
                if self.buf[:2] != b"\r\n":
                    raise FramingError("chunk data not followed by CRLF")
                self.buf, self.state = self.buf[2:], "size"
                continue
            end = self.buf.find(b"\n")
            if end < 0:
                if len(self.buf) > MAX_LINE:
                    raise FramingError("a chunk line over 4 KiB")
                break
            line, self.buf = self.buf[:end].rstrip(b"\r"), self.buf[end + 1:]
            if self.state == "size":
                size = line.partition(b";")[0].strip(b" \t")
                if not _HEX.fullmatch(size):
                    raise FramingError("invalid chunk size line")
                self.left = int(size, 16)
                self.state = "data" if self.left else "trailer"
            elif line:
                self.trailers += len(line) + 2
                if self.trailers > MAX_TRAILERS:
                    raise FramingError("trailers over 16 KiB")
            else:
                self.done = True
        return b"".join(out)


class Inflate:
    """`Content-Encoding` undone (a list of codings, in the order they were applied), in bounded steps:
    `pieces` yields what the input decodes to, STEP bytes at a time. `deflate` is zlib's format, or the
    raw deflate some servers send under that name (told apart by the first bytes)."""

    def __init__(self, codings: Iterable[str]) -> None:
        self.codings = list(reversed([c for c in codings if c != "identity"]))
        for coding in self.codings:
            if coding not in DECODABLE:
                raise FramingError(f"content encoding {coding!r} has no decoder here")
        self.steps: list[zlib._Decompress | None] = [None] * len(self.codings)
        self.start = [b""] * len(self.codings)

    def pieces(self, data: bytes) -> Iterable[bytes]:
        """What `data` decodes to, STEP bytes or fewer at a time (never all of a bomb in memory)."""
        yield from self._through(0, data)

    def _through(self, i: int, data: bytes) -> Iterable[bytes]:
        if i == len(self.codings):
            if data:
                yield data
            return
        d = self.steps[i]
        if d is None:
            data, self.start[i] = self.start[i] + data, b""
            gz = self.codings[i] in ("gzip", "x-gzip")
            if len(data) < 2 and not gz:  # zlib's or raw deflate: told apart by the first two bytes
                self.start[i] = data
                return
            if not data:
                return
            raw = not gz and not (len(data) > 1 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0)
            d = self.steps[i] = zlib.decompressobj(16 + zlib.MAX_WBITS if gz else -zlib.MAX_WBITS if raw else zlib.MAX_WBITS)
        while data and not d.eof:
            try:
                out = d.decompress(data, STEP)
            except zlib.error as err:
                raise FramingError(f"undecodable {self.codings[i]} body: {err}") from None
            data = d.unconsumed_tail
            yield from self._through(i + 1, out)


def codings(value: str) -> list[str]:
    """A Content-Encoding value's codings, lowercase, `identity` dropped."""
    return [c.strip().lower() for c in value.split(",") if c.strip() and c.strip().lower() != "identity"]


# --- what is searched for ---------------------------------------------------------------------------

_KEY_PREFIX = re.compile(r"^(?:[A-Za-z]{1,8}[-_])+(?:[A-Za-z0-9]{1,8}[-_])?|^AIza|^ya29\.|^1//")
_JWT = re.compile(r"^[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{16,}$")
SHORTEST_PART = 12  # a secret's own part shorter than this is searched for whole (the value as it is)


@record
class Secret:
    """One host secret as it is searched for: `name` says which (a route, a file and JSON path, a key
    file: never the value), `forms` its spellings, `least` the shortest run of each that counts."""

    name: str
    forms: tuple[str, ...]
    least: tuple[int, ...]


def secret_forms(name: str, value: str) -> Secret | None:
    """The part of `value` no placeholder shares, as is and URL-quoted: a JWT's signature (its header
    and claims are kept in the box's placeholder, and are no credential without it), a key's text after
    the prefix its placeholder keeps (`sk-ant-api03-`); the whole value when that part is short."""
    value = value.strip()
    if len(value) < 8:
        return None
    if _JWT.match(value):
        part = value.rsplit(".", 1)[1]
    else:
        m = _KEY_PREFIX.match(value)
        part = value[len(m.group(0)):] if m and len(m.group(0)) < len(value) else value
    from urllib.parse import quote  # only for a run that holds a secret

    if len(part) < SHORTEST_PART:
        forms: tuple[str, ...] = tuple(dict.fromkeys((value, quote(value, safe=""))))
        return Secret(name, forms, tuple(len(f) for f in forms))
    forms = tuple(dict.fromkeys((part, quote(part, safe=""))))
    return Secret(name, forms, tuple(Redactor.MIN_RUN for _ in forms))


_PEM = re.compile(rb"-----BEGIN ([A-Z0-9 ]*PRIVATE KEY)-----\r?\n(.*?)-----END \1-----", re.S)
_B64_LINE = re.compile(r"[A-Za-z0-9+/=]{24,}")


def ssh_key_lines(data: bytes, public: bytes | None = None) -> tuple[str, ...]:
    """The body lines of a private key file (OpenSSH or PEM) that hold private bytes, each a secret
    only as a whole line: the first lines (the format's header and the public key, the same in every
    key of a type, or public) are left out, and so is any line that shares 16 characters with the
    key's `.pub` file (the public key, which may be sent anywhere). A 64/70-character base64 line of
    private bytes is found wherever it is pasted, however the lines are joined (\\n, \\\\n, nothing)."""
    lines: list[str] = []
    pub = public.decode("latin-1", "replace") if public else ""
    shared = {pub[i:i + 16] for i in range(0, max(0, len(pub) - 15))}
    for m in _PEM.finditer(data):
        body = [ln.strip() for ln in m.group(2).decode("latin-1").splitlines()]
        body = [ln for ln in body if ln and ":" not in ln]  # PEM headers (Proc-Type, DEK-Info)
        skip = 2 if m.group(1) == b"OPENSSH PRIVATE KEY" else 1
        for ln in body[skip:]:
            if not _B64_LINE.fullmatch(ln):
                continue
            if any(ln[i:i + 16] in shared for i in range(0, len(ln) - 15)):
                continue
            lines.append(ln)
    return tuple(dict.fromkeys(lines))


class HostSecrets:
    """The host's real secrets one proxy searches for: fixed ones (route and grant values, SSH key
    lines) and `sources`, each a callable giving the current secrets of a file the host may rewrite (a
    login's refreshed token), asked again by `current()` at most every `recheck` calls' worth of time
    (the callable itself stats the file and reads it only when it changed)."""

    def __init__(self, fixed: Iterable[Secret] = (), sources: Iterable[Callable[[], list[Secret]]] = ()) -> None:
        self.fixed = [s for s in fixed if s is not None]
        self.sources = list(sources)
        self.lock = threading.Lock()
        self.version: tuple[Secret, ...] | None = None
        self.built: tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]] = ((), (), ())

    def add(self, secret: Secret | None) -> None:
        if secret is not None:
            with self.lock:
                self.fixed.append(secret)
                self.version = None

    def current(self) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
        """(forms, least, the name of each form's secret), as of now."""
        found = list(self.fixed)
        for source in self.sources:
            try:
                found += source()
            except (OSError, ValueError):
                continue  # a file that cannot be read now holds nothing this request could carry
        now = tuple(found)
        with self.lock:
            if now != self.version:
                forms, least, names = [], [], []
                for s in now:
                    forms += s.forms
                    least += s.least
                    names += [s.name] * len(s.forms)
                self.built = (tuple(forms), tuple(least), tuple(names))
                self.version = now
            return self.built

    def __bool__(self) -> bool:
        return bool(self.fixed or self.sources)


class SecretFound(Exception):
    """The box's request carries a host secret: `name` says which (never its value)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class Unscannable(Exception):
    """A request the scan cannot read (a body in an encoding with no decoder here, a compressed body
    over the bound): refused, never passed unread. `status` and `fix` are the answer's."""

    def __init__(self, reason: str, fix: str, status: str) -> None:
        super().__init__(reason)
        self.reason, self.fix, self.status = reason, fix, status


class RequestScan:
    """One request, searched as the box sent it (before any placeholder is swapped): its head, then its
    body decoded (the framing is relay/egress/http_head.py's Body; `codings` its Content-Encoding).
    `body()` returns the payload that may go on now (all but a tail that could begin a secret) or raises
    SecretFound; `end()` the rest."""

    def __init__(self, secrets: HostSecrets, codings: Iterable[str] = ()) -> None:
        forms, least, self.names = secrets.current()
        self.red = Redactor(forms, least)
        self.forms = [f.encode("latin-1") for f in forms]
        self.inflate = Inflate(codings) if list(codings) else None

    def _check(self, data: bytes) -> None:
        before = self.red.count
        out = self.red.scrub(data)
        if self.red.count != before:
            raise SecretFound(self._which(data, out))

    def _which(self, data: bytes, out: bytes) -> str:
        hit = bytes(a for a, b in zip(data, out, strict=True) if a != b)
        for form, name in zip(self.forms, self.names, strict=True):
            if hit[:8] in form or form[:8] in hit:
                return name
        return self.names[0] if self.names else "a host secret"

    def head(self, text: bytes) -> None:
        """The request line and headers (the whole head at once: it is bounded)."""
        if self.red.forms:
            self._check(text)

    def body(self, payload: bytes) -> bytes:
        """The payload (after chunked framing) that may be sent on: with no Content-Encoding all but a
        held tail; with one, the decoded stream is searched as it comes and the caller holds the wire."""
        if not self.red.forms or not payload:
            return payload
        if self.inflate is not None:
            for piece in self.inflate.pieces(payload):
                self._feed(piece)
            return payload
        return self._feed(payload)

    def _feed(self, data: bytes) -> bytes:
        before = self.red.count
        joined = self.red.held + data
        out = self.red.feed(data)
        if self.red.count != before:
            raise SecretFound(self._which(joined, self.red.scrub(joined)) if joined else "a host secret")
        return out

    def end(self) -> bytes:
        return self.red.flush()
