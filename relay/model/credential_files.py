"""Credential files in an agent's state: which JSON values are secrets, and placeholders of their shape.

The table itself lives in config/backends.yaml (`secret_files:` per backend, next to the backend's
`home.rw`, `home.keep` and `login:` routes, so one backend's whole story is in one place and a user
config that defines a backend can give its own). This module is the pure part: find the secret values
a file holds at those paths, and write the box's copy with each replaced by a placeholder of the same
shape, so the CLI parses its login as usual and believes it is logged in:

- a JWT (`xxx.yyy.zzz`, base64url JSON header and payload) stays a parseable JWT: same header, same
  claims (account id, email, plan) except `exp` (far in the future, so the CLI never refreshes) and
  `iat`/`nbf` kept, and a random signature of the same length (so it verifies nowhere);
- an API key keeps its prefix up to the last `-`/`_` of its first part (`sk-`, `sk-proj-`,
  `sk-ant-api03-`, `AIza`) and its length, and every other character is replaced by a random one
  of the same class (letter case, digit), punctuation kept;
- anything else: random characters of the same classes, same length.

Placeholders are random per run (`secrets` module): nothing about the real value can be derived from
one, and two runs' boxes never share one. Paths are dotted JSON paths; a `*` part matches every key
of an object, or every element of an array, at that level (opencode's per-provider entries, claude's
`mcpOAuth` map, gemini's list of MCP servers' tokens), a `**` part any number of levels, none
included (a token file whose layout changes between CLI versions still has its `accessToken`s found),
and any other part with `*`, `?` or `[` a glob on the keys of that level, in any case (an MCP server's
`headers.*authorization*`, its `env.*_TOKEN`).

A file named `.env` (or `*.env`) is a dotenv file instead (gemini's `~/.gemini/.env`, codex's
`~/.codex/.env`: variables the CLI loads at start): its paths are variable-name globs (`*_API_KEY`),
each matching `NAME=value` line (`export` allowed, the value bare or quoted) gets a placeholder for its
value, and every other line stays as it is. A line this parser does not understand (a quoted value
running over lines, say) makes the whole file not understood: ValueError, and the caller gives the
box no copy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from relay.model import token_shapes

MAX_FILE = 1 << 20  # a login file is a few KiB; beyond this it is not a login this table knows
FAR_FUTURE_S = 4_102_444_800  # 2100-01-01: a placeholder JWT's `exp`
_KEY_PREFIX = re.compile(r"^(?:[A-Za-z]{1,8}[-_])+(?:[A-Za-z0-9]{1,8}[-_])?|^AIza|^ya29\.|^1//")
_JWT = re.compile(r"^[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*$")


Step = str | int  # an object's key, or an array's index


def _children(data: Any) -> list[tuple[Step, Any]]:
    if isinstance(data, dict):
        return [(k, data[k]) for k in sorted(k for k in data if isinstance(k, str))]
    if isinstance(data, list):
        return list(enumerate(data))
    return []


def _walk(data: Any, parts: list[str], at: tuple[Step, ...]) -> Iterator[tuple[tuple[Step, ...], str]]:
    if not parts:
        if isinstance(data, str) and data:
            yield at, data
        return
    head, rest = parts[0], parts[1:]
    if head == "**":  # none or more levels: here, then below each child (a file is bounded, so is this)
        yield from _walk(data, rest, at)
        for key, child in _children(data):
            yield from _walk(child, parts, (*at, key))
        return
    if head == "*":
        for key, child in _children(data):
            yield from _walk(child, rest, (*at, key))
    elif any(c in head for c in "*?[") and isinstance(data, dict):  # a glob on the keys, any case
        from fnmatch import fnmatchcase

        for key, child in _children(data):
            if fnmatchcase(str(key).lower(), head.lower()):
                yield from _walk(child, rest, (*at, key))
    elif isinstance(data, dict) and head in data:
        yield from _walk(data[head], rest, (*at, head))


def found(data: Any, paths: tuple[str, ...]) -> list[tuple[tuple[Step, ...], str]]:
    """Every (concrete path, value) of a non-empty string at one of `paths` (each value once). A path
    that starts with `?` is shape-gated: it takes only the values that look like a credential by
    themselves (relay/model/token_shapes.py: a vendor prefix, a URL's key, the argv value after a
    `--token` flag), for places where a key name says nothing (an MCP server's args or url)."""
    out: dict[tuple[Step, ...], str] = {}
    for path in paths:
        gated = path.startswith("?")
        for at, value in _walk(data, path.removeprefix("?").split("."), ()):
            if gated and not token_shapes.looks_secret(value, before(data, at)):
                continue
            out.setdefault(at, value)
    return list(out.items())


def _spans(data: Any, at: tuple[Step, ...], value: str) -> list[tuple[int, int]]:
    """Where the secret is in a value found at `at`: the part that looks like one (a URL's key, the
    value of `--api-key=`), else all of it (a value under a key that names a secret)."""
    return token_shapes.secret_spans(value, before(data, at)) or [(0, len(value))]


def before(data: Any, at: tuple[Step, ...]) -> Any:
    """The list element in front of the one at `at` (the flag of an argv value), or None."""
    if not at or not isinstance(at[-1], int) or at[-1] == 0:
        return None
    parent = _at(data, at[:-1])
    return parent[at[-1] - 1] if isinstance(parent, list) else None


def is_dotenv(path: str) -> bool:
    """Whether a credential file is a dotenv file (variables), not JSON, by its name."""
    name = path.rsplit("/", 1)[-1]
    return name == ".env" or name.endswith(".env")


def _bounded(raw: bytes | None, limit: int = MAX_FILE) -> bytes:
    if raw is None:
        raise ValueError("no file")
    if len(raw) > limit:
        raise ValueError("over the size bound")
    return raw


def parse(raw: bytes | None, limit: int = MAX_FILE) -> Any:
    """The file as JSON (ValueError when it is not: such a file is never copied into a box as is)."""
    try:
        return json.loads(_bounded(raw, limit))
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _without_comments(text: str) -> str:
    """JSON with comments (JSONC: `//`, `/* */`, trailing commas, as gemini's and opencode's settings
    allow) as plain JSON; the text of strings is kept byte for byte."""
    out: list[str] = []
    plain: list[str] = []  # the run of text outside strings since the last string

    def flush() -> None:
        out.append(re.sub(r",(\s*[}\]])", r"\1", "".join(plain)))
        plain.clear()

    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            flush()
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            m = re.compile(r"[\r\n]").search(text, i)
            i = n if m is None else m.start()
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise ValueError("a comment is not closed")
            plain.append(" ")
            i = j + 2
        else:
            plain.append(ch)
            i += 1
    flush()
    return "".join(out)


def parse_settings(raw: bytes | None, path: str) -> Any:
    """A settings file as data: TOML for `.toml` (codex's config.toml), else JSON with comments allowed
    (ValueError when it is neither)."""
    if not path.endswith(".toml"):
        return parse_jsonc(raw)
    import tomllib

    try:
        return tomllib.loads(_bounded(raw).decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


def parse_jsonc(raw: bytes | None) -> Any:
    """The file as JSON, comments and trailing commas allowed (ValueError when it is not even that)."""
    try:
        return parse(raw)
    except ValueError:
        pass
    try:
        text = _bounded(raw).decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    try:
        return json.loads(_without_comments(text))
    except RecursionError:
        raise ValueError("nested too deeply") from None


_ENV_LINE = re.compile(r"^(\s*(?:export\s+)?)([A-Za-z_][A-Za-z0-9_.]*)(\s*=\s*)(.*?)(\s*)$")


def _env_value(text: str) -> tuple[str, str, str]:
    """(opening quote, the value, what follows it) of a dotenv value; ValueError: not one this reads."""
    if text[:1] in ("'", '"'):
        end = text.find(text[0], 1)
        if end < 0:
            raise ValueError("a quoted value runs over lines")
        tail = text[end + 1:]
        if tail.strip() and not tail.lstrip().startswith("#"):
            raise ValueError("text after a quoted value")
        return text[0], text[1:end], text[0] + tail
    value, hash_at = text, text.find(" #")
    if hash_at >= 0:
        value = text[:hash_at]
    return "", value.rstrip(), text[len(value.rstrip()):]


def _env_lines(raw: bytes, paths: tuple[str, ...]) -> Iterator[tuple[str, str | None, tuple[str, str, str, str] | None]]:
    """Per line: (the line, the variable's name when `paths` match it, the parts to rebuild it)."""
    from fnmatch import fnmatchcase

    try:
        text = _bounded(raw).decode()
        bom = "\ufeff" if text.startswith("\ufeff") else ""
        if bom:
            yield bom, None, None
            text = text[1:]
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        if not body.strip() or body.lstrip().startswith("#"):
            yield line, None, None
            continue
        m = _ENV_LINE.match(body)
        if m is None:
            raise ValueError("a line is not NAME=value")
        lead, name, eq, rest, trail = m.groups()
        quote, value, after = _env_value(rest)
        if not any(fnmatchcase(name.upper(), p.upper()) for p in paths) or not value:  # any case, as JSON keys
            yield line, None, None
            continue
        yield line, name, (lead + name + eq + quote, value, after + trail, line[len(body):])


def values(raw: bytes | None, paths: tuple[str, ...], dotenv: bool = False,
           limit: int = MAX_FILE) -> list[tuple[str, str]]:
    """Each (dotted path or variable name, secret value) of this file, for the host's secret scan only;
    ValueError: not a file of its kind this reads (or over `limit`)."""
    if dotenv:
        return [(name, parts[1]) for _, name, parts in _env_lines(_bounded(raw, limit), paths) if name and parts]
    data = parse(raw, limit)
    return [(".".join(map(str, at)), value[a:b]) for at, value in found(data, paths)
            for a, b in _spans(data, at, value)]


def secret_paths(raw: bytes | None, paths: tuple[str, ...], dotenv: bool = False) -> list[str]:
    """The dotted paths (a dotenv file: the variable names) holding a secret in this file, names only,
    never values; ValueError: not a file of its kind this reads."""
    if dotenv:
        return list(dict.fromkeys(name for _, name, _ in _env_lines(_bounded(raw), paths) if name))
    return [".".join(map(str, at)) for at, _ in found(parse(raw), paths)]


def _same_class(ch: str) -> str:
    import secrets  # only when a placeholder is made (secrets pulls random, hmac and base64 in)

    if ch in _LOWER:
        return secrets.choice(_LOWER)
    if ch in _UPPER:
        return secrets.choice(_UPPER)
    if ch in _DIGITS:
        return secrets.choice(_DIGITS)
    return ch


def shaped_text(value: str) -> str:
    """Random text of `value`'s shape: its key prefix kept, each other character one of its class."""
    scheme = next((s for s in _SCHEMES if value.startswith(s) and len(value) > len(s)), "")  # an Authorization header's
    if scheme:
        return scheme + shaped_text(value[len(scheme):])
    m = _KEY_PREFIX.match(value)
    # A prefix is kept when it is a vendor's (`ghp_`) or before a long random part (`sk-ant-api03-` + 95):
    # in `correct-horse-battery-staple` or `Summer_2024_db` the "prefix" is most of the secret.
    keep = m.group(0) if m and (len(value) - len(m.group(0)) >= 16 or token_shapes.vendor_prefix(m.group(0))) else ""
    return keep + "".join(_same_class(c) for c in value[len(keep):])


_LOWER, _UPPER, _DIGITS = "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789"  # not `string`: its import compiles a regex
_SCHEMES = ("Bearer ", "bearer ", "Basic ", "basic ", "token ", "Token ")


def _b64(data: bytes) -> str:
    import base64  # here: only a masked login file needs it

    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    import base64

    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def jwt_claims(value: str) -> dict | None:
    """A JWT's claims, decoded without verifying anything (only to read `exp`); None: not a JWT."""
    if not _JWT.match(value):
        return None
    try:
        claims = json.loads(_unb64(value.split(".")[1]))
    except ValueError:
        return None
    return claims if isinstance(claims, dict) else None


def shaped_jwt(value: str) -> str | None:
    """A JWT with the same header and claims (`exp` far ahead) and a random signature; None: no JWT."""
    if not _JWT.match(value):
        return None
    head, payload, sig = value.split(".")
    try:
        header, claims = json.loads(_unb64(head)), json.loads(_unb64(payload))
        if not isinstance(header, dict) or not isinstance(claims, dict):
            return None
        raw_sig = _unb64(sig)
    except ValueError:
        return None
    if "exp" in claims:
        claims["exp"] = FAR_FUTURE_S
    import secrets

    fake_sig = secrets.token_bytes(max(len(raw_sig), 32))
    return f"{head}.{_b64(json.dumps(claims, separators=(',', ':')).encode())}.{_b64(fake_sig)}"


def placeholder_for(value: str) -> str:
    return shaped_jwt(value) or shaped_text(value)


def _set(data: Any, at: tuple[Step, ...], value: str) -> None:
    for part in at[:-1]:
        data = data[part]
    data[at[-1]] = value


def restore(box: bytes, host: bytes | None, written: list[tuple]) -> bytes:
    """A masked JSON file on its way back from the box: each value still the placeholder `mask` wrote
    there (`written`) becomes the host's value again, so a box that changed nothing there changed
    nothing; a value the box changed stays the box's (the settings review judges it). Not JSON: as it is."""
    try:
        data, real = json.loads(box), json.loads(host) if host is not None else None
    except (ValueError, RecursionError):
        return box
    # A placeholder is the host's value again only while the entry that owns it (an MCP server: two
    # levels up) is otherwise the host's: a box that pointed the server elsewhere keeps the placeholder,
    # so no review and no accept-state ever sends the real token to where the box chose.
    owners: dict[tuple[Step, ...], list[tuple[tuple[Step, ...], str]]] = {}
    changed = False
    for entry in written:
        at, placeholder = entry[0], entry[1]
        # The owner: given (the state search's placeholders: the object holding the value), an MCP server or
        # two levels up, or for `env.KEY` the object holding it (a box that added ANTHROPIC_BASE_URL beside
        # the key keeps the placeholder: red team round 3); a top-level key (primaryApiKey) has none.
        owner = entry[2] if len(entry) > 2 else _owner(at) if len(at) >= 3 else at[:-1] if len(at) == 2 else None
        if owner is not None:
            owners.setdefault(owner, []).append((at, placeholder))
        elif _at(data, at) == placeholder and _at(real, at) is not _NONE:
            _put(data, at, _at(real, at))
            changed = True
    for owner, entries in owners.items():
        box_owner, host_owner = _at(data, owner), _at(real, owner)
        if box_owner is _NONE or host_owner is _NONE:
            continue
        trial = json.loads(json.dumps(box_owner))
        for at, placeholder in entries:
            rest = at[len(owner):]
            if _at(trial, rest) == placeholder and _at(host_owner, rest) is not _NONE:
                _put(trial, rest, _at(host_owner, rest))
        if trial == host_owner:
            _put(data, owner, trial)
            changed = True
    return json.dumps(data, indent=2, ensure_ascii=False).encode("utf-8", "surrogatepass") if changed else box


_NONE = object()
_SERVER_MAPS = ("mcpServers", "mcp_servers", "mcp")


def _owner(at: tuple[Step, ...]) -> tuple[Step, ...]:
    """The entry a secret belongs to: its MCP server (`mcpServers.<name>`, however deep the secret sits:
    `.env.X`, `.args.3`, `.url`), else the level two up."""
    for i in range(len(at) - 2, -1, -1):
        if at[i] in _SERVER_MAPS and i + 1 < len(at) - 1:
            return at[:i + 2]
    return at[:-2]


def _at(data: Any, at: tuple[Step, ...]) -> Any:
    for part in at:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return _NONE
    return data


def _put(data: Any, at: tuple[Step, ...], value: Any) -> None:
    for part in at[:-1]:
        data = data[part]
    data[at[-1]] = value


def mask(raw: bytes, paths: tuple[str, ...], keep: frozenset[str] = frozenset(),
         dotenv: bool = False, written: list[tuple[tuple[Step, ...], str]] | None = None) -> tuple[bytes, int]:
    """The box's copy: every secret at `paths` replaced by a placeholder of its shape (values in `keep`,
    e.g. a placeholder another mask already wrote, stay). Returns (bytes, how many were replaced).
    ValueError when the file is not JSON (or, `dotenv`, not a dotenv file this reads): the caller then
    gives the box no copy."""
    if dotenv:
        out, n = [], 0
        for line, name, parts in _env_lines(raw, paths):
            if name is None or parts is None or parts[1] in keep:
                out.append(line)
                continue
            head, value, tail, newline = parts
            out.append(head + placeholder_for(value) + tail + newline)
            n += 1
        return "".join(out).encode(), n
    data = parse(raw)
    n = 0
    for at, value in found(data, paths):
        if value in keep:
            continue
        placeholder, end = "", 0
        for a, b in _spans(data, at, value):  # only the secret's part: a URL, a flag, a scheme stay as they are
            placeholder += value[end:a] + placeholder_for(value[a:b])
            end = b
        placeholder += value[end:]
        _set(data, at, placeholder)
        if written is not None:
            written.append((at, placeholder))
        n += 1
    return json.dumps(data).encode(), n
