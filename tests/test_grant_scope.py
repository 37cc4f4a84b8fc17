"""Scoping `auth:` grants: `backends:` per grant (strictly checked) and `--no-grants` per run. A grant
that does not apply to a run is no route of its plan, so its secret is never read; the plan says why.
Pure: resolve() against the in-memory host of the golden tests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from relay.commands.cli import build_parser
from relay.config.load import load_matrix, load_shipped
from relay.egress import secret_source
from relay.model.backend import CredentialRoute, Matrix
from relay.model.errors import ConfigError, RefusedError
from relay.plan.resolve import Request, resolve

from .fakefs import WORKDIR, fake_host
from .test_plan_golden import ENV, PROCESS, SUPERVISED, fake_checkout  # noqa: F401 - fixture

GH = "  gh:\n    host: github.com\n    secret: {command: [gh, auth, token]}\n    send: authorization-basic\n"


def matrix_with(tmp_path: Path, text: str) -> Matrix:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    return load_matrix({"HIVE_RELAY_CONFIG": str(cfg), "HOME": str(tmp_path)}, None)


def test_backends_is_read_and_a_grant_without_it_still_loads(tmp_path: Path) -> None:
    m = matrix_with(tmp_path, "auth:\n" + GH + "    backends: [claude, shell, claude]\n"
                              "  any:\n    host: x.example\n    secret: {env: [T]}\n    send: x-api-key\n")
    gh, any_ = m.grants
    assert gh.backends == ("claude", "shell") and any_.backends == ()


def test_a_user_backend_may_be_named(tmp_path: Path) -> None:
    m = matrix_with(tmp_path, "backends:\n  mine:\n    command: [sh]\n    prompt_command: [sh, -c, '{prompt}']\n"
                              "auth:\n" + GH + "    backends: [mine]\n")
    assert m.grants[0].backends == ("mine",)


@pytest.mark.parametrize("value, problem", [
    ("[claud]", "key 'auth.gh.backends': unknown backend 'claud'; fix: use some of claude, codex, gemini, opencode, shell"),
    ("[]", "key 'auth.gh.backends': the list is empty"),
    ("claude", "key 'auth.gh.backends': expected a list of strings"),
    ("[claude, 3]", "key 'auth.gh.backends': expected a list of strings"),
])
def test_a_bad_backends_list_is_one_line_naming_the_key(tmp_path: Path, value: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        matrix_with(tmp_path, "auth:\n" + GH + f"    backends: {value}\n")
    assert problem in str(err.value) and "fix:" in str(err.value) and "\n" not in str(err.value)


def grant(name: str, *backends: str, command: tuple[str, ...] = ("false",)) -> CredentialRoute:
    return CredentialRoute(name, (), f"{name}.example", 443, "authorization-bearer", grant=True,
                           secret_command=command, backends=backends)


def plan_for(backend: str, *grants: CredentialRoute, facts=SUPERVISED, **request) -> dict:  # noqa: ANN001
    backends = load_shipped()
    matrix = Matrix(backends=backends, profiles={}, allow_unsandboxed=frozenset(), sources=(), grants=grants)
    req = Request(backend, workdir=WORKDIR, run_id="1-golden", **request)
    return resolve(backends[backend], matrix, req, facts, dict(ENV), fs=fake_host(), now=0)


def rewrites(plan) -> dict[str, str]:  # noqa: ANN001
    env = dict(plan.env_set)
    return {env[k]: env[k.replace("KEY", "VALUE")] for k in env if k.startswith("GIT_CONFIG_KEY_")
            and env[k].startswith("url.")}


@pytest.mark.usefixtures("fake_checkout")
def test_a_scoped_grant_applies_to_its_backends_only() -> None:
    grants = (grant("forclaude", "claude"), grant("forall"))
    shell = plan_for("shell", *grants)
    assert [r.name for r in shell.credentials] == ["forall"]
    assert rewrites(shell) == {"url.http://127.0.0.1:3128/forall/.insteadOf": "https://forall.example/"}
    assert "auth grant forclaude: not for backend shell (backends: claude)" in shell.notes
    assert shell.to_json()["auth_grants"] == {
        "forclaude": {"applies": False, "skipped": "not for backend shell (backends: claude)"},
        "forall": {"applies": True}}
    claude = plan_for("claude", *grants)
    assert [r.name for r in claude.credentials if r.grant] == ["forclaude", "forall"]
    assert claude.to_json()["auth_grants"] == {"forclaude": {"applies": True}, "forall": {"applies": True}}
    assert {"route": "forclaude", "backends": ["claude"]}.items() <= next(
        c for c in claude.to_json()["credentials"] if c["route"] == "forclaude").items()


@pytest.mark.usefixtures("fake_checkout")
def test_no_grants_turns_them_all_off_and_says_so() -> None:
    plan = plan_for("claude", grant("forclaude", "claude"), grant("forall"), no_grants=True)
    assert not any(r.grant for r in plan.credentials) and rewrites(plan) == {}
    assert plan.to_json()["auth_grants"] == {n: {"applies": False, "skipped": "off for this run (--no-grants)"}
                                             for n in ("forclaude", "forall")}
    assert "auth grant forall: off for this run (--no-grants)" in plan.notes


@pytest.mark.usefixtures("fake_checkout")
def test_a_run_without_network_says_so() -> None:
    plan = plan_for("shell", grant("forall"), facts=PROCESS, live=True)  # the process tier cannot stage
    assert plan.credentials == () and plan.to_json()["auth_grants"] == {
        "forall": {"applies": False, "skipped": "this run has no network"}}


@pytest.mark.usefixtures("fake_checkout")
def test_without_grants_the_plan_has_no_auth_grants_key() -> None:
    assert "auth_grants" not in plan_for("shell").to_json()


@pytest.mark.usefixtures("fake_checkout")
def test_a_skipped_grant_keeps_its_variables_out_of_the_box() -> None:
    scoped = replace(grant("forclaude", "claude", command=()), secret_env=("ANTHROPIC_API_KEY",))
    assert "ANTHROPIC_API_KEY" not in plan_for("shell", scoped).env_pass


@pytest.mark.usefixtures("fake_checkout")
def test_the_secret_of_a_skipped_grant_is_never_read(tmp_path: Path) -> None:
    # The launcher reads the secrets of the plan's routes only: `false` would refuse the run.
    marker = tmp_path / "ran"
    loud = grant("loud", "claude", command=("/bin/sh", "-c", f"touch {marker}; exit 1"))
    plan = plan_for("shell", loud)
    assert secret_source.read_keys(plan.credentials, dict(ENV)) == {} and not marker.exists()
    with pytest.raises(RefusedError, match="auth grant loud"):  # the twin: in scope, it is run (and fails)
        secret_source.read_keys(plan_for("claude", loud).credentials, dict(ENV))
    assert marker.exists()


@pytest.mark.parametrize("flag", ["--no-grants", "-g"])
def test_the_flag_parses(flag: str) -> None:
    assert build_parser().parse_args(["shell", flag]).no_grants is True
    assert build_parser().parse_args(["shell"]).no_grants is False
