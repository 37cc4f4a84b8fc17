"""Credentials in container mode: the same routes and grants, the same host-side proxy, in a podman box.
The box reaches its backend's credential route and a grant's git route on its own loopback and holds
only the placeholder (tests/escape/test_credentials.py and test_grants.py are the local-mode twins)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Sandbox
from .escape.test_credentials import PLACEHOLDER, REAL
from .escape.test_grants import TOKEN, head_of, run_box, with_grant
from .git_server import GitServer, bare_repo

pytestmark = pytest.mark.container

ROUTE_SCRIPT = r"""
echo "env=$ANTHROPIC_API_KEY url=$ANTHROPIC_BASE_URL"
for f in /proc/[0-9]*/environ; do tr '\0' '\n' < "$f"; done 2>/dev/null | grep -c REAL-KEY-ON-THE-HOST || true
grep -rl REAL-KEY-ON-THE-HOST "$HOME" /tmp 2>/dev/null | wc -l
node -e 'fetch(process.env.ANTHROPIC_BASE_URL + "/v1/messages", {method: "POST", headers: {"x-api-key":
  process.env.ANTHROPIC_API_KEY, "content-type": "application/json"}, body: JSON.stringify({model: "m",
  max_tokens: 1, messages: []})}).then(r => r.text()).then(t => console.log(t), e => console.log("error", e))'
"""


def test_a_container_box_reaches_its_route_and_holds_only_the_placeholder(csandbox: Sandbox, ca, tls_api) -> None:
    port = tls_api.server_address[1]
    proc = csandbox.relay("claude", "container", "--quiet", "--prompt", ROUTE_SCRIPT,
                          "--allow-host", f"api.anthropic.com:443=127.0.0.1:{port}", timeout=240,
                          extra_env={"ANTHROPIC_API_KEY": REAL, "SSL_CERT_FILE": str(ca[0])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[:3] == [f"env={PLACEHOLDER} url=http://127.0.0.1:3128/anthropic", "0", "0"], proc.stdout
    assert "msg_fake" in lines[3], proc.stdout
    assert REAL not in proc.stdout + proc.stderr
    seen = [h for h in tls_api.headers_seen if h.get("host") == "api.anthropic.com"]
    assert seen and seen[-1]["x-api-key"] == REAL


@pytest.fixture
def github(ca, tmp_path: Path) -> Iterator[tuple[GitServer, Path]]:
    root = tmp_path / "srv"
    root.mkdir()
    bare = bare_repo(root)
    server = GitServer(root, TOKEN, ca[1]).start()
    yield server, bare
    server.shutdown()


def test_git_push_through_a_grant_from_a_container_box(csandbox: Sandbox, ca, github, tmp_path: Path) -> None:
    server, bare = github
    with_grant(csandbox)
    proc = run_box(csandbox, ca, server, tmp_path, mode="container")
    out = proc.stdout.splitlines()
    assert proc.returncode == 0 and "clone=0" in out and "push=0" in out, proc.stdout + proc.stderr[-2000:]
    assert out[out.index("push=0") + 1:][:3] == ["0", "0", "0"] and TOKEN not in proc.stdout + proc.stderr
    assert head_of(bare) == "from the box"


def test_a_token_recorded_in_the_state_stays_out_of_a_container_box(csandbox: Sandbox) -> None:
    """Container mode gets the same state copy: a log that recorded the route's key stays out of the
    box (said in one line), the state's other files come in (tests/test_credential_files.py has every
    spelling in local mode)."""
    from .test_credential_files import ENV_KEY, MARK, _recorded

    base = csandbox.home / ".codex"
    for rel, content in _recorded(ENV_KEY).items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_bytes(content)
    (base / "notes.txt").write_text("nothing secret here\n")
    proc = csandbox.relay("codex", "container", "--quiet", "--prompt",
                          "cd ~/.codex && cat notes.txt log/agent.log cache/pages.db url-cache.txt 2>&1 | "
                          "tr -c '[:print:]\\n' '.'; true", timeout=240, extra_env={"CODEX_API_KEY": ENV_KEY})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nothing secret here" in proc.stdout and MARK not in proc.stdout, proc.stdout
    for rel in ("log/agent.log", "cache/pages.db", "url-cache.txt", "history.gz", "blob.b64", "wide.txt"):
        assert f"~/.codex/{rel} holds the" in proc.stderr, (rel, proc.stderr[-2000:])
