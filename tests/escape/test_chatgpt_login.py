"""codex's ChatGPT login stays on the host: the box's copy of `~/.codex/auth.json` holds JWTs of the same
shape (claims kept, `exp` in 2100, a random signature) and a placeholder refresh token; the proxy's
`chatgpt-login` route sends the host file's real access token to chatgpt.com only, and refreshes it on
the host (at auth.openai.com) when the token's own JWT `exp` is near.

The backend and the token endpoint are one fake (tests/fake_api.py) speaking TLS under the real names
with the session's throwaway CA, reached through pinned `--allow-host NAME:443=127.0.0.1:PORT` entries.
Every real token carries MARK only in its signature (the part no placeholder shares): MARK found
anywhere the box can see is a leak, and the placeholder found there proves the scan was not blind.
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
from relay.trust import logins

from .. import fake_api
from ..conftest import Sandbox
from .conftest import Report
from .test_credentials import entries

NAMES = ("chatgpt.com", "auth.openai.com", "api.openai.com")
PLACEHOLDER = "hive-relay-placeholder"
MARK = "ONHOST"
ROUTE = next(r for r in load_shipped()["codex"].credentials if r.name == "chatgpt-login")
assert ROUTE.login is not None
CLIENT_ID = ROUTE.login.client_id
ACCOUNT = "d9a4c6f0-1b2c-4d5e-8f90-123456789abc"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt(claims: dict, tag: str) -> str:
    """A JWT as OpenAI's login issues them (RS256 header, its claims), MARK and `tag` in the signature."""
    head = _b64(json.dumps({"alg": "RS256", "kid": "key-1", "typ": "JWT"}).encode())
    sig = f"{MARK}{tag}" + _b64(secrets.token_bytes(250))
    return f"{head}.{_b64(json.dumps(claims).encode())}.{sig}"


def auth_claims() -> dict:
    return {"chatgpt_account_id": ACCOUNT, "chatgpt_plan_type": "plus", "chatgpt_user_id": "user-abc",
            "user_id": "user-abc"}


def access_token(exp: int, tag: str) -> str:
    now = int(time.time())
    return jwt({"aud": ["https://api.openai.com/v1"], "client_id": CLIENT_ID, "exp": exp,
                "https://api.openai.com/auth": auth_claims(),
                "https://api.openai.com/profile": {"email": "dev@example.com", "email_verified": True},
                "iat": now, "iss": "https://auth.openai.com", "jti": "jti-1", "nbf": now,
                "scp": ["openid", "profile", "email", "offline_access"], "session_id": "authsess_1", "sub": "auth0|u1"},
               tag)


def id_token(tag: str) -> str:
    now = int(time.time())
    return jwt({"aud": [CLIENT_ID], "email": "dev@example.com", "email_verified": True, "exp": now + 3600,
                "https://api.openai.com/auth": auth_claims(), "iat": now, "iss": "https://auth.openai.com",
                "sub": "auth0|u1"}, tag)


ACCESS = access_token(int(time.time()) + 10 * 86400, "access-old")
REFRESH = f"rt_{MARK}-refresh-old-" + _b64(secrets.token_bytes(30))
NEW_ACCESS = access_token(int(time.time()) + 10 * 86400, "access-new")
NEW_ID = id_token("id-new")
NEW_REFRESH = f"rt_{MARK}-refresh-new-" + _b64(secrets.token_bytes(30))
OLD_REFRESH_TIME = "2026-10-01T00:00:00.000000Z"


def write_login(home: Path, access: str = ACCESS) -> Path:
    path = home / ".codex" / "auth.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"OPENAI_API_KEY": None, "tokens": {
        "id_token": id_token("id-old"), "access_token": access, "refresh_token": REFRESH, "account_id": ACCOUNT},
        "last_refresh": OLD_REFRESH_TIME}))
    path.chmod(0o600)
    return path


def near_expiry() -> str:
    return access_token(int(time.time()) + 60, "access-old")  # inside the refresh margin


