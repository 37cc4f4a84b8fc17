"""OAuth logins stay on the host: the box's copy of claude's login holds placeholders, the proxy
injects the real access token and refreshes it on the host; claude's OAuth-token variables are
routes like the API key.

The API and the OAuth token endpoint are one fake (tests/fake_api.py) speaking TLS under the real
names (api.anthropic.com, platform.claude.com) with a throwaway CA, reached through pinned
`--allow-host NAME:443=127.0.0.1:PORT` entries: the proxy verifies them as it would the real ones.
The fake's token endpoint answers only a refresh token it was told about, as the real one does.
"""

from __future__ import annotations

import json
import socket
import ssl
import stat
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from relay.config.load import load_shipped
from relay.egress.decision_log import DecisionLog
from relay.egress.proxy import EgressProxy
from relay.model.allow_rules import parse_rule
from relay.trust import logins

from .. import fake_api
from ..conftest import Sandbox
from .conftest import Report
from .test_credentials import entries

NAMES = ("api.anthropic.com", "platform.claude.com")
PLACEHOLDER = "hive-relay-placeholder"
ACCESS = "sk-ant-oat01-ONHOST-access-old"
REFRESH = "sk-ant-ort01-ONHOST-refresh-old"
NEW_ACCESS = "sk-ant-oat01-ONHOST-access-new"
NEW_REFRESH = "sk-ant-ort01-ONHOST-refresh-new"
MARK = "ONHOST"  # in every real token: found anywhere the box can see, it is a leak
ROUTE = next(r for r in load_shipped()["claude"].credentials if r.name == "anthropic-login")
CLIENT_ID = ROUTE.login.client_id if ROUTE.login else ""


@pytest.fixture
def api(ca) -> Iterator[fake_api.Server]:
    server, _ = fake_api.start(tls=ca[1])
    server.oauth_tokens[REFRESH] = {"access_token": NEW_ACCESS, "refresh_token": NEW_REFRESH, "expires_in": 28800,
                                    "token_type": "Bearer"}
    yield server
    server.shutdown()


def write_login(home: Path, expires_ms: int) -> Path:
    path = home / ".claude" / ".credentials.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"claudeAiOauth": {"accessToken": ACCESS, "refreshToken": REFRESH, "expiresAt": expires_ms,
                                                  "scopes": ["user:inference", "user:profile"],
                                                  "subscriptionType": "max"}}))
    path.chmod(0o600)
    return path


def later() -> int:
    return int((time.time() + 3600) * 1000)


def expired() -> int:
    return int((time.time() - 60) * 1000)


def pins(api: fake_api.Server) -> list[str]:
    port = api.server_address[1]
    return [a for n in NAMES for a in ("--allow-host", f"{n}:443=127.0.0.1:{port}")]


def tokens_seen(api: fake_api.Server) -> list[str]:
    return [h.get("authorization", "") for h in api.headers_seen if h.get("host") == "api.anthropic.com"]


# The proxy alone: a real EgressProxy, the login route, the host file.

@pytest.fixture
def proxies(ca, api, tmp_path: Path) -> Iterator[Callable[[], tuple[int, Path, Path]]]:
    """proxies(): a proxy (as one launcher starts it) serving the login route of one host home,
    with its own log and the host's lock dir: (port, the host's login file, the log)."""
    home = tmp_path / "home"
    home.mkdir()
    path = home / ".claude" / ".credentials.json"
    route = replace(ROUTE, login=replace(ROUTE.login, file=str(path)))
    started: list[EgressProxy] = []

    def make() -> tuple[int, Path, Path]:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        log = tmp_path / f"log-{len(started)}.jsonl"
        rules = tuple(parse_rule(f"{n}:443=127.0.0.1:{api.server_address[1]}") for n in NAMES)
        proxy = EgressProxy(listener, rules, DecisionLog(str(log), "claude"), routes=(route,),
                            tls=ssl.create_default_context(cafile=str(ca[0])), notify=None)
        proxy.keys[route.name] = logins.LoginStore(str(path), route.login, str(home), proxy.open_tls,
                                                   lock_dir=str(home / ".local" / "state" / "hive-relay"))
        proxy.start()
        started.append(proxy)
        return listener.getsockname()[1], path, log

    yield make
    for proxy in started:
        proxy.stop()


