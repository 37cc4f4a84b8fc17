"""Request smuggling, as properties of the proxy's request parser (relay/egress/http_head.py `parse_head`, `Body`)
and what a credential route sends upstream (`route_head`, `egress.apply_credential`).

Whatever a client sends (chunked and Content-Length conflicts, TE+CL, obs-fold, bare CR/LF, duplicate
Host, absolute URIs with userinfo, odd versions, a second request after the body, any split into
reads), the proxy either refuses it cleanly (RequestError) or sends upstream exactly one request, to
the route the credential is pinned to, with the credential once; a strict reading of what it sent
finds no second request. The end-to-end cases through a real proxy are in
tests/escape/test_credential_smuggling.py.
"""

from __future__ import annotations

import re

from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from relay.egress.http_head import Body, Request, RequestError, parse_head, route_head
from relay.model.backend import CredentialRoute
from relay.policy.egress import CREDENTIAL_HEADERS, apply_credential, match_route

from .props import examples

KEY = "sk-REAL-KEY-7c1f"
ROUTES = (CredentialRoute("anthropic", ("K",), "api.anthropic.com", 443, "x-api-key"),
          CredentialRoute("maps", ("M",), "maps.example", 443, "query:key"),
          CredentialRoute("github", (), "github.com", 443, "authorization-basic", grant=True))
HOSTS = {r.name: r.upstream_host for r in ROUTES}

_methods = st.sampled_from(["GET", "POST", "PUT", "get", "G ET", "CONNECT", "POST\t", "DELETE", ""])
_targets = st.one_of(
    st.sampled_from([
        "/anthropic/v1/messages", "/anthropic", "/anthropic?beta=1", "/maps/geo?key=evil&a=1", "/github/o/r.git/info/refs",
        "http://api.anthropic.com@evil.test/anthropic/v1", "http://evil.test/anthropic/v1", "/evil.test/v1",
        "//anthropic/v1", "/anthropic/../../x", "/anthropic/v1#frag", "*", "api.anthropic.com:443", "/anthropic/v1 x",
        "/anthropic%2Fv1", "/anthropic/v1\x00", "/anthropic/\u00e9",
    ]),
    st.text(st.characters(min_codepoint=0, max_codepoint=0x7f), max_size=30).map(lambda t: "/anthropic/" + t),
)
_versions = st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "http/1.1", "HTTP/1.1 ", "HTTP/1.10"])
_names = st.sampled_from([
    "Host", "host", "Content-Length", "content-length", "Transfer-Encoding", "transfer-encoding", "Transfer-Encoding ",
    " Transfer-Encoding", "X-Api-Key", "Authorization", "Proxy-Authorization", "x-goog-api-key", "Connection",
    "Expect", "Keep-Alive", "Upgrade", "TE", "Trailer", "X-Other", "Content-Length\t", "Host:",
])
_values = st.one_of(
    st.sampled_from([
        "5", "0", " 5", "+5", "5,5", "0x5", "-1", "05", "99999999999999999999", "chunked", "Chunked", "chunked, identity",
        "identity", "xchunked", "chunked ", "gzip, chunked", "100-continue", "close", "keep-alive, Transfer-Encoding",
        "evil.test", "api.anthropic.com", "hive-relay-placeholder", "Bearer stolen", "a\x0bb", "\xff",
    ]),
    st.text(st.characters(min_codepoint=0, max_codepoint=0xff), max_size=12),
)
_eols = st.sampled_from(["\r\n", "\r\n", "\r\n", "\n", "\r", "\r\n ", "\r\n\t"])


_good_names = st.sampled_from(["Host", "Content-Length", "Transfer-Encoding", "X-Api-Key", "Authorization",
                               "Connection", "Expect", "X-Other", "Accept", "Content-Type"])
