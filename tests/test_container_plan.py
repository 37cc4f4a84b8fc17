"""Container-mode plans, the merged seccomp profile and the image recipe, without an engine."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.config.load import load_shipped
from relay.modes.image import dockerfile_defaults
from relay.modes.image_tag import VERSION_ARGS, spec_for, split_npm_spec
from relay.render.seccomp_bpf import TIOCLINUX, TIOCSTI, policy_for
from relay.render.seccomp_oci import prefix_cover, render

from .conftest import REPO, Sandbox
from .test_plan import FACTS, plan_for


def _covered(pairs: list[tuple[int, int]], value: int) -> bool:
    return any(value & mask == base for mask, base in pairs)


@given(st.sets(st.integers(0, (1 << 32) - 1), max_size=3), st.integers(0, (1 << 32) - 1))
def test_prefix_cover_is_everything_but_the_excluded_values(excluded: set[int], probe: int) -> None:
    pairs = prefix_cover(excluded)
    for value in excluded:
        assert not _covered(pairs, value)
    if probe not in excluded:
        assert _covered(pairs, probe)


def test_merged_profile_refuses_unix_sockets_and_tty_injection_only() -> None:
    base = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
        {"names": ["read", "socket", "ioctl", "ptrace", "clone"], "action": "SCMP_ACT_ALLOW"}]}
    profile = render(policy_for(nested_userns=False), base)
    rules = profile["syscalls"]
    allow_plain = [n for r in rules if r["action"] == "SCMP_ACT_ALLOW" and not r.get("args") for n in r["names"]]
    assert allow_plain == ["read"]  # socket/ioctl/clone only with conditions; ptrace gone
    eperm = {n for r in rules if r["action"] == "SCMP_ACT_ERRNO" and not r.get("args") for n in r["names"]}
    assert "ptrace" in eperm and "bpf" in eperm
    socket_allows = [r["args"][0] for r in rules if r["names"] == ["socket"] and r["action"] == "SCMP_ACT_ALLOW"]
    allowed_families = {f for f in range(64) if any(f & a["value"] == a["valueTwo"] for a in socket_allows)}
    assert allowed_families == set(range(64)) - {1, 40}
    ioctl_allows = [r["args"][0] for r in rules if r["names"] == ["ioctl"] and r["action"] == "SCMP_ACT_ALLOW"]
    for request, allowed in ((TIOCSTI, False), (TIOCLINUX, False), (0x5413, True), (TIOCSTI | 1 << 32, False)):
        assert any(request & a["value"] == a["valueTwo"] for a in ioctl_allows) is allowed
    assert base["syscalls"][0]["names"] == ["read", "socket", "ioctl", "ptrace", "clone"]  # input untouched


@pytest.mark.parametrize("backend", ["shell", "codex"])
def test_container_argv_has_the_policy_and_no_values_of_secrets(sandbox: Sandbox, backend: str) -> None:
    sandbox.env["OPENAI_API_KEY"] = "sk-secret-value"
    plan = plan_for(sandbox, backend, "container", prompt="hi", live=True)  # staged: tests/test_staged.py
    argv = list(plan.command)
    joined = " ".join(argv)
    for flag in ("--read-only", "--rm", "--http-proxy=false"):
        assert flag in argv
    assert argv[argv.index("--cap-drop") + 1] == "ALL" and argv[argv.index("--network") + 1] == "none"
    assert "no-new-privileges" in argv and f"seccomp={plan.run_dir}/seccomp.json" in argv
    assert argv[argv.index("--userns") + 1] == "keep-id" and argv[argv.index("--user") + 1] == "1000:1000"
    assert "-t" not in argv  # no terminal, no -t
    assert "sk-secret-value" not in joined and ".ssh" not in joined
    if backend == "codex":
        # The key stays on the host (a credential route); the box gets a placeholder by value, and a
        # variable the backend passes by name without a route is still passed by name.
        assert "OPENAI_API_KEY" not in [a for a in argv if not a.startswith("OPENAI_API_KEY=")]
        assert "CODEX_API_KEY=hive-relay-placeholder" in argv
        # ~/.codex is a private copy inside the run's home, not the host's dir.
        assert f"{sandbox.home}/.codex:{sandbox.home}/.codex:rw" not in argv
        assert f"{plan.run_dir}/home:{sandbox.home}:rw" in argv
    assert f"{sandbox.workdir}:{sandbox.workdir}:rw" in argv
    assert argv[argv.index("--entrypoint") + 1] == "/opt/hive-relay/bin/container-entrypoint"
    assert plan.container is not None and argv[argv.index(plan.container.image) + 1:] == list(plan.argv)


def test_rootless_on_cgroup_v1_uses_rlimits_and_root_uses_cgroups(sandbox: Sandbox) -> None:
    rootless = plan_for(sandbox, "shell", "container", facts=replace(FACTS, cgroup="v1"))
    assert rootless.limits.method.startswith("rlimit")
    assert "--pids-limit" not in rootless.command and "data=8589934592:8589934592" in rootless.command
    sandbox2 = sandbox
    (sandbox2.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    root = plan_for(sandbox2, "shell", "container", facts=replace(FACTS, uid=0, gid=0, cgroup="v1"))
    assert root.limits.method.startswith("cgroup")
    assert "--pids-limit" in root.command and "--userns" not in root.command
    assert root.command[root.command.index("--user") + 1] == "0:0"


def test_interactive_with_a_terminal_gets_t(sandbox: Sandbox) -> None:
    plan = plan_for(sandbox, "shell", "container", facts=replace(FACTS, tty=True))
    assert "-t" in plan.command and plan.timeout is None


def test_no_engine_is_a_clear_refusal(sandbox: Sandbox) -> None:
    from relay.model.errors import RefusedError

    with pytest.raises(RefusedError, match="needs podman or docker"):
        plan_for(sandbox, "shell", "container", facts=replace(FACTS, podman=None, docker=None))


def test_dockerfile_pins_match_the_config_and_the_tag_follows_them() -> None:
    backends = load_shipped()
    defaults = dockerfile_defaults()
    for name, arg in VERSION_ARGS.items():
        assert defaults[arg] == split_npm_spec(backends[name].install_npm or "")[1]
    text = (REPO / "Dockerfile.contributor").read_text()
    for name in VERSION_ARGS:
        package = split_npm_spec(backends[name].install_npm or "")[0]
        assert f'"{package}@${{{VERSION_ARGS[name]}}}"' in text
    spec = spec_for(backends, 1000, 1000)
    bumped = dict(backends)
    bumped["codex"] = replace(backends["codex"], install_npm="@openai/codex@0.0.1")
    assert spec_for(bumped, 1000, 1000).tag != spec.tag
    assert spec_for(backends, 1001, 1001).tag.endswith("-u1001")
    assert json.dumps(dict(spec.build_args))  # plain strings only


def test_docker_gets_the_same_policy_without_podman_only_flags(sandbox: Sandbox) -> None:
    facts = replace(FACTS, podman=None, docker="/usr/bin/docker", cgroup="v2")
    plan = plan_for(sandbox, "shell", "container", facts=facts, live=True)  # docker cannot stage: refused
    argv = list(plan.command)
    assert argv[:3] == ["/usr/bin/docker", "--log-level=error", "run"]
    for flag in ("--userns", "--pidfile", "--http-proxy=false"):
        assert flag not in argv
    assert "--pids-limit" in argv and argv[argv.index("--network") + 1] == "none"
    assert not any(a.endswith(",U") for a in argv)  # docker's --tmpfs has no U option
    assert plan.container is not None and plan.container.rm_argv()[:3] == ["/usr/bin/docker", "rm", "-f"]


def test_engine_choice_honours_hive_relay_engine(sandbox: Sandbox) -> None:
    from relay.model.errors import RefusedError
    from relay.plan.resolve import choose_engine

    both = replace(FACTS, docker="/usr/bin/docker")
    assert choose_engine(both, {}) == "/usr/bin/podman"
    assert choose_engine(both, {"HIVE_RELAY_ENGINE": "docker"}) == "/usr/bin/docker"
    with pytest.raises(RefusedError, match="HIVE_RELAY_ENGINE=docker: not installed"):
        choose_engine(FACTS, {"HIVE_RELAY_ENGINE": "docker"})


@pytest.mark.parametrize("isolation", ["process", "supervised"])
def test_a_local_tier_with_container_mode_is_a_usage_error(sandbox: Sandbox, isolation: str) -> None:
    proc = sandbox.relay("shell", "container", "--isolation", isolation, "--dry-run")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"hive-relay: error: --isolation {isolation} is a local-mode tier; "
                                   "fix: drop it, or use --mode local")


@pytest.mark.parametrize("backend", ["claude", "codex", "gemini", "opencode", "shell"])
def test_egress_rules_are_the_same_plan_in_both_modes(sandbox: Sandbox, backend: str) -> None:
    (sandbox.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    extra = ("pinned.test:8443=127.0.0.1:8443", "*.example.org")
    local = plan_for(sandbox, backend, "local", allow_hosts=extra)
    (sandbox.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    container = plan_for(sandbox, backend, "container", allow_hosts=extra)
    assert local.egress == container.egress and local.egress
    assert local.proxy_listen == container.proxy_listen == "127.0.0.1:3128"
    assert local.rules == container.rules
    proxy_env = {k: v for k, v in local.env_set if "proxy" in k.lower()}
    assert proxy_env and proxy_env == {k: v for k, v in container.env_set if "proxy" in k.lower()}