@pytest.fixture
def api(ca) -> Iterator[fake_api.Server]:
    server, _ = fake_api.start(tls=ca[1])
    server.oauth_tokens[REFRESH] = {"access_token": NEW_ACCESS, "id_token": NEW_ID, "refresh_token": NEW_REFRESH}
    yield server
    server.shutdown()


def pins(api: fake_api.Server) -> list[str]:
    port = api.server_address[1]
    return [a for n in NAMES for a in ("--allow-host", f"{n}:443=127.0.0.1:{port}")]


def seen_on(api: fake_api.Server, host: str) -> list[str]:
    return [h.get("authorization", "") for h in api.headers_seen if h.get("host") == host]


def refreshes(api: fake_api.Server) -> list[dict]:
    return [json.loads(r["body"]) for r in api.requests if r["path"] == "/oauth/token"]


# The proxy alone: a real EgressProxy, the login route, the host file.

@pytest.fixture
def login_proxy(ca, api, tmp_path: Path) -> Iterator[tuple[int, Path, Path]]:
    home = tmp_path / "home"
    home.mkdir()
    path = home / ".codex" / "auth.json"
    route = replace(ROUTE, login=replace(ROUTE.login, file=str(path)))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    log = tmp_path / "log.jsonl"
    rules = tuple(parse_rule(f"{n}:443=127.0.0.1:{api.server_address[1]}") for n in NAMES)
    proxy = EgressProxy(listener, rules, DecisionLog(str(log), "codex"), routes=(route,),
                        tls=ssl.create_default_context(cafile=str(ca[0])), notify=None)
    proxy.keys[route.name] = logins.LoginStore(str(path), route.login, str(home), proxy.open_tls,
                                               lock_dir=str(home / ".local" / "state" / "hive-relay"))
    proxy.start()
    yield listener.getsockname()[1], path, log
    proxy.stop()


def ask(port: int, path: str = "/chatgpt-login/backend-api/codex/responses", token: str = PLACEHOLDER) -> bytes:
    body = b'{"model": "m", "stream": true, "input": []}'
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:3128\r\nAuthorization: Bearer {token}\r\n"
                     f"chatgpt-account-id: {ACCOUNT}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def test_the_route_sends_the_host_files_access_token_to_chatgpt_only(api, login_proxy, report: Report) -> None:
    port, path, log = login_proxy
    write_login(path.parent.parent)
    answer = ask(port)
    seen = [h for h in api.headers_seen if h.get("host") == "chatgpt.com"]
    works = (answer.startswith(b"HTTP/1.1 200") and b"response.completed" in answer
             and [h["authorization"] for h in seen] == [f"Bearer {ACCESS}"])
    report.legit(works)
    assert works, (answer[:300], seen)
    # codex's account header passes as the box sent it: the box's id token claims name the same account.
    assert seen[0]["chatgpt-account-id"] == ACCOUNT and seen[0]["accept-encoding"] == "identity"
    assert refreshes(api) == [] and [e["route"] for e in entries(log)] == ["chatgpt-login"]
    assert MARK not in log.read_text() and MARK.encode() not in answer


def test_paths_outside_codexs_own_api_get_no_token(api, login_proxy, report: Report) -> None:
    """chatgpt.com has more than codex's API under /backend-api/ (file uploads, conversations): the
    route carries only /backend-api/codex/ and /backend-api/wham/."""
    port, path, _ = login_proxy
    write_login(path.parent.parent)
    answer = ask(port, "/chatgpt-login/backend-api/files")
    blocked = answer.startswith(b"HTTP/1.1 403") and api.headers_seen == []
    report.attack(blocked)
    assert blocked, answer[:300]


