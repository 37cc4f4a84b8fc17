"""Red-team of the credential routes: an upstream that answers with the request (TRACE, an echo or
debug endpoint, a redirect or error page that repeats the URL) must not carry the real key back
into the box. Each attack has its twin: the legitimate request on the same route still works.

Real parts: the real EgressProxy, real TLS upstreams on 127.0.0.1 under the route's name with a
throwaway CA, pinned by an `--allow-host`-style rule (fixtures from test_credential_smuggling).
"""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.egress.redact import Redactor
from relay.policy.egress import key_forms

from ..conftest import Sandbox
from .conftest import Report
from .test_credential_smuggling import ANTHROPIC, BASIC, GITHUB, MAPS, ca2, proxy  # noqa: F401 - pytest fixtures
from .test_credential_smuggling import status as status_of
from .test_credentials import REAL, TLSUpstream, entries, exchange

H = b"Host: 127.0.0.1:3128\r\n"
BASIC_B64 = BASIC.removeprefix(b"Authorization: Basic ")


def reflect(head: bytes) -> bytes:
    """What TRACE (Apache's default TraceEnable On) or a debug endpoint answers: the request itself."""
    return b"HTTP/1.1 200 OK\r\nContent-Type: message/http\r\nContent-Length: %d\r\n\r\n" % len(head) + head


@pytest.mark.parametrize("method", [b"TRACE", b"TRACK", b"DEBUG"])
@pytest.mark.parametrize("route", [ANTHROPIC, GITHUB], ids=["header", "basic-grant"])
def test_an_echoing_method_is_refused_before_the_key_is_added(ca2, proxy, method: bytes, route,  # noqa: F811
                                                              report: Report) -> None:
    upstream = TLSUpstream(ca2[1], reflect)
    port, log = proxy(upstream, route)
    answer = exchange(port, method + b" /" + route.name.encode() + b"/ HTTP/1.1\r\n" + H + b"\r\n")
    blocked = status_of(answer) == b"405" and upstream.conns == [] and REAL.encode() not in answer
    report.attack(blocked)
    assert blocked, answer
    line = entries(log)[0]
    assert line["decision"] == "deny" and line["route"] == route.name and REAL not in log.read_text()
    # twin: the same route carries the methods an API or git uses.
    twin = TLSUpstream(ca2[1])
    port, _ = proxy(twin, route)
    for verb in (b"GET", b"POST", b"HEAD", b"OPTIONS"):
        body = b"Content-Length: 0\r\n" if verb == b"POST" else b""
        assert status_of(exchange(port, verb + b" /" + route.name.encode() + b"/x HTTP/1.1\r\n" + H + body + b"\r\n")) == b"200"
    report.legit(len(twin.conns) == 4)
    assert len(twin.conns) == 4


# An upstream that echoes what it received: the key is scrubbed from the answer, in every spelling
# it was sent in, with the answer's length (and framing) unchanged.

def redirect_keeping_query(head: bytes) -> bytes:
    """A trailing-slash redirect that keeps the query (and with it `?key=`), as many servers do."""
    target = head.split(b" ")[1]
    return (b"HTTP/1.1 301 Moved Permanently\r\nLocation: https://maps.example" + target.replace(b"?", b"/?", 1)
            + b"\r\nContent-Length: 0\r\n\r\n")


def not_found_quoting_url(head: bytes) -> bytes:
    body = b"<p>The requested URL <code>" + head.split(b" ")[1] + b"</code> was not found on this server.</p>"
    return b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(body) + body


