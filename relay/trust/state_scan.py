"""The host's real secrets, looked for in every file of an agent's state before its copy enters the box.

Why: the masks (agentstate._mask_logins) replace the tokens of the login and credential files the
plan names, by file. A CLI's log or cache, a transcript that quoted a key, or an old copy under an
unrelated name can hold the same token, and would reach the box's copy as it is (issue 29). So each
file to be copied is searched for the host's real secrets (relay/egress/secret_source.host_secrets:
the routes' and grants' values, the masked login files' tokens, the deny-listed SSH keys' private
lines; relay/modes/runner._host_secrets adds every backend's credential variables and files), and a
file that holds one stays out of the box.

What is looked for (`Needles`): each secret's own part (relay/egress/secret_scan.secret_forms: a
JWT's signature, a key after the prefix its placeholder keeps; a stop-44 lesson: every string a mask
changed is not a secret, and counting paths and URLs as tokens broke legitimate state), in the
spellings a file may hold it in: as is and URL-quoted (the forms given), JSON-escaped (`\\/`),
UTF-16 (little and big endian), base64 and base64url (each of the three alignments, only the
characters the secret alone decides).

How: any run of `least` (15, or the whole of a short secret or an SSH key's line) or more bytes of
a spelling is found wherever it lies, however the file cuts the token around it (a line wrap, a
SQLite overflow page). The file is read as 8-byte words at 8-byte offsets; a run of 15 bytes holds
one whole word; every word of every spelling, at every offset, is in one set, so the search is one
set lookup per word at C speed (`set.isdisjoint` over a `memoryview` cast, 200-340 MB/s here against
~1 MB/s for `re` with the same pieces), and a hit is grown to the run it belongs to before it counts.
A file compressed with gzip, bzip2, xz, lzma or zlib, or a zip archive, is searched decompressed as
well, nested to MAX_DEPTH and bounded (MAX_DECODED, `Budget`); one that cannot be (zstd, lz4, a zip
the standard library cannot read, past a bound) is `Unsearchable`, and stays out as well.

Not found: a secret shorter than 8 characters; a run shorter than `least`; other encodings (a token
encrypted, hashed, or encoded twice). docs/credentials.md says so.

A memo (relay/host/memo.py, kind STATE_SCAN) keeps, per file, its identity (device, inode, size,
mtime, ctime: ctime cannot be set back without root) and the digests of the secrets it was found
clean of, so a launch reads only the files that changed and a new token costs one pass.
"""

from __future__ import annotations

import base64
import os
import sys
import zlib
from collections.abc import Iterable, Iterator
from typing import Protocol

from relay.model.hashing import sha256

WORD = 8
BLOCK = 1 << 20  # bytes read (or decoded) at a time
MAX_DECODED = 64 << 20  # a compressed file whose content is larger is not searched (and stays out)
SHORT = 2 * WORD - 1  # a spelling whose shortest counted run is under this is looked for with find()

_GZIP, _BZIP2, _XZ = b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00"
_UNREADABLE = {b"\x28\xb5\x2f\xfd": "zstd-compressed", b"\x04\x22\x4d\x18": "lz4-compressed"}


class Sought(Protocol):
    """A host secret as the proxy's scan holds it (relay/egress/secret_scan.Secret)."""

    name: str
    forms: tuple[str, ...]
    least: tuple[int, ...]


class Unsearchable(ValueError):
    """A file whose bytes cannot be searched as they would be read (compressed in a way the standard
    library does not decode, or larger than MAX_DECODED once decoded)."""


def digest(secret: Sought) -> str:
    """What the memo keeps of a secret: a digest of its spellings (never the value)."""
    h = sha256()
    for form in secret.forms:
        h.update(form.encode("utf-8", "surrogateescape") + b"\0")
    return h.hexdigest()[:32]


