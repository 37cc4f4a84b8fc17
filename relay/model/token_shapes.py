"""Whether a string in a CLI's settings looks like a credential by its shape, where no key name says so.

A token pasted into an MCP server's argv (`--api-key ctx7sk-…`, `-e GITHUB_TOKEN=ghp_…`), into a
command line written as one string, a URL carrying one in its query, fragment, userinfo or path
(`?exaApiKey=…`, `https://ghp_…@github.com`, `/fc-…/mcp`), a header written as one string
(`Authorization: Bearer …`, `{"Authorization": "Bearer …"}`), or a value with a known vendor prefix
(`ghp_`, `glpat-`, `xoxb-`, `sk-`, `AIza`, a JWT), found inside a longer string too.

Pure: the credential-file table uses it for its shape-gated paths (`?mcpServers.*.args.*`), where a
key name says nothing. Deliberately not a general entropy detector: a model id (`claude-sonnet-4-5`),
a package (`@scope/pkg@1.2.3`) or a path must pass, or every settings file would refuse.
"""

from __future__ import annotations

import re


class _Lazy:
    """A regex compiled on first use: every launch imports this module, few runs ever use it (its
    patterns cost about 3 ms to compile)."""

    __slots__ = ("pattern", "_re")

    def __init__(self, pattern: str) -> None:
        self.pattern, self._re = pattern, None

    def __getattr__(self, name: str):  # noqa: ANN204 - the compiled pattern's methods
        if self._re is None:
            self._re = re.compile(self.pattern)
        return getattr(self._re, name)


# A value that names a variable or a file instead of holding a secret (`$GITHUB_TOKEN`, `${X}`,
# opencode's `{env:X}` and `{file:~/k}`): the CLI or the server reads the real value itself.
REFERENCE = _Lazy(r"\$[A-Za-z_][A-Za-z0-9_]*|\$\{[A-Za-z_][A-Za-z0-9_]*(?:[:?+=\-][^}]*)?\}|\{(env|file):[^}]*\}"
                       r"|\$\([^)]*\)|`[^`]*`")  # and a shell's `${X:-}`, `$(gh auth token)`

# Vendor prefixes of API keys and tokens, each followed by at least 12 more token characters.
_VENDOR_PREFIX = (r"(?:gh[pousr]_|github_pat_|glpat-|gloas-|xox[abposr]-|xapp-|sk-|sk_live_|rk_live_|sk_test_|AIza|"
                  r"ya29\.|AKIA|ASIA|npm_|hf_|lin_api_|lin_oauth_|ntn_|sntrys_|pplx-|gsk_|tvly-|ctx7sk-|dop_v1_|"
                  r"shpat_|figd_|r8_|fw_|fc-|csk-|xai-|nvapi-|pat_|bearer_|ABSK)")
_VENDOR = _Lazy(_VENDOR_PREFIX + r"[A-Za-z0-9_\-.+=]{12,}")
_JWT = _Lazy(r"eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*")
# A random-looking run: 32+ token characters with upper case, lower case and digits; or padded base64.
_RANDOM = _Lazy(r"(?=[A-Za-z0-9_\-+]*[A-Z])(?=[A-Za-z0-9_\-+]*[a-z])(?=[A-Za-z0-9_\-+]*[0-9])[A-Za-z0-9_\-+]{32,}"
                     r"|[A-Za-z0-9+/]{30,}={1,2}")
# The same, found inside a longer string: not glued to other token characters on either side.
_EMBEDDED = _Lazy(r"(?<![A-Za-z0-9_\-.])(?:" + _VENDOR.pattern + "|" + _JWT.pattern + r")(?![A-Za-z0-9_\-])")
_SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "pat", "auth", "authorization", "cookie",
                 "credential", "credentials", "sig", "signature", "bearer", "dsn")
# A name whose last word says its value is about a secret, not one: `--token-file`, `api_key_env`,
# `token_type`, `--auth-type`, `CLAUDE_CODE_API_KEY_HELPER_TTL_MS`, `--secret-name`, `--spreadsheet-id`.
_NOT_SECRET_LAST = ("file", "path", "env", "var", "type", "mode", "name", "id", "ids", "dir", "url", "uri", "endpoint",
                    "helper", "ttl", "ms", "version", "header", "headers", "length", "count", "size", "limit",
                    "timeout", "method", "scope", "scopes", "provider", "kind", "format", "prefix", "command", "cmd")
_FLAG = _Lazy(r"--?([A-Za-z0-9][A-Za-z0-9_\-]*)")
# Inside a longer string: NAME=VALUE (`-e GITHUB_TOKEN=…`, `Authorization=Bearer …`), "NAME": "VALUE"
# (JSON in a string), `--flag VALUE` and `Name: VALUE`.
_IN_ASSIGN = _Lazy(r"(?<![\w\-])-{0,2}([A-Za-z_][A-Za-z0-9_\-]*)=(?:(?:[Bb]earer|[Bb]asic|[Tt]oken)\s+)?"
                        r"(\"[^\"\s]+\"|'[^'\s]+'|\$?\{[^}\s]*\}|\$\([^)]*\)|[^\s&;,\"'}]+)")
