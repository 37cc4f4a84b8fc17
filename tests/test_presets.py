"""Egress presets: `--allow-preset NAME` (and the user config's named presets) add one ecosystem's
hosts, shown by `--dry-run`, logged with the preset's name; unknown names are one line and exit 2;
a repo config can only drop presets, never add one or define one."""

from __future__ import annotations

import json

import pytest

from relay.config import presets
from relay.model.allow_rules import parse_rule
from relay.model.errors import UsageError

from .conftest import Sandbox, require_tool
from .servers import start_http


def user_config(s: Sandbox, extra: str) -> None:
    path = s.home / ".config" / "hive-relay" / "config.yaml"
    path.write_text(path.read_text() + extra)


def dry_json(s: Sandbox, *args: str) -> dict:
    proc = s.relay("shell", "local", "--dry-run", "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_builtin_presets_expand_to_their_ecosystems_hosts() -> None:
    (npm, pypi) = presets.expand(["npm", "pypi", "npm"])
    assert npm == ("npm", (parse_rule("registry.npmjs.org"),))
    assert [r.render() for r in pypi[1]] == ["pypi.org", "files.pythonhosted.org"]
    apt = dict(presets.expand(["apt"]))["apt"]
    assert {r.target for r in apt} == {"deb.debian.org:443", "deb.debian.org:80", "security.debian.org:443",
                                       "security.debian.org:80"}
    assert not any(r.wildcard for rules in presets.BUILTIN.values() for r in map(parse_rule, rules))


def test_origins_name_every_preset_that_lists_a_rule() -> None:
    table = presets.origins(presets.expand(["github-read", "mine"], {"mine": ("github.com", "x.example.com")}))
    assert table[parse_rule("github.com")] == "github-read+mine"
    assert table[parse_rule("raw.githubusercontent.com")] == "github-read"


def test_unknown_preset_is_one_line_with_the_known_ones(sandbox: Sandbox) -> None:
    with pytest.raises(UsageError, match="known presets: apt, crates, github-read, go, npm, pypi"):
        presets.expand(["nmp"])
    proc = sandbox.relay("shell", "local", "--dry-run", "--allow-preset", "nmp")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "hive-relay: error: --allow-preset 'nmp': unknown preset; known presets: apt, crates, github-read, go, "
        "npm, pypi (more can be named under `presets:` in your user config)"]
    assert proc.stdout == ""


def test_dry_run_shows_the_expansion_in_text_and_json(sandbox: Sandbox) -> None:
    data = dry_json(sandbox, "--allow-preset", "npm", "-e", "crates")
    assert data["presets"] == {"npm": ["registry.npmjs.org"],
                               "crates": ["crates.io", "index.crates.io", "static.crates.io"]}
    assert {"registry.npmjs.org", "crates.io", "static.crates.io"} <= set(data["egress"])
    assert dry_json(sandbox)["presets"] == {}  # none is on by default
    text = sandbox.relay("shell", "local", "--dry-run", "-e", "go").stdout
    assert "preset   go: proxy.golang.org, sum.golang.org" in text
    assert "ask      " not in text
    asking = sandbox.relay("shell", "local", "--dry-run", "--ask")
    assert "ask      a denied host is put to `" in asking.stdout and " ask` (the request" in asking.stdout
    assert dry_json(sandbox, "--ask")["ask"] is True and dry_json(sandbox)["ask"] is False


