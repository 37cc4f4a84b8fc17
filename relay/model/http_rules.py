"""Method and path rules for what the proxy sees as HTTP: plain-HTTP rules, credential routes, grants.

Why: a host name is too coarse where the proxy holds a key. A `github-read` grant that can
`git push`, or an API route that reaches every endpoint of its host with the user's key, gives the
box more than the user meant. Where the proxy reads the request line (plain HTTP, the origin-form
credential routes), it can say which methods and paths go through.

A path rule is a prefix (`/v1/`: that path and everything under it, segment-wise, so `/v1` never
covers `/v1evil`) or a glob (`*` within one segment, `**` across segments, `?` one character).
Rules match a *normalised* path: one that holds no `.` or `..` segment, no `//`, no backslash, no
encoded slash, backslash or NUL, and no encoded `.`/`..` segment, since an upstream could read such a
path differently from us (`/v1/../admin`). Such a path is refused outright, not normalised and passed.

Git over smart HTTP is judged here too: `git-upload-pack` is a fetch, `git-receive-pack` a push; a
grant or route without `push: true` never carries a push, and a `git: true` grant carries nothing
but git's fetch (`info/refs?service=git-upload-pack` and `POST .../git-upload-pack`).

Pure functions only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from relay.model.record import record

_METHOD = re.compile(r"[A-Z]{1,16}")
_BAD_ENCODED = re.compile(r"%(2f|5c|00)", re.IGNORECASE)
_PATH_RULE = re.compile(r"/[\x21-\x7e]{0,255}")


class PathError(ValueError):
    """A request path that is not normalised (the reason in words, for a 400)."""


def check_method(value: str) -> str:
    """A method rule: upper-case letters (GET, POST, ...), or ValueError."""
    if not _METHOD.fullmatch(value):
        raise ValueError(f"method {value[:20]!r} must be an upper-case HTTP method, e.g. GET")
    return value


def check_path_rule(value: str) -> str:
    """A path rule: an absolute, normalised path prefix or glob, printable ASCII, or ValueError."""
    if not isinstance(value, str) or not _PATH_RULE.fullmatch(value) or "," in value:
        raise ValueError(f"path {str(value)[:40]!r} must start with '/' and be printable ASCII without ','")
    try:
        normalise_path(value.replace("*", "x").replace("?", "x"))
    except PathError as err:
        raise ValueError(f"path {value[:40]!r}: {err}") from None
    return value


def normalise_path(target: str) -> tuple[str, str]:
    """(the path, percent-decoded, with no query; the raw query) of an origin-form target, or
    PathError when it is not normalised (see the module doc)."""
    path, _, query = target.partition("?")
    if not path.startswith("/"):
        raise PathError("the path does not start with '/'")
    if _BAD_ENCODED.search(path):
        raise PathError("the path holds an encoded '/', '\\' or NUL")
    if "\\" in path:
        raise PathError("the path holds a backslash")
    decoded = path
    if "%" in path:
        from urllib.parse import unquote  # here: urllib.parse (with ipaddress) is ~3 ms of a launch that parses no path

        decoded = unquote(path, errors="strict")
    if "//" in decoded:
        raise PathError("the path holds an empty segment ('//')")
    if any(seg in (".", "..") for seg in decoded.split("/")):
        raise PathError("the path holds a '.' or '..' segment")
    if any(ord(c) < 0x21 or ord(c) == 0x7f for c in decoded):
        raise PathError("the path holds a control character or space")
    return decoded, query


def _glob(rule: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(rule):
        if rule.startswith("**", i):
            out.append(".*")
            i += 2
        elif rule[i] == "*":
            out.append("[^/]*")
            i += 1
        elif rule[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(rule[i]))
            i += 1
    return re.compile("".join(out))


def path_matches(rule: str, path: str) -> bool:
    """Whether the normalised `path` is covered by `rule` (a prefix, segment-wise, or a glob)."""
    if any(c in rule for c in "*?"):
        return _glob(rule).fullmatch(path) is not None
    if rule.endswith("/"):
        return path.startswith(rule) or path == rule[:-1]
    return path == rule or path.startswith(rule + "/")


@record
class HttpRules:
    """What one rule, route or grant lets through. `methods`/`paths` empty: any. `push`: git's
    receive-pack is carried; `git_only`: nothing but git's fetch (and push, with `push`)."""

    methods: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    push: bool = False
    git_only: bool = False

    @property
    def limited(self) -> bool:
        return bool(self.methods or self.paths or self.git_only)

    def describe(self) -> str:
        """The rules in one short phrase, for the log and --dry-run."""
        parts = []
        if self.git_only:
            parts.append("git fetch" + (" and push" if self.push else " only"))
        elif not self.push:
            parts.append("no git push")
        if self.methods:
            parts.append("methods " + " ".join(self.methods))
        if self.paths:
            parts.append("paths " + " ".join(self.paths))
        return "; ".join(parts) or "any method and path"

    def as_json(self) -> dict[str, object]:
        return {"methods": list(self.methods), "paths": list(self.paths), "push": self.push, "git": self.git_only}


def git_service(path: str, query: str) -> str:
    """"upload-pack" or "receive-pack" when the request is git smart HTTP (either of its two
    requests), else "". A service named in the query other than those two counts as receive-pack
    (unknown: refused as a push would be)."""
    last = path.rsplit("/", 1)[-1]
    if last in ("git-upload-pack", "git-receive-pack"):
        return last.removeprefix("git-")
    if path.endswith("/info/refs"):
        from urllib.parse import unquote

        services = [unquote(p.partition("=")[2]) for p in query.split("&") if p.partition("=")[0] == "service"]
        if not services:
            return "dumb"
        return "upload-pack" if services == ["git-upload-pack"] else "receive-pack"
    return ""


def refusal(rules: HttpRules, method: str, target: str) -> str:
    """Why `method target` is not let through under `rules` ("" when it is). A path that is not
    normalised is refused whatever the rules (PathError's reason)."""
    try:
        path, query = normalise_path(target)
    except (PathError, UnicodeDecodeError) as err:
        return f"the path is not normalised: {err}"
    service = git_service(path, query)
    if service == "receive-pack" and not rules.push:
        return "git push (git-receive-pack) is not allowed by this rule (it has no push: true)"
    if rules.git_only:
        if service == "upload-pack" and (method == "GET" and path.endswith("/info/refs")
                                         or method == "POST" and path.endswith("/git-upload-pack")):
            return ""
        if service == "receive-pack" and (method == "GET" and path.endswith("/info/refs")
                                          or method == "POST" and path.endswith("/git-receive-pack")):
            return ""
        return f"{method} {path[:80]} is not a git fetch, the only thing this git rule allows"
    if rules.methods and method not in rules.methods:
        return f"method {method} is not one of {', '.join(rules.methods)}"
    if rules.paths and not any(path_matches(rule, path) for rule in rules.paths):
        return f"path {path[:80]} is not under {', '.join(rules.paths)}"
    return ""


def from_rule(methods: Sequence[str], paths: Sequence[str]) -> HttpRules:
    """A plain-HTTP host rule's methods and paths. No key rides on it, so git push is not singled
    out (limit it with `,method=`/`,path=`); on routes and grants, which carry a key, it is."""
    return HttpRules(tuple(methods), tuple(paths), push=True)