def test_a_token_near_its_jwt_expiry_is_refreshed_on_the_host(api, login_proxy, report: Report) -> None:
    port, path, log = login_proxy
    write_login(path.parent.parent, near_expiry())
    before = path.stat()
    answer = ask(port)
    data = json.loads(path.read_text())
    tokens = data["tokens"]
    works = (answer.startswith(b"HTTP/1.1 200") and seen_on(api, "chatgpt.com") == [f"Bearer {NEW_ACCESS}"]
             and (tokens["access_token"], tokens["refresh_token"], tokens["id_token"]) == (NEW_ACCESS, NEW_REFRESH, NEW_ID))
    report.legit(works)
    assert works, (answer[:300], seen_on(api, "chatgpt.com"), tokens)
    # OpenAI's refresh grant: JSON {grant_type, refresh_token, client_id} at auth.openai.com, once.
    assert refreshes(api) == [{"grant_type": "refresh_token", "refresh_token": REFRESH, "client_id": CLIENT_ID}]
    assert [h["host"] for h in api.headers_seen] == ["auth.openai.com", "chatgpt.com"]
    # Replaced atomically, same mode; the account kept, last_refresh now (codex's own form).
    after = path.stat()
    assert after.st_ino != before.st_ino and stat.S_IMODE(after.st_mode) == 0o600
    assert tokens["account_id"] == ACCOUNT and data["OPENAI_API_KEY"] is None
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", data["last_refresh"])
    assert data["last_refresh"] > OLD_REFRESH_TIME and data["last_refresh"][:4] == time.strftime("%Y", time.gmtime())
    assert MARK not in "".join(json.dumps(e) for e in entries(log, 2))
    ask(port)  # the new token's exp is days ahead: no second refresh
    assert len(refreshes(api)) == 1 and seen_on(api, "chatgpt.com")[-1] == f"Bearer {NEW_ACCESS}"


def test_a_revoked_refresh_sends_nothing_and_leaves_the_host_file(api, login_proxy, report: Report) -> None:
    port, path, _ = login_proxy
    write_login(path.parent.parent, access_token(int(time.time()) - 60, "access-old"))
    api.oauth_tokens.clear()
    original = path.read_bytes()
    answer = ask(port)
    blocked = (answer.startswith(b"HTTP/1.1 502") and b"log in again on the host" in answer
               and seen_on(api, "chatgpt.com") == [] and path.read_bytes() == original)
    report.attack(blocked)
    assert blocked, answer[:300]
    assert MARK.encode() not in answer


def test_the_box_copy_keeps_the_login_shape_with_placeholders() -> None:
    """What agentstate writes into the box (logins.mask, then the secret_files mask): parseable JWTs with
    the same claims and `exp` in 2100 (codex refreshes on a passed `exp`), a placeholder refresh token,
    last_refresh now, the account id kept; nothing of a real token's signature."""
    original = {"OPENAI_API_KEY": None, "tokens": {"id_token": id_token("id-old"), "access_token": near_expiry(),
                                                   "refresh_token": REFRESH, "account_id": ACCOUNT},
                "last_refresh": OLD_REFRESH_TIME}
    masked = logins.mask(json.dumps(original).encode(), ROUTE.login, PLACEHOLDER)
    masked, _ = credential_files.mask(masked, load_shipped()["codex"].secret_files[0][1], keep=frozenset({PLACEHOLDER}))
    copy = json.loads(masked)
    assert MARK not in masked.decode()
    tokens = copy["tokens"]
    assert tokens["refresh_token"] == PLACEHOLDER and tokens["account_id"] == ACCOUNT
    for name in ("access_token", "id_token"):
        claims = credential_files.jwt_claims(tokens[name])
        real = credential_files.jwt_claims(original["tokens"][name])
        assert claims is not None and real is not None
        assert claims["exp"] == credential_files.FAR_FUTURE_S
        assert {k: v for k, v in claims.items() if k != "exp"} == {k: v for k, v in real.items() if k != "exp"}
        assert tokens[name].split(".")[0] == original["tokens"][name].split(".")[0]
    assert copy["last_refresh"] > OLD_REFRESH_TIME


# In the real box: a shell in codex's box (the sandbox's sh override), then the real codex CLI.