_IN_JSON = _Lazy(r"\"([A-Za-z0-9_\-]+)\"\s*:\s*\"(?:(?:[Bb]earer|[Bb]asic|[Tt]oken)\s+)?([^\"\s]+)\"")
_IN_FLAG = _Lazy(r"(?<!\S)--?([A-Za-z0-9][A-Za-z0-9_\-]*)\s+(?:(?:[Bb]earer|[Bb]asic|[Tt]oken)\s+)?([^\s\-\"'][^\s\"']*)")
_IN_HEADER = _Lazy(r"(?<![\w\-])([A-Za-z][A-Za-z0-9_\-]*)\s*:\s*(?:(?:[Bb]earer|[Bb]asic|[Tt]oken)\s+)?"
                        r"(\$?\{[^}\s]*\}|\$\([^)]*\)|[^\s\"',}]+)")
_URL = _Lazy(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s\"'<>]+")
# Values that are settings, not secrets: a number, a boolean, a path, a variable's name.
_PLAIN = _Lazy(r"(?i)[-+]?\d+(\.\d+)?|true|false|yes|no|on|off|none|null|")
_PATHLIKE = _Lazy(r"(?:~|\.{1,2})?/\S*|[A-Za-z]:[\\/].*|%[A-Za-z_][A-Za-z0-9_]*%(?:[\\/].*)?|\\\\\S.*")  # and Windows'
# What a secret found inside prose or a command line looks like: 8+ token characters, starting with
# one, with a digit or mixed case (`*)`, `<`, `ask`, `value` in a sentence or a permission rule are not).
_TOKENISH = _Lazy(r"(?=[^\s]*(?:[0-9]|[A-Z][^\s]*[a-z]|[a-z][^\s]*[A-Z]))[A-Za-z0-9][A-Za-z0-9_\-.+/=~:@!%]{7,}")
_VAR_NAME = _Lazy(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")


def _words(name: str) -> list[str]:
    return [w.lower() for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name)]


def secret_name(name: str) -> bool:
    """Whether a flag, query parameter or header name says its value is a secret: one of its words
    (`api-key`, `exaApiKey`, `X_Auth_Token`) or its end (`apikey`) is key, token, secret, password,
    pat, auth, cookie, credential or sig; `path`, `author`, `design` are not, and neither is a name
    whose last word says it is about a secret (`--token-file`, `token_type`, `--secret-name`)."""
    if not re.fullmatch(r"[A-Za-z0-9_\-]+", name):
        return False
    words = _words(name)
    if words and words[-1] in _NOT_SECRET_LAST:
        return False
    low = name.lower()
    return any(w in _SECRET_WORDS for w in words) or low.endswith(_SECRET_WORDS[:5] + ("credentials",))


def secret_entry(key: object, value: str, before: object = None) -> bool:
    """Whether a settings entry holds a secret: a value shaped like one wherever it sits, or a value
    that is not a plain setting under a key whose name says secret (`GITHUB_TOKEN`, `apiKey`; not
    `GIT_AUTHOR_NAME`, `AZURE_KEYVAULT_URL`, `AUTH_TYPE`, `TOKEN_ENDPOINT`)."""
    if is_reference(value):
        return False
    if isinstance(key, str) and secret_name(key) and not plain_value(value):
        return True
    return looks_secret(value, before)


def plain_value(value: str) -> bool:
    """A value that is a setting, not a secret, whatever its key's name: `0`, `false`, a path, `MY_VAR`."""
    value = value.strip().strip("\"'")
    return bool(_PLAIN.fullmatch(value) or _PATHLIKE.fullmatch(value) or _VAR_NAME.fullmatch(value))


def _bare(value: str) -> str:
    """The part of a value that could be the secret: after a header's scheme (`Bearer x`)."""
    value = value.strip()
    head, _, rest = value.partition(" ")
    return rest.strip() if rest and head.lower() in ("bearer", "basic", "token", "bot") else value


def vendor_prefix(prefix: str) -> bool:
    """Whether `prefix` is exactly a vendor's key prefix (`ghp_`, `sk-`, `glpat-`): no secret in it."""
    return bool(re.fullmatch(_VENDOR_PREFIX, prefix))


def is_reference(value: str) -> bool:
    return bool(REFERENCE.fullmatch(_bare(value)))


def _shaped(value: str) -> bool:
    bare = _bare(value)
    if not bare or REFERENCE.fullmatch(bare):
        return False
    return any(p.fullmatch(bare) for p in (_VENDOR, _JWT, _RANDOM))