def _b64_runs(raw: bytes) -> Iterator[bytes]:
    """The base64 characters `raw` alone decides, at each of the three alignments it may start at."""
    for pad in range(3):
        enc = base64.b64encode(b"\0" * pad + raw)
        first = -(-8 * pad // 6)  # the first character whose 6 bits are all raw's
        last = 8 * (pad + len(raw)) // 6  # one past the last such character
        yield enc[first:last]


def spellings(form: str, least: int) -> list[tuple[bytes, int]]:
    """FORM as a file may hold it, each with the shortest run of it that counts."""
    raw = form.encode("utf-8", "surrogateescape")
    out = [(raw, least)]
    if b"/" in raw:
        out.append((raw.replace(b"/", b"\\/"), least))
    out.append((form.encode("utf-16-le", "surrogatepass"), 2 * least))
    out.append((form.encode("utf-16-be", "surrogatepass"), 2 * least))
    out.append((raw.hex().encode(), 2 * least))  # a hex dump (xxd -p), either case
    out.append((raw.hex().upper().encode(), 2 * least))
    b64_least = -(-4 * least // 3)
    for run in _b64_runs(raw):
        out.append((run, b64_least))
        out.append((run.translate(bytes.maketrans(b"+/", b"-_")), b64_least))
    return [(text, min(n, len(text))) for text, n in dict.fromkeys(out) if len(text) >= min(n, len(text)) >= 8]


class Needles:
    """Every spelling of the secrets looked for, indexed by its 8-byte words (see the module)."""

    def __init__(self, secrets: Iterable[Sought]) -> None:
        self.names: list[str] = []
        self.texts: list[bytes] = []
        self.least: list[int] = []
        self.words: dict[int, list[tuple[int, int]]] = {}  # word -> (spelling, its offset there)
        self.short: list[int] = []  # spellings found whole with find()
        for secret in secrets:
            for form, least in zip(secret.forms, secret.least, strict=True):
                for text, run in spellings(form, least):
                    i = len(self.texts)
                    self.names.append(secret.name)
                    self.texts.append(text)
                    self.least.append(run)
                    if run < SHORT:
                        self.short.append(i)
                        continue
                    # A run of `run` bytes or more holds an aligned word within its first 8 bytes, so
                    # only the words starting up to len-run+7 are needed (an SSH key's line, counted
                    # whole: 8 words instead of ~60).
                    for at in range(min(len(text) - WORD + 1, len(text) - run + WORD)):
                        self.words.setdefault(int.from_bytes(text[at:at + WORD], sys.byteorder), []).append((i, at))
        self.keys = frozenset(self.words)
        # Bytes kept before and after a word being checked, so a run through it is seen whole.
        self.context = -(-max((len(t) for t in self.texts), default=WORD) // WORD) * WORD

    def __bool__(self) -> bool:
        return bool(self.texts)

    def _grown(self, buf: bytes, pos: int) -> str | None:
        """The secret whose run of at least `least` bytes holds the word at buf[pos:pos+8], if any."""
        for i, at in self.words.get(int.from_bytes(buf[pos:pos + WORD], sys.byteorder), ()):
            text = self.texts[i]
            left = 0
            while left < at and pos - left > 0 and buf[pos - left - 1] == text[at - left - 1]:
                left += 1
            right = WORD
            while at + right < len(text) and pos + right < len(buf) and buf[pos + right] == text[at + right]:
                right += 1
            if left + right >= self.least[i]:
                return self.names[i]
        return None

    def _short_in(self, buf: bytes) -> str | None:
        for i in self.short:
            if self.texts[i] in buf:
                return self.names[i]
        return None

    def search(self, chunks: Iterable[bytes]) -> str | None:
        """The name of the first secret found in the stream CHUNKS (bytes in order), or None."""
        scan = _Search(self)
        for chunk in chunks:
            found = scan.feed(chunk)
            if found:
                return found
        return scan.end()


class _Search:
    """One stream searched as it is pushed in (see the module): the words that have `context` bytes
    after them are checked on each push, the rest at the end."""

    def __init__(self, needles: Needles) -> None:
        self.needles = needles
        self.buf = b""
        self.start = 0  # where in buf the next unchecked word starts (a multiple of WORD from the stream's start)

    def feed(self, data: bytes) -> str | None:
        if not data or not self.needles:
            return None
        self.buf += data
        return self._check(final=False)

    def end(self) -> str | None:
        return self._check(final=True) if self.needles else None

    def _check(self, final: bool) -> str | None:
        n, buf, ctx = self.needles, self.buf, self.needles.context
        stop = (len(buf) // WORD) * WORD if final else max(self.start, ((len(buf) - ctx) // WORD) * WORD)
        if stop > self.start and not n.keys.isdisjoint(memoryview(buf)[self.start:stop].cast("Q")):
            for pos in range(self.start, stop, WORD):
                if int.from_bytes(buf[pos:pos + WORD], sys.byteorder) in n.keys:
                    found = n._grown(buf, pos)
                    if found:
                        return found
        if n.short:
            found = n._short_in(buf)
            if found:
                return found
        cut = max(0, stop - ctx)  # keep `ctx` bytes before the next unchecked word, and all after it
        self.buf, self.start = buf[cut:], stop - cut
        return None


# --- what a file holds: as it is, and as what it decompresses to ----------------------------------------

MAX_DEPTH = 3  # a compressed file inside a compressed file inside one more, and no deeper
MAX_MEMBERS = 4096  # concatenated gzip members (each one's remainder is copied by the decoder: bounded)
FEED = 1 << 16  # bytes handed to a decoder at a time (its output bound, BLOCK, keeps a bomb in check)


class Budget:
    """What decompression may cost one launch (a box could leave many small bombs in the state it
    syncs back: each costs once, the memo keeps its verdict, and past this a compressed file waits,
    out of the box, for the next launch)."""

    def __init__(self, total: int = 256 << 20) -> None:
        self.left = total

    def spend(self, n: int) -> None:
        """Count N decompressed bytes; Spent once the launch's budget is gone."""
        self.left -= n
        if self.left < 0:
            raise Spent("not searched this launch: the decompression budget is spent")


class Spent(Unsearchable):
    """The launch's decompression budget ran out (this file is not judged: no memo)."""


def _kind(head: bytes) -> str | None:
    """Which compression HEAD begins, by its magic: gzip, bzip2, xz, lzma (alone), zlib, or one we
    cannot decode (Unsearchable); None: not compressed (as far as a magic says)."""
    if head.startswith(_GZIP):
        return "gzip"
    if head.startswith(_BZIP2) and head[3:4].isdigit():
        return "bzip2"
    if head.startswith(_XZ):
        return "xz"
    if head.startswith(b"\x5d\x00\x00"):
        return "lzma"
    if len(head) >= 2 and head[0] & 0x0F == 8 and head[0] >> 4 <= 7 and (head[0] << 8 | head[1]) % 31 == 0:
        return "zlib"
    if len(head) >= 4 and head[0] & 0xF0 == 0x50 and head[1:4] == b"\x2a\x4d\x18":
        raise Unsearchable("zstd-compressed")  # a skippable frame, which zstd reads on past
    for magic, what in _UNREADABLE.items():
        if head.startswith(magic):
            raise Unsearchable(what)
    return None


def _decoder(kind: str):  # noqa: ANN202
    if kind == "gzip":
        return zlib.decompressobj(31)
    if kind == "zlib":
        return zlib.decompressobj(15)
    if kind == "bzip2":
        import bz2  # only for a state that holds one: a launch does not load bz2 or lzma

        return bz2.BZ2Decompressor()
    import lzma

    return lzma.LZMADecompressor(lzma.FORMAT_XZ if kind == "xz" else lzma.FORMAT_ALONE)


class _Stream:
    """The bytes of one stream (a file, or what a layer of it decompresses to), pushed in order:
    searched as they are, and when they begin with a compression magic, decoded (member after member)
    and pushed into a _Stream one level deeper, searched the same way. A decoder that fails (not
    really that format, damaged, cut off) stops there: what it gave was searched, and the bytes past the
    damage are searched as they are, which is all any reader gets of them."""

    def __init__(self, needles: Needles, budget: Budget, depth: int = 0, what: str = "") -> None:
        self.needles, self.budget, self.depth, self.what = needles, budget, depth, what
        self.raw = _Search(needles)
        self.head = b""
        self.kind: str | None = None
        self.decided = False
        self.dec = None
        self.inner: _Stream | None = None
        self.members = 0
        self.decoded = 0
        self.pending_magic = False  # a member ended at a read's end: what comes next decides

    def feed(self, data: bytes) -> str | None:
        found = self.raw.feed(data)
        if found:
            return found
        if not self.decided:
            self.head += data
            if len(self.head) < 8:
                return None
            data, self.head = self.head, b""
            self._decide(data)
        return self._decode(data) if self.dec is not None else None

    def end(self) -> str | None:
        if not self.decided and self.depth < MAX_DEPTH:  # a short last layer is searched as it is
            data, self.head = self.head, b""
            self._decide(data)
            found = self._decode(data) if self.dec is not None else None
            if found:
                return found
        found = self.raw.end()
        if found:
            return found
        if self.dec is not None and self.kind == "gzip" and not self.dec.eof:
            found = self._push(self.dec.flush())  # a cut-off member: what it holds is still content
            if found:
                return found
        return self.inner.end() if self.inner is not None else None

    def _decide(self, head: bytes) -> None:
        self.decided = True
        self.kind = _kind(head)
        if self.kind is not None and self.depth >= MAX_DEPTH:
            raise Unsearchable(f"{self.what}compressed more than {MAX_DEPTH} deep")
        if self.kind is not None:
            self.dec = _decoder(self.kind)
            self.inner = _Stream(self.needles, self.budget, self.depth + 1, f"{self.what}{self.kind}-compressed ")

    def _push(self, out: bytes) -> str | None:
        if not out:
            return None
        self.decoded += len(out)
        if self.decoded > MAX_DECODED:
            raise Unsearchable(f"{self.what}{self.kind}-compressed, over {MAX_DECODED >> 20} MiB decompressed")
        self.budget.spend(len(out))
        assert self.inner is not None
        return self.inner.feed(out)

    def _decode(self, data: bytes) -> str | None:
        """Push DATA through the decoder, FEED bytes at a time."""
        if self.pending_magic:
            data = data.lstrip(b"\0")
            if not data:
                return None
            self.pending_magic = False
            kind = _kind(data[:8])
            if kind is None:
                self.dec = None
                return None
            self.kind, self.dec = kind, _decoder(kind)
        view = memoryview(data)
        while view and self.dec is not None:
            piece, view = view[:FEED], view[FEED:]
            while True:
                try:
                    out = self.dec.decompress(piece, BLOCK)
                except Exception:  # noqa: BLE001 - zlib.error, OSError, EOFError, lzma.LZMAError: the format's end
                    self.dec = None
                    return None
                found = self._push(out)
                if found:
                    return found
                rest = self.dec.unconsumed_tail if self.kind in ("gzip", "zlib") else b""
                if self.dec.eof:
                    self.members += 1
                    if self.members >= MAX_MEMBERS:
                        raise Unsearchable(f"{self.what}{self.kind}-compressed, in over {MAX_MEMBERS} members")
                    # What follows a member: zero padding (xz's, or a tool's) is skipped, and any
                    # compression magic after it starts the next stream (`xz -dc` and Python's gzip read
                    # on past padding); anything else ends the decoding (its bytes were searched raw).
                    piece = (self.dec.unused_data + bytes(rest) + bytes(view)).lstrip(b"\0")
                    view = memoryview(b"")
                    if not piece:
                        self.dec = _decoder(self.kind)  # more members may follow in the next read
                        self.pending_magic = True
                        break
                    kind = _kind(piece[:8])
                    if kind is None:
                        self.dec = None
                        return None
                    self.kind, self.dec = kind, _decoder(kind)
                    continue
                if rest:
                    piece = rest
                    continue
                if self.kind in ("bzip2", "xz", "lzma") and not self.dec.needs_input:
                    piece = b""  # output held back by the bound: ask for it
                    continue
                break
        return None


def search_fd(fd: int, needles: Needles, budget: Budget | None = None) -> str | None:
    """The name of a secret NEEDLES finds in the open regular file FD (read from its start, as it is
    and as what it decompresses to), or None. Raises Unsearchable (see there)."""
    budget = budget if budget is not None else Budget()
    os.lseek(fd, 0, os.SEEK_SET)
    first = os.read(fd, BLOCK)
    if first.startswith(b"PK\x03\x04") or _zip_tail(fd, first):
        return _search_zip(fd, needles, budget)
    os.lseek(fd, len(first), os.SEEK_SET)
    stream = _Stream(needles, budget)
    data = first
    while data:
        found = stream.feed(data)
        if found:
            return found
        data = os.read(fd, BLOCK)
    return stream.end()


def _read(fd: int, first: bytes) -> Iterator[bytes]:
    if first:
        yield first
    while True:
        data = os.read(fd, BLOCK)
        if not data:
            return
        yield data


def _zip_tail(fd: int, first: bytes) -> bool:
    """Whether the file ends like a zip archive (its end-of-central-directory record in the last 64 KiB):
    unzip reads one with anything before it (a self-extracting stub) or, within limits, after it. A file
    read whole already (`first`) is not read again."""
    tail = (64 << 10) + 22
    if len(first) < BLOCK:
        return b"PK\x05\x06" in first[-tail:]
    size = os.fstat(fd).st_size
    os.lseek(fd, max(0, size - tail), os.SEEK_SET)
    return b"PK\x05\x06" in os.read(fd, tail)


def _search_zip(fd: int, needles: Needles, budget: Budget) -> str | None:
    """A zip archive: its bytes as they are, then each member as it unpacks (stored, deflate, bzip2,
    lzma), nested compression in it searched as in any stream. What the standard library cannot read
    of it (an archive it refuses, a damaged or encrypted member, another method) is Unsearchable: a
    more lenient reader (unzip) could still get its bytes out."""
    import zipfile

    os.lseek(fd, 0, os.SEEK_SET)
    found = needles.search(_read(fd, b""))
    if found:
        return found
    with os.fdopen(os.dup(fd), "rb") as fh:
        try:
            archive = zipfile.ZipFile(fh)
        except Spent:
            raise
        except Exception as err:  # noqa: BLE001 - BadZipFile, NotImplementedError, zlib.error, ...: any
            raise Unsearchable(f"a zip archive the standard library cannot open ({type(err).__name__})") from None
        with archive:
            members = archive.infolist()
            if len(members) > MAX_MEMBERS:
                raise Unsearchable(f"a zip archive of over {MAX_MEMBERS} members")
            for info in members:
                if info.flag_bits & 0x1:
                    raise Unsearchable("an encrypted zip archive")
                stream = _Stream(needles, budget, 1, "a zip member, ")
                try:
                    with archive.open(info) as member:
                        while True:
                            data = member.read(BLOCK)
                            if not data:
                                break
                            budget.spend(len(data))
                            found = stream.feed(data)
                            if found:
                                return found
                except Unsearchable:
                    raise
                except Exception as err:  # noqa: BLE001 - a damaged member, a method it lacks: unzip may differ
                    raise Unsearchable(f"a zip archive with a member the standard library cannot read "
                                       f"({type(err).__name__})") from None
                found = stream.end()
                if found:
                    return found
    return None


def _strings(data: object, at: tuple = (), keys: bool = False) -> Iterator[tuple[tuple, str]]:
    """Every string value of DATA with its path (and, with `keys`, every key as well)."""
    if isinstance(data, dict):
        for key, child in data.items():
            if keys and isinstance(key, str):
                yield (*at, key), key
            yield from _strings(child, (*at, key), keys)
    elif isinstance(data, list):
        for i, child in enumerate(data):
            yield from _strings(child, (*at, i), keys)
    elif isinstance(data, str):
        yield at, data


def json_text(raw: bytes) -> bytes:
    """A JSON file's string values, decoded (escapes undone) and one per line; b"" when it is not JSON."""
    from relay.model import credential_files

    try:
        data = credential_files.parse(raw)
    except (ValueError, RecursionError):
        return b""
    return "\n".join(v for _, v in _strings(data, keys=True)).encode("utf-8", "surrogatepass")


def masked_json(raw: bytes, needles: Needles) -> tuple[bytes, list[tuple]]:
    """A JSON file (a synced file such as ~/.claude.json) with every string value that holds a host
    secret replaced by a placeholder of its shape (relay/model/credential_files.placeholder_for), and
    where each went (the sync-back puts the host's values back where the box left the placeholder).
    ValueError: not JSON, or a secret that is not in a string value (a key) is still found."""
    import json

    from relay.model import credential_files

    data = credential_files.parse(raw)
    written: list[tuple] = []
    for at, value in list(_strings(data)):
        if at and needles.search([value.encode("utf-8", "surrogatepass")]):
            placeholder = credential_files.placeholder_for(value)
            credential_files._put(data, at, placeholder)
            # Put back at sync-back only while the object holding it is otherwise the host's (a box that
            # changed the URL beside a key keeps the placeholder), whatever changed around that object.
            written.append((at, placeholder, at[:-1]))
    out = json.dumps(data, indent=2, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if needles.search([out]) or needles.search([json_text(out)]):  # a key holds one: no placeholder can
        raise ValueError("a host secret outside the file's string values")
    return out, written
