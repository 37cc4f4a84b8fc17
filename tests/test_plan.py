"""Plans for every backend × mode, asserted without launching anything."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from relay.config.load import load_matrix
from relay.host.fs_view import HostFs
from relay.model.errors import RefusedError, UsageError
from relay.model.host_facts import HostFacts
from relay.modes.image_tag import with_image
from relay.plan.resolve import Request, resolve

from .conftest import Sandbox

BACKENDS = ("claude", "codex", "gemini", "opencode", "shell")
FACTS = HostFacts(uid=1000, gid=1000, home="/", user="u", shell="/bin/bash", tty=False, bwrap="/usr/bin/bwrap",
                  bwrap_version="0.8.0", seccomp=True, box_python="/usr/bin/python3", podman="/usr/bin/podman")


def plan_for(sandbox: Sandbox, backend: str, mode: str = "local", facts: HostFacts | None = None, **req):
    env = dict(sandbox.env)
    env.pop("HIVE_RELAY_CONFIG", None)
    (sandbox.home / ".config" / "hive-relay" / "config.yaml").unlink(missing_ok=True)
    matrix = load_matrix(env, Path(sandbox.workdir))
    facts = replace(facts or FACTS, home=str(sandbox.home))
    request = Request(backend=backend, mode=mode, workdir=str(sandbox.workdir), run_id="1-test", **req)
    return resolve(matrix.backends[backend], matrix, request, with_image(facts, matrix, request, env), env, fs=HostFs())


@pytest.mark.parametrize("mode", ["local", "container"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dry_run_json_for_every_backend_and_mode(sandbox: Sandbox, backend: str, mode: str) -> None:
    proc = sandbox.relay(backend, mode, "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["backend"] == backend and plan["mode"] == mode
    assert plan["tier"] == ("supervised" if mode == "local" else "container")
    assert plan["profile"] == "agent"
    assert plan["workdir"] == str(sandbox.workdir)
    assert plan["interactive"] is True and plan["timeout"] is None
    assert plan["limits"]["memory"] == 8 << 30 and plan["limits"]["pids"] == 512
    command = plan["command"]
    if mode == "local":
        assert command[0].endswith("bwrap")
        for flag in ("--unshare-all", "--die-with-parent", "--cap-drop", "--seccomp"):
            assert flag in command
        assert "--new-session" not in command  # interactive sessions keep the caller's terminal
        assert command[-len(plan["argv"]):] == plan["argv"]
    else:
        assert "run" in command[:3] and command[0].endswith(("podman", "docker"))
        assert "--network" in command and "none" in command
    # The ssh dir exists in the fake HOME but is never bound in.
    assert not any(".ssh" in (m.get("src") or "") for m in plan["mounts"])


def test_per_backend_grants_and_hosts_never_cross(sandbox: Sandbox) -> None:
    claude = plan_for(sandbox, "claude")
    home = str(sandbox.home)
    bound = {m.dst for m in claude.mounts if m.kind in ("bind", "ro-bind")}
    # The state dir is a private copy in the box's home, never the host's dir bound in.
    assert claude.state_dirs == (f"{home}/.claude",) and f"{home}/.claude" not in bound
    assert any(m.kind == "private-bind" and m.dst == home for m in claude.mounts)
    assert f"{home}/.codex" not in bound and f"{home}/.gemini" not in bound
    assert "api.anthropic.com" in claude.egress
    assert not any("openai" in h or "google" in h for h in claude.egress)


def test_codex_never_sees_claude(sandbox: Sandbox) -> None:
    codex = plan_for(sandbox, "codex")
    bound = {m.dst for m in codex.mounts if m.kind in ("bind", "ro-bind")}
    assert codex.state_dirs == (f"{sandbox.home}/.codex",) and f"{sandbox.home}/.claude" not in bound
    assert "api.openai.com" in codex.egress and not any("anthropic" in h for h in codex.egress)


def test_secrets_are_names_only(sandbox: Sandbox) -> None:
    sandbox.env["ANTHROPIC_API_KEY"] = "sk-ant-SECRET-VALUE"
    proc = sandbox.relay("claude", "local", "--dry-run", "--json", "--prompt", "hi")
    assert proc.returncode == 0, proc.stderr
    assert "sk-ant-SECRET-VALUE" not in proc.stdout
    plan = json.loads(proc.stdout)
    # The key stays on the host: the proxy injects it, the box gets a placeholder and the proxy's URL.
    assert "ANTHROPIC_API_KEY" not in plan["env_pass"]
    assert plan["env_set"]["ANTHROPIC_API_KEY"] == "hive-relay-placeholder"
    assert plan["env_set"]["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:3128/anthropic"
    assert plan["credentials"] == [{"route": "anthropic", "upstream": "api.anthropic.com:443", "send": "x-api-key",
                                    "from": ["ANTHROPIC_API_KEY"], "box_url": "http://127.0.0.1:3128/anthropic",
                                    "allows": {"methods": [], "paths": ["/v1/", "/api/"], "push": False, "git": False,
                                               "summary": "no git push; paths /v1/ /api/"}}]


def test_a_key_pointed_elsewhere_stays_in_the_box_and_says_so(sandbox: Sandbox) -> None:
    sandbox.env.update(ANTHROPIC_API_KEY="sk-ant-SECRET-VALUE", ANTHROPIC_BASE_URL="https://gateway.example")
    proc = sandbox.relay("claude", "local", "--dry-run", "--json", "--prompt", "hi")
    assert proc.returncode == 0, proc.stderr
    assert "sk-ant-SECRET-VALUE" not in proc.stdout
    plan = json.loads(proc.stdout)
    assert "ANTHROPIC_API_KEY" in plan["env_pass"] and plan["credentials"] == []
    assert any(n.startswith("credentials: in box for route anthropic: ANTHROPIC_BASE_URL is set") for n in plan["notes"])


def test_codex_key_is_injected_with_its_base_url_on_the_argv(sandbox: Sandbox) -> None:
    sandbox.env["OPENAI_API_KEY"] = "sk-openai-SECRET-VALUE"
    shell = json.loads(sandbox.relay("codex", "local", "--dry-run", "--json", "--prompt", "hi").stdout)
    assert shell["argv"] == ["/bin/sh", "-c", "hi"]  # the suite's sh override is not the CLI: no codex flags
    (sandbox.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    proc = sandbox.relay("codex", "local", "--dry-run", "--json", "--prompt", "hi")
    assert proc.returncode == 0, proc.stderr
    assert "sk-openai-SECRET-VALUE" not in proc.stdout
    plan = json.loads(proc.stdout)
    assert not {"OPENAI_API_KEY", "CODEX_API_KEY"} & set(plan["env_pass"])
    assert plan["env_set"]["CODEX_API_KEY"] == "hive-relay-placeholder"
    assert plan["argv"][1:3] == ["-c", "openai_base_url=http://127.0.0.1:3128/openai/v1"]
    assert [r["route"] for r in plan["credentials"]] == ["openai"]


def test_no_key_set_means_no_route(sandbox: Sandbox) -> None:
    plan = json.loads(sandbox.relay("gemini", "local", "--dry-run", "--json", "--prompt", "hi").stdout)
    assert plan["credentials"] == [] and "GEMINI_API_KEY" not in plan["env_set"]


def test_prompt_run_has_timeout_and_noninteractive_argv(sandbox: Sandbox) -> None:
    plan = plan_for(sandbox, "codex", prompt="fix it", timeout=42)
    assert plan.interactive is False and plan.timeout == 42
    assert plan.argv[0] == "codex" and plan.argv[-3:] == ("exec", "--skip-git-repo-check", "fix it")
    # The suite's ~/.codex/auth.json holds an API key: its route comes first, then our box is codex's sandbox.
    assert plan.argv[1:3] == ("-c", "openai_base_url=http://127.0.0.1:3128/openai-login/v1")
    assert plan.argv[3:5] == ("--sandbox", "danger-full-access")


def test_interactive_run_has_no_wall_clock_kill(sandbox: Sandbox) -> None:
    plan = plan_for(sandbox, "claude", timeout=42)
    assert plan.timeout is None
    assert any("--timeout applies to --prompt" in n for n in plan.notes)


def test_allow_host_adds_to_the_backend_list(sandbox: Sandbox) -> None:
    plan = plan_for(sandbox, "shell", allow_hosts=("fake.test:8443=127.0.0.1:9999",))
    assert plan.egress == ("fake.test:8443=127.0.0.1:9999",)
    assert dict(plan.env_set)["HTTPS_PROXY"] == "http://127.0.0.1:3128"
    assert dict(plan.env_set)["http_proxy"] == "http://127.0.0.1:3128"
    assert dict(plan.env_set)["NO_PROXY"] == "localhost,127.0.0.1,::1"


def test_default_profile_is_fail_closed(sandbox: Sandbox) -> None:
    plan = plan_for(sandbox, "claude", profile="default")
    bound = {m.dst for m in plan.mounts if m.kind in ("bind", "ro-bind")}
    assert not any(p.startswith(str(sandbox.home)) for p in bound)
    assert plan.proxy_listen is None and plan.egress == ()
    assert plan.limits.memory == 4 << 30 and plan.limits.pids == 256
    assert set(plan.env_pass) <= {"LANG", "TERM", "COLORTERM"}


def test_default_profile_refuses_allow_host(sandbox: Sandbox) -> None:
    with pytest.raises(RefusedError, match="no network"):
        plan_for(sandbox, "shell", profile="default", allow_hosts=("x.test",))


def test_missing_bwrap_refuses_with_fix(sandbox: Sandbox) -> None:
    facts = replace(FACTS, bwrap=None, bwrap_error="bubblewrap is not installed")
    with pytest.raises(RefusedError, match="apt-get install bubblewrap"):
        plan_for(sandbox, "shell", facts=facts)


def test_root_caller_box_runs_as_non_root_uid(sandbox: Sandbox) -> None:
    plan = plan_for(sandbox, "shell", facts=replace(FACTS, uid=0, gid=0))
    assert plan.box_uid == 1000
    i = plan.command.index("--uid")
    assert plan.command[i + 1] == "1000"


def test_unknown_isolation_and_mode_are_usage_errors(sandbox: Sandbox) -> None:
    with pytest.raises(UsageError):
        plan_for(sandbox, "shell", isolation="jail")


def test_protected_paths_inside_workdir(sandbox: Sandbox) -> None:
    (sandbox.workdir / ".git" / "hooks").mkdir(parents=True)
    plan = plan_for(sandbox, "shell", live=True)
    wd = str(sandbox.workdir)
    assert f"{wd}/.git/hooks" in plan.protected
    assert f"{wd}/.vscode" in plan.placeholders  # missing: masked so it cannot be created
    staged = plan_for(sandbox, "shell")  # the default: the mask's placeholder is made in the layer
    assert f"{wd}/.vscode" not in staged.placeholders and f"{wd}/.vscode" in staged.staged.placeholders
    assert staged.mounts == plan.mounts
    ro = {m.dst for m in plan.mounts if m.kind == "ro-bind"}
    assert f"{wd}/.git/hooks" in ro


def test_symlinked_deny_path_masks_its_target(sandbox: Sandbox) -> None:
    real = sandbox.workdir / "aws-real"
    real.mkdir()
    (real / "credentials").write_text("SECRET")
    import shutil
    shutil.rmtree(sandbox.home / ".aws")
    (sandbox.home / ".aws").symlink_to(real)
    plan = plan_for(sandbox, "shell")
    assert str(real) in plan.denied


def test_grant_resolving_into_a_secret_is_skipped(sandbox: Sandbox) -> None:
    import shutil
    shutil.rmtree(sandbox.home / ".claude")
    (sandbox.home / ".claude").symlink_to(sandbox.home / ".ssh")
    plan = plan_for(sandbox, "claude")
    assert any("resolves into denied" in n for n in plan.notes)
    assert not any(m.src and ".ssh" in m.src for m in plan.mounts)


def test_nested_userns_is_opt_in_per_backend(sandbox: Sandbox) -> None:
    cfg = sandbox.home / ".config" / "hive-relay" / "config.yaml"
    cfg.write_text("backends:\n  shell: {nested_userns: true}\n")
    proc = sandbox.relay("shell", "--dry-run", "--json")
    plan = json.loads(proc.stdout)
    assert not any("unshare" in rule for rule in plan["seccomp"])
    default = json.loads(sandbox.relay("codex", "--dry-run", "--json").stdout)
    assert "unshare: EPERM" in default["seccomp"]


def test_dry_run_text_puts_the_policy_first_and_the_command_last_once(sandbox: Sandbox) -> None:
    """Issue 27.5: denied, protected, egress and credentials first; the argv (claude's --settings
    JSON and all) once, in the command line at the end."""
    (sandbox.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")  # the real claude argv
    proc = sandbox.relay("claude", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    heads = [line.split()[0] for line in proc.stdout.splitlines() if line and not line.startswith(" ")]
    assert heads.index("denied") < heads.index("protected") < heads.index("egress") < heads.index("limits")
    assert heads[-1] == "command" or heads[heads.index("command") + 1:] == ["hive-relay:"] * (
        len(heads) - heads.index("command") - 1)
    assert proc.stdout.count('"permissions"') == 1 and "argv" not in heads


@pytest.mark.parametrize("backend", BACKENDS)
def test_host_steps_copy_disjoint_places_in_their_undo_order(sandbox: Sandbox, backend: str) -> None:
    """The run dir's steps are made run dir, git dir, agent state, synced files, and undone in the
    reverse (synced files back first, the run dir removed last). That order is only safe because
    the three copy disjoint places: no synced file lies in a state dir, and neither in .git."""
    from relay.plan.host_steps import host_steps

    (sandbox.workdir / ".git").mkdir(exist_ok=True)
    plan = plan_for(sandbox, backend)
    steps = [s.step.value for s in host_steps(plan)]
    made = [s for s in steps if s in ("run-dir", "git-dir", "agent-state", "sync-files", "passwd")]
    order = ["run-dir", "git-dir", "agent-state", "sync-files", "passwd"]
    assert made == [s for s in order if s in made] and made[0] == "run-dir", steps
    assert [json.loads(json.dumps(plan.to_json()))["host_steps"][i]["step"] for i in range(len(steps))] == steps
    for synced in plan.sync_files:
        assert not any(synced == d or synced.startswith(d.rstrip("/") + "/") for d in plan.state_dirs), synced
        assert "/.git/" not in synced + "/", synced
