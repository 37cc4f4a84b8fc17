"""Read a tunnel's first TLS record without terminating it: the ClientHello's server_name.

Why: a CONNECT names the host the policy judged, but the TLS inside can name another (domain
fronting: one CDN address, many tenants, the SNI picks the tenant). The proxy therefore reads the
client's first bytes, checks that they are a TLS ClientHello whose `server_name` is the CONNECT
host (canonicalised by `hostname.canonical_host`), and only then forwards them, unchanged, and
splices the rest. Nothing is decrypted and nothing is re-encrypted, so the handshake (and the
certificate check the client does) is the client's own. With ECH, the server_name read here is
the outer one, which is what the network (and a fronting CDN) routes on.

`parse_client_hello` is pure (bytes in, verdict out); `read_client_hello` is the bounded I/O
(at most MAX_HELLO bytes, at most `timeout` seconds, however the bytes trickle in).
"""

from __future__ import annotations

import socket
import time

from relay.model.hostname import HostError, canonical_host, is_ip
from relay.model.record import record

MAX_HELLO = 64 * 1024  # a ClientHello with post-quantum key shares is ~2 KiB; a record is at most 16 KiB
HELLO_TIMEOUT = 10.0
_RECORD_MAX = 16384 + 256
_EXT_SNI = 0x0000
_EXT_ECH = 0xFE0D
# Sent to the client when its tunnel is refused after the ClientHello: a fatal access_denied alert
# (TLS 1.2 record framing, which every TLS client parses before its handshake is done).
ALERT_ACCESS_DENIED = bytes((0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x31))


@record
class Hello:
    """The verdict on a tunnel's first bytes. `kind`: "tls" (a whole ClientHello; `sni` its
    canonical server_name, None when it has none), "opaque" (not TLS, `reason` says what it
    looks like), "incomplete" (a TLS start, more bytes needed), or "bad" (TLS framing that is
    malformed, or a server_name that cannot be made canonical)."""

    kind: str
    sni: str | None = None
    reason: str = ""
    ech: bool = False


def _looks_like(data: bytes) -> str:
    if data.startswith(b"SSH-"):
        return "an SSH session"
    word = data.split(b" ", 1)[0]
    if word.isalpha() and word.isupper() and 3 <= len(word) <= 8:
        return "plain HTTP" if b" HTTP/" in data.split(b"\r\n", 1)[0] or len(data) < 64 else "a text protocol"
    return "not TLS"


def parse_client_hello(data: bytes) -> Hello:
    """Judge the bytes a client sent first in a tunnel (see Hello)."""
    if not data:
        return Hello("incomplete")
    if data[0] != 0x16:
        return Hello("opaque", reason=_looks_like(data))
    handshake = bytearray()
    at = 0
    while True:
        if len(data) - at < 5:
            return Hello("incomplete")
        ctype, major, length = data[at], data[at + 1], int.from_bytes(data[at + 3:at + 5], "big")
        if ctype != 0x16 or major != 3:
            return Hello("bad" if handshake else "opaque", reason="not a TLS handshake record")
        if length == 0 or length > _RECORD_MAX:
            return Hello("bad", reason="a TLS record of impossible length")
        if len(data) - at - 5 < length:
            return Hello("incomplete")
        handshake += data[at + 5:at + 5 + length]
        at += 5 + length
        if len(handshake) >= 4:
            if handshake[0] != 0x01:
                return Hello("bad", reason="the first handshake message is not a ClientHello")
            need = int.from_bytes(handshake[1:4], "big")
            if need > MAX_HELLO:
                return Hello("bad", reason="a ClientHello larger than the proxy reads")
            if len(handshake) >= 4 + need:
                return _hello_body(bytes(handshake[4:4 + need]))