def _scheme_end(value: str) -> int:
    """Where the secret of a header value starts: after `Bearer `, `Basic `, `token `, else at once."""
    head, sep, rest = value.partition(" ")
    return len(head) + len(sep) + (len(rest) - len(rest.lstrip())) if rest and head.lower() in ("bearer", "basic", "token", "bot") else 0


def _secret_value(value: str) -> bool:
    """A value found after a secret's name: a secret unless it is a reference or a plain setting."""
    value = value.strip().strip("\"'")
    return bool(value) and not REFERENCE.fullmatch(value) and not plain_value(value)


def _url_spans(url: str, at: int) -> list[tuple[int, int]]:
    """In a URL starting at `at`: its userinfo's password (any scheme, up to the last `@` before the
    path), a user name shaped like a token, and for http and ws each secret query or fragment value
    (by its name, percent-decoded, or its shape) and each path segment shaped like a token."""
    from urllib.parse import unquote

    spans = []
    start = url.index("://") + 3
    end = min([i for i in (url.find(c, start) for c in "/?#") if i >= 0] or [len(url)])
    authority = url[start:end]
    if "@" in authority:
        info = authority[:authority.rindex("@")]
        user, colon, password = info.partition(":")
        if colon and password and not REFERENCE.fullmatch(password):
            spans.append((at + start + len(user) + 1, at + start + len(info)))
        if user and _shaped(unquote(user)):
            spans.append((at + start, at + start + len(user)))
    if urlsplit_scheme(url) not in ("http", "https", "ws", "wss"):
        return spans
    for m in re.finditer(r"(?<=[?&;#])([^=&;#]+)=([^&;#]*)", url[end:]):
        name, v = unquote(m.group(1)), unquote(m.group(2))
        if v and not REFERENCE.fullmatch(v) and ((secret_name(name) and not plain_value(v)) or _shaped(v)):
            spans.append((at + end + m.start(2), at + end + m.end(2)))
    path_end = min([i for i in (url.find(c, end) for c in "?#") if i >= 0] or [len(url)])
    for m in re.finditer(r"[^/]+", url[end:path_end]):
        if _shaped(m.group(0)):
            spans.append((at + end + m.start(), at + end + m.end()))
    return spans


def urlsplit_scheme(url: str) -> str:
    from urllib.parse import urlsplit  # here, not at the top: a launch that checks no URL never loads it

    try:
        return urlsplit(url).scheme.lower()
    except ValueError:
        return ""


def _embedded(value: str) -> list[tuple[int, int]]:
    """Secrets inside a longer string (a command line, JSON or headers in a string, a URL)."""
    spans = [m.span() for m in _EMBEDDED.finditer(value)]
    for m in _URL.finditer(value):
        spans += _url_spans(m.group(0), m.start())
    for pattern in (_IN_ASSIGN, _IN_JSON, _IN_FLAG, _IN_HEADER):
        for m in pattern.finditer(value):
            if secret_name(m.group(1)) and _secret_value(m.group(2)) and "://" not in m.group(2) \
                    and _TOKENISH.fullmatch(m.group(2).strip("\"'")):
                a, b = m.span(2)
                if value[a:b][:1] in "\"'":
                    a, b = a + 1, b - 1
                spans.append((a, b))
    return spans


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def secret_spans(value: str, before: object = None) -> list[tuple[int, int]]:
    """Where in `value` the credentials are, when they look like ones by themselves (empty: none):
    the whole value past a header scheme when it is shaped like a token (a vendor prefix, a JWT, a
    random 32+ run) or is the argv value after a `--token` flag `before` it; else each one found inside
    it: a URL's password, user name, secret query values and token-shaped path segments, the value of
    `NAME=…`, `--api-key …`, `"Authorization": "Bearer …"` and `Name: …` where the name says secret,
    and a vendor-prefixed token or JWT anywhere. The rest (the URL, the flag) is kept, so a
    placeholder keeps the shape the CLI parses."""
    if not isinstance(value, str) or not value.strip():
        return []
    lead = len(value) - len(value.lstrip())
    core = value.strip()
    if isinstance(before, str):
        m = _FLAG.fullmatch(before)
        if m and not secret_name(m.group(1)) and _words(m.group(1))[-1:] and _words(m.group(1))[-1] in _NOT_SECRET_LAST \
                and _RANDOM.fullmatch(core):
            return []  # `--spreadsheet-id 1Bxi…`: an id after an id's flag, however random it looks
        if m and secret_name(m.group(1)) and core[:1].isalnum() and _secret_value(core):
            return [(lead + _scheme_end(core), lead + len(core))]
    if _shaped(core):
        return [(lead + _scheme_end(core), lead + len(core))]
    return _merged(_embedded(value))


def looks_secret(value: str, before: object = None) -> bool:
    """Whether `value` holds a credential by its shape; `before` is the argv element in front of it,
    when it is one (`--api-key`, `--token`: the value after such a flag is a secret by position)."""
    return bool(secret_spans(value, before))
