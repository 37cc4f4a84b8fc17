"""Scrubbing a credential route's key from what its upstream answers, before the box reads it, and
finding a host secret in what the box sends (relay/egress/secret_scan.py builds on it).

Its own module because it is the one defence against an upstream that echoes the request (the box
would otherwise read back the key the proxy added): pure bytes in, bytes out, no sockets, tested on
its own (tests/escape/test_credential_reflection.py, tests/escape/test_secret_scan.py).
"""

from __future__ import annotations

from collections.abc import Sequence

# CPython's bytes.find turns to its two-way search on a haystack of 30,000 bytes or more (a needle
# under 100), which on text and on random bytes runs at half the speed of its default search for the
# 8- to 32-byte pieces here (measured on 256 KiB reads: 0.23 against 0.13 ms per MiB a piece). A
# large read is therefore searched in windows under that size, overlapping by a piece's length.
WINDOW = 28_000
# glibc's memmem (a shift table on pairs of bytes) is faster again: three pieces over 256 KiB reads of
# SSE text 0.21 against 0.58 ms per MiB (bytes.find, windowed or not), on random bytes 0.21 against
# 0.49; the proxy's whole route costs ~1.7. A foreign call costs ~1.4 µs, so small reads (an SSE
# event) keep bytes.find. Where ctypes or memmem is missing, bytes.find does it all.
NATIVE_FROM = 8192
_native: list = []  # [memmem or None], made on first use (ctypes costs an import a launch need not pay)


def _memmem():  # noqa: ANN202 - a ctypes function or None
    if not _native:
        try:
            import ctypes

            fn = ctypes.CDLL(None).memmem
            fn.restype = ctypes.c_void_p
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
            address = ctypes.c_void_p

            def memmem(data: bytes, block: bytes, start: int) -> int:
                base = ctypes.cast(data, address).value  # the bytes' own buffer: no copy
                at = fn(base + start, len(data) - start, block, len(block))
                return -1 if at is None else at - base

            _native.append(memmem)
        except (ImportError, OSError, AttributeError):
            _native.append(None)
    return _native[0]


def find(data: bytes, block: bytes, start: int = 0) -> int:
    """`data.find(block, start)`: by memmem on a large read, else window by window (WINDOW)."""
    last = len(data) - len(block)
    if start > last:
        return -1
    if last - start >= NATIVE_FROM and type(data) is bytes:
        native = _memmem()
        if native is not None:
            return native(data, block, start)
    while start <= last:
        p = data.find(block, start, start + WINDOW + len(block) - 1)
        if p >= 0:
            return p
        start += WINDOW
    return -1