_good_values = st.sampled_from(["2", "0", "chunked", "api.anthropic.com", "hive-relay-placeholder", "Bearer stolen",
                                "close", "100-continue", "text/plain", "keep-alive, X-Other"])


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    """A request head (without its blank line): half of them well-formed but for their framing and
    credential headers, the others with the mutations smuggling uses anywhere."""
    if draw(st.booleans()):
        target = draw(st.sampled_from(["/anthropic/v1/messages", "/maps/geo?key=evil&a=1", "/github/o/r.git/info/refs",
                                       "/anthropic", "/evil/x"]))
        line = f"{draw(st.sampled_from(['GET', 'POST', 'PUT']))} {target} {draw(st.sampled_from(['HTTP/1.1', 'HTTP/1.0']))}"
        fields = draw(st.lists(st.tuples(_good_names, _good_values, st.just("\r\n")), max_size=5))
    else:
        line = f"{draw(_methods)} {draw(_targets)} {draw(_versions)}"
        fields = draw(st.lists(st.tuples(_names, _values, _eols), max_size=7))
    out = line
    for name, value, eol in fields:
        out += eol + f"{name}: {value}"
    return out.encode("latin-1", "replace")


_SMUGGLED = b"GET /anthropic/steal HTTP/1.1\r\nHost: api.anthropic.com\r\n\r\n"


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """What follows the head: chunked bodies (well-formed or not), raw bytes, and a second request."""
    parts = []
    for size, eol in draw(st.lists(st.tuples(st.integers(0, 20), st.sampled_from([b"\r\n", b"\n", b"\r\n", b"\r"])),
                                   max_size=4)):
        ext = draw(st.sampled_from([b"", b";a=b", b" ", b";\r", b"\x00"]))
        size_text = draw(st.sampled_from([b"%x" % size, b"%X" % size, b"0x%x" % size, b"+%x" % size,
                                          b"%x" % (size + 1), b"0000000000000000%x" % size]))
        parts.append(size_text + ext + eol + b"a" * size + draw(st.sampled_from([b"\r\n", b"", b"\n", b"xx"])))
    tail = draw(st.sampled_from([b"", b"0\r\n\r\n", b"0\r\nX: y\r\n\r\n", b"0\r\n", b"0\n\n", b"0\r\nX y\r\n\r\n"]))
    raw = draw(st.binary(max_size=24))
    smuggle = draw(st.sampled_from([b"", _SMUGGLED, b"\r\n" + _SMUGGLED]))
    return draw(st.sampled_from([b"".join(parts) + tail + smuggle, raw + smuggle, b"{}" + smuggle]))


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points:
        pieces.append(data[last:p])
        last = p
    return [*pieces, data[last:]]


def upstream(head: bytes, body: bytes, cuts: list[int]) -> tuple[bytes, Request, bool, bytes] | None:
    """What the proxy sends a route's upstream for this client input (head, then the body fed in the
    given reads), the request, whether its body ended, and what was held back; None: refused."""
    try:
        req = parse_head(head)
        if not req.origin:
            return None  # an absolute-URI or CONNECT request is plain egress: no credential is ever added
        match = match_route(ROUTES, req.path)
        if match.route is None:
            return None
        path, credential = apply_credential(match.route, KEY, match.path)
        route = match.route
        sent = route_head(req, path, route.upstream_host, route.upstream_port, credential)
        framing = Body(req)
        for piece in _split(body, cuts):
            sent += framing.feed(piece)
        return sent, req, framing.done, framing.extra
    except RequestError:
        return None


