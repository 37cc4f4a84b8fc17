"""Load and strictly validate the backend matrix and the user and repo config layers.

Three layers, in trust order:
  1. `config/backends.yaml` shipped with hive relay (complete entries);
  2. the user's own `~/.config/hive-relay/config.yaml` (may add or widen anything);
  3. the workspace repo's `.hive-relay.yaml` (may only narrow: the repo is what the
     agent edits, so it must never be able to widen its own box).
Any invalid file is an error naming file, backend and key; nothing falls back to defaults.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from relay.config.presets import BUILTIN as BUILTIN_PRESETS
from relay.config.presets import NAME_RE as PRESET_NAME
from relay.host import memo, safefs
from relay.host.paths import PACKAGE_ROOT, config_home
from relay.model import credential_files
from relay.model.allow_rules import HostRule, parse_rule
from relay.model.backend import Backend, CredentialRoute, LoginFile, Matrix, ProfileSpec
from relay.model.errors import ConfigError, UsageError
from relay.model.http_rules import check_method, check_path_rule
from relay.model.record import fields, replace
from relay.model.vocab import RefreshBody

TYPE_CHECKING = False  # importing typing costs ~4 ms per launch; annotations are strings anyway
if TYPE_CHECKING:
    from typing import Any

SHIPPED_CONFIG = PACKAGE_ROOT / "config" / "backends.yaml"
REPO_CONFIG_NAME = ".hive-relay.yaml"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PLACEHOLDERS = {"{prompt}", "{shell}", "{workdir}"}
MAX_CONFIG_BYTES = 1 << 20


SENDS = ("x-api-key", "authorization-bearer", "x-goog-api-key", "authorization-basic")
SEND_QUERY = "query:"  # `query:NAME`: the key as the query parameter NAME (any client-sent value replaced)
_QUERY_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
ROUTE_PLACEHOLDERS = {"{url}", "{placeholder}"}


def _send(value: Any, where: _Where, key: str) -> str:
    """One of SENDS, or `query:NAME` with NAME a plain parameter name (nothing to escape)."""
    send = _str(value, where, key)
    if send in SENDS or (send.startswith(SEND_QUERY) and _QUERY_NAME.fullmatch(send[len(SEND_QUERY):])):
        return send
    raise where.fail(key, f"unknown way {send!r}", f"use one of {', '.join(SENDS)} or query:NAME")


class _Where:
    """Builds the one-line error that names file, backend and key."""

    def __init__(self, file: str, backend: str | None = None) -> None:
        self.file = file
        self.backend = backend

    def fail(self, key: str, problem: str, fix: str) -> ConfigError:
        owner = f"backend '{self.backend}': " if self.backend else ""
        return ConfigError(f"{self.file}: {owner}key '{key}': {problem}; fix: {fix}")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _str(value: Any, where: _Where, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise where.fail(key, f"expected a non-empty string, got {_type_name(value)}", "write a quoted string")
    return value


def _bool(value: Any, where: _Where, key: str) -> bool:
    if not isinstance(value, bool):
        raise where.fail(key, f"expected true or false, got {_type_name(value)}", "write true or false")
    return value


def _str_list(value: Any, where: _Where, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise where.fail(key, f"expected a list of strings, got {_type_name(value)}", "write [a, b] or []")
    return tuple(value)


def _argv(value: Any, where: _Where, key: str) -> tuple[str, ...]:
    argv = _str_list(value, where, key)
    if not argv:
        raise where.fail(key, "the command is empty", "give the program name first, e.g. [claude]")
    for arg in argv:
        for found in re.findall(r"\{[a-z_]+\}", arg):
            if found not in _PLACEHOLDERS:
                raise where.fail(key, f"unknown placeholder {found}", f"use one of {sorted(_PLACEHOLDERS)}")
    return argv


def _paths(value: Any, where: _Where, key: str) -> tuple[str, ...]:
    paths = _str_list(value, where, key)
    for path in paths:
        if not (path.startswith("/") or path.startswith("~/")):
            raise where.fail(key, f"path {path!r} is neither absolute nor ~/…", "write /abs/path or ~/relative")
        if "\0" in path or any(part == ".." for part in path.split("/")):
            raise where.fail(key, f"path {path!r} contains '..'", "write the path without '..'")
    return paths


_KEEP_PART = re.compile(r"^(\*\*|(?:[A-Za-z0-9._@+=,~ -]|\*(?!\*))*)$")


def _keep_patterns(value: Any, where: _Where, key: str) -> tuple[str, ...]:
    """home.keep: what the host takes back from a box's private copy of the agent's state. Each entry is
    `~/` plus path parts: a literal name, a name with `*` (any characters but `/`), or `**` (any
    number of parts). Nothing else (no `?`, `[...]`, `..`, absolute paths), so a pattern means one thing."""
    patterns = _str_list(value, where, key)
    for pattern in patterns:
        parts = pattern.split("/")
        ok = (pattern.startswith("~/") and len(parts) > 1 and all(parts[1:])
              and not any(p in (".", "..") for p in parts[1:]) and all(_KEEP_PART.match(p) for p in parts[1:])
              and parts[1] not in ("*", "**"))
        if not ok:
            raise where.fail(key, f"{pattern!r} is not a keep pattern",
                             "write ~/dir/file, ~/dir/*.jsonl or ~/dir/sub/** (no '..', '?', '[' or leading '*')")
    return patterns


def _env_names(value: Any, where: _Where, key: str) -> tuple[str, ...]:
    """Variable names passed into the box: exact names only. A pattern (`LC_*`, `AWS_*`) would
    also pass any secret whose name happens to match it."""
    names = _str_list(value, where, key)
    for name in names:
        if "*" in name or "?" in name or "[" in name:
            raise where.fail(key, f"{name!r} is a pattern; only exact names are passed",
                             "list each variable by name, e.g. [LC_ALL, LC_CTYPE] instead of LC_*")
        if not _ENV_NAME.match(name):
            raise where.fail(key, f"{name!r} is not an environment variable name", "use LETTERS_DIGITS_")
    return names


def _env_map(value: Any, where: _Where, key: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise where.fail(key, f"expected a mapping NAME: value, got {_type_name(value)}", "write {NAME: '1'}")
    items = []
    for name, val in value.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise where.fail(key, f"{name!r} is not an environment variable name", "use LETTERS_DIGITS_")
        if not isinstance(val, str):
            raise where.fail(f"{key}.{name}", f"expected a quoted string, got {_type_name(val)}", f"write {name}: '{val}'")
        items.append((name, val))
    return tuple(sorted(items))


def _hosts(value: Any, where: _Where, key: str) -> tuple[str, ...]:
    entries = _str_list(value, where, key)
    for entry in entries:
        try:
            parse_rule(entry)
        except UsageError as err:
            raise where.fail(key, str(err).removeprefix("--allow-host "), "write NAME, NAME:PORT or *.domain") from None
    return entries


def _preset_names(value: Any, where: _Where, key: str) -> tuple[str, ...]:
    names = _str_list(value, where, key)
    for name in names:
        if not PRESET_NAME.fullmatch(name):
            raise where.fail(key, f"{name!r} is not a preset name", "use lowercase letters, digits and '-'")
    return tuple(dict.fromkeys(names))


def _user_presets(value: Any, where: _Where) -> dict[str, tuple[str, ...]]:
    """The user config's `presets: {name: [hosts]}`: new names only (a built-in one keeps its meaning,
    so `--allow-preset npm` means the same for everyone), each a non-empty list of valid entries."""
    out = {}
    for name, hosts in _mapping(value, where, "presets").items():
        key = f"presets.{name}"
        if not PRESET_NAME.fullmatch(name):
            raise where.fail(key, f"{name!r} is not a preset name", "use lowercase letters, digits and '-'")
        if name in BUILTIN_PRESETS:
            raise where.fail(key, "is a built-in preset", "pick another name for your own list")
        out[name] = _hosts(hosts, where, key)
        if not out[name]:
            raise where.fail(key, "is empty", "list at least one host, or remove the preset")
    return out


def _check_presets(backends: Mapping[str, Backend], known: Mapping[str, tuple[str, ...]], file: str) -> None:
    for backend in backends.values():
        for name in backend.presets:
            if name not in known:
                raise _Where(file, backend.name).fail(
                    "presets", f"unknown preset {name!r}", f"use one of {', '.join(sorted(known))}")


def parse_size(value: Any, where: _Where, key: str) -> int:
    """Parse 8GiB / 512MiB / 4G / plain bytes; refuse zero and nonsense."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", value, re.IGNORECASE)
        if m and int(m.group(1)) > 0:
            scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
            return int(m.group(1)) * scale
    raise where.fail(key, f"{value!r} is not a size", "write e.g. 8GiB or 512MiB")


