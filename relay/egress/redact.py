"""Scrubbing a credential route's key from what its upstream answers, before the box reads it.

Its own module because it is the one defence against an upstream that echoes the request (the box
would otherwise read back the key the proxy added): pure bytes in, bytes out, no sockets, tested on
its own (tests/escape/test_credential_reflection.py).
"""

from __future__ import annotations


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