@pytest.fixture
def login_proxy(proxies) -> tuple[int, Path, Path]:
    return proxies()


def ask(port: int, token: str = PLACEHOLDER) -> bytes:
    body = b'{"model": "m", "max_tokens": 1, "messages": []}'
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /anthropic-login/v1/messages HTTP/1.1\r\nHost: 127.0.0.1:3128\r\nAuthorization: Bearer "
                     + token.encode() + b"\r\nanthropic-beta: oauth-2025-04-20\r\nx-api-key: other\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def test_the_login_route_sends_the_host_files_token(api, login_proxy, report: Report) -> None:
    port, path, log = login_proxy
    write_login(path.parent.parent, later())
    answer = ask(port)
    seen = [h for h in api.headers_seen if h.get("host") == "api.anthropic.com"]
    works = answer.startswith(b"HTTP/1.1 200") and [h["authorization"] for h in seen] == [f"Bearer {ACCESS}"]
    report.legit(works)
    assert works, (answer, seen)
    # The client's other headers pass (claude's OAuth beta flag); its credential headers do not.
    assert seen[0]["anthropic-beta"] == "oauth-2025-04-20" and "x-api-key" not in seen[0]
    assert [e["route"] for e in entries(log)] == ["anthropic-login"] and MARK not in log.read_text()
    assert json.loads(path.read_text())["claudeAiOauth"]["accessToken"] == ACCESS


def test_an_expired_token_is_refreshed_on_the_host_and_the_file_updated(api, login_proxy, report: Report) -> None:
    port, path, log = login_proxy
    write_login(path.parent.parent, expired())
    before = path.stat()
    answer = ask(port)
    refreshes = [r for r in api.requests if r["path"] == "/v1/oauth/token"]
    data = json.loads(path.read_text())["claudeAiOauth"]
    works = (answer.startswith(b"HTTP/1.1 200") and tokens_seen(api) == [f"Bearer {NEW_ACCESS}"]
             and data["accessToken"] == NEW_ACCESS and data["refreshToken"] == NEW_REFRESH)
    report.legit(works)
    assert works, (answer, tokens_seen(api), data)
    assert len(refreshes) == 1 and json.loads(refreshes[0]["body"]) == {
        "grant_type": "refresh_token", "refresh_token": REFRESH, "client_id": CLIENT_ID}
    assert [h["host"] for h in api.headers_seen] == ["platform.claude.com", "api.anthropic.com"]
    # Atomically replaced (a new inode), same mode, the rest of the file kept, the expiry moved on.
    after = path.stat()
    assert after.st_ino != before.st_ino and stat.S_IMODE(after.st_mode) == 0o600
    assert data["subscriptionType"] == "max" and data["expiresAt"] > time.time() * 1000 + 3600_000
    assert not [p for p in path.parent.iterdir() if p.name != path.name]  # no temporary left behind
    # Logged as a use of the token endpoint; no token in the log. A second request needs no refresh.
    text = "".join(json.dumps(e) for e in entries(log, 2))
    assert '"login_refresh": true' in text and MARK not in text
    ask(port)
    assert len([r for r in api.requests if r["path"] == "/v1/oauth/token"]) == 1
    assert tokens_seen(api)[-1] == f"Bearer {NEW_ACCESS}"


def test_a_refused_refresh_sends_nothing_and_leaves_the_host_file(api, login_proxy, report: Report) -> None:
    port, path, _ = login_proxy
    write_login(path.parent.parent, expired())
    api.oauth_tokens.clear()  # the refresh token was revoked
    original = path.read_bytes()
    answer = ask(port)
    blocked = answer.startswith(b"HTTP/1.1 502") and b"log in again on the host" in answer and tokens_seen(api) == []
    report.attack(blocked)
    assert blocked, answer
    assert path.read_bytes() == original and MARK.encode() not in answer