def _positive_int(value: Any, where: _Where, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 22:
        return value
    raise where.fail(key, f"{value!r} is not a positive whole number", "write e.g. 512")


def _mapping(value: Any, where: _Where, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise where.fail(key, f"expected a mapping, got {_type_name(value)}", f"write {key}: {{...}}")
    for sub in value:
        if not isinstance(sub, str):
            raise where.fail(f"{key}.{sub}", "keys must be strings", "quote the key")
    return value


def _section(value: Any, where: _Where, key: str, allowed: set[str]) -> dict[str, Any]:
    _mapping(value, where, key)
    for sub in value:
        if sub not in allowed:
            raise where.fail(f"{key}.{sub}", "unknown key", f"remove it; known keys: {', '.join(sorted(allowed))}")
    return value


BACKEND_KEYS = {
    "description", "command", "prompt_command", "install", "home", "egress",
    "env", "native", "deny", "opt_in", "nested_userns", "credentials", "logins_in_box", "presets",
    "login_command", "secret_files", "unmaskable",
}
ROUTE_KEYS = {"secret_env", "upstream", "send", "box_env", "box_args", "login", "methods", "paths", "inspect"}
LOGIN_KEYS = {"file", "token", "refresh_token", "expires", "refresh_url", "client_id", "id_token", "refreshed_at",
              "unless", "client_secret", "refresh_body"}
LOGIN_OPTIONAL_KEYS = {"expires", "id_token", "refreshed_at", "unless", "client_secret", "refresh_body"}  # no expires: the token's own JWT `exp`
_JSON_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_SECRET_PART = r"(\*\*?|[A-Za-z_][A-Za-z0-9_]*|[A-Za-z0-9_*?\[\]-]*[*?\[][A-Za-z0-9_*?\[\]-]*)"  # a key, * or **, a glob
_SECRET_PATH = re.compile(r"\??" + _SECRET_PART + r"(\." + _SECRET_PART + r")*")  # ?: shape-gated
_ENV_NAME_GLOB = re.compile(r"[A-Za-z0-9_*]+")  # a dotenv file's secret_files entries: variable-name globs
_ROUTE_NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")


def _route_template(value: str, where: _Where, key: str) -> str:
    for found in re.findall(r"\{[a-z_]+\}", value):
        if found not in ROUTE_PLACEHOLDERS:
            raise where.fail(key, f"unknown placeholder {found}", f"use one of {sorted(ROUTE_PLACEHOLDERS)}")
    return value


def _entry_name(name: str, where: _Where, key: str, noun: str) -> None:
    """A route's or grant's name: it becomes the proxy path `/NAME`, so plain letters only."""
    if not _ROUTE_NAME.fullmatch(name):
        raise where.fail(key, f"{name!r} is not a {noun} name", "use lowercase letters, digits, '-'")


def _require(data: dict[str, Any], where: _Where, key: str, names: tuple[str, ...]) -> None:
    for required in names:
        if required not in data:
            raise where.fail(f"{key}.{required}", "missing", f"add {required}")


def _one_host(text: str, where: _Where, key: str, parse_fix: str, what: str, example: str) -> HostRule:
    """A route's or grant's upstream: one host name with a port, never a wildcard, an IP or a pin
    (a pin is the user's `--allow-host` decision, not a config file's)."""
    try:
        rule = parse_rule(text)
    except UsageError as err:
        raise where.fail(key, str(err).removeprefix("--allow-host "), parse_fix) from None
    if rule.port is None or rule.pin_addr is not None or rule.wildcard or rule.is_ip:
        raise where.fail(key, what, f"write e.g. {example} (pin it with --allow-host, never here)")
    return rule


def _credentials(value: Any, where: _Where, env_pass: tuple[str, ...]) -> tuple[CredentialRoute, ...]:
    """`credentials: {ROUTE: {secret_env, upstream, send, box_env, box_args}}`, strictly."""
    routes = []
    for name, raw in _mapping(value, where, "credentials").items():
        key = f"credentials.{name}"
        _entry_name(name, where, key, "route")
        data = _section(raw, where, key, ROUTE_KEYS)
        _require(data, where, key, ("upstream", "send") if "login" in data else ("secret_env", "upstream", "send"))
        login = _login(data["login"], where, f"{key}.login") if "login" in data else None
        secret_env = _env_names(data.get("secret_env", []), where, f"{key}.secret_env")
        if login is not None and secret_env:
            raise where.fail(f"{key}.secret_env", "a login route takes its token from the login file",
                             "drop secret_env here, or make it a route of its own")
        if not secret_env and login is None:
            raise where.fail(f"{key}.secret_env", "no variable named", "list the host variables holding the key")
        missing = [n for n in secret_env if n not in env_pass]
        if missing:
            raise where.fail(f"{key}.secret_env", f"{', '.join(missing)} not in env.pass",
                             "list each secret variable in env.pass too (a repo that drops it there drops the route's use of it)")
        upstream = _str(data["upstream"], where, f"{key}.upstream")
        rule = _one_host(upstream, where, f"{key}.upstream", "write NAME:PORT",
                         f"{upstream!r} is not one host name with a port", "api.anthropic.com:443")
        send = _send(data["send"], where, f"{key}.send")
        box_env = _env_map(data.get("box_env", {}), where, f"{key}.box_env")
        box_env = tuple((n, _route_template(v, where, f"{key}.box_env.{n}")) for n, v in box_env)
        clash = [n for n, _ in box_env if n in secret_env and "{placeholder}" not in dict(box_env)[n]]
        if clash:
            raise where.fail(f"{key}.box_env", f"{clash[0]} is a secret variable set to something else than the placeholder",
                             "set it to '{placeholder}' or leave it out")
        box_args = tuple(_route_template(a, where, f"{key}.box_args")
                         for a in _str_list(data.get("box_args", []), where, f"{key}.box_args"))
        methods, paths = _http_limits(data, where, key)
        routes.append(CredentialRoute(str(name), secret_env, rule.name, rule.port, send, box_env, box_args, login=login,
                                      methods=methods, paths=paths,
                                      inspect=_bool(data.get("inspect", False), where, f"{key}.inspect")))
    return tuple(routes)


GRANT_KEYS = {"host", "secret", "send", "user", "backends", "methods", "paths", "push", "git", "inspect"}


def _http_limits(data: dict[str, Any], where: _Where, key: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A route's or grant's `methods:` and `paths:` (relay/model/http_rules.py), each checked; absent: any."""
    out: list[tuple[str, ...]] = []
    for field, check in (("methods", check_method), ("paths", check_path_rule)):
        values = _str_list(data.get(field, []), where, f"{key}.{field}")
        if field in data and not values:
            raise where.fail(f"{key}.{field}", "the list is empty (it would allow nothing)",
                             f"list what it allows, or remove {field} (then any)")
        try:
            out.append(tuple(dict.fromkeys(check(v) for v in values)))
        except ValueError as err:
            raise where.fail(f"{key}.{field}", str(err), "write e.g. methods: [GET, POST], paths: [/v1/]") from None
    return out[0], out[1]
SECRET_KEYS = {"env", "command", "file", "json"}


def _grants(value: Any, where: _Where) -> tuple[CredentialRoute, ...]:
    """`auth: {NAME: {host, secret: {env | command | file [+ json]}, send, user, backends}}` (user config
    only): a credential for another host, injected by the proxy on the route `/NAME` (e.g. git over HTTPS).
    `backends:` (checked against the known backends by user_grants) scopes it to those backends' runs."""
    grants = []
    for name, raw in _mapping(value, where, "auth").items():
        key = f"auth.{name}"
        _entry_name(name, where, key, "grant")
        data = _section(raw, where, key, GRANT_KEYS)
        _require(data, where, key, ("host", "secret", "send"))
        host = _str(data["host"], where, f"{key}.host")
        rule = _one_host(host if ":" in host else f"{host}:443", where, f"{key}.host", "write NAME or NAME:PORT",
                         f"{host!r} is not one host name", "github.com")
        secret = _section(data["secret"], where, f"{key}.secret", SECRET_KEYS)
        sources = [s for s in ("env", "command", "file") if s in secret]
        if len(sources) != 1 or ("json" in secret and sources != ["file"]):
            raise where.fail(f"{key}.secret", "needs exactly one of env, command, file (json only with file)",
                             "write {env: [GH_TOKEN]}, {command: [gh, auth, token]} or {file: ~/x.json, json: a.b}")
        env_names: tuple[str, ...] = ()
        command: tuple[str, ...] = ()
        file = json_path = ""
        if "env" in secret:
            env_names = _env_names(secret["env"], where, f"{key}.secret.env")
            if not env_names:
                raise where.fail(f"{key}.secret.env", "no variable named", "list the host variables holding it")
        elif "command" in secret:
            command = _str_list(secret["command"], where, f"{key}.secret.command")
            if not command:
                raise where.fail(f"{key}.secret.command", "the command is empty", "write e.g. [gh, auth, token]")
        else:
            file = _paths([secret["file"]] if isinstance(secret["file"], str) else secret["file"],
                          where, f"{key}.secret.file")[0]
            if "json" in secret:
                json_path = _str(secret["json"], where, f"{key}.secret.json")
                if not all(json_path.split(".")):
                    raise where.fail(f"{key}.secret.json", f"{json_path!r} is not a dotted path", "write e.g. a.b")
        send = _send(data["send"], where, f"{key}.send")
        user = _str(data.get("user", "x-access-token"), where, f"{key}.user")
        if ":" in user or not _QUERY_NAME.fullmatch(user.replace("@", "")):
            raise where.fail(f"{key}.user", f"{user!r} is not a plain user name", "write e.g. x-access-token")
        scope = _str_list(data["backends"], where, f"{key}.backends") if "backends" in data else ()
        if "backends" in data and not scope:
            raise where.fail(f"{key}.backends", "the list is empty (the grant would apply to no run)",
                             "list the backends it is for, or remove the key (then it is for every backend)")
        methods, paths = _http_limits(data, where, key)
        grants.append(CredentialRoute(str(name), env_names, rule.name, rule.port, send, grant=True,
                                      secret_command=command, secret_file=file, secret_json=json_path,
                                      basic_user=user, backends=tuple(dict.fromkeys(scope)),
                                      methods=methods, paths=paths,
                                      push=_bool(data.get("push", False), where, f"{key}.push"),
                                      git=_bool(data.get("git", False), where, f"{key}.git"),
                                      inspect=_bool(data.get("inspect", False), where, f"{key}.inspect")))
    return tuple(grants)


def _login(value: Any, where: _Where, key: str) -> LoginFile:
    """`login: {file, token, refresh_token, expires, refresh_url, client_id}` (and optionally
    `id_token`, `refreshed_at`, `client_secret`, `refresh_body: json|form`; `expires` left out when
    the token is a JWT whose `exp` says it),
    strictly; or just `{file, token}`: a static key in a login file (codex's `auth.json` API key),
    read per request and never refreshed. `unless: {PATH: VALUE}`: the route does not apply while the
    file's string at PATH is VALUE (codex's `auth_mode: chatgpt` wins over a key in the same file)."""
    data = _section(value, where, key, LOGIN_KEYS)
    if set(data) - {"unless"} == {"file", "token"}:  # a static key: nothing to refresh
        data = {**data, "refresh_token": "", "refresh_url": "", "client_id": ""}
    data = {**{k: "" for k in LOGIN_OPTIONAL_KEYS}, **data}
    missing = sorted(LOGIN_KEYS - set(data))
    if missing:
        raise where.fail(f"{key}.{missing[0]}", "missing", f"add {missing[0]}")
    file = _paths([data["file"]], where, f"{key}.file")[0]
    if not file.startswith("~/"):
        raise where.fail(f"{key}.file", f"{file!r} is not under ~/", "write ~/dir/file (inside a home.rw dir)")
    paths = {}
    for field in ("token", "refresh_token", "expires", "id_token", "refreshed_at"):
        paths[field] = _str(data[field], where, f"{key}.{field}") if data[field] != "" else ""
        if (paths[field] or field == "token") and not _JSON_PATH.fullmatch(paths[field]):
            raise where.fail(f"{key}.{field}", f"{paths[field]!r} is not a dotted JSON path", "write e.g. a.b.c")
    url = _str(data["refresh_url"], where, f"{key}.refresh_url") if data["refresh_url"] != "" else ""
    if url and not re.fullmatch(r"https://[a-z0-9.-]+(:[0-9]{1,5})?/[\x21-\x7e]*", url):
        raise where.fail(f"{key}.refresh_url", f"{url!r} is not an https:// URL", "write https://HOST/path")
    client_id = _str(data["client_id"], where, f"{key}.client_id") if data["client_id"] != "" else ""
    client_secret = _str(data["client_secret"], where, f"{key}.client_secret") if data["client_secret"] != "" else ""
    body = _str(data["refresh_body"], where, f"{key}.refresh_body") if data["refresh_body"] != "" else "json"
    if body not in {b.value for b in RefreshBody}:
        raise where.fail(f"{key}.refresh_body", f"{body[:20]!r} is not a refresh body",
                         f"write one of: {', '.join(b.value for b in RefreshBody)}")
    if (client_secret or data["refresh_body"] != "") and not url:
        raise where.fail(f"{key}.{'client_secret' if client_secret else 'refresh_body'}",
                         "only a login with a refresh_url is refreshed", "add refresh_url, or drop this key")
    unless = []
    for path, wanted in (_mapping(data["unless"], where, f"{key}.unless") if data["unless"] != "" else {}).items():
        if not isinstance(path, str) or not _JSON_PATH.fullmatch(path):
            raise where.fail(f"{key}.unless", f"{path!r} is not a dotted JSON path", "write e.g. auth_mode: chatgpt")
        unless.append((path, _str(wanted, where, f"{key}.unless.{path}")))
    return LoginFile(file, paths["token"], paths["refresh_token"], paths["expires"], url, client_id,
                     paths["id_token"], paths["refreshed_at"], tuple(unless), client_secret, RefreshBody(body))


def _secret_files(value: Any, where: _Where, key: str = "secret_files") -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`secret_files: {~/file: [dotted JSON paths, `*` for every key or element of a level, `**` for any
    levels]}`; a `.env` file's entries are variable-name globs (`*_API_KEY`) instead."""
    out = []
    for path, paths in _mapping(value, where, key).items():
        file = _paths([path], where, key)[0]
        if not file.startswith("~/"):
            raise where.fail(key, f"{file!r} is not under ~/", "write ~/dir/file (inside a home.rw dir)")
        listed = _str_list(paths, where, f"{key}.{path}")
        dotenv = credential_files.is_dotenv(file)
        bad = [p for p in listed if not (_ENV_NAME_GLOB if dotenv else _SECRET_PATH).fullmatch(p)]
        if bad or not listed:
            what = "a variable-name glob" if dotenv else "a dotted JSON path"
            raise where.fail(f"{key}.{path}", f"{bad[0]!r} is not {what}" if bad else "no path",
                             "write e.g. *_API_KEY" if dotenv else "write e.g. tokens.access_token or providers.*.key")
        out.append((file, tuple(listed)))
    return tuple(out)


def _logins_in_box(value: Any, where: _Where) -> tuple[tuple[str, str], ...]:
    """`logins_in_box: {~/file: reason}`: login files the proxy cannot hold for this CLI (yet)."""
    out = []
    for path, why in _mapping(value, where, "logins_in_box").items():
        _paths([path], where, "logins_in_box")
        out.append((path, _str(why, where, f"logins_in_box.{path}")))
    return tuple(out)


def _backend_from(name: str, raw: Any, where: _Where, base: Backend | None) -> Backend:
    """Validate one backend mapping; with `base`, given keys override it, else all are required."""
    where = _Where(where.file, name)
    if not re.fullmatch(r"[a-z][a-z0-9-]{0,31}", name):
        raise where.fail("(name)", f"{name!r} is not a backend name", "use lowercase letters, digits, '-'")
    data = _section(raw, where, "(backend)", BACKEND_KEYS)
    if base is None:
        for required in ("command", "prompt_command"):
            if required not in data:
                raise where.fail(required, "missing", f"add {required}: [program, ...]")
    values: dict[str, Any] = {}
    if "description" in data:
        values["description"] = _str(data["description"], where, "description")
    if "command" in data:
        values["command"] = _argv(data["command"], where, "command")
    if "prompt_command" in data:
        values["prompt_command"] = _argv(data["prompt_command"], where, "prompt_command")
        if not any("{prompt}" in a for a in values["prompt_command"]):
            raise where.fail("prompt_command", "has no {prompt} placeholder", "add \"{prompt}\" where the text goes")
    if "install" in data:
        inst = data["install"]
        if inst is None:
            values["install_npm"] = values["install_bin"] = None
        else:
            inst = _section(inst, where, "install", {"npm", "bin"})
            values["install_npm"] = _str(inst.get("npm"), where, "install.npm")
            values["install_bin"] = _str(inst.get("bin"), where, "install.bin")
    if "home" in data:
        home = _section(data["home"], where, "home", {"ro", "rw", "sync", "guard", "keep"})
        for part in ("ro", "rw", "sync", "guard"):
            if part in home:
                values[f"home_{part}"] = _paths(home[part], where, f"home.{part}")
        if "keep" in home:
            values["home_keep"] = _keep_patterns(home["keep"], where, "home.keep")
    if "egress" in data:
        values["egress"] = _hosts(data["egress"], where, "egress")
    if "env" in data:
        env = _section(data["env"], where, "env", {"pass", "set"})
        if "pass" in env:
            values["env_pass"] = _env_names(env["pass"], where, "env.pass")
        if "set" in env:
            values["env_set"] = _env_map(env["set"], where, "env.set")
    if "native" in data:
        native = _section(data["native"], where, "native", {"boxed", "unsandboxed"})
        for part in ("boxed", "unsandboxed"):
            if part in native:
                values[f"native_{part}"] = _str_list(native[part], where, f"native.{part}")
    if "deny" in data:
        values["deny"] = _paths(data["deny"], where, "deny")
    if "opt_in" in data:
        opt = _str(data["opt_in"], where, "opt_in")
        if not _ENV_NAME.match(opt):
            raise where.fail("opt_in", f"{opt!r} is not an environment variable name", "use LETTERS_DIGITS_")
        values["opt_in"] = opt
    if "nested_userns" in data:
        values["nested_userns"] = _bool(data["nested_userns"], where, "nested_userns")
    if "presets" in data:
        values["presets"] = _preset_names(data["presets"], where, "presets")
    if "credentials" in data:
        env_pass = values.get("env_pass", base.env_pass if base is not None else ())
        values["credentials"] = _credentials(data["credentials"], where, env_pass)
    if "logins_in_box" in data:
        values["logins_in_box"] = _logins_in_box(data["logins_in_box"], where)
    if "secret_files" in data:
        values["secret_files"] = _secret_files(data["secret_files"], where)
    if "unmaskable" in data:
        values["unmaskable"] = _secret_files(data["unmaskable"], where, "unmaskable")
    if "login_command" in data:
        values["login_command"] = tuple(_str_list(data["login_command"], where, "login_command"))
    if base is not None:
        return replace(base, **values)
    defaults: dict[str, Any] = {
        "description": name, "install_npm": None, "install_bin": None, "home_ro": (), "home_rw": (),
        "home_sync": (), "egress": (), "env_pass": (), "env_set": (), "native_boxed": (),
        "native_unsandboxed": (), "deny": (), "opt_in": f"HIVE_RELAY_UNSANDBOXED_{name.upper().replace('-', '_')}",
    }
    return Backend(name=name, **{**defaults, **values})


PROFILE_KEYS = {"extends", "backend_home", "toolchain", "network", "home", "env", "memory", "pids"}


def _profile_from(name: str, raw: Any, where: _Where) -> ProfileSpec:
    where = _Where(where.file)
    key = f"profiles.{name}"
    if not re.fullmatch(r"[a-z][a-z0-9-]{0,31}", name):
        raise where.fail(key, f"{name!r} is not a profile name", "use lowercase letters, digits, '-'")
    data = _section(raw, where, key, PROFILE_KEYS)
    values: dict[str, Any] = {}
    if "extends" in data:
        values["extends"] = _str(data["extends"], where, f"{key}.extends")
    for flag in ("backend_home", "toolchain", "network"):
        if flag in data:
            values[flag] = _bool(data[flag], where, f"{key}.{flag}")
    if "home" in data:
        home = _section(data["home"], where, f"{key}.home", {"ro", "rw"})
        for part in ("ro", "rw"):
            if part in home:
                values[f"home_{part}"] = _paths(home[part], where, f"{key}.home.{part}")
    if "env" in data:
        values["env"] = _env_names(data["env"], where, f"{key}.env")
    if "memory" in data:
        values["memory"] = parse_size(data["memory"], where, f"{key}.memory")
    if "pids" in data:
        values["pids"] = _positive_int(data["pids"], where, f"{key}.pids")
    return ProfileSpec(name=name, **values)


# Where a config file comes from decides how far its path is trusted:
#   "shipped"  our own file; the package layout may use links (followed once, then no-follow);
#   "user"     the caller's own file; a link is allowed (dotfile managers) but must end at a
#              regular file, which is then opened without following anything further;
#   "repo"     written by whoever controls the repo, a previous box included: a regular file in
#              the workdir itself, never a link, never a FIFO or device.
SHIPPED, USER, REPO = "shipped", "user", "repo"
ABSENT = object()  # read_yaml's answer for a missing optional file (an empty file is None)


def _read_bytes(path: Path, kind: str) -> bytes | None:
    """The file's bytes (None: absent), bounded, never blocking, no link followed where `kind`
    forbids one. Raises ConfigError naming what is wrong and the fix."""
    target = str(path)
    if kind != REPO:
        # The user's (and our own) links are followed once, to their end; what is opened is then
        # a plain name in a real directory, so a link swapped in meanwhile fails instead.
        target = os.path.realpath(target)
    try:
        return safefs.read_file(os.path.abspath(target), MAX_CONFIG_BYTES)
    except safefs.UnsafePath as err:
        if err.errno == errno.ELOOP and kind == REPO:
            raise ConfigError(
                f"{path}: is a symbolic link; a repo config must be a regular file in the workdir itself; "
                f"fix: replace the link with a regular file (or move the settings to your user config)"
            ) from None
        if err.errno == errno.ELOOP:  # a link swapped in after it was resolved
            raise ConfigError(f"{path}: changed into a symbolic link while being read; fix: check who writes it") from None
        if err.errno == errno.EFBIG:
            raise ConfigError(f"{path}: file is larger than 1 MiB; fix: shorten it") from None
        raise ConfigError(
            f"{path}: not a regular file (a FIFO, device, socket or directory); fix: make it a regular YAML file"
        ) from None
    except OSError as err:
        if err.errno == errno.EISDIR:
            raise ConfigError(f"{path}: is a directory; fix: make it a regular YAML file") from None
        reason = err.strerror or str(err)
        raise ConfigError(f"{path}: cannot read: {reason}; fix: check the file exists and is readable") from None


def read_yaml(path: Path, kind: str = SHIPPED, required: bool = True, env: Mapping[str, str] | None = None) -> Any:
    """Read one YAML file; every failure becomes a one-line ConfigError naming the file. An absent
    file is an error when `required`, else ABSENT.

    With `env`, the parsed data is memoized by the sha256 of the file's bytes (and the parser's
    identity) in the cache dir, which no box can write (`relay.host.memo`): a launch then skips
    importing PyYAML (~20 ms). The file itself is still read and checked on every launch, so an
    edit is a new key, and the memo only ever answers for the exact bytes it was made from.
    """
    raw = _read_bytes(path, kind)
    if raw is None:
        if required:
            raise ConfigError(f"{path}: cannot read: No such file or directory; fix: check the file exists and is readable")
        return ABSENT
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: cannot read: not UTF-8 text; fix: save it as UTF-8") from None
    if env is None:
        return _parse_yaml(path, text)
    key = memo.key_of("yaml", memo.module_identity("yaml") or "none", raw)
    cached = memo.get(env, memo.MemoKind.PARSED_CONFIG, key, 4 * MAX_CONFIG_BYTES)
    if cached is not None:
        try:
            return json.loads(cached)
        except ValueError:
            pass  # torn or foreign: parse again and write it anew
    data = _parse_yaml(path, text)
    try:
        encoded = json.dumps(data, separators=(",", ":"))
    except (TypeError, ValueError):
        return data  # a value JSON cannot hold (a date, a set): parsed on every launch
    if json.loads(encoded) == data:  # keys that were not strings would come back changed
        memo.put(env, memo.MemoKind.PARSED_CONFIG, key, encoded.encode())
    return data


# Quoted runs in PyYAML/libyaml messages are file content (aliases, tags, characters); Python repr
# escapes included. What is left must be plain words, or the whole problem is dropped.
_QUOTED = re.compile(r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"|`[^`\n]*`")
_PLAIN_PROBLEM = re.compile(r"[a-z][A-Za-z0-9 <>,()….*\-]{0,118}")


def _safe_problem(problem: Any) -> str:
    """A YAML problem string with no snippet of the file in it (or a generic one)."""
    if not isinstance(problem, str):
        return "invalid YAML"
    stripped = _QUOTED.sub("…", problem).strip()
    return stripped if _PLAIN_PROBLEM.fullmatch(stripped) else "invalid YAML"


def _loader() -> Any:
    import yaml

    return getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def _parse_yaml(path: Path, text: str) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 - a safe loader (C or Python)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        if mark is None and isinstance(getattr(err, "position", None), int):
            where = f" at character {err.position}"  # ReaderError: an unprintable character
        problem = _safe_problem(getattr(err, "problem", None))
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}; fix: correct the syntax") from None
    except RecursionError:
        raise ConfigError(f"{path}: YAML nested too deeply; fix: flatten it") from None


def _top(data: Any, where: _Where, allowed: set[str]) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise where.fail("(top level)", f"expected a mapping, got {_type_name(data)}", "start with 'backends:'")
    for key in data:
        if key not in allowed:
            raise where.fail(str(key), "unknown key", f"remove it; known keys: {', '.join(sorted(allowed))}")
    if "version" in data and data["version"] != 1:
        raise where.fail("version", f"unsupported version {data['version']!r}", "write version: 1")
    return data


def load_shipped(path: Path = SHIPPED_CONFIG, env: Mapping[str, str] | None = None) -> dict[str, Backend]:
    where = _Where(str(path))
    data = _top(read_yaml(path, SHIPPED, env=env), where, {"version", "backends"})
    raw = _mapping(data.get("backends"), where, "backends")
    if not raw:
        raise where.fail("backends", "no backends defined", "add at least one backend")
    backends = {name: _backend_from(name, entry, where, None) for name, entry in raw.items()}
    _check_presets(backends, BUILTIN_PRESETS, str(path))
    return backends


def user_config_path(env: Mapping[str, str]) -> Path:
    if env.get("HIVE_RELAY_CONFIG"):
        return Path(env["HIVE_RELAY_CONFIG"])
    return Path(config_home(env)) / "hive-relay" / "config.yaml"


def apply_user(
    backends: dict[str, Backend], path: Path, data: Any = ABSENT
) -> tuple[dict[str, Backend], dict[str, ProfileSpec], frozenset[str]]:
    """Merge the user's own config: it may add backends and profiles, widen, and opt in.
    `data` is the already-read YAML (else the file is read). Its `auth:` grants: `user_grants`."""
    where = _Where(str(path))
    data = _top(read_yaml(path, USER) if data is ABSENT else data, where,
                {"version", "backends", "profiles", "allow_unsandboxed", "auth", "presets", "workdir", "isolation",
                 "vm"})
    merged = dict(backends)
    for name, entry in _mapping(data.get("backends") or {}, where, "backends").items():
        merged[name] = _backend_from(str(name), entry, where, merged.get(name))
    raw_profiles = data.get("profiles") or {}
    profiles = {
        str(name): _profile_from(str(name), entry, where)
        for name, entry in _mapping(raw_profiles, where, "profiles").items()
    }
    opt_ins = frozenset(_str_list(data.get("allow_unsandboxed", []), where, "allow_unsandboxed"))
    for name in opt_ins:
        if name not in merged:
            raise where.fail("allow_unsandboxed", f"unknown backend {name!r}", f"use one of {sorted(merged)}")
    return merged, profiles, opt_ins


def user_presets(path: Path, data: Any, backends: Mapping[str, Backend]) -> dict[str, tuple[str, ...]]:
    """The user config's named presets, and a check that every backend names only known ones."""
    where = _Where(str(path))
    presets = _user_presets(data.get("presets") or {}, where) if isinstance(data, dict) else {}
    _check_presets(backends, {**BUILTIN_PRESETS, **presets}, str(path))
    return presets


def user_grants(backends: Mapping[str, Backend], path: Path, data: Any) -> tuple[CredentialRoute, ...]:
    """The user config's `auth:` grants; a name a backend's route already uses is refused (one name,
    one upstream), and so is a `backends:` entry that names no known backend (a typo would otherwise
    silently scope the grant out of the runs it was meant for)."""
    where = _Where(str(path))
    grants = _grants((data or {}).get("auth") or {}, where) if isinstance(data, dict) else ()
    taken: dict[str, str] = {}
    for b in backends.values():
        for r in b.credentials:
            taken.setdefault(r.name, b.name)  # the first backend (in matrix order) names it
    for grant in grants:
        if grant.name in taken:
            raise where.fail(f"auth.{grant.name}", f"the name is backend {taken[grant.name]}'s credential route",
                             "choose another name")
        unknown = [b for b in grant.backends if b not in backends]
        if unknown:
            raise where.fail(f"auth.{grant.name}.backends", f"unknown backend {unknown[0]!r}",
                             f"use some of {', '.join(sorted(backends))}")
    return grants


NARROWABLE = {"egress", "home", "deny", "env", "presets"}
# What a repo config may do to each Backend field. Every field not named here (and any field added
# later) must come out exactly as the base has it, so a new key is refused by default.
# home_keep: fewer kept paths means more of the box's writes are kept aside for review, never more synced.
REPO_MAY_NARROW = ("egress", "home_ro", "home_rw", "home_sync", "home_keep", "env_pass", "presets")  # result ⊆ base
REPO_MAY_ADD = ("deny",)  # result ⊇ base: every added deny entry narrows the box
# home.guard is host-side: the guard reads and restores those files with the caller's rights.
# A repo may repeat base entries, but not add one (the host would touch a path the repo chose)
# and not drop one (a settings file left unguarded is wider).
REPO_KEEPS = ("home_guard",)
# credentials (the key routes) are in none of these lists: a repo cannot add, change or drop a route
# (dropping one would put the real key back into the box). It can only withhold a key from both the
# box and the proxy, by narrowing env.pass.


def _yaml_key(field: str) -> str:
    return field.replace("_", ".", 1) if field.split("_")[0] in ("home", "env", "native", "install") else field


def _subset(
    narrowed: tuple[str, ...], base: tuple[str, ...], where: _Where, key: str
) -> tuple[str, ...]:
    extra = [item for item in narrowed if item not in base]
    if extra:
        raise where.fail(
            key,
            f"repo config may only narrow, but adds {', '.join(extra)}",
            "remove those entries, or add them to your own ~/.config/hive-relay/config.yaml",
        )
    return narrowed


def _narrow(base: Backend, checked: Backend, where: _Where) -> Backend:
    """`base` narrowed by what the repo asked for (`checked`); refuses anything that would widen."""
    values: dict[str, Any] = {}
    for spec in fields(Backend):
        field = spec.name
        mine, theirs = getattr(checked, field), getattr(base, field)
        if field in REPO_MAY_ADD:
            values[field] = tuple(dict.fromkeys(theirs + mine))
        elif field in REPO_MAY_NARROW or field in REPO_KEEPS:
            if mine != theirs:
                _subset(mine, theirs, where, _yaml_key(field))
            values[field] = theirs if field in REPO_KEEPS else mine
        elif mine != theirs:
            if field == "env_set":
                raise where.fail("env.set", "repo config cannot set variables", "remove env.set")
            raise where.fail(_yaml_key(field), "repo config cannot change this key", "remove it")
    return replace(base, **values)


def apply_repo(backends: dict[str, Backend], path: Path, data: Any = ABSENT) -> dict[str, Backend]:
    """Apply the workspace repo's `.hive-relay.yaml`, which may only narrow existing backends.
    `data` is the already-read YAML (else the file is read, as a repo config: no link, no FIFO)."""
    where = _Where(str(path))
    data = _top(read_yaml(path, REPO) if data is ABSENT else data, where, {"version", "backends", "workdir"})
    raw = data.get("backends") or {}
    merged = dict(backends)
    for name, entry in _mapping(raw, where, "backends").items():
        if name not in merged:
            raise _Where(str(path), str(name)).fail(
                "(backend)", "repo config cannot define a new backend", "define it in your user config"
            )
        bwhere = _Where(str(path), str(name))
        narrowing = _section(entry, bwhere, "(backend)", NARROWABLE)
        checked = _backend_from(str(name), narrowing, where, merged[name])
        merged[name] = _narrow(merged[name], checked, bwhere)
    return merged


def workdir_mode(data: Any, path: Path, repo: bool) -> str | None:
    """The `workdir:` key: `staged` or `live`; a repo's may only say `staged` (it narrows the box,
    never widens it)."""
    value = data.get("workdir") if isinstance(data, dict) else None
    if value is None:
        return None
    allowed = ("staged",) if repo else ("staged", "live")
    if value not in allowed:
        raise _Where(str(path)).fail("workdir", f"{value!r} is not allowed here",
                                     "write `workdir: staged`" + ("" if repo else " or `workdir: live`"))
    return str(value)


# The `--isolation` words a user config may make the default (relay/policy/tiers.py ISOLATIONS, which
# tests/test_config.py keeps in step; config sits below policy and cannot import it).
CONFIG_ISOLATIONS = ("auto", "process", "supervised", "gvisor", "container", "vm")


def isolation_default(data: Any, path: Path) -> str | None:
    """The user config's `isolation:` key: the tier a launch asks for when --isolation is not given
    (`isolation: gvisor`). Only the user's own config has it: a repo cannot pick the tier its box runs at."""
    value = data.get("isolation") if isinstance(data, dict) else None
    if value is None:
        return None
    if value not in CONFIG_ISOLATIONS:
        raise _Where(str(path)).fail("isolation", f"{value!r} is not an isolation level",
                                     f"write one of {', '.join(CONFIG_ISOLATIONS)}")
    return str(value)


# The VM tier's accelerators (`vm: {accel: ...}` and --vm-accel; relay/policy/tiers.py VM_ACCELS keeps in step).
CONFIG_VM_ACCELS = ("kvm", "tcg")


def vm_accel_default(data: Any, path: Path) -> str | None:
    """The user config's `vm: {accel: tcg}`: the VM tier's accelerator when --vm-accel is not given. Only
    the user's own config has it (like `isolation:`), and it only matters once the tier is vm."""
    value = data.get("vm") if isinstance(data, dict) else None
    if value is None:
        return None
    where = _Where(str(path))
    if not isinstance(value, dict) or set(value) - {"accel"}:
        raise where.fail("vm", f"expected a mapping with only 'accel', got {_type_name(value)}"
                         + (f" with {sorted(set(value) - {'accel'})}" if isinstance(value, dict) else ""),
                         "write `vm: {accel: tcg}` (or kvm)")
    accel = value.get("accel")
    if accel not in CONFIG_VM_ACCELS:
        raise where.fail("vm.accel", f"{accel!r} is not a VM accelerator", f"write one of {', '.join(CONFIG_VM_ACCELS)}")
    return str(accel)


def load_matrix(env: Mapping[str, str], workdir: Path | None, shipped: Path = SHIPPED_CONFIG) -> Matrix:
    """All three layers, strictly; a missing optional layer is simply absent (a named user config
    must exist). Each file is read once, bounded, without blocking; its parse may come from the
    memo of its exact bytes (`read_yaml`)."""
    backends = load_shipped(shipped, env)
    sources = [str(shipped)]
    profiles: dict[str, ProfileSpec] = {}
    opt_ins: frozenset[str] = frozenset()
    presets: dict[str, tuple[str, ...]] = {}
    grants: tuple[CredentialRoute, ...] = ()
    mode = "staged"
    forced = None
    isolation = None
    vm_accel = None
    user_path = user_config_path(env)
    data = read_yaml(user_path, USER, required=bool(env.get("HIVE_RELAY_CONFIG")), env=env)
    if data is not ABSENT:
        backends, profiles, opt_ins = apply_user(backends, user_path, data)
        presets = user_presets(user_path, data, backends)
        grants = user_grants(backends, user_path, data)
        mode = workdir_mode(data, user_path, repo=False) or mode
        isolation = isolation_default(data, user_path)
        vm_accel = vm_accel_default(data, user_path)
        sources.append(str(user_path))
    if workdir is not None:
        repo_path = workdir / REPO_CONFIG_NAME
        data = read_yaml(repo_path, REPO, required=False, env=env)
        if data is not ABSENT:
            backends = apply_repo(backends, repo_path, data)
            if workdir_mode(data, repo_path, repo=True):
                mode, forced = "staged", str(repo_path)
            sources.append(str(repo_path))
    return Matrix(backends=backends, profiles=profiles, allow_unsandboxed=opt_ins, sources=tuple(sources),
                  grants=grants, presets=presets, workdir_mode=mode, workdir_forced=forced, isolation=isolation,
                  vm_accel=vm_accel)


def backend_names(matrix: Matrix) -> list[str]:
    return sorted(matrix.backends)


def get_backend(matrix: Matrix, name: str) -> Backend:
    if name not in matrix.backends:
        raise UsageError(f"unknown backend {name!r}; choose one of: {', '.join(backend_names(matrix))}")
    return matrix.backends[name]


