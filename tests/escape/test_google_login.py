"""gemini's Google login stays on the host: the box gets GOOGLE_CLOUD_ACCESS_TOKEN as a placeholder and
a masked `~/.gemini/oauth_creds.json` (placeholders, `expiry_date` in 2100); the proxy's `google-login`
route sends the host file's real access token to cloudcode-pa.googleapis.com (Code Assist, the only API
of that login) and refreshes it on the host at oauth2.googleapis.com, as an RFC 6749 form with the CLI's
public installed-app client secret, when `expiry_date` is near.

The API and the token endpoint are one fake (tests/fake_api.py) speaking TLS under the real names with
the session's throwaway CA, reached through pinned `--allow-host NAME:443=127.0.0.1:PORT` entries. Every
real token carries MARK: found anywhere the box can see, it is a leak; the placeholder found there proves
the scan was not blind.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import socket
import ssl
import stat
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from relay.config.load import load_shipped
from relay.egress.decision_log import DecisionLog
from relay.egress.proxy import EgressProxy
from relay.model import credential_files
from relay.model.allow_rules import parse_rule
from relay.model.vocab import RefreshBody
from relay.trust import logins

from .. import fake_api
from ..conftest import Sandbox
from .conftest import Report
from .test_credentials import entries

API, TOKENS = "cloudcode-pa.googleapis.com", "oauth2.googleapis.com"
NAMES = (API, TOKENS, "generativelanguage.googleapis.com")
PLACEHOLDER = "hive-relay-placeholder"
MARK = "ONHOST"
ROUTE = next(r for r in load_shipped()["gemini"].credentials if r.name == "google-login")
assert ROUTE.login is not None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def id_token(tag: str) -> str:
    """An id token as Google issues them (RS256, its claims), MARK and `tag` in the signature."""
    now = int(time.time())
    head = _b64(json.dumps({"alg": "RS256", "kid": "k1", "typ": "JWT"}).encode())
    claims = {"iss": "https://accounts.google.com", "aud": ROUTE.login.client_id, "sub": "1234567890",
              "email": "dev@example.com", "email_verified": True, "iat": now, "exp": now + 3600}
    return f"{head}.{_b64(json.dumps(claims).encode())}.{MARK}{tag}{_b64(secrets.token_bytes(200))}"


ACCESS = f"ya29.a0{MARK}-access-old-" + _b64(secrets.token_bytes(90))
REFRESH = f"1//0g{MARK}-refresh-" + _b64(secrets.token_bytes(60))
NEW_ACCESS = f"ya29.a0{MARK}-access-new-" + _b64(secrets.token_bytes(90))
NEW_ID = id_token("id-new")


def write_login(home: Path, expires_in_s: float = 3000) -> Path:
    path = home / ".gemini" / "oauth_creds.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "access_token": ACCESS, "refresh_token": REFRESH, "token_type": "Bearer", "id_token": id_token("id-old"),
        "scope": "https://www.googleapis.com/auth/cloud-platform openid", "expiry_date": int((time.time() + expires_in_s) * 1000)},
        indent=2))
    path.chmod(0o600)
    return path


@pytest.fixture
def api(ca) -> Iterator[fake_api.Server]:
    server, _ = fake_api.start(tls=ca[1])
    # Google's answer to a refresh: a new access and id token, `expires_in`, and no new refresh token.
    server.oauth_tokens[REFRESH] = {"access_token": NEW_ACCESS, "expires_in": 3599, "token_type": "Bearer",
                                    "scope": "https://www.googleapis.com/auth/cloud-platform", "id_token": NEW_ID}
    yield server
    server.shutdown()


def pins(api: fake_api.Server) -> list[str]:
    port = api.server_address[1]
    return [a for n in NAMES for a in ("--allow-host", f"{n}:443=127.0.0.1:{port}")]


def seen_on(api: fake_api.Server, host: str) -> list[str]:
    return [h.get("authorization", "") for h in api.headers_seen if h.get("host") == host]


def refreshes(api: fake_api.Server) -> list[tuple[str, str]]:
    return [(r["body"], h.get("content-type", "")) for r, h in zip(api.requests, api.headers_seen, strict=True)
            if r["path"] == "/token"]


def test_the_shipped_route_refreshes_as_googles_form() -> None:
    assert ROUTE.login.refresh_body == RefreshBody.FORM and ROUTE.login.client_secret.startswith("GOCSPX-")
    assert ROUTE.upstream_host == API and ROUTE.login.refresh_url == f"https://{TOKENS}/token"
    assert dict(ROUTE.box_env) == {"CODE_ASSIST_ENDPOINT": "{url}", "GOOGLE_GENAI_USE_GCA": "true",
                                   "GOOGLE_CLOUD_ACCESS_TOKEN": "{placeholder}"}


# The proxy alone: a real EgressProxy, the login route, the host file.

@pytest.fixture
def login_proxy(ca, api, tmp_path: Path) -> Iterator[tuple[int, Path, Path]]:
    home = tmp_path / "home"
    home.mkdir()
    path = home / ".gemini" / "oauth_creds.json"
    route = replace(ROUTE, login=replace(ROUTE.login, file=str(path)))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    log = tmp_path / "log.jsonl"
    rules = tuple(parse_rule(f"{n}:443=127.0.0.1:{api.server_address[1]}") for n in NAMES)
    proxy = EgressProxy(listener, rules, DecisionLog(str(log), "gemini"), routes=(route,),
                        tls=ssl.create_default_context(cafile=str(ca[0])), notify=None)
    proxy.keys[route.name] = logins.LoginStore(str(path), route.login, str(home), proxy.open_tls,
                                               lock_dir=str(home / ".local" / "state" / "hive-relay"))
    proxy.start()
    yield listener.getsockname()[1], path, log
    proxy.stop()


def ask(port: int, path: str = "/google-login/v1internal:streamGenerateContent?alt=sse") -> bytes:
    body = json.dumps({"model": "gemini-2.5-pro", "project": "fake-project-1",
                       "request": {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:3128\r\nAuthorization: Bearer {PLACEHOLDER}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def test_the_route_sends_the_host_files_token_to_code_assist_only(api, login_proxy, report: Report) -> None:
    port, path, log = login_proxy
    write_login(path.parent.parent)
    answer = ask(port)
    works = (answer.startswith(b"HTTP/1.1 200") and fake_api.ANSWER.encode() in answer
             and seen_on(api, API) == [f"Bearer {ACCESS}"])
    report.legit(works)
    assert works, (answer[:300], api.headers_seen)
    assert refreshes(api) == [] and [e["route"] for e in entries(log)] == ["google-login"]
    assert MARK not in log.read_text() and MARK.encode() not in answer


@pytest.mark.parametrize("path", ["/google-login/v1/projects/p/locations", "/google-login/v1internalx:generateContent",
                                  "/google-login/upload/v1internal:x",
                                  "/google-login/v1internal:setCodeAssistGlobalUserSetting",
                                  "/google-login/v1internal:streamGenerateContentX"])
def test_paths_outside_code_assist_get_no_token(api, login_proxy, path: str, report: Report) -> None:
    """cloudcode-pa has more than the Code Assist methods gemini calls: the route carries those and its
    onboarding operations only (not the account setting a box could flip)."""
    port, home_file, _ = login_proxy
    write_login(home_file.parent.parent)
    answer = ask(port, path)
    blocked = answer.startswith(b"HTTP/1.1 403") and api.headers_seen == []
    report.attack(blocked)
    assert blocked, answer[:300]


def test_a_token_near_its_expiry_is_refreshed_on_the_host_as_a_form(api, login_proxy, report: Report) -> None:
    port, path, log = login_proxy
    write_login(path.parent.parent, expires_in_s=60)  # inside the refresh margin
    before = path.stat()
    answer = ask(port)
    data = json.loads(path.read_text())
    works = (answer.startswith(b"HTTP/1.1 200") and seen_on(api, API) == [f"Bearer {NEW_ACCESS}"]
             and (data["access_token"], data["refresh_token"], data["id_token"]) == (NEW_ACCESS, REFRESH, NEW_ID))
    report.legit(works)
    assert works, (answer[:300], seen_on(api, API), data)
    # Google's grant: a form with the CLI's public client id and secret, at oauth2.googleapis.com, once.
    [(body, kind)] = refreshes(api)
    assert kind == "application/x-www-form-urlencoded"
    assert dict(re.findall(r"([^&=]+)=([^&]*)", body)).keys() == {"grant_type", "refresh_token", "client_id", "client_secret"}
    from urllib.parse import parse_qs
    form = {k: v[0] for k, v in parse_qs(body).items()}
    assert form == {"grant_type": "refresh_token", "refresh_token": REFRESH, "client_id": ROUTE.login.client_id,
                    "client_secret": ROUTE.login.client_secret}
    assert [h["host"] for h in api.headers_seen] == [TOKENS, API]
    # Replaced atomically, same mode; the refresh token kept (Google sends none), expiry_date from expires_in.
    after = path.stat()
    assert after.st_ino != before.st_ino and stat.S_IMODE(after.st_mode) == 0o600
    assert abs(data["expiry_date"] / 1000 - (time.time() + 3599)) < 120 and data["token_type"] == "Bearer"
    assert MARK not in "".join(json.dumps(e) for e in entries(log, 2))
    ask(port)  # the new token is good for an hour: no second refresh
    assert len(refreshes(api)) == 1 and seen_on(api, API)[-1] == f"Bearer {NEW_ACCESS}"


def test_a_revoked_refresh_sends_nothing_and_leaves_the_host_file(api, login_proxy, report: Report) -> None:
    port, path, _ = login_proxy
    write_login(path.parent.parent, expires_in_s=-60)
    api.oauth_tokens.clear()
    original = path.read_bytes()
    answer = ask(port)
    blocked = (answer.startswith(b"HTTP/1.1 502") and b"log in again on the host" in answer
               and seen_on(api, API) == [] and path.read_bytes() == original)
    report.attack(blocked)
    assert blocked, answer[:300]
    assert MARK.encode() not in answer


def test_a_failed_refresh_is_not_retried_until_the_host_file_changes(api, login_proxy, report: Report) -> None:
    """A box cannot make the host post the real refresh token again and again (into Google's rate limits):
    after a failed refresh, requests get 502 at once until the host's file changes (a new login there)."""
    port, path, _ = login_proxy
    write_login(path.parent.parent, expires_in_s=-60)
    api.oauth_tokens.clear()
    answers = [ask(port) for _ in range(6)]
    blocked = all(a.startswith(b"HTTP/1.1 502") for a in answers) and len(refreshes(api)) == 1
    report.attack(blocked)
    assert blocked, (len(refreshes(api)), answers[-1][:300])
    assert b"log in again on the host" in answers[-1] and seen_on(api, API) == []
    # Twin: the user logs in again on the host (the file changes): the next request refreshes, and works.
    write_login(path.parent.parent, expires_in_s=-60)
    api.oauth_tokens[REFRESH] = {"access_token": NEW_ACCESS, "expires_in": 3599}
    answer = ask(port)
    works = answer.startswith(b"HTTP/1.1 200") and len(refreshes(api)) == 2 and seen_on(api, API) == [f"Bearer {NEW_ACCESS}"]
    report.legit(works)
    assert works, answer[:300]


def test_a_login_file_that_is_a_link_refuses_the_run(box: Sandbox, report: Report) -> None:
    """A dotfile manager's layout (`oauth_creds.json -> accounts/me.json`): nothing masks a link, and the
    box's copy of ~/.gemini would hold the target as it is. The run refuses; the file itself is the twin."""
    (box.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    real = write_login(box.home)
    target = box.home / ".gemini" / "accounts" / "me.json"
    target.parent.mkdir()
    real.rename(target)
    real.symlink_to("accounts/me.json")
    proc = box.relay("gemini", "--dry-run", "--json")
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    blocked = (proc.returncode == 3 and len(lines) == 1 and "~/.gemini/oauth_creds.json is a symbolic link" in proc.stderr
               and "HIVE_RELAY_LOGIN_IN_BOX_GEMINI=1" in proc.stderr and MARK not in proc.stdout + proc.stderr)
    report.attack(blocked)
    assert blocked, proc.stderr
    real.unlink()
    target.rename(real)
    proc = box.relay("gemini", "--dry-run", "--json")
    works = proc.returncode == 0 and json.loads(proc.stdout)["login_files"][str(real)]["held"] == "masked"
    report.legit(works)
    assert works, proc.stderr


def test_the_box_copy_holds_placeholders_of_the_logins_shape(tmp_path: Path) -> None:
    """What agentstate writes into the box (logins.mask, then the secret_files mask): the same keys,
    placeholders for both tokens, a parseable id token with the same claims, `expiry_date` in 2100."""
    original = json.loads(write_login(tmp_path).read_text())
    masked = logins.mask(json.dumps(original).encode(), ROUTE.login, PLACEHOLDER)
    masked, _ = credential_files.mask(masked, load_shipped()["gemini"].secret_files[0][1], keep=frozenset({PLACEHOLDER}))
    copy = json.loads(masked)
    assert MARK not in masked.decode() and copy.keys() == original.keys()
    assert copy["access_token"] == copy["refresh_token"] == PLACEHOLDER
    assert copy["expiry_date"] == logins.FAR_FUTURE_MS and copy["scope"] == original["scope"]
    claims, real = credential_files.jwt_claims(copy["id_token"]), credential_files.jwt_claims(original["id_token"])
    assert claims is not None and real is not None and claims["email"] == real["email"] == "dev@example.com"


def test_dry_run_routes_the_google_login_and_names_no_token(box: Sandbox) -> None:
    (box.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    path = write_login(box.home)
    proc = box.relay("gemini", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert [c["route"] for c in plan["credentials"]] == ["google-login"]
    assert plan["credentials"][0]["upstream"] == f"{API}:443"
    assert plan["login_files"][str(path)]["held"] == "masked"
    env = dict(plan["env_set"])
    assert env["CODE_ASSIST_ENDPOINT"] == "http://127.0.0.1:3128/google-login"
    assert env["GOOGLE_CLOUD_ACCESS_TOKEN"] == PLACEHOLDER and env["GOOGLE_GENAI_USE_GCA"] == "true"
    assert MARK not in proc.stdout + proc.stderr
    # Twin: the same login beside a key on the host: both routes, the file still masked, no refusal.
    proc = box.relay("gemini", "--dry-run", "--json", extra_env={"GEMINI_API_KEY": "AIzaSyREAL"})
    plan = json.loads(proc.stdout)
    assert [c["route"] for c in plan["credentials"]] == ["gemini", "google-login"], plan["credentials"]
    assert plan["login_files"][str(path)]["held"] == "masked"


# The real gemini CLI (tests/test_agents.py installs it) with a Google login on the host, refreshed
# by the proxy before the first request.

PROBE = """#!/bin/sh
echo "probe-proc=$(for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < "$f"; done 2>/dev/null | grep -c 'ONHO''ST')"
echo "probe-home=$(grep -rl 'ONHO''ST' "$HOME" /tmp 2>/dev/null | wc -l)"
echo "probe-seen=$(grep -rl 'hive-relay-placeholder' "$HOME" 2>/dev/null | wc -l)"
echo "probe-env=$GOOGLE_CLOUD_ACCESS_TOKEN"
"""
MODES = [pytest.param("local", marks=pytest.mark.box), pytest.param("container", marks=pytest.mark.container)]


@pytest.mark.parametrize("mode", MODES)
def test_real_gemini_turn_with_a_google_login_refreshed_on_the_host(mode_sandbox: Sandbox, ca, api, mode: str,
                                                                   report: Report) -> None:
    from ..test_agents import TOOLS
    from ..test_credential_turns import files_holding

    s = mode_sandbox
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    (s.home / ".gemini").mkdir(exist_ok=True)
    (s.home / ".gemini" / "settings.json").write_text(json.dumps({
        "security": {"auth": {"selectedType": "oauth-personal"}},
        "tools": {"allowed": ["run_shell_command(sh probe-creds.sh)"]}}))
    path = write_login(s.home, expires_in_s=60)  # the proxy refreshes it before the first request
    probe = s.workdir / "probe-creds.sh"
    probe.write_text(PROBE)
    probe.chmod(0o644)
    api.tool_command = "sh probe-creds.sh"
    proc = s.relay("gemini", mode, "--prompt", "say the answer", *pins(api), "--timeout", "240", timeout=300,
                   extra_env={"SSL_CERT_FILE": str(ca[0]), "HIVE_RELAY_TOOLS": TOOLS})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and fake_api.ANSWER in proc.stdout, (proc.stdout[-1500:], proc.stderr[-3000:])
    assert "credentials: in box" not in proc.stderr
    # Every Code Assist request went through the route with the refreshed real token; the host refreshed once.
    seen = seen_on(api, API)
    data = json.loads(path.read_text())
    works = bool(seen) and set(seen) == {f"Bearer {NEW_ACCESS}"} and data["access_token"] == NEW_ACCESS
    report.legit(works)
    assert works, (seen, data)
    assert [parse_refresh(b) for b, _ in refreshes(api)] == [REFRESH]  # the host's, once; none from the box
    assert {h["host"] for h in api.headers_seen} <= {API, TOKENS}, {h["host"] for h in api.headers_seen}
    paths = {r["path"].partition("?")[0] for r in api.requests if r["host"] == API}
    assert {"/v1internal:loadCodeAssist", "/v1internal:streamGenerateContent"} <= paths, paths
    # The box saw only placeholders (and did see them): the probe's answer came back in the next request.
    bodies = "\n".join(r["body"] for r in api.requests if r["host"] == API)
    found = dict(re.findall(r"probe-(proc|home|seen|env)=([\w-]*)", bodies))
    blocked = (found.get("proc") == "0" and found.get("home") == "0" and int(found.get("seen", "0")) >= 1
               and found.get("env") == PLACEHOLDER)
    report.attack(blocked)
    assert blocked, (found, bodies[-2000:])
    assert MARK not in bodies and MARK not in out
    # The new token is only in the host's own file; the box's copy never came back over it.
    assert files_holding(s.home, NEW_ACCESS.encode()) == [str(path)]
    assert files_holding(s.workdir, MARK.encode()) == []


def parse_refresh(body: str) -> str:
    from urllib.parse import parse_qs

    return parse_qs(body)["refresh_token"][0]