SCRIPT = r"""
for f in /proc/[0-9]*/environ; do tr '\0' '\n' < "$f"; done 2>/dev/null | grep -c ONHO''ST || true
grep -rl ONHO''ST "$HOME" /tmp 2>/dev/null | wc -l
grep -rl hive-relay-placeholder "$HOME" 2>/dev/null | wc -l
tr -d '\n' < "$HOME/.codex/auth.json"; echo
TOKEN=$(sed 's/.*"access_token": *"\([^"]*\)".*/\1/' "$HOME/.codex/auth.json")
curl -s -H "Authorization: Bearer $TOKEN" -H 'chatgpt-account-id: d9a4c6f0-1b2c-4d5e-8f90-123456789abc' \
     -H 'content-type: application/json' -d '{"model": "m", "stream": true, "input": []}' \
     http://127.0.0.1:3128/chatgpt-login/backend-api/codex/responses | grep -c '^event: response.completed'
curl -sk -o /dev/null -w 'other=%{http_code}\n' -H "Authorization: Bearer $TOKEN" -H 'content-type: application/json' \
     -d '{"model": "m", "input": []}' https://api.openai.com/v1/responses
"""


@pytest.fixture(params=["local", "container"])
def any_box(request: pytest.FixtureRequest) -> tuple[Sandbox, str]:
    if request.param == "container":
        return request.getfixturevalue("csandbox"), "container"
    return request.getfixturevalue("box"), "local"


