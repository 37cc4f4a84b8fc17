"""The real agent CLIs (installed from npm) complete real turns inside an enforced box, against a
local fake API reached only through our proxy via a pinned --allow-host entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relay.config.load import load_shipped
from relay.modes.install import cli_path, ensure_cli

from .conftest import REPO, Sandbox, require_box
from .fake_api import ANSWER, start

pytestmark = pytest.mark.box

AGENTS = ("claude", "codex", "gemini", "opencode")
TOOLS = os.environ.get("HIVE_RELAY_TOOLS") or str(REPO / ".cache" / "npm")
PROBE = """#!/bin/sh
cat "$HOME/.ssh/id_rsa" 2>&1 || echo SSH-REFUSED
echo made-by-agent > made-by-agent.txt && echo WORKDIR-WRITE-OK
echo escaped > ../escaped-by-agent.txt 2>/dev/null
echo escaped > /usr/escaped-by-agent.txt 2>&1 || echo OUTSIDE-WRITE-REFUSED
curl -s -o /dev/null -w 'example.com connect=%{http_connect}\\n' https://example.com/ || true
"""


@pytest.fixture(scope="module")
def tools() -> str:
    """Install the pinned CLIs once (CI pre-installs them into a shared cache)."""
    require_box()
    env = {**os.environ, "HIVE_RELAY_TOOLS": TOOLS}
    backends = load_shipped()
    for name in AGENTS:
        ensure_cli(backends[name], env, backends[name].install_bin or name)
        assert cli_path(backends[name], env), f"{name} CLI missing after install"
    return TOOLS


@pytest.fixture(scope="module")
def api():
    server, port = start()
    yield server, port
    server.shutdown()


@pytest.fixture
def agent(sandbox: Sandbox, tools: str, api):
    """A sandbox whose user config does not override the agents, plus each CLI's fake-API setup."""
    server, port = api
    server.requests.clear()
    server.headers_seen.clear()
    server.tool_command = None
    sandbox.env.update(HIVE_RELAY_TOOLS=tools)
    setup_agent_home(sandbox, port)
    return sandbox, server, port