def test_a_refresh_answer_without_a_token_changes_nothing(api, login_proxy, report: Report) -> None:
    port, path, _ = login_proxy
    write_login(path.parent.parent, expired())
    api.oauth_tokens[REFRESH] = {"token_type": "Bearer", "refresh_token": NEW_REFRESH}  # 200, but no access token
    original = path.read_bytes()
    answer = ask(port)
    blocked = answer.startswith(b"HTTP/1.1 502") and b"gave no access token" in answer and tokens_seen(api) == []
    report.attack(blocked)
    assert blocked, answer
    assert path.read_bytes() == original


def test_boxes_refreshing_at_once_use_the_refresh_token_once(api, proxies, report: Report) -> None:
    """The refresh token is single use (rotated): four launchers' proxies, each asked twice at once
    with the host's token expired, refresh once between them and all inject the new token."""
    ports = [proxies() for _ in range(4)]
    write_login(ports[0][1].parent.parent, expired())
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: ask(p[0]), ports + ports))
    works = (all(a.startswith(b"HTTP/1.1 200") for a in answers) and len(tokens_seen(api)) == 8
             and set(tokens_seen(api)) == {f"Bearer {NEW_ACCESS}"})
    report.legit(works)
    assert works, ([a[:40] for a in answers], tokens_seen(api))
    assert len([r for r in api.requests if r["path"] == "/v1/oauth/token"]) == 1


def test_a_login_file_behind_a_link_is_not_read(api, login_proxy, tmp_path: Path, report: Report) -> None:
    port, path, _ = login_proxy
    elsewhere = write_login(tmp_path / "elsewhere", later())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(elsewhere)
    answer = ask(port)
    blocked = answer.startswith(b"HTTP/1.1 502") and tokens_seen(api) == []
    report.attack(blocked)
    assert blocked, answer


def test_a_margin_refreshes_early_and_the_host_file_gets_the_real_expiry(api, ca, tmp_path: Path) -> None:
    """kube mode needs a token good for the whole run (relay/modes/kube_secrets.py): a store with a margin
    refreshes a token that would expire inside it, and the host file gets the expiry the token
    endpoint gave (now + expires_in), not one shifted by the margin; the twin: a token good past the
    margin is used as it is, with no refresh."""
    home = tmp_path / "home"
    path = home / ".claude" / ".credentials.json"
    route = replace(ROUTE, login=replace(ROUTE.login, file=str(path)))
    context = ssl.create_default_context(cafile=str(ca[0]))

    def opener(host: str, port: int) -> ssl.SSLSocket:
        return context.wrap_socket(socket.create_connection(("127.0.0.1", api.server_address[1]), timeout=10),
                                   server_hostname=host)

    margin = 2400.0
    write_login(home, int((time.time() + 3 * 3600) * 1000))  # good past the margin: no refresh
    store = logins.LoginStore(str(path), route.login, str(home), opener, margin=margin)
    assert store() == ACCESS and store.refreshed == 0
    write_login(home, int((time.time() + 1200) * 1000))  # expires inside the margin: refreshed now
    before = time.time()
    assert store() == NEW_ACCESS and store.refreshed == 1
    expires = store.expires_at()
    assert expires is not None and before + 28800 - 5 <= expires <= time.time() + 28800 + 5
    assert json.loads(path.read_text())["claudeAiOauth"]["expiresAt"] == int(expires * 1000)


def test_mask_keeps_the_login_shape_with_placeholders() -> None:
    raw = json.dumps({"claudeAiOauth": {"accessToken": ACCESS, "refreshToken": REFRESH, "expiresAt": 1,
                                        "scopes": ["user:inference"]}, "other": 1}).encode()
    masked = json.loads(logins.mask(raw, ROUTE.login, PLACEHOLDER))
    assert masked == {"claudeAiOauth": {"accessToken": PLACEHOLDER, "refreshToken": PLACEHOLDER,
                                        "expiresAt": logins.FAR_FUTURE_MS, "scopes": ["user:inference"]}, "other": 1}
    for bad in (b"not json", b"{}", b'{"claudeAiOauth": {"accessToken": 5}}'):
        with pytest.raises(logins.LoginError) as err:
            logins.mask(bad, ROUTE.login, PLACEHOLDER)
        assert MARK not in str(err.value)