def test_box_with_a_chatgpt_login_holds_placeholders_only(any_box, ca, api, report: Report) -> None:
    box, mode = any_box
    path = write_login(box.home)
    proc = box.relay("codex", mode, "--quiet", "--prompt", SCRIPT, *pins(api),
                     extra_env={"SSL_CERT_FILE": str(ca[0])}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    copy = json.loads(lines[3])
    claims = credential_files.jwt_claims(copy["tokens"]["access_token"]) or {}
    # attack: no process's environment, no file under $HOME or /tmp holds a real token; the placeholder is there.
    blocked = (lines[:2] == ["0", "0"] and int(lines[2]) >= 1 and copy["tokens"]["refresh_token"] == PLACEHOLDER
               and claims.get("exp") == credential_files.FAR_FUTURE_S and MARK not in proc.stdout + proc.stderr)
    report.attack(blocked)
    assert blocked, proc.stdout
    # legit: the route's request reached chatgpt.com with the host's real token.
    works = lines[4] == "1" and seen_on(api, "chatgpt.com") == [f"Bearer {ACCESS}"]
    report.legit(works)
    assert works, (lines[4:], api.headers_seen)
    # attack twin: the placeholder sent to another host (allowed, but not the login's) stays a placeholder.
    other = seen_on(api, "api.openai.com")
    twin = lines[5] == "other=200" and other == [f"Bearer {copy['tokens']['access_token']}"] and MARK not in other[0]
    report.attack(twin)
    assert twin, (lines[5:], other)
    assert json.loads(path.read_text())["tokens"]["access_token"] == ACCESS  # the host's file as it was


def test_dry_run_routes_the_chatgpt_login_and_names_no_token(box: Sandbox) -> None:
    (box.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    write_login(box.home)
    proc = box.relay("codex", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert [c["route"] for c in plan["credentials"]] == ["chatgpt-login"]
    assert plan["credentials"][0]["upstream"] == "chatgpt.com:443"
    assert plan["login_files"][str(box.home / ".codex" / "auth.json")]["held"] == "masked"
    assert "model_providers.hive-relay-chatgpt.base_url=http://127.0.0.1:3128/chatgpt-login/backend-api/codex" in proc.stdout
    assert MARK not in proc.stdout + proc.stderr
    # An API-key login in the same file is its own route (the ChatGPT flags are not added).
    (box.home / ".codex" / "auth.json").write_text(json.dumps({"OPENAI_API_KEY": "sk-proj-abc", "tokens": None}))
    plan = json.loads(box.relay("codex", "--dry-run", "--json").stdout)
    assert [c["route"] for c in plan["credentials"]] == ["openai-login"]
    assert "hive-relay-chatgpt" not in json.dumps(plan)
    # A ChatGPT login with a key left in the file (older logins kept both): codex goes by `auth_mode`,
    # so the ChatGPT route carries, and with `auth_mode: apikey` the key's route does (both masked).
    write_login(box.home)
    login = json.loads((box.home / ".codex" / "auth.json").read_text())
    for mode, route in (("chatgpt", "chatgpt-login"), ("apikey", "openai-login")):
        (box.home / ".codex" / "auth.json").write_text(json.dumps({**login, "OPENAI_API_KEY": "sk-proj-abc",
                                                                   "auth_mode": mode}))
        plan = json.loads(box.relay("codex", "--dry-run", "--json").stdout)
        assert [c["route"] for c in plan["credentials"]] == [route], (mode, plan["credentials"])
        assert plan["login_files"][str(box.home / ".codex" / "auth.json")]["held"] == "masked"


# The real codex CLI (tests/test_agents.py installs it) with a ChatGPT login on the host.

PROBE = """#!/bin/sh
echo "probe-proc=$(for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < "$f"; done 2>/dev/null | grep -c 'ONHO''ST')"
echo "probe-home=$(grep -rl 'ONHO''ST' "$HOME" /tmp 2>/dev/null | wc -l)"
echo "probe-seen=$(grep -rl 'hive-relay-placeholder' "$HOME" 2>/dev/null | wc -l)"
"""
MODES = [pytest.param("local", marks=pytest.mark.box), pytest.param("container", marks=pytest.mark.container)]


@pytest.mark.parametrize("mode", MODES)
def test_real_codex_turn_with_a_chatgpt_login_refreshed_on_the_host(mode_sandbox: Sandbox, ca, api, mode: str,
                                                                    report: Report) -> None:
    from ..test_agents import TOOLS
    from ..test_credential_turns import files_holding

    s = mode_sandbox
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    path = write_login(s.home, near_expiry())  # the proxy refreshes it before the first request
    probe = s.workdir / "probe-creds.sh"
    probe.write_text(PROBE)
    probe.chmod(0o644)
    api.tool_command = "sh probe-creds.sh"
    proc = s.relay("codex", mode, "--prompt", "say the answer", *pins(api), "--timeout", "240", timeout=300,
                   extra_env={"SSL_CERT_FILE": str(ca[0]), "HIVE_RELAY_TOOLS": TOOLS})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and fake_api.ANSWER in proc.stdout, (proc.stdout[-1500:], proc.stderr[-3000:])
    assert "credentials: in box" not in proc.stderr
    # Every request codex made went through the route to chatgpt.com, with the refreshed real token.
    seen = seen_on(api, "chatgpt.com")
    data = json.loads(path.read_text())["tokens"]
    works = (bool(seen) and set(seen) == {f"Bearer {NEW_ACCESS}"} and data["access_token"] == NEW_ACCESS
             and data["refresh_token"] == NEW_REFRESH and data["id_token"] == NEW_ID)
    report.legit(works)
    assert works, (seen, data)
    assert {h["host"] for h in api.headers_seen} == {"chatgpt.com", "auth.openai.com"}
    assert [r["refresh_token"] for r in refreshes(api)] == [REFRESH]  # the host's refresh, once; none from the box
    assert all(h.get("chatgpt-account-id") == ACCOUNT for h in api.headers_seen if h.get("host") == "chatgpt.com")
    assert not any(h.get("content-encoding") for h in api.headers_seen)
    paths = {r["path"].partition("?")[0] for r in api.requests if r["host"] == "chatgpt.com"}
    assert "/backend-api/codex/responses" in paths, paths
    # The box saw only placeholders (and did see them): the probe's answer came back in the next request.
    bodies = "\n".join(r["body"] for r in api.requests if r["host"] == "chatgpt.com")  # not the host's refresh
    found = dict(re.findall(r"probe-(proc|home|seen)=(\d+)", bodies))
    blocked = found.get("proc") == "0" and found.get("home") == "0" and int(found.get("seen", "0")) >= 1
    report.attack(blocked)
    assert blocked, (found, bodies[-2000:])
    assert MARK not in bodies and MARK not in out
    # The new tokens are only in the host's own file; the box's copy never came back over it.
    assert files_holding(s.home, NEW_ACCESS.encode()) == [str(path)]
    assert files_holding(s.workdir, MARK.encode()) == []