def test_a_redirect_that_keeps_the_query_does_not_hand_the_key_back(ca2, proxy, report: Report) -> None:  # noqa: F811
    upstream = TLSUpstream(ca2[1], redirect_keeping_query)
    port, log = proxy(upstream, MAPS)
    answer = exchange(port, b"GET /maps/geo?q=1 HTTP/1.1\r\n" + H + b"\r\n")
    blocked = REAL.encode() not in answer and b"Location: https://maps.example/geo/?q=1&key=" + b"*" * len(REAL) in answer
    report.attack(blocked)
    assert blocked, answer
    # twin: the key did go to the pinned upstream, and the redirect itself reaches the box.
    works = status_of(answer) == b"301" and b"key=" + REAL.encode() in upstream.received()
    report.legit(works)
    assert works
    line = entries(log)[0]
    assert line["redacted"] == 1 and line["status"] == 301 and REAL not in log.read_text()


def test_an_error_page_quoting_the_url_is_scrubbed_even_when_gzip_is_asked(ca2, proxy, report: Report) -> None:  # noqa: F811
    upstream = TLSUpstream(ca2[1], not_found_quoting_url)
    port, _ = proxy(upstream, MAPS)
    answer = exchange(port, b"GET /maps/nope?q=1 HTTP/1.1\r\n" + H + b"Accept-Encoding: gzip, br\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    sent = upstream.received().split(b"\r\n\r\n")[0]
    # the box asked for gzip (a compressed echo would hide the key from the scrub): upstream is asked for identity
    blocked = (REAL.encode() not in answer and b"gzip" not in sent and sent.count(b"Accept-Encoding") == 1
               and b"Accept-Encoding: identity" in sent)
    report.attack(blocked)
    assert blocked, (answer, sent)
    works = status_of(answer) == b"404" and b"Content-Length: %d" % len(body) in head and b"/nope?q=1&key=***" in body
    report.legit(works)
    assert works, answer


def test_an_echo_of_the_basic_header_is_scrubbed(ca2, proxy, report: Report) -> None:  # noqa: F811
    upstream = TLSUpstream(ca2[1], reflect)
    port, log = proxy(upstream, GITHUB)
    answer = exchange(port, b"GET /github/debug/headers HTTP/1.1\r\n" + H + b"\r\n")
    blocked = BASIC_B64 not in answer and REAL.encode() not in answer and b"Authorization: Basic ****" in answer
    report.attack(blocked)
    assert blocked, answer
    works = status_of(answer) == b"200" and BASIC_B64 in upstream.received()
    report.legit(works)
    assert works and entries(log)[0]["redacted"] == 1


def test_a_key_split_across_two_reads_is_still_scrubbed(ca2, proxy, report: Report) -> None:  # noqa: F811
    """The upstream writes the echo in two pieces, 0.3 s apart, cut inside the key: the tail that could
    start a key is held until the next read, then scrubbed with it."""
    key = REAL.encode()

    def split(head: bytes) -> list[bytes]:
        body = b"you sent " + key + b" thanks\n"
        return [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\nyou sent " % len(body) + key[:10], key[10:] + b" thanks\n"]

    upstream = TLSUpstream(ca2[1], split)
    port, _ = proxy(upstream)
    answer = exchange(port, b"GET /anthropic/v1/echo HTTP/1.1\r\n" + H + b"\r\n")
    blocked = key not in answer and key[:10] not in answer and answer.endswith(b"you sent " + b"*" * len(key) + b" thanks\n")
    report.attack(blocked)
    assert blocked, answer
    # twin: a body that merely ends in the key's first bytes is delivered whole, unaltered, at its end.
    tail = TLSUpstream(ca2[1], lambda head: b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsome" + key[:4])
    port, _ = proxy(tail)
    answer = exchange(port, b"GET /anthropic/v1/x HTTP/1.1\r\n" + H + b"\r\n")
    report.legit(answer.endswith(b"\r\n\r\nsome" + key[:4]))
    assert answer.endswith(b"\r\n\r\nsome" + key[:4]), answer


def _longest_key_run(data: bytes, forms: tuple[str, ...]) -> int:
    """The longest run of `data` that is a piece of one of `forms`."""
    best = 0
    for form in (f.encode() for f in forms):
        for i in range(len(data)):
            n = best + 1
            while i + n <= len(data) and data[i:i + n] in form:
                best, n = n, n + 1
    return best


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=120), st.binary(max_size=120), st.integers(0, len(REAL)), st.integers(0, len(REAL)),
       st.lists(st.integers(0, 400), max_size=6))
def test_the_scrub_holds_however_the_stream_is_cut(before: bytes, after: bytes, a: int, b: int,
                                                   cuts: list[int]) -> None:
    """Redactor on a stream cut anywhere: nothing is lost, added or moved (each byte is itself or `*`),
    the whole key and any piece of it of Redactor.MIN_RUN bytes or more are gone, and a stream with no
    key in it passes unchanged."""
    forms = key_forms(GITHUB, REAL)
    piece = REAL.encode()[min(a, b):max(a, b)]
    stream = before + REAL.encode() + after + piece + forms[0].encode() + before
    red, out, last = Redactor(forms), b"", 0
    for cut in sorted(c for c in cuts if c <= len(stream)) + [len(stream)]:
        out += red.feed(stream[last:cut])
        last = cut
    out += red.flush()
    assert len(out) == len(stream) and all(o in (s, 42) for o, s in zip(out, stream, strict=True))
    assert _longest_key_run(out, forms) < Redactor.MIN_RUN
    clean = before.replace(b"*", b"")
    if _longest_key_run(clean, forms) < 6:
        plain, red2 = b"", Redactor(forms)
        for i in range(0, len(clean), 7):
            plain += red2.feed(clean[i:i + 7])
        assert plain + red2.flush() == clean and red2.count == 0


def test_an_echo_cut_short_before_the_keys_end_is_scrubbed_too(ca2, proxy, report: Report) -> None:  # noqa: F811
    """An error page that shows only the first 60 bytes of the URL: the box pads its path so the cut
    falls just before the key's last characters, hoping to learn all of it but those."""
    def cut_short(head: bytes) -> bytes:
        body = b"URL too long: " + head.split(b" ")[1][:60] + b"..."
        return b"HTTP/1.1 414 URI Too Long\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    upstream = TLSUpstream(ca2[1], cut_short)
    port, _ = proxy(upstream, MAPS)
    pad = 60 - len("/geo?q=&key=") - (len(REAL) - 3)
    answer = exchange(port, b"GET /maps/geo?q=" + b"a" * pad + b" HTTP/1.1\r\n" + H + b"\r\n")
    body = answer.partition(b"\r\n\r\n")[2]
    blocked = REAL.encode()[: len(REAL) - 3] not in body and b"key=" + b"*" * (len(REAL) - 3) + b"..." in body
    report.attack(blocked)
    assert blocked, body
    report.legit(status_of(answer) == b"414")
    assert status_of(answer) == b"414"


# The same attacks from inside a real box (bwrap, the real proxy started by the launcher), plus what
# the box can see of the host-side proxy that holds the key.

BOX_ATTACKS = r"""
curl -s -X TRACE "$ANTHROPIC_BASE_URL/" -o /tmp/trace -w 'trace=%{http_code}\n'
curl -s "$ANTHROPIC_BASE_URL/v1/debug/echo" -o /tmp/echo -w 'echo=%{http_code}\n'
curl -s -H 'Accept-Encoding: gzip' --compressed "$ANTHROPIC_BASE_URL/v1/debug/echo" -o /tmp/echo-gz -w 'gz=%{http_code}\n'
cat /tmp/trace /tmp/echo /tmp/echo-gz | grep -c 'REAL-KEY-ON-THE-HOS[T]' || true
grep -c 'x-api-key: \*\*\*\*' /tmp/echo || true
ps -eo args= 2>/dev/null | grep -c '[-]m relay' || true
for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do tr '\0' '\n' < "$f"; done 2>/dev/null | grep -c 'REAL-KEY-ON-THE-HOS[T]' || true
"""


def test_in_a_real_box_an_echoing_upstream_never_returns_the_key(box: Sandbox, ca2, report: Report) -> None:  # noqa: F811
    upstream = TLSUpstream(ca2[1], reflect)
    proc = box.box(BOX_ATTACKS, "claude", "--allow-host", f"api.anthropic.com:443=127.0.0.1:{upstream.port}",
                   extra_env={"ANTHROPIC_API_KEY": REAL, "SSL_CERT_FILE": str(ca2[0])})
    lines = proc.stdout.splitlines()
    # attack: TRACE refused; the echo's key scrubbed (compressed or not); no host process (the launcher,
    # whose environment has the key) is visible, and no process in the box holds the key.
    blocked = (proc.returncode == 0 and lines[0] == "trace=405" and lines[3] == "0" and lines[5] == "0"
               and lines[6] == "0" and REAL not in proc.stdout + proc.stderr)
    report.attack(blocked)
    assert blocked, (proc.stdout, proc.stderr[-2000:])
    # twin: the echo endpoint answered through the route (the key reached the pinned upstream).
    works = lines[1] == "echo=200" and lines[2] == "gz=200" and lines[4] == "1" and REAL.encode() in upstream.received()
    report.legit(works)
    assert works, proc.stdout


def test_a_credential_header_spelt_with_underscores_is_dropped_too(ca2, proxy, report: Report) -> None:  # noqa: F811
    """CGI-style upstreams read `X_Api_Key` as x-api-key: the box's own value under that spelling
    would sit beside the real key, and the upstream might take either."""
    upstream = TLSUpstream(ca2[1])
    port, _ = proxy(upstream)
    answer = exchange(port, b"GET /anthropic/v1/models HTTP/1.1\r\n" + H + b"X_Api_Key: box\r\nX-API-KEY: box2\r\n"
                      b"AUTHORIZATION: Bearer box3\r\nX_Goog_Api_Key: box4\r\nX-Request-Id: kept_too\r\n\r\n")
    sent = upstream.received().split(b"\r\n\r\n")[0]
    blocked = b"box" not in sent and sent.lower().count(b"x-api-key") == 1
    report.attack(blocked)
    assert blocked, sent
    works = status_of(answer) == b"200" and b"x-api-key: " + REAL.encode() in sent and b"X-Request-Id: kept_too" in sent
    report.legit(works)
    assert works, sent


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=120), st.integers(0, len(REAL)), st.booleans(), st.lists(st.integers(0, 400), max_size=6))
def test_a_2xx_body_loses_the_whole_key_and_any_echo_cut_at_one_end(before: bytes, n: int, prefix: bool,
                                                                    cuts: list[int]) -> None:
    """A 2xx body is searched for the ends of each spelling only (Redactor.full False): the whole key
    and any run of MIN_RUN+ bytes that starts or ends where the key does are still gone."""
    forms = key_forms(ANTHROPIC, REAL)
    piece = REAL.encode()[:n] if prefix else REAL.encode()[len(REAL) - n:]
    stream = before + REAL.encode() + before + piece + b"\n"
    red, out, last = Redactor(forms), b"", 0
    red.full = False
    for cut in sorted(c for c in cuts if c <= len(stream)) + [len(stream)]:
        out += red.feed(stream[last:cut])
        last = cut
    out += red.flush()
    assert len(out) == len(stream) and REAL.encode() not in out
    assert _longest_key_run(out, forms) < Redactor.MIN_RUN