def read_as_upstream(data: bytes) -> tuple[Request, bytes, bool, bytes]:
    """A strict upstream's reading of the bytes it got: one head, its body by its framing, and what is left."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep, "the head sent upstream is not terminated"
    req = parse_head(head)  # what the proxy sends is itself a strict, canonical request
    framing = Body(req)
    got = framing.feed(rest)
    return req, got, framing.done, framing.extra


@settings(max_examples=examples(1500), deadline=None)
@given(head=heads(), body=bodies(), cuts=st.lists(st.integers(0, 400), max_size=4))
@example(head=b"POST /anthropic/v1 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked", body=b"0\r\n\r\n",
         cuts=[])
@example(head=b"POST /anthropic/v1 HTTP/1.1\r\nTransfer-Encoding: chunked", body=b"2\r\n{}\r\n0\r\n\r\n" + _SMUGGLED,
         cuts=[3, 9])
@example(head=b"GET http://api.anthropic.com@evil.test/anthropic/v1 HTTP/1.1\r\nHost: evil.test", body=b"", cuts=[])
@example(head=b"GET /anthropic/v1 HTTP/1.1\r\nHost: a\r\nHost: evil.test", body=b"", cuts=[])
@example(head=b"GET /maps/geo?key=evil&k%65y=x HTTP/1.1\r\nHost: a", body=b"", cuts=[])
def test_one_request_to_the_pinned_route_with_the_credential_once(head: bytes, body: bytes, cuts: list[int]) -> None:
    result = upstream(head, body, cuts)
    event("refused" if result is None else "sent, body complete" if result[2] else "sent, body incomplete")
    if result is None:
        return  # refused cleanly: nothing was sent, so no credential went anywhere
    sent, req, done, held = result
    name = req.path[1:].partition("/")[0].partition("?")[0]
    route = next(r for r in ROUTES if r.name == name)
    again, forwarded, upstream_done, left = read_as_upstream(sent)
    # Exactly one request, to the route's host, its path under the route, with the credential once.
    assert again.origin and again.method == req.method
    hosts = [line for line in again.kept if line.lower().startswith("host:")]
    assert hosts == [] and sent.count(b"\r\nHost: ") == 1
    assert f"\r\nHost: {HOSTS[name]}\r\n".encode() in sent
    assert sent.count(KEY.encode()) + sent.count(b"eC1hY2Nlc3MtdG9rZW46c2stUkVBTC1LRVktN2MxZg==") == 1
    credential_lines = [line for line in again.kept if line.partition(":")[0].strip().lower() in CREDENTIAL_HEADERS]
    assert len(credential_lines) == (0 if route.send.startswith("query:") else 1)
    if route.send.startswith("query:"):
        assert re.findall(r"[?&]key=([^&]*)", again.path) == [KEY]
    # Whatever the client sent after its body is held back, and the upstream reads nothing more.
    # (A smuggled request after a complete body is in `held`, never in `sent`.)
    assert upstream_done == done and left == b""
    if done and body.endswith(_SMUGGLED) and _SMUGGLED in held:
        assert forwarded.count(b"/anthropic/steal") == body[: len(body) - len(held)].count(b"/anthropic/steal")


@settings(max_examples=examples(800), deadline=None)
@given(head=heads(), body=bodies(), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_reads_split_anywhere_give_the_same_result(head: bytes, body: bytes, cuts: list[int]) -> None:
    """The framing cannot be steered by how the client times its writes."""
    whole, split = upstream(head, body, []), upstream(head, body, cuts)
    assert (whole is None) == (split is None)
    if whole is not None and split is not None:
        assert whole[0] == split[0] and whole[2:] == split[2:]


@settings(max_examples=examples(800), deadline=None)
@given(data=st.binary(max_size=400))
def test_any_bytes_as_a_head_parse_to_a_canonical_request_or_a_refusal(data: bytes) -> None:
    try:
        req = parse_head(data)
    except RequestError:
        return
    for line in req.kept:
        assert "\r" not in line and "\n" not in line
    if req.head is not None:
        assert req.head.endswith(b"\r\n\r\n") and req.head.count(b"\r\n\r\n") == 1
        assert parse_head(req.head[:-4]).head == req.head  # canonical: reading it again changes nothing


@settings(max_examples=examples(500), deadline=None)
@given(head=st.binary(min_size=1, max_size=64).map(lambda b: b"GET /anthropic/v1 HTTP/1.1\r\nX: " + b))
def test_bytes_in_a_header_value_never_become_a_second_header_or_request(head: bytes) -> None:
    result = upstream(head, b"", [])
    if result is not None:
        sent = result[0]
        # request line, Host, X, the key, Accept-Encoding, Connection, then the blank line: nothing split off.
        assert sent.count(b"\r\n\r\n") == 1 and sent.count(b"\r\n") == 7 and sent.endswith(b"\r\n\r\n")
