"""Strict config loading: each bad input is one line naming file, backend, key and fix; exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relay.config.load import apply_repo, load_matrix, load_shipped
from relay.config.profiles import resolve_profile
from relay.model.backend import ProfileSpec
from relay.model.errors import ConfigError, UsageError

from .conftest import REPO


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_shipped_matrix_has_all_five_backends() -> None:
    backends = load_shipped()
    assert set(backends) == {"claude", "codex", "gemini", "opencode", "shell"}
    assert "api.anthropic.com" in backends["claude"].egress
    assert "~/.codex" in backends["codex"].home_rw
    assert backends["shell"].egress == ()


@pytest.mark.parametrize(
    "body, expected",
    [
        ("backends: [1, 2", "not valid YAML"),
        ("backends:\n  claude:\n    command: [claude]\n    prompt_command: [claude, '{prompt}']\n    colour: red\n",
         "backend 'claude': key '(backend).colour': unknown key"),
        ("backends:\n  claude:\n    command: claude\n    prompt_command: [claude, '{prompt}']\n",
         "backend 'claude': key 'command': expected a list of strings"),
        ("backends:\n  claude:\n    command: [claude]\n    prompt_command: [claude, '{prompt}']\n    home: {rw: [.claude]}\n",
         "key 'home.rw': path '.claude' is neither absolute nor ~/"),
        ("backends:\n  claude:\n    command: [claude]\n    prompt_command: [claude]\n",
         "key 'prompt_command': has no {prompt} placeholder"),
        ("backends:\n  claude:\n    command: [claude]\n    prompt_command: [claude, '{prompt}']\n    egress: ['bad host!']\n",
         "key 'egress'"),
        ("nonsense: true\n", "key 'nonsense': unknown key"),
        ("backends:\n  claude:\n    prompt_command: [claude, '{prompt}']\n", "key 'command': missing"),
    ],
)
def test_bad_shipped_config_names_file_backend_key(tmp_path: Path, body: str, expected: str) -> None:
    path = write(tmp_path / "backends.yaml", body)
    with pytest.raises(ConfigError) as err:
        load_shipped(path)
    message = str(err.value)
    assert str(path) in message
    assert expected in message
    assert "fix:" in message
    assert "\n" not in message


def test_broken_user_config_is_exit_2_with_one_line(tmp_path: Path) -> None:
    cfg = write(tmp_path / "user.yaml", "backends:\n  claude: {egress: [api.anthropic.com, 12]}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "relay", "claude", "local", "--dry-run"],
        cwd=tmp_path, env={"HIVE_RELAY_CONFIG": str(cfg), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin",
                           "PYTHONPATH": str(REPO)},
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(cfg) in lines[0] and "backend 'claude'" in lines[0] and "egress" in lines[0]
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_invalid_user_config_never_falls_back(tmp_path: Path) -> None:
    cfg = write(tmp_path / "user.yaml", "profiles:\n  agent: {pids: -1}\n")
    with pytest.raises(ConfigError):
        load_matrix({"HIVE_RELAY_CONFIG": str(cfg), "HOME": str(tmp_path)}, None)


def test_missing_named_user_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_matrix({"HIVE_RELAY_CONFIG": str(tmp_path / "nope.yaml"), "HOME": str(tmp_path)}, None)


def test_user_config_may_widen(tmp_path: Path) -> None:
    cfg = write(tmp_path / "user.yaml", "backends:\n  claude: {egress: [api.anthropic.com, corp.example.com]}\n"
                "allow_unsandboxed: [codex]\n")
    matrix = load_matrix({"HIVE_RELAY_CONFIG": str(cfg), "HOME": str(tmp_path)}, None)
    assert matrix.backends["claude"].egress == ("api.anthropic.com", "corp.example.com")
    assert matrix.allow_unsandboxed == {"codex"}


def test_repo_config_may_narrow(tmp_path: Path) -> None:
    write(tmp_path / ".hive-relay.yaml", "backends:\n  claude:\n    egress: [api.anthropic.com]\n    deny: [~/.claude/secret]\n")
    matrix = load_matrix({"HOME": str(tmp_path / "h")}, tmp_path)
    claude = matrix.backends["claude"]
    assert claude.egress == ("api.anthropic.com",)
    assert "~/.claude/secret" in claude.deny
    assert str(tmp_path / ".hive-relay.yaml") in matrix.sources


@pytest.mark.parametrize(
    "body, expected",
    [
        ("backends:\n  claude:\n    egress: [api.anthropic.com, evil.example.com]\n", "may only narrow, but adds evil.example.com"),
        ("backends:\n  claude:\n    home: {rw: [~/.claude, ~/.ssh]}\n", "may only narrow, but adds ~/.ssh"),
        ("backends:\n  claude:\n    command: [sh]\n", "unknown key"),
        ("backends:\n  evil:\n    egress: []\n", "cannot define a new backend"),
        ("profiles:\n  agent: {network: true}\n", "unknown key"),
        ("backends:\n  claude:\n    env: {set: {NODE_OPTIONS: '--require /x'}}\n", "cannot set variables"),
        ("backends:\n  claude:\n    home: {guard: [~/.bashrc]}\n", "key 'home.guard': repo config may only narrow, but adds ~/.bashrc"),
        ("backends:\n  claude:\n    env: {pass: ['ANTHROPIC_*']}\n", "is a pattern; only exact names are passed"),
    ],
)
def test_repo_config_cannot_widen(tmp_path: Path, body: str, expected: str) -> None:
    repo = write(tmp_path / ".hive-relay.yaml", body)
    with pytest.raises(ConfigError) as err:
        apply_repo(load_shipped(), repo)
    assert expected in str(err.value)


def test_repo_empty_egress_list_narrows_to_nothing(tmp_path: Path) -> None:
    repo = write(tmp_path / ".hive-relay.yaml", "backends:\n  claude:\n    egress: []\n")
    assert apply_repo(load_shipped(), repo)["claude"].egress == ()


def test_empty_list_in_user_profile_never_widens() -> None:
    spec = ProfileSpec(name="agent", env=(), home_rw=())
    profile = resolve_profile("agent", {"agent": spec})
    assert profile.env == ()
    assert profile.home_rw == ()
    assert profile.network is True  # unset fields still inherit the built-in


def test_profile_extends_loop_is_refused() -> None:
    specs = {"a": ProfileSpec(name="a", extends="b"), "b": ProfileSpec(name="b", extends="a")}
    with pytest.raises(UsageError, match="loops"):
        resolve_profile("a", specs)


def test_unknown_profile_lists_choices() -> None:
    with pytest.raises(UsageError, match="choose one of: agent, default"):
        resolve_profile("nope", {})


def test_builtin_profiles_pass_exact_names_only() -> None:
    for name in ("default", "agent"):
        env = resolve_profile(name, {}).env
        assert env and not any(ch in n for n in env for ch in "*?[")
    assert {"LC_ALL", "LC_CTYPE", "LC_MESSAGES"} <= set(resolve_profile("agent", {}).env)


def test_user_profile_env_pattern_is_refused_with_the_fix(tmp_path: Path) -> None:
    cfg = write(tmp_path / "user.yaml", "profiles:\n  mine: {env: [PATH, 'LC_*']}\n")
    with pytest.raises(ConfigError) as err:
        load_matrix({"HIVE_RELAY_CONFIG": str(cfg), "HOME": str(tmp_path)}, None)
    assert "key 'profiles.mine.env'" in str(err.value) and "list each variable by name" in str(err.value)


def test_repo_config_symlink_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "real.yaml").write_text("backends: {}\n")
    (tmp_path / ".hive-relay.yaml").symlink_to(tmp_path / "real.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "relay", "shell", "local", "--dry-run"],
        cwd=tmp_path, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "symbolic link" in lines[0] and "fix:" in lines[0], proc.stderr


@pytest.mark.parametrize("pattern", ["~/*", "~/**", "/abs/path", "~/.claude/../x", "~/.claude/[ab]", "~/.claude/?",
                                     "~/.claude//x", "relative/x", "~/.claude/a**", "~/.claude/a**b"])
def test_bad_keep_pattern_is_one_line_with_the_fix(tmp_path: Path, pattern: str) -> None:
    path = write(tmp_path / "b.yaml", "backends:\n  claude:\n    command: [claude]\n    prompt_command: [claude, '{prompt}']\n"
                 f"    home: {{keep: ['{pattern}']}}\n")
    with pytest.raises(ConfigError, match=r"backend 'claude': key 'home.keep': .* is not a keep pattern; fix: ") as err:
        load_shipped(path)
    assert "\n" not in str(err.value)


def test_repo_config_may_drop_keep_patterns_but_not_add_one(tmp_path: Path) -> None:
    base = load_shipped()
    keep = list(base["claude"].home_keep)
    narrowed = apply_repo(dict(base), write(tmp_path / "n" / ".hive-relay.yaml",
                                            f"backends:\n  claude:\n    home: {{keep: ['{keep[0]}']}}\n"))
    assert narrowed["claude"].home_keep == (keep[0],)
    with pytest.raises(ConfigError, match=r"key 'home.keep': repo config may only narrow, but adds ~/.claude/commands/\*\*"):
        apply_repo(dict(base), write(tmp_path / "w" / ".hive-relay.yaml",
                                     "backends:\n  claude:\n    home: {keep: ['~/.claude/commands/**']}\n"))


def test_shipped_credential_routes() -> None:
    backends = load_shipped()
    routes = {r.name: r for r in backends["claude"].credentials}
    assert list(routes) == ["anthropic-token", "anthropic", "anthropic-oauth", "anthropic-login",
                            "anthropic-console"]  # claude's precedence
    claude = routes["anthropic"]
    assert (claude.name, claude.upstream_host, claude.upstream_port, claude.send) == (
        "anthropic", "api.anthropic.com", 443, "x-api-key")
    assert routes["anthropic-oauth"].secret_env == ("CLAUDE_CODE_OAUTH_TOKEN",)
    assert routes["anthropic-token"].send == routes["anthropic-oauth"].send == "authorization-bearer"
    login = routes["anthropic-login"].login
    assert login is not None and login.file == "~/.claude/.credentials.json" and routes["anthropic-login"].secret_env == ()
    assert login.refresh_url == "https://platform.claude.com/v1/oauth/token"
    files = {n: dict(backends[n].secret_files) for n in ("claude", "codex", "gemini", "opencode")}
    assert files["codex"]["~/.codex/auth.json"] == ("OPENAI_API_KEY", "tokens.access_token", "tokens.refresh_token",
                                                    "tokens.id_token")
    assert files["gemini"]["~/.gemini/oauth_creds.json"] == ("access_token", "refresh_token", "id_token")
    assert "mcpOAuth.*.clientSecret" in files["claude"]["~/.claude/.credentials.json"]
    assert "*.refresh" in files["opencode"]["~/.local/share/opencode/auth.json"]
    codex, in_file, chatgpt = backends["codex"].credentials  # an API key before the ChatGPT login, as codex does
    assert chatgpt.login is not None and (chatgpt.login.token, chatgpt.login.expires, chatgpt.login.id_token) == (
        "tokens.access_token", "", "tokens.id_token")  # no expires: the access token's own JWT exp
    assert (chatgpt.upstream_host, chatgpt.login.refresh_url) == ("chatgpt.com", "https://auth.openai.com/oauth/token")
    assert "model_providers.hive-relay-chatgpt.base_url={url}/backend-api/codex" in chatgpt.box_args
    assert in_file.login is not None and in_file.login.unless == (("auth_mode", "chatgpt"),)
    assert in_file.login is not None and (in_file.login.file, in_file.login.token, in_file.login.refresh_url) == (
        "~/.codex/auth.json", "OPENAI_API_KEY", "")
    assert codex.secret_env == ("CODEX_API_KEY", "OPENAI_API_KEY") and codex.send == "authorization-bearer"
    assert codex.box_args == ("-c", "openai_base_url={url}/v1")
    gemini, google = backends["gemini"].credentials  # an API key first, then the Google login
    assert gemini.send == "x-goog-api-key" and dict(gemini.box_env)["GEMINI_API_KEY"] == "{placeholder}"
    assert google.login is not None and (google.login.file, google.login.token, google.login.expires) == (
        "~/.gemini/oauth_creds.json", "access_token", "expiry_date")
    assert (google.upstream_host, google.login.refresh_url, google.login.refresh_body) == (
        "cloudcode-pa.googleapis.com", "https://oauth2.googleapis.com/token", "form")
    assert chatgpt.login.refresh_body == "json" and chatgpt.login.client_secret == ""


ROUTE = ("backends:\n  claude:\n    command: [claude]\n    prompt_command: [claude, '{{prompt}}']\n"
         "    env: {{pass: [KEY]}}\n    credentials:\n      r: {body}\n")


@pytest.mark.parametrize(
    "body, expected",
    [
        ("{secret_env: [KEY], upstream: api.example.com:443, send: cookie}", "key 'credentials.r.send': unknown way"),
        ("{secret_env: [KEY], upstream: api.example.com, send: x-api-key}", "is not one host name with a port"),
        ("{secret_env: [KEY], upstream: '*.example.com:443', send: x-api-key}", "is not one host name with a port"),
        ("{secret_env: [KEY], upstream: 'api.example.com:443=127.0.0.1:9', send: x-api-key}", "not one host name"),
        ("{secret_env: [KEY], upstream: '10.0.0.1:443', send: x-api-key}", "is not one host name with a port"),
        ("{secret_env: [OTHER], upstream: api.example.com:443, send: x-api-key}", "OTHER not in env.pass"),
        ("{secret_env: [], upstream: api.example.com:443, send: x-api-key}", "no variable named"),
        ("{upstream: api.example.com:443, send: x-api-key}", "key 'credentials.r.secret_env': missing"),
        ("{secret_env: [KEY], upstream: a.example:443, send: x-api-key, box_env: {U: '{key}'}}", "unknown placeholder {key}"),
        ("{secret_env: [KEY], upstream: a.example:443, send: x-api-key, box_env: {KEY: 'x'}}", "set to something else"),
        ("{secret_env: [KEY], upstream: a.example:443, send: x-api-key, colour: red}", "credentials.r.colour': unknown key"),
        ("{login: {file: ~/.c/l.json, token: a.t, refresh_token: a.r, expires: a.e, refresh_url: 'https://o.example/t', client_id: c}, secret_env: [KEY], upstream: a.example:443, send: x-api-key}", "takes its token from the login"),
        ("{login: {file: ~/.c/l.json, token: a.t, refresh_token: a.r, expires: a.e, refresh_url: 'https://o.example/t', client_id: c, colour: red}, upstream: a.example:443, send: x-api-key}", "login.colour': unknown key"),
        ("{login: {file: ~/.c/l.json, token: 'a..t', refresh_token: a.r, expires: a.e, refresh_url: 'https://o.example/t', client_id: c}, upstream: a.example:443, send: x-api-key}", "not a dotted JSON path"),
        ("{login: {file: ~/.c/l.json, token: a.t, refresh_token: a.r, expires: a.e, refresh_url: 'http://o.example/t', client_id: c}, upstream: a.example:443, send: x-api-key}", "not an https:// URL"),
        ("{login: {file: /etc/l.json, token: a.t, refresh_token: a.r, expires: a.e, refresh_url: 'https://o.example/t', client_id: c}, upstream: a.example:443, send: x-api-key}", "is not under ~/"),
        ("{login: {file: ~/.c/l.json, token: k, unless: {'a..b': x}}, upstream: a.example:443, send: x-api-key}", "not a dotted JSON path"),
        ("{login: {file: ~/.c/l.json, token: k, unless: {mode: [x]}}, upstream: a.example:443, send: x-api-key}", "login.unless.mode"),
        ("{login: {file: ~/.c/l.json, token: k, unless: chatgpt}, upstream: a.example:443, send: x-api-key}", "login.unless"),
        ("{login: {file: ~/.c/l.json}, upstream: a.example:443, send: x-api-key}", "login.client_id': missing"),
        ("{login: {file: ~/.c/l.json, token: a.t, refresh_token: a.r, expires: a.e, refresh_url: 'https://o.example/t', client_id: c, refresh_body: xml}, upstream: a.example:443, send: x-api-key}", "'xml' is not a refresh body"),
        ("{login: {file: ~/.c/l.json, token: a.t, refresh_token: a.r, expires: a.e, refresh_url: '', client_id: c, client_secret: s}, upstream: a.example:443, send: x-api-key}", "only a login with a refresh_url is refreshed"),
    ],
)
def test_bad_credential_route_is_one_line_with_the_fix(tmp_path: Path, body: str, expected: str) -> None:
    path = write(tmp_path / "b.yaml", ROUTE.format(body=body))
    with pytest.raises(ConfigError) as err:
        load_shipped(path)
    assert expected in str(err.value) and "fix:" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("body", [
    "backends:\n  claude:\n    credentials: {evil: {secret_env: [ANTHROPIC_API_KEY], upstream: 'evil.example:443', send: x-api-key}}\n",
    "backends:\n  claude:\n    credentials: {}\n",
    "backends:\n  codex:\n    credentials: {openai: {secret_env: [OPENAI_API_KEY], upstream: 'api.openai.com:443', send: x-api-key}}\n",
])
def test_repo_config_cannot_add_change_or_drop_a_route(tmp_path: Path, body: str) -> None:
    repo = write(tmp_path / ".hive-relay.yaml", body)
    with pytest.raises(ConfigError, match=r"key '\(backend\).credentials': unknown key"):
        apply_repo(load_shipped(), repo)


def test_repo_narrowing_env_pass_keeps_the_route_unchanged(tmp_path: Path) -> None:
    base = load_shipped()
    repo = write(tmp_path / ".hive-relay.yaml", "backends:\n  claude:\n    env: {pass: [ANTHROPIC_MODEL]}\n")
    claude = apply_repo(dict(base), repo)["claude"]
    assert claude.credentials == base["claude"].credentials and claude.env_pass == ("ANTHROPIC_MODEL",)


def test_every_backend_field_is_covered_by_the_repo_rule(tmp_path: Path) -> None:
    """A route changed by any path other than the YAML key (a future NARROWABLE entry) is still refused."""
    from dataclasses import replace

    from relay.config.load import _narrow, _Where

    base = load_shipped()["claude"]
    with pytest.raises(ConfigError, match="key 'credentials': repo config cannot change this key"):
        _narrow(base, replace(base, credentials=()), _Where("repo.yaml", "claude"))