@pytest.mark.parametrize("full", [True, False], ids=["error page", "2xx body"])
def test_a_read_boundary_inside_an_echoed_key_leaves_none_of_it(full: bool) -> None:
    """A read that ends inside an echoed key, fewer than MIN_RUN bytes before its end: the first part
    is scrubbed, and the few bytes that come in the next read are too (they were passed as they were,
    too short to count as a run: found by a red-team helper; a head read of exactly 64 KiB over the
    batched TLS reads put the boundary where the box's request chose)."""
    forms = key_forms(GITHUB, REAL)
    body = b'{"error": "bad url /x?key=' + REAL.encode() + b'"}'
    at, end = body.index(REAL.encode()), body.index(REAL.encode()) + len(REAL)
    for cut in range(at, end + 1):
        red = Redactor(forms)
        red.full = full
        out = red.feed(body[:cut]) + red.feed(body[cut:]) + red.flush()
        assert out[at:end] == b"*" * len(REAL), (cut, out)
        assert out[:at] == body[:at] and out[end:] == body[end:]


def test_the_scrubbers_search_finds_what_bytes_find_does_on_every_path() -> None:
    """redact.find takes glibc's memmem on a large read and windows of bytes.find on the rest: every
    path must answer as bytes.find does, a match across a window's edge and at the read's end too
    (a miss here is a key passed to the box)."""
    import random

    from relay.egress import redact

    assert redact._memmem() is not None  # glibc here: the fast path is the one tested
    rng = random.Random(46)
    key = REAL.encode()
    for size in (0, 40, redact.NATIVE_FROM - 1, redact.NATIVE_FROM + 40, redact.WINDOW + 7, 3 * redact.WINDOW, 1 << 18):
        for at in {0, max(0, size - len(key)), redact.WINDOW - 5, redact.WINDOW - len(key) // 2, rng.randrange(size + 1)}:
            if at + len(key) > size:
                continue
            data = bytearray(rng.randbytes(size))
            data[at:at + len(key)] = key
            data = bytes(data)
            for piece in (key[:15], key[-15:], key[10:42]):
                for start in (0, 1, at, at + 1, size):
                    assert redact.find(data, piece, start) == data.find(piece, start), (size, at, start)


STARRY = "sk-Z=3qU/x*9+Lm*" + "Q7xZ2mN8pL4vR1tY6wK3jH9gF5dS0aB7cE2" * 3  # `*`, `/`, `+`, `=`: spellings differ, `*` is the mask


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=60), st.integers(0, 150), st.integers(0, 150), st.sampled_from([0, 1]),
       st.lists(st.integers(0, 400), max_size=8), st.booleans(), st.booleans())
