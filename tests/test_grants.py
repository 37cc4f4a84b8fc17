"""`auth:` grants (user config), the send modes, and reading a grant's secret on the host
(relay/egress/secret_source.py): strict validation, one clear line per failure, never the secret."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from relay.config.load import load_matrix
from relay.egress import secret_source as hostsecrets
from relay.model.allow_rules import parse_rule
from relay.model.backend import CredentialRoute
from relay.model.errors import ConfigError, RefusedError
from relay.policy.egress import apply_credential, route_rules

SECRET = "s3cr3t-GRANT-VALUE"


def matrix_with(tmp_path: Path, text: str):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    return load_matrix({"HIVE_RELAY_CONFIG": str(cfg), "HOME": str(tmp_path)}, None)


def test_a_grant_is_read_strictly(tmp_path: Path) -> None:
    m = matrix_with(tmp_path, "auth:\n  gh:\n    host: github.com\n    secret: {env: [GH_TOKEN, GITHUB_TOKEN]}\n"
                              "    send: authorization-basic\n  maps:\n    host: maps.example:8443\n"
                              "    secret: {file: ~/k.json, json: a.b}\n    send: query:key\n")
    gh, maps = m.grants
    assert (gh.name, gh.upstream_host, gh.upstream_port, gh.send, gh.secret_env, gh.grant) == (
        "gh", "github.com", 443, "authorization-basic", ("GH_TOKEN", "GITHUB_TOKEN"), True)
    assert (maps.upstream_port, maps.secret_file, maps.secret_json, maps.send) == (8443, "~/k.json", "a.b", "query:key")


@pytest.mark.parametrize("body, problem", [
    ("  gh: {host: github.com, secret: {env: [T]}, send: bearer}", "key 'auth.gh.send': unknown way 'bearer'"),
    ("  gh: {host: github.com, secret: {env: [T]}, send: 'query:a b'}", "unknown way 'query:a b'"),
    ("  gh: {host: github.com, secret: {env: [T], command: [x]}, send: x-api-key}", "needs exactly one of"),
    ("  gh: {host: github.com, secret: {command: [x], json: a}, send: x-api-key}", "needs exactly one of"),
    ("  gh: {host: github.com, secret: {command: []}, send: x-api-key}", "the command is empty"),
    ("  gh: {host: github.com, secret: {env: ['GH_*']}, send: x-api-key}", "is a pattern"),
    ("  gh: {host: '*.github.com', secret: {env: [T]}, send: x-api-key}", "is not one host name"),
    ("  gh: {host: 'github.com=127.0.0.1:1', secret: {env: [T]}, send: x-api-key}", "key 'auth.gh.host'"),
    ("  gh: {host: github.com, secret: {file: rel/path}, send: x-api-key}", "neither absolute nor"),
    ("  gh: {host: github.com, secret: {env: [T]}, send: x-api-key, extra: 1}", "key 'auth.gh.extra': unknown key"),
    ("  gh: {secret: {env: [T]}, send: x-api-key}", "key 'auth.gh.host': missing"),
    ("  anthropic: {host: github.com, secret: {env: [T]}, send: x-api-key}", "backend claude's credential route"),
    ("  Bad: {host: github.com, secret: {env: [T]}, send: x-api-key}", "not a grant name"),
    ("  gh: {host: github.com, secret: {env: [T]}, send: authorization-basic, user: 'a:b'}", "not a plain user"),
])
def test_a_bad_grant_is_one_line_naming_the_key(tmp_path: Path, body: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        matrix_with(tmp_path, "auth:\n" + body + "\n")
    assert problem in str(err.value) and "fix:" in str(err.value) and "\n" not in str(err.value)


def test_a_backend_route_takes_the_new_send_modes_too(tmp_path: Path) -> None:
    m = matrix_with(tmp_path, "backends:\n  shell:\n    env: {pass: [K]}\n    credentials:\n"
                              "      maps: {secret_env: [K], upstream: 'maps.example:443', send: 'query:key'}\n")
    assert m.backends["shell"].credentials[0].send == "query:key"


def route(send: str, **kw) -> CredentialRoute:
    return CredentialRoute("r", ("K",), "api.example", 443, send, **kw)


@pytest.mark.parametrize("path, sent", [
    ("/v1/x", "/v1/x?key=s3cr3t-GRANT-VALUE"),
    ("/v1/x?a=1", "/v1/x?a=1&key=s3cr3t-GRANT-VALUE"),
    # Whatever the client sent as `key` (plain, percent-encoded, plus-encoded, empty, repeated) is gone.
    ("/v1/x?key=evil&a=1&k%65y=evil2&key&key=&b=2", "/v1/x?a=1&b=2&key=s3cr3t-GRANT-VALUE"),
    ("/?key=placeholder", "/?key=s3cr3t-GRANT-VALUE"),
])
def test_query_mode_replaces_every_client_value(path: str, sent: str) -> None:
    assert apply_credential(route("query:key"), SECRET, path) == (sent, None)


def test_query_mode_escapes_the_key_and_basic_encodes_user_and_key() -> None:
    assert apply_credential(route("query:key"), "a/b+c&d=e", "/x")[0] == "/x?key=a%2Fb%2Bc%26d%3De"
    assert apply_credential(route("authorization-basic"), "tok", "/x") == (
        "/x", ("Authorization", "Basic eC1hY2Nlc3MtdG9rZW46dG9r"))  # x-access-token:tok
    with pytest.raises(ValueError) as err:
        apply_credential(route("query:key"), "a\r\nb", "/x")
    assert "a\r\nb" not in str(err.value)


def test_a_grant_host_is_allowed_for_the_proxy_only_and_a_pin_applies() -> None:
    grant = CredentialRoute("gh", (), "github.com", 443, "authorization-basic", grant=True)
    assert route_rules((), grant)[0].render() == "github.com:443"
    pinned = (parse_rule("github.com:443=127.0.0.1:9"),)
    assert route_rules(pinned, grant) == pinned
    backend_route = CredentialRoute("a", ("K",), "api.example", 443, "x-api-key")
    assert route_rules((), backend_route) == ()  # a backend's route stays under its egress policy


# Reading the secret on the host.

def grant(**kw) -> CredentialRoute:
    hostsecrets._CACHE.clear()
    return CredentialRoute("gh", kw.pop("env", ()), "github.com", 443, "authorization-basic", grant=True, **kw)


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "secret-cmd"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(stat.S_IRWXU)
    return str(path)


def test_secret_from_env_command_and_file(tmp_path: Path) -> None:
    assert hostsecrets.read_key(grant(env=("A", "B")), {"B": SECRET}) == SECRET
    assert hostsecrets.read_key(grant(secret_command=(script(tmp_path, f"echo {SECRET}"),)), {}) == SECRET
    (tmp_path / "k.json").write_text(json.dumps({"a": {"b": SECRET}}))
    env = {"HOME": str(tmp_path)}
    assert hostsecrets.read_key(grant(secret_file="~/k.json", secret_json="a.b"), env) == SECRET
    (tmp_path / "k.txt").write_text(SECRET + "\n")
    assert hostsecrets.read_key(grant(secret_file=str(tmp_path / "k.txt")), env) == SECRET


@pytest.mark.parametrize("body, problem", [
    ("echo nope >&2; exit 3", "failed with exit code 3: nope"),
    ("true", "gave an empty secret"),
    ("echo 'two words'", "did not give one printable token"),
    ("yes x | head -c 200000", "printed more than 64 KiB"),
])
def test_a_failing_command_is_one_line_never_the_secret(tmp_path: Path, body: str, problem: str) -> None:
    with pytest.raises(RefusedError) as err:
        hostsecrets.read_key(grant(secret_command=(script(tmp_path, body),)), {"PATH": os.defpath})
    line = str(err.value)
    assert line.startswith("auth grant gh: ") and problem in line and "fix:" in line and "\n" not in line
    assert "two words" not in line


def test_a_hanging_command_is_killed_at_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostsecrets, "COMMAND_TIMEOUT", 0.5)
    start = time.monotonic()
    with pytest.raises(RefusedError) as err:
        hostsecrets.read_key(grant(secret_command=(script(tmp_path, "exec sleep 30"),)), {})
    assert "did not finish within 0.5 s" in str(err.value) and time.monotonic() - start < 5


def test_a_command_runs_without_a_shell(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(RefusedError) as err:
        hostsecrets.read_key(grant(secret_command=(f"echo x; touch {marker}",)), {"PATH": "/usr/bin:/bin"})
    assert "could not start: No such file" in str(err.value) and not marker.exists()


def test_file_failures_are_one_line(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    with pytest.raises(RefusedError, match="does not exist"):
        hostsecrets.read_key(grant(secret_file="~/missing"), env)
    (tmp_path / "k.json").write_text('{"a": 1}')
    with pytest.raises(RefusedError, match="has no string at a"):
        hostsecrets.read_key(grant(secret_file="~/k.json", secret_json="a"), env)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(RefusedError, match="cannot read"):  # never blocks on a FIFO
        hostsecrets.read_key(grant(secret_file="~/fifo"), env)
    with pytest.raises(RefusedError, match="none of GH_TOKEN is set"):
        hostsecrets.read_key(grant(env=("GH_TOKEN",)), {})


def _alive(pid: int) -> bool:
    """Running (a killed child not yet reaped by its new parent is a zombie: gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("body, works", [
    # A command that prints the token and leaves a child holding its output (a helper daemon that
    # forgot to close stdout): the token is used within a moment, and the child does not outlive the read.
    (f"sleep 30 & echo $! > {{pid}}; echo {SECRET}", True),
    # A command that hangs in a child (no exec): refused at the timeout, and the child killed too.
    ("sleep 30 & echo $! > {pid}; wait", False),
])
def test_a_command_leaves_nothing_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str,
                                          works: bool) -> None:
    timeout = 3.0 if works else 1.0  # the hang is refused at the timeout: a short one keeps the suite quick
    monkeypatch.setattr(hostsecrets, "COMMAND_TIMEOUT", timeout)
    pidfile = tmp_path / "child.pid"
    command = (script(tmp_path, body.format(pid=pidfile)),)
    start = time.monotonic()
    if works:
        assert hostsecrets.read_key(grant(secret_command=command), {}) == SECRET
        assert time.monotonic() - start < 2.5  # not the whole timeout
    else:
        with pytest.raises(RefusedError, match=f"did not finish within {timeout:g} s"):
            hostsecrets.read_key(grant(secret_command=command), {})
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 2
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(child)
