"""Real agent CLIs complete a turn with their API key injected by the proxy, in local (bwrap) and
container (podman) mode: the same routes, the same host-side proxy, the same assertions.

The fake API (tests/fake_api.py) speaks TLS under the backend's real API name with a throwaway CA,
pinned with `--allow-host NAME:443=127.0.0.1:PORT`; the launcher trusts that CA via SSL_CERT_FILE.
In container mode the proxy still runs on the host, so the pinned upstream on 127.0.0.1 is the same.

The fake API also makes each CLI run a probe in the box through its own shell tool (claude's Bash,
codex's exec_command, gemini's run_shell_command, opencode's bash): what the box's environment, every
/proc/*/environ and every file under $HOME and /tmp hold comes back in the next request's body. After
the run, what the box printed and wrote back under the host's HOME and workdir holds no key either.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from . import fake_api
from .conftest import Sandbox, require_box

REAL = "sk-REAL-TURN-KEY-ON-THE-HOST-ONLY"
PLACEHOLDER = "hive-relay-placeholder"
KEY_HEADERS = ("x-api-key", "authorization", "x-goog-api-key")
# backend -> (the host variable its route reads, the real API name, the variable the box sees)
BACKENDS = {
    "claude": ("ANTHROPIC_API_KEY", "api.anthropic.com", "ANTHROPIC_API_KEY"),
    "codex": ("CODEX_API_KEY", "api.openai.com", "CODEX_API_KEY"),
    "gemini": ("GEMINI_API_KEY", "generativelanguage.googleapis.com", "GEMINI_API_KEY"),
    "opencode": ("ANTHROPIC_API_KEY", "api.anthropic.com", "ANTHROPIC_API_KEY"),
}
# The probe never spells the key's marker in one piece, so its own text is no false hit; probe-seen is
# the twin of probe-proc (the environments it reads do hold the placeholder: the scan is not blind).
PROBE = """#!/bin/sh
echo "probe-env=${VAR}"
echo "probe-proc=$(for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < "$f"; done 2>/dev/null | grep -c 'TURN-KEY''-ON-THE-HOST')"
echo "probe-seen=$(for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < "$f"; done 2>/dev/null | grep -c 'hive-relay-placeholder')"
echo "probe-home=$(grep -rl 'TURN-KEY''-ON-THE-HOST' "$HOME" /tmp 2>/dev/null | wc -l)"
"""
MODES = [pytest.param("local", marks=pytest.mark.box), pytest.param("container", marks=pytest.mark.container)]


@pytest.fixture
def mode_box(request: pytest.FixtureRequest) -> tuple[Sandbox, str]:
    mode = request.node.callspec.params["mode"]
    if mode == "container":
        return request.getfixturevalue("csandbox"), mode
    require_box()
    return request.getfixturevalue("sandbox"), mode


def setup_home(s: Sandbox, backend: str, box_var: str) -> None:
    """The real CLIs (no sh override), no key anywhere under HOME, each CLI set to use its API key and
    to run the probe without asking (gemini drops its shell tool from a prompt run unless allowed)."""
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    (s.home / ".codex" / "auth.json").unlink()
    (s.home / ".claude" / "settings.json").write_text(json.dumps({"permissions": {"allow": ["Bash"]}}))
    (s.home / ".gemini" / "settings.json").write_text(json.dumps({"security": {"auth": {"selectedType": "gemini-api-key"}},
                                                                "tools": {"allowed": ["run_shell_command(sh probe-creds.sh)"]}}))
    if backend == "opencode":
        config = s.workdir / "opencode.json"  # in the workdir: the rest of /tmp is private to the box
        config.write_text(json.dumps({"model": "anthropic/claude-sonnet-4-5", "autoupdate": False, "share": "disabled"}))
        config.chmod(0o644)
        s.env["OPENCODE_CONFIG"] = str(config)
    probe = s.workdir / "probe-creds.sh"
    probe.write_text(PROBE.replace("${VAR}", "${" + box_var + "}"))
    probe.chmod(0o644)


def files_holding(root: Path, needle: bytes) -> list[str]:
    found = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
                found.append(str(path))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_real_cli_turn_with_the_key_injected(mode_box, ca, tls_api, backend: str, mode: str) -> None:
    from .test_agents import TOOLS

    s, _ = mode_box
    host_var, name, box_var = BACKENDS[backend]
    setup_home(s, backend, box_var)
    tls_api.tool_command = "sh probe-creds.sh"
    tls_api.tool_name = "bash" if backend == "opencode" else "Bash"
    port = tls_api.server_address[1]
    proc = s.relay(backend, mode, "--prompt", "say the answer", "--allow-host", f"{name}:443=127.0.0.1:{port}",
                   "--timeout", "240", timeout=300,
                   extra_env={host_var: REAL, "SSL_CERT_FILE": str(ca[0]), "HIVE_RELAY_TOOLS": TOOLS})
    out = proc.stdout + proc.stderr
    # The turn: the CLI printed the fake API's answer.
    assert proc.returncode == 0 and fake_api.ANSWER in proc.stdout, (proc.stdout[-1500:], proc.stderr[-3000:])
    assert f"{backend} · {mode} · " in proc.stderr and "credentials: in box" not in proc.stderr
    # The pinned upstream got the real key on every request that carried one, and only under its name.
    keys = [v for h in tls_api.headers_seen for k, v in h.items() if k in KEY_HEADERS]
    assert keys and all(REAL in v for v in keys), keys
    assert all(h.get("host") == name for h in tls_api.headers_seen)
    bodies = "\n".join(r["body"] for r in tls_api.requests)
    assert REAL not in bodies
    # The box saw only the placeholder: its environment, every process's, its home and /tmp.
    probe = dict(re.findall(r"probe-(env|proc|seen|home)=([\w-]*)", bodies))
    seen = int(probe.pop("seen", "0"))
    assert probe == {"env": PLACEHOLDER, "proc": "0", "home": "0"} and seen >= 1, (probe, seen, bodies[-2000:])
    # Nothing the box printed or wrote back under the host's HOME holds the key.
    assert REAL not in out
    assert files_holding(s.home, REAL.encode()) == [] and files_holding(s.workdir, REAL.encode()) == []
    # The run's log names the route's use, never the key.
    logs = "".join(p.read_text() for p in (s.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    assert '"route": ' in logs and REAL not in logs