class Redactor:
    """Scrubs a route's key (each spelling it was sent in, `egress.key_forms`) from the answer, byte for
    byte in place (same length, so Content-Length stays true): an upstream that echoes the request (a
    redirect or 404 page repeating the URL with `?key=`, a debug endpoint, an error quoting the header)
    must not hand the key to the box. A partial echo is scrubbed too: any run of MIN_RUN or more bytes
    of a key spelling (an error page that cuts a long URL short would otherwise give the box all of the
    key but its last characters). Found by the spelling's aligned pieces of BLOCK bytes (any run of
    2*BLOCK-1 bytes holds one whole), each grown to the whole matching run.

    A spelling may ask for a longer shortest run (`least`, one per form): an SSH key's line is a
    secret only as a whole, a shorter run of it is shared by every key of its type. Its pieces are
    then (least+1)//2 bytes, so a run of `least` still holds one; one that counts only whole is
    found by one piece of MID_BLOCK bytes from its middle.

    Every piece is looked for in the head and in a non-2xx answer (redirects and error pages, where
    URLs are echoed). A 2xx body (a large download, a stream) is searched (`full` False) for the first
    and last MIN_RUN bytes of each spelling, which find any run of MIN_RUN bytes at the key's start or
    end, and for its centre (MID_BLOCK bytes, at most (len-1)//2), which finds the key minus its two
    ends and any echo that keeps the centre. Measured on SSE text (docs/credentials.md): one
    `bytes.find` of 15 to 32 bytes costs ~0.2 ms per MiB, one of 8 bytes twice that, against ~3.5 ms
    per MiB of the proxy's CPU for the route: all 14 8-byte pieces of a 108-byte key would more than
    double the route's cost, and each further 32-byte middle piece add 2-4% while it narrows
    what passes only from 68 to 62 bytes of the key's middle; so three pieces, the old cost.

    A stream is scrubbed as it flows: only a tail that could continue into a key run in the next read
    is held back until then, raw, and searched again with it (an SSE event ends in a blank line, which
    no key holds, so events are never held); at the end it is scrubbed as it is and let go."""

    BLOCK = 8
    MIN_RUN = 2 * BLOCK - 1
    MID_BLOCK = 32

    # The pieces of each set of spellings, made once: the proxy searches every request for the same
    # host secrets, and making them cost ~20 µs a request (a route's SSE event takes ~3 ms in all).
    _made: dict[tuple[type, tuple[str, ...], tuple[int, ...] | None], tuple] = {}

    def __init__(self, forms: Sequence[str], least: Sequence[int] | None = None) -> None:
        key = (type(self), tuple(forms), None if least is None else tuple(least))
        made = Redactor._made.get(key)
        if made is None:
            made = self._make(forms, least)
            if len(Redactor._made) >= 64:  # secrets change (a refreshed login): the old ones are dropped
                Redactor._made.clear()
            Redactor._made[key] = made
        self.forms, self.least, self.blocks, self.ends, self.hold = made
        self.full = True
        self.held = b""
        self.mark = b""
        self.count = 0

    @classmethod
    def _make(cls, forms: Sequence[str], least: Sequence[int] | None) -> tuple:
        self = cls.__new__(cls)
        runs = least if least is not None else [self.MIN_RUN] * len(forms)
        pairs = list(dict.fromkeys((f.encode("latin-1"), n) for f, n in zip(forms, runs, strict=True) if len(f) >= 6))
        self.forms = [form for form, _ in pairs]
        self.least = max((min(n, len(form)) for form, n in pairs), default=0)
        # (spelling, where its piece starts, the piece, the shortest run scrubbed)
        self.blocks = [b for form, n in pairs for b in self._pieces(form, min(n, len(form)), (min(n, len(form)) + 1) // 2)
                       if n < len(form) or len(form) <= self.MID_BLOCK]
        # A spelling that counts only whole (an SSH key's line): any one piece of it finds it, so one,
        # from its middle, is searched for (a request to a box with several keys would otherwise pay
        # for two or three pieces of every line).
        self.blocks += [(form, (len(form) - self.MID_BLOCK) // 2,
                         form[(len(form) - self.MID_BLOCK) // 2:(len(form) + self.MID_BLOCK) // 2], len(form))
                        for form, n in pairs if n >= len(form) > self.MID_BLOCK]
        ends, mids = [], []
        for form, n in pairs:
            run = min(n, len(form))
            if run > self.MIN_RUN:  # a whole-line secret: its pieces are few already
                ends += [b for b in self.blocks if b[0] == form]
                continue
            # A run of `run` bytes or more that starts (ends) where the key does holds its first (last) `run` bytes.
            ends += [(form, 0, form[:run], run), (form, len(form) - run, form[-run:], run)]
            mid = max(self.BLOCK, min(self.MID_BLOCK, (len(form) - 1) // 2))
            at = (len(form) - mid) // 2
            if len(form) > run + 1 and at > 0 and at + mid < len(form):  # its centre: in the key minus its two ends
                mids.append((form, at, form[at:at + mid], run))
        self.ends = list(dict.fromkeys(ends + mids))
        # A run cut by a read's end is held whole, raw, and searched again with what follows: every
        # piece of it is then seen whole, whichever read it ends in.
        self.hold = max([0] + [len(form) - 1 for form in self.forms])
        return tuple(self.forms), self.least, tuple(self.blocks), tuple(self.ends), self.hold

    @staticmethod
    def _pieces(form: bytes, least: int, size: int) -> list[tuple[bytes, int, bytes, int]]:
        """The aligned pieces of `size` bytes, and the last one aligned to the end: a run of 2*size-1
        bytes of `form` holds one whole."""
        size = max(1, min(size, len(form)))
        out = [(form, at, form[at:at + size], least) for at in range(0, len(form) - size + 1, size)]
        if len(form) % size:
            out.append((form, len(form) - size, form[-size:], least))
        return out

    def scrub(self, data: bytes, full: bool | None = None) -> bytes:
        runs = []
        for form, at, block, least in self.blocks if (self.full if full is None else full) else self.ends:
            p = find(data, block)
            while p >= 0:
                lo, hi, a, b = p, p + len(block), at, at + len(block)
                while lo > 0 and a > 0 and data[lo - 1] == form[a - 1]:
                    lo, a = lo - 1, a - 1
                while hi < len(data) and b < len(form) and data[hi] == form[b]:
                    hi, b = hi + 1, b + 1
                if hi - lo >= least:
                    runs.append((lo, hi))
                p = find(data, block, max(hi, p + 1))
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
        """The next piece of a stream, scrubbed; all but a held tail, kept raw: any run of a spelling cut
        by the read's end is held whole (up to the longest spelling less one) and searched again with
        its continuation, and what was scrubbed of it already (`mark`) stays scrubbed. (Red team,
        stop 46: a tail held scrubbed, or only `2*piece-2` of it, let a key's last bytes through
        when a read ended inside an echo, a 2xx echo's early part when the read ended before its
        end piece, and a key holding `*` past its carry.)"""
        joined = self.held + data if self.held else data
        out = self.scrub(joined)
        if self.mark:
            out = _marked(self.mark, out[:len(self.mark)]) + out[len(self.mark):]
        hold = self._tail(joined)
        self.held = joined[len(joined) - hold:] if hold else b""
        self.mark = out[len(out) - hold:] if hold else b""
        return out[: len(out) - hold]

    def flush(self) -> bytes:
        held, self.held, mark, self.mark = self.held, b"", self.mark, b""
        return _marked(mark, self.scrub(held)) if held else held

    def _tail(self, data: bytes) -> int:
        """The longest tail of `data` that is a run of some spelling which the next read could continue
        (a complete spelling at the end was scrubbed already), up to `hold` bytes: enough that a run
        cut by the read's end is either held whole or held a whole piece on this side. Grown from one
        byte up, and stopped at the first length that is no run (a longer tail holds that one)."""
        if not self.forms or not data or not any(data[-1:] in form for form in self.forms):
            return 0
        n = 0
        while n < min(self.hold, len(data)) and any(data[-(n + 1):] in form[:-1] for form in self.forms):
            n += 1
        return n


def _marked(mark: bytes, out: bytes) -> bytes:
    """`out` with every byte `mark` scrubbed (`*`) scrubbed too: a held tail searched again keeps what
    an earlier read's search found in it."""
    return bytes(a if a == 42 else b for a, b in zip(mark, out, strict=True))