def _hello_body(body: bytes) -> Hello:
    """The ClientHello's fields up to its extensions; server_name from them."""
    try:
        at = 2 + 32  # legacy_version, random
        at += 1 + body[at]  # session id
        at += 2 + int.from_bytes(body[at:at + 2], "big")  # cipher suites
        at += 1 + body[at]  # compression methods
        if at == len(body):
            return Hello("tls")  # no extensions at all: no server_name
        end = at + 2 + int.from_bytes(body[at:at + 2], "big")
        at += 2
        if end != len(body):
            return Hello("bad", reason="the ClientHello's extensions do not fill it")
        seen: set[int] = set()
        sni: str | None = None
        while at < end:
            etype, elen = int.from_bytes(body[at:at + 2], "big"), int.from_bytes(body[at + 2:at + 4], "big")
            data = body[at + 4:at + 4 + elen]
            if len(data) != elen:
                return Hello("bad", reason="a truncated ClientHello extension")
            if etype in seen:
                return Hello("bad", reason="a ClientHello extension given twice")
            seen.add(etype)
            if etype == _EXT_SNI:
                sni_or_error = _server_name(data)
                if isinstance(sni_or_error, Hello):
                    return sni_or_error
                sni = sni_or_error
            at += 4 + elen
        return Hello("tls", sni=sni, ech=_EXT_ECH in seen)
    except IndexError:
        return Hello("bad", reason="a truncated ClientHello")


def _server_name(data: bytes) -> str | Hello:
    """The one host_name in a server_name extension, canonical; more than one, or any other kind, is bad."""
    if len(data) < 2 or int.from_bytes(data[:2], "big") != len(data) - 2:
        return Hello("bad", reason="a malformed server_name extension")
    at, names = 2, []
    while at < len(data):
        kind, n = data[at], int.from_bytes(data[at + 1:at + 3], "big")
        raw = data[at + 3:at + 3 + n]
        if kind != 0 or len(raw) != n or n == 0:
            return Hello("bad", reason="a malformed server_name entry")
        names.append(raw)
        at += 3 + n
    if len(names) != 1:
        return Hello("bad", reason="a server_name extension with more than one name")
    try:
        return canonical_host(names[0].decode("ascii"))
    except (UnicodeDecodeError, HostError) as err:
        return Hello("bad", reason=f"a server_name that is not a canonical host name ({err})")


def sni_problem(hello: Hello, host: str) -> str:
    """Why this first flight may not go to the CONNECT target `host` (canonical), or "" when it may:
    a ClientHello whose server_name is `host`; for an IP-literal target, one with no server_name
    (RFC 6066 forbids an address there) or that address itself."""
    if hello.kind == "opaque":
        if hello.reason.startswith("no "):
            return f"the client sent {hello.reason}"
        return f"the tunnel's first bytes are {hello.reason}, not a TLS ClientHello"
    if hello.kind != "tls":
        return hello.reason or "the tunnel's first bytes are not a whole TLS ClientHello"
    outer = " (the ECH outer server_name)" if hello.ech else ""
    if hello.sni is None:
        return "" if is_ip(host) else f"the TLS ClientHello names no server (SNI missing) for {host}"
    if hello.sni != host:
        return f"the TLS ClientHello names {hello.sni}{outer}, not the CONNECT host {host}"
    return ""


def read_client_hello(sock: socket.socket, first: bytes, timeout: float = HELLO_TIMEOUT,
                      limit: int = MAX_HELLO) -> tuple[bytes, Hello]:
    """Read from `sock` (after `first`, what already arrived) until the bytes are judged, at most
    `limit` bytes and `timeout` seconds in all. Returns every byte read (to forward unchanged) and
    the verdict; silence until the deadline is "opaque" (a server-speaks-first protocol), EOF "bad"."""
    data = bytes(first)
    deadline = time.monotonic() + timeout
    hello = parse_client_hello(data)
    try:
        while hello.kind == "incomplete":
            left = deadline - time.monotonic()
            if left <= 0 or len(data) >= limit:
                why = "no TLS ClientHello within the time bound" if left <= 0 else "a ClientHello over the size bound"
                return data, Hello("opaque" if not data else "bad", reason=why)
            sock.settimeout(left)
            chunk = sock.recv(min(65536, limit - len(data)))
            if not chunk:
                return data, Hello("bad", reason="the client closed the tunnel before a whole ClientHello")
            data += chunk
            hello = parse_client_hello(data)
    except TimeoutError:
        return data, Hello("opaque" if not data else "bad", reason="no TLS ClientHello within the time bound")
    except OSError as err:
        return data, Hello("bad", reason=f"the tunnel failed before a ClientHello: {err.strerror or err}")
    finally:
        try:
            sock.settimeout(None)
        except OSError:
            pass
    return data, hello