# In the real box.

SCRIPT = r"""
echo "url=$ANTHROPIC_BASE_URL oauth=$CLAUDE_CODE_OAUTH_TOKEN token=$ANTHROPIC_AUTH_TOKEN"
for f in /proc/[0-9]*/environ; do tr '\0' '\n' < "$f"; done 2>/dev/null | grep -c ONHOST || true
grep -rl ONHOST "$HOME" /tmp 2>/dev/null | wc -l
cat "$HOME/.claude/.credentials.json" 2>/dev/null || printf 'no login file'; echo
curl -s -H "Authorization: Bearer $CLAUDE_CODE_OAUTH_TOKEN" -H 'anthropic-beta: oauth-2025-04-20' \
     -H 'content-type: application/json' -d '{"model": "m", "max_tokens": 1, "messages": []}' \
     "$ANTHROPIC_BASE_URL/v1/messages"; echo
"""


def run_box(box: Sandbox, ca, api: fake_api.Server, script: str, env: dict[str, str] | None = None,
            mode: str = "local"):
    return box.relay("claude", mode, "--quiet", "--prompt", script, *pins(api),
                     extra_env={"SSL_CERT_FILE": str(ca[0]), **(env or {})}, timeout=300)


def assert_no_token_in_box(proc, lines: list[str]) -> None:
    assert lines[1:3] == ["0", "0"], proc.stdout  # no process's environment, no file in $HOME or /tmp
    assert MARK not in proc.stdout + proc.stderr


@pytest.fixture(params=["local", "container"])
def any_box(request: pytest.FixtureRequest) -> tuple[Sandbox, str]:
    """The box in each mode: local (bwrap) and container (podman, the user's image)."""
    if request.param == "container":
        return request.getfixturevalue("csandbox"), "container"
    return request.getfixturevalue("box"), "local"


def test_box_with_a_login_on_the_host_holds_placeholders_only(any_box, ca, api, report: Report) -> None:
    box, mode = any_box
    path = write_login(box.home, later())
    proc = run_box(box, ca, api, SCRIPT, mode=mode)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    copy = json.loads(lines[3])["claudeAiOauth"]
    in_box = (lines[0].startswith("url=http://127.0.0.1:3128/anthropic-login ")
              and copy["accessToken"] == copy["refreshToken"] == PLACEHOLDER and copy["expiresAt"] == logins.FAR_FUTURE_MS)
    report.attack(in_box and MARK not in proc.stdout + proc.stderr)
    assert in_box, proc.stdout
    assert_no_token_in_box(proc, lines)
    works = tokens_seen(api) == [f"Bearer {ACCESS}"] and "msg_fake" in lines[4]
    report.legit(works)
    assert works, (tokens_seen(api), lines[4:])
    # The host's file is as it was: the box's placeholder copy never comes back over it.
    assert json.loads(path.read_text())["claudeAiOauth"]["accessToken"] == ACCESS


@pytest.mark.parametrize("var, route", [("CLAUDE_CODE_OAUTH_TOKEN", "anthropic-oauth"),
                                        ("ANTHROPIC_AUTH_TOKEN", "anthropic-token")])
def test_token_variables_stay_on_the_host(box: Sandbox, ca, api, var: str, route: str, report: Report) -> None:
    proc = run_box(box, ca, api, SCRIPT, {var: ACCESS})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    shown = {"oauth": "", "token": ""}
    shown["oauth" if var == "CLAUDE_CODE_OAUTH_TOKEN" else "token"] = PLACEHOLDER
    in_box = lines[0] == f"url=http://127.0.0.1:3128/{route} oauth={shown['oauth']} token={shown['token']}"
    report.attack(in_box and MARK not in proc.stdout + proc.stderr)
    assert in_box, lines[0]
    assert_no_token_in_box(proc, lines)
    works = tokens_seen(api) == [f"Bearer {ACCESS}"] and "msg_fake" in lines[4]
    report.legit(works)
    assert works, (tokens_seen(api), lines[4:])