def test_no_backend_has_a_preset_on_by_default(sandbox: Sandbox) -> None:
    for backend in ("claude", "codex", "gemini", "opencode", "shell"):
        proc = sandbox.relay(backend, "local", "--dry-run", "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["presets"] == {}


def test_a_profile_without_network_refuses_presets(sandbox: Sandbox) -> None:
    proc = sandbox.relay("shell", "local", "--dry-run", "--profile", "default", "-e", "npm")
    assert proc.returncode == 3 and "no network" in proc.stderr and "npm" in proc.stderr, proc.stderr


def test_user_config_names_presets_and_turns_them_on_per_backend(sandbox: Sandbox) -> None:
    user_config(sandbox, "presets:\n  corp: [pkgs.corp.example.com, 'git.corp.example.com:8443']\n"
                         "backends:\n  shell:\n    presets: [corp, pypi]\n")
    data = dry_json(sandbox)
    assert data["presets"] == {"corp": ["pkgs.corp.example.com", "git.corp.example.com:8443"],
                               "pypi": ["pypi.org", "files.pythonhosted.org"]}
    assert dry_json(sandbox, "-e", "corp", "-e", "npm")["presets"].keys() == {"corp", "pypi", "npm"}


@pytest.mark.parametrize(("extra", "problem"), [
    ("presets:\n  npm: [evil.example.com]\n", "key 'presets.npm': is a built-in preset"),
    ("presets:\n  Bad_Name: [x.example.com]\n", "is not a preset name"),
    ("presets:\n  mine: [localhost:80]\n", "key 'presets.mine'"),
    ("presets:\n  mine: []\n", "is empty"),
    ("presets:\n  mine: x.example.com\n", "key 'presets.mine'"),
    ("backends:\n  shell:\n    presets: [nope]\n", "unknown preset 'nope'"),
])
def test_user_presets_are_validated_strictly(sandbox: Sandbox, extra: str, problem: str) -> None:
    user_config(sandbox, extra)
    proc = sandbox.relay("shell", "local", "--dry-run")
    assert proc.returncode == 2 and problem in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_repo_config_may_drop_presets_but_never_add_or_define_one(sandbox: Sandbox) -> None:
    user_config(sandbox, "backends:\n  shell:\n    presets: [npm, pypi]\n")
    repo = sandbox.workdir / ".hive-relay.yaml"
    repo.write_text("backends:\n  shell:\n    presets: [npm]\n")
    assert dry_json(sandbox)["presets"] == {"npm": ["registry.npmjs.org"]}  # the twin: narrowing works
    repo.write_text("backends:\n  shell:\n    presets: [npm, crates]\n")
    proc = sandbox.relay("shell", "local", "--dry-run")
    assert proc.returncode == 2 and "repo config may only narrow, but adds crates" in proc.stderr, proc.stderr
    repo.write_text("presets:\n  evil: [evil.example.com]\n")
    proc = sandbox.relay("shell", "local", "--dry-run")
    assert proc.returncode == 2 and "key 'presets': unknown key" in proc.stderr, proc.stderr


@pytest.mark.box
@pytest.mark.parametrize("mode", ["local", "container"])
def test_a_preset_host_is_reached_and_logged_with_the_preset_name(request: pytest.FixtureRequest, mode: str) -> None:
    """A user preset pinning a local registry: reached through the proxy and logged with `preset`;
    the host next to it, not in any preset, is denied (the twin)."""
    require_tool("curl")
    s: Sandbox = request.getfixturevalue("csandbox" if mode == "container" else "box_sandbox")
    server, port, _ = start_http()
    try:
        user_config(s, f"presets:\n  localreg: ['registry.test:{port}=127.0.0.1:{port}']\n")
        script = (f"curl -sS http://registry.test:{port}/pkg; "
                  f"curl -s -o /dev/null -w 'other=%{{http_code}}\\n' http://other.test:{port}/pkg")
        proc = s.relay("shell", mode, "--quiet", "--prompt", script, "--allow-preset", "localreg")
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "hello from the fake upstream" in proc.stdout and "other=403" in proc.stdout
    logs = sorted((s.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    entries = [json.loads(line) for line in logs[-1].read_text().splitlines()]
    allowed = [e for e in entries if e["decision"] == "allow"]
    assert allowed and all(e["preset"] == "localreg" and e["host"] == "registry.test" for e in allowed)
    denied = [e for e in entries if e["decision"] == "deny"]
    assert denied and all("preset" not in e for e in denied)