def test_a_split_stream_is_scrubbed_at_least_where_the_whole_one_is(before: bytes, a: int, b: int, which: int,
                                                                    cuts: list[int], full: bool, bytewise: bool) -> None:
    """Whatever the reads: every byte one read of the whole stream scrubs is scrubbed, nothing is added,
    lost or moved, in error-page and 2xx mode, for a key whose spellings differ and which holds `*`
    (red team, stop 46: a tail held scrubbed let a key's last bytes through, a 2xx echo's early part
    passed when a read ended before its end piece, and a key with `*` defeated the carry)."""
    forms = (STARRY, quote(STARRY, safe=""))
    form = forms[which].encode()
    echo = form[min(a, b) % len(form):max(a, b) % len(form) or len(form)]
    stream = before + b'{"v":"' + echo + b'"} ' + form + b" " + before
    whole = Redactor(forms)
    whole.full = full
    expect = whole.feed(stream) + whole.flush()
    red = Redactor(forms)
    red.full = full
    edges = range(1, len(stream)) if bytewise else sorted({c for c in cuts if c < len(stream)})
    out, last = b"", 0
    for cut in [*edges, len(stream)]:
        out += red.feed(stream[last:cut])
        last = cut
    out += red.flush()
    assert len(out) == len(stream) and all(o in (s, 42) for o, s in zip(out, stream, strict=True))
    assert all(o == 42 for o, e in zip(out, expect, strict=True) if e == 42)


def test_the_pieces_made_once_are_each_classs_own() -> None:
    """Redactor's pieces are made once per set of spellings, and per class: a subclass with other
    sizes that made a set first must not hand the base class its pieces (red team, stop 46)."""

    class Coarse(Redactor):
        BLOCK, MIN_RUN, MID_BLOCK = 16, 31, 32

    Coarse([REAL])
    assert Redactor([REAL]).least == Redactor.MIN_RUN
    assert b"*" * 20 in Redactor([REAL]).scrub(b"<" + REAL.encode()[5:25] + b">")