REFRESH_SCRIPT = SCRIPT + r"""
curl -sk -o /dev/null -w 'steal=%{http_code}\n' -H 'content-type: application/json' \
     -d "{\"grant_type\": \"refresh_token\", \"refresh_token\": \"$(sed 's/.*refreshToken\": *\"\([^\"]*\)\".*/\1/' "$HOME/.claude/.credentials.json")\", \"client_id\": \"x\"}" \
     https://platform.claude.com/v1/oauth/token
grep -rl ONHOST "$HOME" /tmp 2>/dev/null | wc -l
"""


def test_the_proxy_refreshes_an_expired_login_the_box_cannot(box: Sandbox, ca, api, report: Report) -> None:
    path = write_login(box.home, expired())
    proc = run_box(box, ca, api, REFRESH_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    refreshes = [json.loads(r["body"]) for r in api.requests if r["path"] == "/v1/oauth/token"]
    data = json.loads(path.read_text())["claudeAiOauth"]
    # legit: the request through the route got the refreshed token; the host file holds the new pair.
    works = (tokens_seen(api) == [f"Bearer {NEW_ACCESS}"] and "msg_fake" in lines[4]
             and (data["accessToken"], data["refreshToken"]) == (NEW_ACCESS, NEW_REFRESH))
    report.legit(works)
    assert works, (tokens_seen(api), lines[4:], data)
    # attack: the box posts what its copy holds as the refresh token to the real token endpoint.
    blocked = ([r["refresh_token"] for r in refreshes] == [REFRESH, PLACEHOLDER] and lines[5] == "steal=400"
               and lines[6] == "0")
    report.attack(blocked)
    assert blocked, (refreshes, lines[5:])
    assert_no_token_in_box(proc, lines)


def test_a_login_file_the_box_writes_never_replaces_the_hosts(any_box, ca, api, report: Report) -> None:
    box, mode = any_box
    path = write_login(box.home, later())
    original = path.read_bytes()
    fake = json.dumps({"claudeAiOauth": {"accessToken": "sk-ant-oat01-ATTACKER", "refreshToken": "x", "expiresAt": 1}})
    proc = run_box(box, ca, api, f"printf '%s' '{fake}' > $HOME/.claude/.credentials.json\n"
                                 "echo '{\"display\": \"kept\"}' >> $HOME/.claude/history.jsonl\n", mode=mode)
    assert proc.returncode == 0, proc.stderr[-2000:]
    blocked = path.read_bytes() == original
    report.attack(blocked)
    assert blocked
    # The box's version is kept aside for review, not lost; the legitimate state comes back as before.
    kept = list((box.home / ".local" / "state" / "hive-relay" / "kept").glob("*/.claude/.credentials.json"))
    assert [p.read_text() for p in kept] == [fake]
    works = (box.home / ".claude" / "history.jsonl").read_text() == '{"display": "kept"}\n'
    report.legit(works)
    assert works
    # accept-state never lays the box's copy over the real login: named, it is refused with the fix;
    # accepting the whole run takes the rest and says the login stays aside.
    run = kept[0].parent.parent.name
    named = box.relay("accept-state", run, "~/.claude/.credentials.json")
    assert named.returncode == 2 and "a login the host holds" in named.stderr and " login BACKEND" in named.stderr
    every = box.relay("accept-state", run)
    assert every.returncode == 0, every.stderr
    assert "left aside, never accepted: ~/.claude/.credentials.json" in every.stdout, every.stdout
    report.attack(path.read_bytes() == original)
    assert path.read_bytes() == original and kept[0].read_text() == fake


def test_dry_run_names_the_login_file_never_its_token(box: Sandbox, report: Report) -> None:
    write_login(box.home, later())
    proc = box.relay("claude", "--dry-run", "--json")
    plan = json.loads(proc.stdout)
    shown = plan["credentials"] == [{"route": "anthropic-login", "upstream": "api.anthropic.com:443",
                                     "send": "authorization-bearer", "from": [str(box.home / ".claude" / ".credentials.json")],
                                     "box_url": "http://127.0.0.1:3128/anthropic-login",
                                     "allows": {"methods": [], "paths": ["/v1/", "/api/"], "push": False, "git": False,
                                                "summary": "no git push; paths /v1/ /api/"}}]
    report.attack(shown and MARK not in proc.stdout + proc.stderr)
    assert shown, plan["credentials"]
    assert plan["env_set"]["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:3128/anthropic-login"


# codex's ChatGPT login, gemini's Google login and opencode's ChatGPT login are routed (tests/escape/
# test_chatgpt_login.py, test_google_login.py, tests/test_opencode_chatgpt.py); gemini's file without an access
# token is no login the route can read, and opencode's GitHub Copilot login has no route.
@pytest.mark.parametrize("backend, path, login", [
    ("gemini", ".gemini/oauth_creds.json", {"refresh_token": "y"}),
    ("opencode", ".local/share/opencode/auth.json", {"github-copilot": {"type": "oauth", "access": "x", "refresh": "y"}})])
def test_a_login_no_route_holds_is_refused_not_noted(box: Sandbox, backend: str, path: str, login: dict) -> None:
    (box.home / path).parent.mkdir(parents=True, exist_ok=True)
    (box.home / path).write_text(json.dumps(login))
    proc = box.relay(backend, "--dry-run")
    assert proc.returncode == 3 and f"~/{path} holds a login" in proc.stderr, proc.stdout + proc.stderr
    opt = f"HIVE_RELAY_LOGIN_IN_BOX_{backend.upper()}"
    proc = box.relay(backend, "--dry-run", extra_env={opt: "1"})  # the opt-in: in the box, and said so
    assert proc.returncode == 0 and f"credentials: in box for {backend}: ~/{path} is copied into the box as it is " \
        f"({opt}=1)" in proc.stdout + proc.stderr, proc.stdout


# The real claude CLI (tests/test_agents.py installs it) with a login on the host.

def test_real_claude_turn_with_an_expired_login_on_the_host(box: Sandbox, ca, api, report: Report) -> None:
    from ..test_agents import TOOLS

    (box.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    path = write_login(box.home, expired())
    proc = box.relay("claude", "local", "--prompt", "say the answer", *pins(api), "--timeout", "240", timeout=300,
                     extra_env={"SSL_CERT_FILE": str(ca[0]), "HIVE_RELAY_TOOLS": TOOLS})
    seen = tokens_seen(api)
    data = json.loads(path.read_text())["claudeAiOauth"]
    works = (proc.returncode == 0 and fake_api.ANSWER in proc.stdout and bool(seen)
             and all(t == f"Bearer {NEW_ACCESS}" for t in seen) and data["accessToken"] == NEW_ACCESS)
    report.legit(works)
    assert works, (seen, proc.stdout[-1500:], proc.stderr[-3000:])
    assert all("oauth-2025-04-20" in h.get("anthropic-beta", "") for h in api.headers_seen
               if h.get("host") == "api.anthropic.com" and h.get("authorization"))
    assert [json.loads(r["body"])["refresh_token"] for r in api.requests if r["path"] == "/v1/oauth/token"] == [REFRESH]
    assert MARK not in proc.stdout + proc.stderr
    assert ".credentials.json" not in proc.stderr  # claude left its placeholder copy alone: nothing kept aside


# opencode: its providers take their base URL from ANTHROPIC_BASE_URL / OPENAI_BASE_URL, so its keys
# are routes too (checked in its bundle: the AI SDK's `environmentVariableName: "ANTHROPIC_BASE_URL"`);
# its real turn with the key injected, in both modes, is in tests/test_credential_turns.py.