def setup_agent_home(sandbox: Sandbox, port: int) -> None:
    """Each CLI's config pointed at the fake API (also used by the container-mode tests)."""
    (sandbox.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    base = f"http://fake-api.test:{port}"
    sandbox.env.update(ANTHROPIC_API_KEY="sk-ant-fake", ANTHROPIC_BASE_URL=base,
                       GEMINI_API_KEY="gemini-fake", GOOGLE_GEMINI_BASE_URL=base)
    (sandbox.home / ".claude" / "settings.json").write_text(json.dumps({"permissions": {"allow": ["Bash"]}}))
    (sandbox.home / ".codex" / "config.toml").write_text(
        f'model_provider = "fake"\n[model_providers.fake]\nname = "fake"\nbase_url = "{base}/v1"\n'
        'wire_api = "responses"\nrequires_openai_auth = true\nsupports_websockets = false\n')
    (sandbox.home / ".gemini" / "settings.json").write_text(
        json.dumps({"security": {"auth": {"selectedType": "gemini-api-key"}}}))
    opencode = sandbox.workdir / "opencode.json"  # inside the workdir: the rest of /tmp is private to the box
    opencode.write_text(json.dumps({"provider": {"anthropic": {"options": {"baseURL": base + "/v1", "apiKey": "sk-fake"}}},
                                    "model": "anthropic/claude-sonnet-4-5", "autoupdate": False, "share": "disabled"}))
    opencode.chmod(0o644)
    sandbox.env["OPENCODE_CONFIG"] = str(opencode)
    (sandbox.workdir / "probe.sh").write_text(PROBE)


def run(s: Sandbox, backend: str, port: int, prompt: str = "say the answer") -> subprocess.CompletedProcess:
    return s.relay(backend, "local", "--prompt", prompt, "--allow-host", f"fake-api.test:{port}=127.0.0.1:{port}",
                   "--timeout", "240", timeout=300)


def log_entries(s: Sandbox) -> list[dict]:
    logs = sorted((s.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    return [json.loads(line) for path in logs for line in path.read_text().splitlines()]


@pytest.mark.parametrize("backend", AGENTS)
def test_real_cli_completes_a_turn_through_the_proxy(agent, backend: str) -> None:
    s, server, port = agent
    proc = run(s, backend, port)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert ANSWER in proc.stdout
    assert f"{backend} · local · supervised · profile agent" in proc.stderr
    # The request went through our proxy (logged) to the pinned fake server, with credentials.
    entries = log_entries(s)
    assert any(e["host"] == "fake-api.test" and e["port"] == port and e["decision"] == "allow" for e in entries)
    assert server.requests and all(r["host"] and "fake-api.test" in r["host"] for r in server.requests)
    assert any(r["auth"] for r in server.requests)
    # Nothing of the user's secrets ever reached the API.
    assert not any("PRIVATE-KEY-DO-NOT-LEAK" in r["body"] for r in server.requests)
    # Every other host the CLI tried was refused, and said so.
    for e in entries:
        if e["decision"] == "deny":
            assert e["host"] != "fake-api.test"


def test_codex_finds_auth_json_and_keeps_its_state(agent) -> None:
    s, server, port = agent
    proc = run(s, "codex", port)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The key came from ~/.codex/auth.json inside the box (no key in the environment): the box's copy holds a
    # placeholder of its shape, and this provider (the user's own base_url) is no route: it gets the placeholder.
    sent = [h.get("authorization", "") for h in server.headers_seen if h.get("authorization")]
    assert sent and all(v.startswith("Bearer sk-") and len(v) == len("Bearer sk-test") and "sk-test" not in v
                        for v in sent), sent
    assert list((s.home / ".codex" / "sessions").rglob("*.jsonl")), "codex state did not persist to ~/.codex"


def test_claude_state_is_synced_back(agent) -> None:
    s, server, port = agent
    before = (s.home / ".claude.json").read_text()
    proc = run(s, "claude", port)
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = json.loads((s.home / ".claude.json").read_text())
    assert after != json.loads(before) and after.get("numStartups", 0) >= 1
    assert list((s.root / "run").iterdir()) == []


@pytest.mark.parametrize("backend", ["codex", "claude"])
def test_tool_call_writes_workdir_but_not_outside_and_cannot_read_ssh(agent, backend: str) -> None:
    s, server, port = agent
    server.tool_command = "sh probe.sh"
    proc = run(s, backend, port, prompt="run the probe")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    bodies = "\n".join(r["body"] for r in server.requests)
    # Staged (the default): the real CLI's write is in the run's layer, and lands on apply.
    assert not (s.workdir / "made-by-agent.txt").exists()
    applied = s.relay("apply", "last")
    assert applied.returncode == 0, applied.stderr
    assert (s.workdir / "made-by-agent.txt").read_text() == "made-by-agent\n"
    assert "WORKDIR-WRITE-OK" in bodies
    assert not (s.root / "escaped-by-agent.txt").exists()  # ../ is the box's private /tmp
    assert not Path("/usr/escaped-by-agent.txt").exists()
    assert "OUTSIDE-WRITE-REFUSED" in bodies
    assert "PRIVATE-KEY-DO-NOT-LEAK" not in bodies and "SSH-REFUSED" in bodies
    assert "example.com connect=403" in bodies
    assert any(e["host"] == "example.com" and e["decision"] == "deny" for e in log_entries(s))


def test_claude_gets_the_deny_list_as_native_permissions(sandbox: Sandbox) -> None:
    plan = json.loads(sandbox.relay("claude", "--dry-run", "--json", extra_env={"HIVE_RELAY_TOOLS": TOOLS}).stdout)
    # The sandbox's user config replaced claude's command; use the shipped matrix instead.
    (sandbox.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    plan = json.loads(sandbox.relay("claude", "--dry-run", "--json").stdout)
    settings = json.loads(plan["argv"][plan["argv"].index("--settings") + 1])
    assert "Read(~/.ssh/**)" in settings["permissions"]["deny"]
    assert any(r.startswith("Edit(") and ".git/hooks" in r for r in settings["permissions"]["deny"])
    assert "sandbox" not in settings


def test_unsandboxed_opt_in_uses_the_strictest_native_sandbox(sandbox: Sandbox) -> None:
    (sandbox.home / ".config" / "hive-relay" / "config.yaml").write_text("allow_unsandboxed: [claude, codex]\n")
    nobwrap = sandbox.root / "bin"
    nobwrap.mkdir()
    for tool in ("sh", "true"):
        (nobwrap / tool).symlink_to(f"/usr/bin/{tool}")
    env = {"PATH": str(nobwrap)}
    claude = json.loads(sandbox.relay("claude", "--dry-run", "--json", extra_env=env).stdout)
    settings = json.loads(claude["argv"][claude["argv"].index("--settings") + 1])
    assert claude["tier"] == "unsandboxed" and settings["sandbox"]["enabled"] and settings["sandbox"]["failIfUnavailable"]
    codex = json.loads(sandbox.relay("codex", "--dry-run", "--json", extra_env=env).stdout)
    assert codex["argv"][:3] == ["codex", "--sandbox", "workspace-write"]


def test_missing_npm_is_one_line_with_the_fix(sandbox: Sandbox, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("sh", "bwrap", "true"):
        (bindir / tool).symlink_to(f"/usr/bin/{tool}")
    (sandbox.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    proc = sandbox.relay("gemini", "--prompt", "hi", extra_env={"PATH": str(bindir), "HIVE_RELAY_TOOLS": str(tmp_path / "t")})
    assert proc.returncode == 127
    assert proc.stderr.strip().splitlines() == [
        "hive-relay: error: gemini is not installed and npm is missing; fix: apt-get install nodejs npm "
        "(or install Node.js 20+), then run again"]


def test_first_use_installs_the_cli_project_locally(agent, tmp_path: Path) -> None:
    s, server, port = agent
    fresh = tmp_path / "fresh-tools"
    s.env["HIVE_RELAY_TOOLS"] = str(fresh)
    # npm needs the machine's registry settings (CA file) and may reuse its download cache.
    for name in ("NODE_EXTRA_CA_CERTS", "SSL_CERT_FILE", "NPM_CONFIG_CAFILE", "NPM_CONFIG_REGISTRY"):
        if os.environ.get(name):
            s.env[name] = os.environ[name]
    user_npmrc = Path(os.path.expanduser("~/.npmrc"))
    if os.access(user_npmrc, os.R_OK):
        s.env["NPM_CONFIG_USERCONFIG"] = str(user_npmrc)
    if os.access(os.path.expanduser("~/.npm"), os.W_OK):
        s.env["NPM_CONFIG_CACHE"] = os.path.expanduser("~/.npm")
    proc = run(s, "gemini", port)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "first use of gemini: installing @google/gemini-cli@0.61.0" in proc.stderr
    assert (fresh / "node_modules" / ".bin" / "gemini").exists()
    assert ANSWER in proc.stdout



def test_claude_tui_works_interactively_in_the_box(agent) -> None:
    """The point of the product: the real TUI starts, renders, answers, and exits on Ctrl-C twice."""
    import pexpect

    s, server, port = agent
    key = s.env["ANTHROPIC_API_KEY"]
    (s.home / ".claude.json").write_text(json.dumps({
        "hasCompletedOnboarding": True, "theme": "dark",
        "customApiKeyResponses": {"approved": [key[-20:]], "rejected": []},
        "projects": {str(s.workdir): {"hasTrustDialogAccepted": True, "hasCompletedProjectOnboarding": True}}}))
    child = pexpect.spawn(sys.executable, ["-m", "relay", "claude", "--quiet", "--allow-host",
                                           f"fake-api.test:{port}=127.0.0.1:{port}"],
                          cwd=str(s.workdir), env=s.env, encoding="utf-8", timeout=60, dimensions=(40, 120))
    seen = []
    child.logfile_read = type("Tee", (), {"write": lambda self, d: seen.append(d), "flush": lambda self: None})()
    child.expect("shortcuts")  # the input box has rendered
    child.send("say the answer")
    child.expect("answer")
    child.send("\r")
    child.expect(ANSWER)
    child.sendcontrol("c")
    child.expect("again to exit")
    child.sendcontrol("c")
    child.expect(pexpect.EOF)
    child.close()
    screen = "".join(seen)
    assert child.exitstatus == 0
    assert "could not be read" not in screen  # no settings noise from our placeholders
    assert any("/v1/messages" in r["path"] for r in server.requests)
