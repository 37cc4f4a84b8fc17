"""opencode's ChatGPT login (its built-in codex plugin): a route that inspects chatgpt.com, where the
plugin's fixed endpoint is. The box's auth.json holds placeholders (a JWT of the same claims, the
expiry in 2100); the proxy ends the box's TLS with the run CA's leaf and adds the real access token
on chatgpt.com's /backend-api/codex/ only, and refreshes an expiring token on the host.

A real opencode turn, its shell tool running a probe in the box: env and every file under $HOME and
/tmp hold no real value; the pinned upstream got the real token; a request elsewhere on chatgpt.com
is refused (403) without it. In local and container mode.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from . import fake_api
from .test_credential_files import ACCOUNT, MARK, OPENAI_CLAIMS, files_holding, jwt
from .test_credential_turns import setup_home

ACCESS = jwt({**OPENAI_CLAIMS, "scp": ["openid"]})
NEW_ACCESS = jwt({**OPENAI_CLAIMS, "scp": ["openid"], "iat": 1_800_000_001})
REFRESH = "rt_" + MARK + "opencodeRefresh0123"
PROBE = """#!/bin/sh
echo "probe-env=$(env | grep -c 'REAL''SECRET')"
echo "probe-home=$(grep -rl 'REAL''SECRET' "$HOME" /tmp 2>/dev/null | wc -l)"
echo "probe-seen=$(grep -c '"access"' "$HOME/.local/share/opencode/auth.json")"
echo "probe-elsewhere=$(curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer x' https://chatgpt.com/backend-api/accounts)"
"""


@pytest.mark.parametrize("mode", [pytest.param("local", marks=pytest.mark.box),
                                  pytest.param("container", marks=pytest.mark.container)])
@pytest.mark.parametrize("expiring", [False, True], ids=["fresh", "expiring"])
def test_opencode_with_a_chatgpt_login_runs_through_the_inspected_route(mode_sandbox, ca, tls_api, mode: str,  # noqa: ANN001
                                                                        expiring: bool) -> None:
    from .test_agents import TOOLS

    s = mode_sandbox
    setup_home(s, "opencode", "HOME")
    config = s.workdir / "opencode.json"
    config.write_text(json.dumps({"model": "openai/gpt-5.5", "autoupdate": False, "share": "disabled"}))
    config.chmod(0o644)
    expires = int((time.time() + (60 if expiring else 86400)) * 1000)
    path = s.home / ".local" / "share" / "opencode" / "auth.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"openai": {"type": "oauth", "access": ACCESS, "refresh": REFRESH, "expires": expires,
                                           "accountId": ACCOUNT}}))
    path.chmod(0o600)
    if expiring:  # the host's refresh at auth.openai.com (pinned to the fake API): a new pair, single use
        tls_api.oauth_tokens[REFRESH] = {"access_token": NEW_ACCESS, "refresh_token": "rt_" + MARK + "next",
                                         "id_token": NEW_ACCESS, "expires_in": 3600}
    (s.workdir / "probe-creds.sh").write_text(PROBE)
    (s.workdir / "probe-creds.sh").chmod(0o644)
    tls_api.tool_command = "sh probe-creds.sh"
    tls_api.tool_name = "bash"
    port = tls_api.server_address[1]
    pins = [a for n in ("chatgpt.com", "auth.openai.com") for a in ("--allow-host", f"{n}:443=127.0.0.1:{port}")]
    proc = s.relay("opencode", mode, "--prompt", "say the answer", *pins, "--timeout", "240", timeout=300,
                   extra_env={"SSL_CERT_FILE": str(ca[0]), "HIVE_RELAY_TOOLS": TOOLS})
    assert proc.returncode == 0 and fake_api.ANSWER in proc.stdout, (proc.stdout[-1500:], proc.stderr[-3000:])
    assert "TLS inspected (this run's CA, trusted in the box): chatgpt.com:443" in proc.stderr  # never silent
    bodies = "\n".join(r["body"] for r in tls_api.requests)
    probe = dict(re.findall(r"probe-(env|home|seen|elsewhere)=([^\n\\\"]*)", bodies))
    assert probe.get("env") == "0" and probe.get("home") == "0" and probe.get("seen") == "1", probe
    assert probe.get("elsewhere") == "403", probe  # chatgpt.com outside the route's paths: refused, nothing added
    want = NEW_ACCESS if expiring else ACCESS
    routed = [h.get("authorization", "") for h in tls_api.headers_seen if h.get("host") == "chatgpt.com"]
    assert routed and all(v == f"Bearer {want}" for v in routed), [v[:30] for v in routed]
    assert MARK not in proc.stdout + proc.stderr
    host = json.loads(path.read_text())["openai"]
    if expiring:  # refreshed on the host, written back in opencode's own fields; the box never saw either pair
        assert host["access"] == NEW_ACCESS and host["refresh"] == "rt_" + MARK + "next" and host["expires"] > expires
        assert NEW_ACCESS.split(".")[2] not in bodies
    else:
        assert host["access"] == ACCESS and host["refresh"] == REFRESH
    assert [p for p in files_holding(s.home, MARK.encode()) if p != str(path)] == []
