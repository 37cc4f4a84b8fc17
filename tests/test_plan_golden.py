"""resolve() is pure: every backend × mode × profile (× tier) resolved against a host that exists only
in memory, with the real host's file calls made to raise, and compared with reviewed golden plans.

Regenerate after an intended change with `HIVE_RELAY_GOLDEN=1 pytest tests/test_plan_golden.py`, then
review the diff of tests/golden/ like code: it is the whole decision, argv and mounts included.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

import relay.box.landlock  # noqa: F401
import relay.host.container_engine  # noqa: F401 - imported ahead: loading code is not reading the host
import relay.trust.gitdir  # noqa: F401
from relay.config.load import Matrix, load_shipped
from relay.host import paths
from relay.model.errors import RelayError
from relay.model.host_facts import HostFacts
from relay.plan.resolve import Request, resolve

from .fakefs import HOME, TOOLS, WORKDIR, HostTouched, fake_host, no_host_io

GOLDEN = Path(__file__).parent / "golden" / "plans"
BACKENDS = ("claude", "codex", "gemini", "opencode", "shell")
ENV = {"HOME": HOME, "USER": "u", "SHELL": "/bin/bash", "PATH": "/usr/local/bin:/usr/bin:/bin",
       "XDG_RUNTIME_DIR": "/run/user/1000", "LANG": "C.UTF-8", "ANTHROPIC_API_KEY": "sk-never-in-a-plan",
       "SSH_AUTH_SOCK": "/run/user/1000/ssh-agent.sock"}
SUPERVISED = HostFacts(uid=1000, gid=1000, home=HOME, user="u", shell="/bin/bash", tty=True, bwrap="/usr/bin/bwrap",
                       bwrap_version="0.8.0", seccomp=True, landlock_abi=4, cgroup="v2", podman="/usr/bin/podman",
                       box_python="/usr/bin/python3", nofile=524288,
                       image="localhost/hive-relay-contributor:0123456789ab-u1000")
PROCESS = replace(SUPERVISED, bwrap=None, bwrap_version=None, bwrap_error="bubblewrap is not installed", cgroup=None)


def cases() -> Iterator[tuple[str, HostFacts, Request, dict[str, str]]]:
    """(name, facts, request, env) for one backend: each tier the host allows, each profile. The
    process tier cannot stage the workdir, so its cases ask for --live (the default's refusal there
    is a case of its own)."""
    for profile in (None, "default", "agent"):
        yield f"local/supervised-host/{profile or 'auto'}", SUPERVISED, Request("", profile=profile), ENV
        yield f"local/process-host/{profile or 'auto'}", PROCESS, Request("", profile=profile, live=True), ENV
        yield f"container/{profile or 'auto'}", SUPERVISED, Request("", mode="container", profile=profile), ENV
    yield "local/process-host/staged-default", PROCESS, Request(""), ENV
    yield "local/supervised-host/live", SUPERVISED, Request("", live=True), ENV
    yield "local/supervised-host/process", SUPERVISED, Request("", isolation="process", live=True), ENV
    yield "local/supervised-host/agent-prompt", SUPERVISED, Request("", prompt="fix the bug", timeout=60), ENV
    yield "container/prompt", SUPERVISED, Request("", mode="container", prompt="fix the bug"), ENV
    yield "container/live", SUPERVISED, Request("", mode="container", live=True), ENV
    yield "local/process-host/opted-in", PROCESS, Request("", live=True), {**ENV, "HIVE_RELAY_UNSANDBOXED_ALL": "1"}
    sockets = {"allow_sockets": ("ssh-agent",), "allow_ssh": ("git.test",)}
    yield "local/supervised-host/sockets", SUPERVISED, Request("", **sockets), ENV
    yield "container/sockets", SUPERVISED, Request("", mode="container", live=True, **sockets), ENV
    yield "local/supervised-host/process-sockets", SUPERVISED, Request("", isolation="process", live=True,
                                                                        **sockets), ENV


def _opt_in(env: dict[str, str], backend: str) -> dict[str, str]:
    if env.pop("HIVE_RELAY_UNSANDBOXED_ALL", None):
        env[f"HIVE_RELAY_UNSANDBOXED_{backend.upper()}"] = "1"
    return env


@pytest.fixture()
def fake_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """hive relay's own paths as on the fake host (not this checkout's), and one time zone."""
    monkeypatch.setattr(paths, "PACKAGE_ROOT", Path("/opt/hive-relay"))
    monkeypatch.setattr(paths, "IN_CHECKOUT", True)
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def resolve_all(backend: str) -> tuple[dict[str, object], list[str]]:
    """Every case's plan (its --dry-run --json) or refusal, and the host calls attempted meanwhile."""
    backends = load_shipped()
    matrix = Matrix(backends=backends, profiles={}, allow_unsandboxed=frozenset(), sources=())
    fs = fake_host()
    out: dict[str, object] = {}
    with no_host_io() as attempted:
        for name, facts, request, env in cases():
            request = replace(request, backend=backend, workdir=WORKDIR, run_id="1-golden")
            try:
                plan = resolve(backends[backend], matrix, request, facts, _opt_in(dict(env), backend), fs=fs, now=0)
                out[name] = plan.to_json()
            except RelayError as err:
                out[name] = {"refused": type(err).__name__, "exit": err.exit_code, "message": err.message}
    return out, attempted


@pytest.mark.parametrize("backend", BACKENDS)
def test_resolve_reads_nothing_and_matches_the_golden_plans(backend: str, fake_checkout: None) -> None:
    got, attempted = resolve_all(backend)
    assert attempted == []  # no host call, even one swallowed by an `except`
    text = json.dumps(got, indent=1, sort_keys=True) + "\n"
    path = GOLDEN / f"{backend}.json"
    if os.environ.get("HIVE_RELAY_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs: review, then regenerate with HIVE_RELAY_GOLDEN=1"


def test_the_fake_host_is_what_the_planner_saw(fake_checkout: None) -> None:
    """The harness itself: the same request against the real FsView would read the host (so the
    golden run above proves something), and the fake answers as the real one would."""
    fs = fake_host()
    assert fs.realpath(f"{HOME}/.config/git") == f"{HOME}/.gitconfig-dir" and fs.kind(f"{HOME}/.config/git") == "missing"
    assert fs.lkind(f"{HOME}/.config/git") == "link" and fs.which("sh", "/bin") == "/bin/sh"
    assert fs.listdir(f"{WORKDIR}/.git/modules") == ["lib"] and fs.which("gemini", f"{TOOLS}/node_modules/.bin") is None
    with no_host_io() as attempted, pytest.raises(HostTouched):
        resolve(load_shipped()["shell"], Matrix(load_shipped(), {}, frozenset(), ()),
                Request("shell", workdir=WORKDIR, run_id="1-golden"), SUPERVISED, dict(ENV), now=0)
    assert attempted
