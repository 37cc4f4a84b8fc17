"""Whether a string in a CLI's settings looks like a credential by its shape, where no key name says so.

A token pasted into an MCP server's argv (`--api-key ctx7sk-…`), a URL carrying one in its query
(`?exaApiKey=…`) or its userinfo, a header written as one string (`Authorization: Bearer …`), or a
value with a known vendor prefix (`ghp_`, `glpat-`, `xoxb-`, `sk-`, `AIza`, a JWT).

Pure: the credential-file table uses it for its shape-gated paths (`?mcpServers.*.args.*`), where a
key name says nothing. Deliberately not a general entropy detector: a model id (`claude-sonnet-4-5`),
a package (`@scope/pkg@1.2.3`) or a path must pass, or every settings file would refuse.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

# A value that names a variable or a file instead of holding a secret (`$GITHUB_TOKEN`, `${X}`,
# opencode's `{env:X}` and `{file:~/k}`): the CLI or the server reads the real value itself.
REFERENCE = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?|\{(env|file):[^}]*\}")

# Vendor prefixes of API keys and tokens, each followed by at least 12 more token characters.
_VENDOR = re.compile(
    r"(?:gh[pousr]_|github_pat_|glpat-|gloas-|xox[abposr]-|xapp-|sk-|sk_live_|rk_live_|sk_test_|AIza|ya29\.|"
    r"AKIA|ASIA|npm_|hf_|lin_api_|lin_oauth_|ntn_|sntrys_|pplx-|gsk_|tvly-|ctx7sk-|dop_v1_|shpat_|figd_|"
    r"r8_|fw_|csk-|xai-|nvapi-|pat_|bearer_)[A-Za-z0-9_\-.]{12,}")
_JWT = re.compile(r"eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*")
# A random-looking run: 32+ token characters with upper case, lower case and digits.
_RANDOM = re.compile(r"(?=[A-Za-z0-9_\-]*[A-Z])(?=[A-Za-z0-9_\-]*[a-z])(?=[A-Za-z0-9_\-]*[0-9])[A-Za-z0-9_\-]{32,}")
_SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "pat", "auth", "authorization", "cookie",
                 "credential", "credentials", "sig", "signature")
_FLAG = re.compile(r"--?([A-Za-z0-9][A-Za-z0-9_\-]*)")
_FLAG_EQ = re.compile(r"--?([A-Za-z0-9][A-Za-z0-9_\-]*)=(.+)", re.S)
_HEADER = re.compile(r"([A-Za-z0-9_\-]+)\s*:\s*(.+)", re.S)


def secret_name(name: str) -> bool:
    """Whether a flag, query parameter or header name says its value is a secret: one of its words
    (`api-key`, `exaApiKey`, `X_Auth_Token`) or its end (`apikey`) is key, token, secret, password,
    pat, auth, cookie, credential or sig; `path`, `author`, `design` are not."""
    if not re.fullmatch(r"[A-Za-z0-9_\-]+", name):
        return False
    words = [w.lower() for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name)]
    low = name.lower()
    return any(w in _SECRET_WORDS for w in words) or low.endswith(_SECRET_WORDS[:5] + ("credentials",))


def _bare(value: str) -> str:
    """The part of a value that could be the secret: after a header's scheme (`Bearer x`)."""
    value = value.strip()
    head, _, rest = value.partition(" ")
    return rest.strip() if rest and head.lower() in ("bearer", "basic", "token", "bot") else value


def is_reference(value: str) -> bool:
    return bool(REFERENCE.fullmatch(_bare(value)))


def _shaped(value: str) -> bool:
    bare = _bare(value)
    if not bare or REFERENCE.fullmatch(bare):
        return False
    return any(p.fullmatch(bare) for p in (_VENDOR, _JWT, _RANDOM))


_QUERY_PAIR = re.compile(r"(?<=[?&;])([^=&;#]+)=([^&;#]*)")
_USERINFO = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://[^:/@?#]*:([^@/?#]+)@")


def _scheme_end(value: str) -> int:
    """Where the secret of a header value starts: after `Bearer `, `Basic `, `token `, else at once."""
    head, sep, rest = value.partition(" ")
    return len(head) + len(sep) + (len(rest) - len(rest.lstrip())) if rest and head.lower() in ("bearer", "basic", "token", "bot") else 0


def _url_spans(value: str) -> list[tuple[int, int]]:
    """A URL's password (any scheme: `postgres://u:PW@h`) and, for http and ws, its secret query values."""
    if "://" not in value or any(c.isspace() for c in value):
        return []
    spans = []
    m = _USERINFO.match(value)
    if m and not REFERENCE.fullmatch(m.group(1)):
        spans.append(m.span(1))
    try:
        scheme = urlsplit(value).scheme.lower()
    except ValueError:
        return spans
    if scheme not in ("http", "https", "ws", "wss"):
        return spans
    query_at = value.find("?")
    for m in _QUERY_PAIR.finditer(value, query_at if query_at >= 0 else len(value)):
        name, v = m.group(1), m.group(2)
        if v and not REFERENCE.fullmatch(v) and (secret_name(name) or _shaped(v)):
            spans.append(m.span(2))
    return spans


def secret_spans(value: str, before: object = None) -> list[tuple[int, int]]:
    """Where in `value` the credential is, when it looks like one by itself (empty: it does not):
    the whole value past a header scheme (a vendor prefix, a JWT, a random 32+ run, or the argv value
    after a `--token` flag `before` it); a URL's password and its secret query values; the value of
    `--api-key=VALUE` and of `Authorization: Bearer VALUE`. The rest (the URL, the flag) is kept, so a
    placeholder keeps the shape the CLI parses."""
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        return [(0, len(value))] if isinstance(value, str) and value.strip() and looks_secret(value.strip(), before) else []
    if _shaped(value):
        return [(_scheme_end(value), len(value))]
    spans = _url_spans(value)
    if spans:
        return spans
    m = _FLAG_EQ.fullmatch(value)
    if m and secret_name(m.group(1)) and not is_reference(m.group(2)):
        return [(m.start(2) + _scheme_end(m.group(2)), len(value))]
    m = _HEADER.fullmatch(value)
    if m and "://" not in value and secret_name(m.group(1)) and not is_reference(m.group(2)):
        return [(m.start(2) + _scheme_end(m.group(2)), len(value))]
    if isinstance(before, str):
        m = _FLAG.fullmatch(before)
        if m and secret_name(m.group(1)) and not value.startswith("-") and not is_reference(value):
            return [(0, len(value))]
    return []


def looks_secret(value: str, before: object = None) -> bool:
    """Whether `value` looks like a credential by itself; `before` is the argv element in front of it,
    when it is one (`--api-key`, `--token`: the value after such a flag is a secret by position)."""
    if not isinstance(value, str) or not value.strip():
        return False
    return bool(secret_spans(value.strip(), before))
