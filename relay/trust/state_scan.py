"""The host's real secrets, looked for in every file of an agent's state before its copy enters the box.

Why: the masks (agentstate._mask_logins) replace the tokens of the login and credential files the
plan names, by file. A CLI's log or cache, a transcript that quoted a key, or an old copy under an
unrelated name can hold the same token, and would reach the box's copy as it is (issue 29). So each
file to be copied is searched for the host's real secrets (relay/egress/secret_source.host_secrets:
the routes' and grants' values, the masked login files' tokens, the deny-listed SSH keys' private
lines), and a file that holds one stays out of the box.

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
set lookup per word at C speed (`set.isdisjoint` over a `memoryview` cast, ~120 MB/s here against
~1 MB/s for `re` with the same pieces), and a hit is grown to the run it belongs to before it counts.
A file compressed with gzip, bzip2 or xz is searched decompressed (bounded); one that cannot be
(zstd, zip, past the bound) is `Unsearchable`, and stays out as well.

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
MAX_DECODED = 256 << 20  # a compressed file whose content is larger is not searched (and stays out)
SHORT = 2 * WORD - 1  # a spelling whose shortest counted run is under this is looked for with find()

_GZIP, _BZIP2, _XZ = b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00"
_UNREADABLE = {b"\x28\xb5\x2f\xfd": "zstd-compressed", b"PK\x03\x04": "a zip archive", b"\x04\x22\x4d\x18": "lz4-compressed"}


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
                    for at in range(len(text) - WORD + 1):
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
        if not self:
            return None
        ctx = self.context
        buf = b""
        start = 0  # where in buf the next unchecked word starts (always a multiple of WORD)
        for chunk in _then_end(chunks):
            final = chunk is None
            if not final:
                buf += chunk
            # Check the words that have `ctx` bytes after them (all of them at the end).
            stop = (len(buf) // WORD) * WORD if final else max(start, ((len(buf) - ctx) // WORD) * WORD)
            if stop > start and not self.keys.isdisjoint(memoryview(buf)[start:stop].cast("Q")):
                for pos in range(start, stop, WORD):
                    if int.from_bytes(buf[pos:pos + WORD], sys.byteorder) in self.keys:
                        found = self._grown(buf, pos)
                        if found:
                            return found
            if self.short:
                found = self._short_in(buf)
                if found:
                    return found
            if final:
                return None
            # Keep `ctx` bytes before the next unchecked word (and everything after it).
            cut = max(0, stop - ctx)
            buf, start = buf[cut:], stop - cut
        return None


def _then_end(chunks: Iterable[bytes]) -> Iterator[bytes | None]:
    for chunk in chunks:
        if chunk:
            yield chunk
    yield None


def _read(fd: int, first: bytes) -> Iterator[bytes]:
    if first:
        yield first
    while True:
        data = os.read(fd, BLOCK)
        if not data:
            return
        yield data


def _decoded(make, zlib_like: bool, stream: Iterator[bytes], what: str) -> Iterator[bytes]:  # noqa: ANN001
    """The decompressed bytes of STREAM (one member or several in a row), BLOCK at a time, bounded in
    total: a bomb is never held whole. A corrupt or cut-off stream is Unsearchable (what lies past the
    damage cannot be read as it would be decoded)."""
    total = 0
    dec = make()
    fed = False  # the current decoder got input: it must reach its stream's end
    try:
        for data in stream:
            while True:
                fed = fed or bool(data)
                out = dec.decompress(data, BLOCK)
                data = dec.unconsumed_tail if zlib_like else b""
                total += len(out)
                if total > MAX_DECODED:
                    raise Unsearchable(f"{what}, over {MAX_DECODED >> 20} MiB decompressed")
                if out:
                    yield out
                if dec.eof:  # a member ended: the next one (concatenated gzip) starts after it
                    data = dec.unused_data + data
                    dec, fed = make(), False
                    if not data:
                        break
                elif (not data) if zlib_like else dec.needs_input:
                    break
        if fed:
            raise Unsearchable(f"{what}, and cut off before its end")
    except (zlib.error, OSError, EOFError, ValueError) as err:  # lzma.LZMAError is an Exception: search_fd
        raise Unsearchable(f"{what}, and not readable as such ({err})") from None


def search_fd(fd: int, needles: Needles) -> str | None:
    """The name of a secret NEEDLES finds in the open regular file FD (read from its start; a file
    compressed with gzip, bzip2 or xz as decompressed), or None. Raises Unsearchable (see there)."""
    os.lseek(fd, 0, os.SEEK_SET)
    first = os.read(fd, BLOCK)
    stream = _read(fd, first)
    if first.startswith((_GZIP, _BZIP2, _XZ)):  # its bytes as they are first: a token after the magic, raw
        found = needles.search(stream)
        if found:
            return found
        os.lseek(fd, 0, os.SEEK_SET)
        first = os.read(fd, BLOCK)
        stream = _read(fd, first)
    if first.startswith(_GZIP):
        return needles.search(_decoded(lambda: zlib.decompressobj(47), True, stream, "gzip-compressed"))
    if first.startswith(_BZIP2) and len(first) > 3 and first[3:4].isdigit():
        import bz2  # only for a state that holds one: a launch does not load bz2 or lzma

        return needles.search(_decoded(bz2.BZ2Decompressor, False, stream, "bzip2-compressed"))
    if first.startswith(_XZ):
        import lzma

        try:
            return needles.search(_decoded(lambda: lzma.LZMADecompressor(lzma.FORMAT_XZ), False, stream,
                                           "xz-compressed"))
        except lzma.LZMAError as err:
            raise Unsearchable(f"xz-compressed, and not readable as such ({err})") from None
    for magic, what in _UNREADABLE.items():
        if first.startswith(magic):
            raise Unsearchable(what)
    return needles.search(stream)


def _strings(data: object, at: tuple = ()) -> Iterator[tuple[tuple, str]]:
    if isinstance(data, dict):
        for key, child in data.items():
            yield from _strings(child, (*at, key))
    elif isinstance(data, list):
        for i, child in enumerate(data):
            yield from _strings(child, (*at, i))
    elif isinstance(data, str):
        yield at, data


def masked_json(raw: bytes, needles: Needles) -> tuple[bytes, list[tuple[tuple, str]]]:
    """A JSON file (a synced file such as ~/.claude.json) with every string value that holds a host
    secret replaced by a placeholder of its shape (relay/model/credential_files.placeholder_for), and
    where each went (the sync-back puts the host's values back where the box left the placeholder).
    ValueError: not JSON, or a secret that is not in a string value (a key) is still found."""
    import json

    from relay.model import credential_files

    data = credential_files.parse(raw)
    written: list[tuple[tuple, str]] = []
    for at, value in list(_strings(data)):
        if at and needles.search([value.encode("utf-8", "surrogateescape")]):
            placeholder = credential_files.placeholder_for(value)
            target = data
            for part in at[:-1]:
                target = target[part]
            target[at[-1]] = placeholder
            written.append((at, placeholder))
    out = json.dumps(data, indent=2, ensure_ascii=False).encode()
    if needles.search([out]):
        raise ValueError("a host secret outside the file's string values")
    return out, written
