"""The CLIs' other token stores in their state dirs get placeholders too, not only their logins:
MCP servers' and remote agents' OAuth (gemini's `mcp-oauth-tokens.json` and `a2a-oauth-tokens.json`, a
JSON list per server; opencode's `mcp-auth.json`; codex's `.credentials.json`), gemini's encrypted
keychain file (its key is the host and user name: not JSON, so never copied), and the dotenv files the
CLIs load at start (`~/.gemini/.env`, `~/.codex/.env`). Each is listed in `secret_files:`
(config/backends.yaml); the paths may use `*` over a list and `**` over any depth, a dotenv file's
paths are variable-name globs.

Attack: the box reads each file and finds no real value (MARK), and the real value stays only in the
host's file. Twin: the same file is there, with the placeholder and the non-secret fields as they were.
A store no route can hold (no API credential of that backend on the host) refuses the run (exit 3),
unless the backend's opt-in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relay.config.load import load_shipped
from relay.model import credential_files

from .conftest import Sandbox, require_box

MARK = "REALSECRET"
GEMINI_MCP = [{"serverName": "linear", "token": {"accessToken": f"lin_{MARK}_a1", "refreshToken": f"lin_{MARK}_r1",
                                                 "tokenType": "Bearer", "expiresAt": 1_900_000_000_000},
               "clientId": "client-kept", "tokenUrl": "https://mcp.linear.app/token", "updatedAt": 1},
              {"serverName": "notion", "token": {"accessToken": f"ntn_{MARK}_a2", "tokenType": "Bearer"},
               "clientId": "client-2", "updatedAt": 2}]
OPENCODE_MCP = {"linear": {"tokens": {"accessToken": f"lin_{MARK}_a3", "refreshToken": f"lin_{MARK}_r3", "expiresAt": 1},
                           "clientInfo": {"clientId": "oc-client-kept", "clientSecret": f"cs_{MARK}_4"},
                           "codeVerifier": f"pkce_{MARK}_5", "serverUrl": "https://mcp.linear.app/mcp"}}
CODEX_MCP = {"linear|abc123": {"server_name": "linear", "server_url": "https://mcp.linear.app/mcp",
                               "client_id": "cx-client-kept", "access_token": f"lin_{MARK}_a6",
                               "refresh_token": f"lin_{MARK}_r6", "expires_at": 1, "scopes": ["read"]}}
DOTENV = (f"# my keys\nexport GEMINI_API_KEY=AIzaSy{MARK}0123456789abcdefghij\nGOOGLE_CLOUD_PROJECT=my-project\n"
          f"GITHUB_TOKEN=\"ghp_{MARK}xyz\"  # for the gh tool\nOPENAI_API_KEY='sk-proj-{MARK}abc'\nEMPTY_TOKEN=\n\n")
# backend -> [(file under HOME, content, a non-secret piece that must stay)]
STORES = {
    "gemini": [(".gemini/mcp-oauth-tokens.json", json.dumps(GEMINI_MCP), '"clientId": "client-kept"'),
               (".gemini/a2a-oauth-tokens.json", json.dumps(GEMINI_MCP), '"tokenUrl": "https://mcp.linear.app/token"'),
               (".gemini/.env", DOTENV, "GOOGLE_CLOUD_PROJECT=my-project")],
    "opencode": [(".local/share/opencode/mcp-auth.json", json.dumps(OPENCODE_MCP), '"clientId": "oc-client-kept"')],
    "codex": [(".codex/.credentials.json", json.dumps(CODEX_MCP), '"client_id": "cx-client-kept"'),
              (".codex/.env", DOTENV, "GOOGLE_CLOUD_PROJECT=my-project")],
}
KEYS = {"gemini": "GEMINI_API_KEY", "opencode": "ANTHROPIC_API_KEY", "codex": "CODEX_API_KEY", "claude": "ANTHROPIC_API_KEY"}
CASES = [(b, f, c, k) for b, stores in STORES.items() for f, c, k in stores]


def table(backend: str, rel: str) -> tuple[str, ...]:
    return dict(load_shipped()[backend].secret_files)["~/" + rel]


# --- the masks (pure) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, rel, content, kept", CASES)
def test_every_token_of_the_store_is_masked_and_the_rest_kept(backend: str, rel: str, content: str, kept: str) -> None:
    dotenv = credential_files.is_dotenv(rel)
    masked, n = credential_files.mask(content.encode(), table(backend, rel), dotenv=dotenv)
    text = masked.decode()
    assert MARK not in text and n == content.count(MARK) and kept in text
    names = credential_files.secret_paths(content.encode(), table(backend, rel), dotenv)
    assert names and not any(MARK in n for n in names)  # names only, never values
    if dotenv:  # line for line: comments, quotes, `export`, the empty value and the trailing comment kept
        assert [line.split("=")[0] for line in text.splitlines()] == [line.split("=")[0] for line in content.splitlines()]
        assert '"  # for the gh tool' in text and "export GEMINI_API_KEY=AIza" in text and "EMPTY_TOKEN=\n" in text
    else:
        assert json.loads(text).__class__ is json.loads(content).__class__


def test_star_walks_lists_and_doublestar_any_depth() -> None:
    data = {"a": [{"t": "x1"}, {"b": {"t": "x2"}}], "t": "x0", "c": {"t": 3}}
    assert sorted(v for _, v in credential_files.found(data, ("**.t",))) == ["x0", "x1", "x2"]
    assert [v for _, v in credential_files.found(data, ("a.*.t",))] == ["x1"]
    assert sorted(v for _, v in credential_files.found(data, ("**",))) == ["x0", "x1", "x2"]
    assert credential_files.secret_paths(json.dumps(data).encode(), ("a.*.b.t",)) == ["a.1.b.t"]


@pytest.mark.parametrize("bad", [b'KEY_TOKEN="runs over\nlines"\n', b"not an assignment\n", b"A_TOKEN='x' tail\n",
                                 b"\xff\xfe=1\n"])
def test_a_dotenv_file_it_cannot_read_is_refused_whole(bad: bytes) -> None:
    with pytest.raises(ValueError):
        credential_files.mask(bad, ("*_TOKEN",), dotenv=True)


def test_the_encrypted_keychain_file_is_never_copied() -> None:
    with pytest.raises(ValueError):  # not JSON: agentstate gives the box no copy, the plan says masked or refuses
        credential_files.mask(b"9f2c:aa01:77e3deadbeef", table("gemini", ".gemini/gemini-credentials.json"))


# --- the plan and the box -------------------------------------------------------------------------------

def plant(s: Sandbox, rel: str, content: str) -> Path:
    path = s.home / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("backend, rel, content, kept", CASES)
def test_a_store_no_route_holds_refuses_unless_a_key_or_the_opt_in(sandbox: Sandbox, backend: str, rel: str,
                                                                   content: str, kept: str) -> None:
    s = sandbox
    (s.home / ".codex" / "auth.json").unlink()  # the suite's fake codex login would be a route
    path = plant(s, rel, content)
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    proc = s.relay(backend, "local", "--dry-run", "--json")
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 3 and len(lines) == 1 and f"~/{rel}" in proc.stderr, proc.stderr
    assert MARK not in proc.stdout + proc.stderr
    opt = f"HIVE_RELAY_LOGIN_IN_BOX_{backend.upper()}"
    proc = s.relay(backend, "local", "--dry-run", "--json", extra_env={KEYS[backend]: "sk-test-not-real"})
    assert proc.returncode == 0 and json.loads(proc.stdout)["login_files"][str(path)]["held"] == "masked", proc.stderr
    proc = s.relay(backend, "local", "--dry-run", "--json", extra_env={opt: "1"})
    assert proc.returncode == 0 and json.loads(proc.stdout)["login_files"][str(path)]["held"] == "in_box", proc.stderr


@pytest.mark.box
@pytest.mark.parametrize("backend", list(STORES))
def test_the_box_reads_placeholders_and_the_host_files_stay(sandbox: Sandbox, backend: str) -> None:
    require_box()
    s = sandbox
    planted = {rel: (plant(s, rel, content), kept) for rel, content, kept in STORES[backend]}
    keychain = plant(s, ".gemini/gemini-credentials.json", f"9f2c:aa01:{MARK}77e3") if backend == "gemini" else None
    before = {rel: path.read_bytes() for rel, (path, _) in planted.items()}
    script = "; ".join(f"echo '== {rel}'; cat ~/{rel}" for rel in planted)
    if keychain is not None:
        script += "; test -e ~/.gemini/gemini-credentials.json && echo KEYCHAIN-IN-BOX || echo no-keychain"
    proc = s.box(script + "; echo DONE", backend, extra_env={KEYS[backend]: "sk-test-not-real"})
    assert "DONE" in proc.stdout, proc.stderr
    attack = MARK not in proc.stdout + proc.stderr and (keychain is None or "no-keychain" in proc.stdout)
    assert attack, proc.stdout
    for rel, (path, kept) in planted.items():  # twin: the file is there, its other fields as they were
        section = proc.stdout.split(f"== {rel}\n", 1)[1].split("\n== ", 1)[0]
        assert kept in section, (rel, section)
        assert path.read_bytes() == before[rel]  # the host's file as it was
    assert "credentials: in box" not in proc.stderr


# --- ~/.claude.json: a synced file, not a state dir --------------------------------------------------------

CLAUDE_JSON = {"numStartups": 1, "primaryApiKey": f"sk-ant-api03-{MARK}0123456789",
               "mcpServers": {"gh": {"type": "http", "url": "https://api.githubcopilot.com/mcp/",
                                     "headers": {"Authorization": f"Bearer ghp_{MARK}abc", "Accept": "application/json"}},
                              "db": {"command": "db-mcp", "env": {"DB_PASSWORD": f"pw{MARK}", "NODE_ENV": "production"}}},
               "projects": {"/w": {"mcpServers": {"x": {"command": "x", "env": {"X_API_KEY": f"k{MARK}"}},
                                                  # tokens where no key name says so: argv and a url's query
                                                  "c7": {"command": "npx", "args": ["-y", "@upstash/context7-mcp",
                                                                                    "--api-key", f"ctx7sk-{MARK}0123"]},
                                                  "exa": {"type": "http",
                                                          "url": f"https://mcp.exa.ai/mcp?exaApiKey={MARK}-42&tools=web"}}}}}


def test_claude_json_refuses_without_a_route_and_is_masked_with_one(sandbox: Sandbox) -> None:
    """A Console `/login` leaves its API key in ~/.claude.json (`primaryApiKey`, Linux has no keychain for
    it), and MCP servers carry tokens in headers and env: the file is synced into the box, so it is masked
    like a state file. The Console key is a route's (anthropic-console, read from the host's file); MCP
    tokens with no claude credential on the host refuse the run."""
    s = sandbox
    path = plant(s, ".claude.json", json.dumps(CLAUDE_JSON))
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    proc = s.relay("claude", "local", "--dry-run", "--json")
    plan = json.loads(proc.stdout)
    assert proc.returncode == 0 and [r["route"] for r in plan["credentials"]] == ["anthropic-console"], proc.stderr
    assert plan["login_files"][str(path)]["held"] == "masked" and MARK not in proc.stdout + proc.stderr
    path.write_text(json.dumps({k: v for k, v in CLAUDE_JSON.items() if k != "primaryApiKey"}))
    proc = s.relay("claude", "local", "--dry-run", "--json")
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 3 and len(lines) == 1 and "~/.claude.json holds a login (mcpServers." in proc.stderr, proc.stderr
    assert MARK not in proc.stdout + proc.stderr
    path.write_text(json.dumps(CLAUDE_JSON))
    proc = s.relay("claude", "local", "--dry-run", "--json", extra_env={"ANTHROPIC_API_KEY": "sk-ant-test-not-real"})
    use = json.loads(proc.stdout)["login_files"][str(path)]
    assert proc.returncode == 0 and use["held"] == "masked" and len(use["secrets"]) == 8, use  # every env and header value
    assert [r["route"] for r in json.loads(proc.stdout)["credentials"]] == ["anthropic"]  # the env key comes first
    assert "projects./w.mcpServers.c7.args.3" in use["secrets"] and "projects./w.mcpServers.exa.url" in use["secrets"], use


@pytest.mark.parametrize("mode", [pytest.param("local", marks=pytest.mark.box),
                                  pytest.param("container", marks=pytest.mark.container)])
def test_claude_json_in_the_box_holds_placeholders_and_syncs_back_only_what_the_box_changed(mode_sandbox: Sandbox, mode: str) -> None:
    s = mode_sandbox
    path = plant(s, ".claude.json", json.dumps(CLAUDE_JSON))
    edit = ("python3 -c 'import json,sys; p=sys.argv[1]; d=json.load(open(p)); d[\"numStartups\"]=7; "
            "json.dump(d, open(p, \"w\"))' ~/.claude.json")
    proc = s.relay("claude", mode, "--quiet", "--prompt", f"cat ~/.claude.json; echo; {edit}; echo DONE",
                 extra_env={"ANTHROPIC_API_KEY": "sk-ant-test-not-real"})
    assert "DONE" in proc.stdout, proc.stderr
    copy = json.loads(proc.stdout.split("\n", 1)[0])
    # attack: no real value in the box; twin: the same file, placeholders of the same shape, the rest kept.
    assert MARK not in proc.stdout + proc.stderr
    assert copy["primaryApiKey"].startswith("sk-ant-api03-") and copy["mcpServers"]["gh"]["headers"]["Authorization"].startswith("Bearer ghp_")
    assert copy["mcpServers"]["db"]["command"] == "db-mcp" and copy["mcpServers"]["gh"]["url"] == CLAUDE_JSON["mcpServers"]["gh"]["url"]
    servers = copy["projects"]["/w"]["mcpServers"]
    assert servers["c7"]["args"][:3] == ["-y", "@upstash/context7-mcp", "--api-key"] and len(servers["c7"]["args"][3]) == len(f"ctx7sk-{MARK}0123")
    assert servers["exa"]["url"].startswith("https://mcp.exa.ai/mcp?exaApiKey=") and servers["exa"]["url"].endswith("&tools=web")
    # The box's data change comes back; the placeholders it left alone are the host's values again.
    back = json.loads(path.read_text())
    assert back == {**CLAUDE_JSON, "numStartups": 7}, back
    assert "kept aside" not in proc.stderr, proc.stderr
    # Attack twin: the box writes its own key there: it never lands in the host's file.
    proc = s.relay("claude", mode, "--quiet", "--prompt",
                   "python3 -c 'import json,sys; p=sys.argv[1]; d=json.load(open(p)); d[\"primaryApiKey\"]=\"sk-box\"; "
                   "json.dump(d, open(p, \"w\"))' ~/.claude.json; echo DONE",
                 extra_env={"ANTHROPIC_API_KEY": "sk-ant-test-not-real"})
    assert "DONE" in proc.stdout and json.loads(path.read_text())["primaryApiKey"] == CLAUDE_JSON["primaryApiKey"], proc.stderr


# --- the red team's cases ------------------------------------------------------------------------------

def test_restore_gives_no_real_token_to_an_mcp_server_the_box_pointed_elsewhere() -> None:
    """The box leaves the placeholder and changes the server's url: the real token must not follow the
    new url into the host's file (a review's accept-state would install it). Twin: an untouched server
    and a top-level key get the host's values back, and the output is indented as claude writes it."""
    host = {"primaryApiKey": f"sk-ant-api03-{MARK}1", "n": 1,
            "mcpServers": {"gh": {"url": "https://gh", "headers": {"Authorization": f"Bearer {MARK}2"}},
                           "db": {"url": "https://db", "env": {"T": f"{MARK}3"}}}}
    paths = table("claude", ".claude.json")
    written: list = []
    masked, _ = credential_files.mask(json.dumps(host).encode(), paths, written=written)
    box = json.loads(masked)
    box["n"], box["mcpServers"]["db"]["url"] = 2, "https://attacker.example/mcp"
    back = credential_files.restore(json.dumps(box).encode(), json.dumps(host).encode(), written)
    out = json.loads(back)
    assert out["mcpServers"]["db"]["url"] == "https://attacker.example/mcp" and MARK not in json.dumps(out["mcpServers"]["db"])
    assert out["primaryApiKey"] == host["primaryApiKey"] and out["mcpServers"]["gh"] == host["mcpServers"]["gh"]
    assert out["n"] == 2 and back.startswith(b"{\n  ")


def test_every_mcp_env_and_header_value_is_masked_whatever_its_name() -> None:
    data = {"mcpServers": {"notion": {"command": "npx", "args": ["-y", "@notionhq/notion-mcp-server"],
                                      "env": {"OPENAPI_MCP_HEADERS": json.dumps({"Authorization": f"Bearer ntn_{MARK}"}),
                                              "DATABASE_URL": f"postgres://u:{MARK}@h/d"}},
                           "x": {"type": "http", "url": "https://x", "headers": {"X-Auth": f"{MARK}x"}}},
            "env": {"ANTHROPIC_API_KEY": f"sk-ant-{MARK}"}, "customApiKeyResponses": {"approved": [f"{MARK}tail20"]}}
    masked, _ = credential_files.mask(json.dumps(data).encode(), table("claude", ".claude.json"))
    out = json.loads(masked)
    assert MARK not in masked.decode() and out["mcpServers"]["notion"]["args"] == data["mcpServers"]["notion"]["args"]


def test_dotenv_names_match_in_any_case() -> None:
    env = f"github_token=ghp_{MARK}\nGEMINI_APIKEY={MARK}k\nDATABASE_URL=postgres://u:{MARK}@h/d\nTOKEN={MARK}t\nLANG=C\n"
    masked, n = credential_files.mask(env.encode(), table("gemini", ".gemini/.env"), dotenv=True)
    assert MARK not in masked.decode() and n == 4 and "LANG=C\n" in masked.decode()
    bom, _ = credential_files.mask(("\ufeff" + env).encode(), table("gemini", ".gemini/.env"), dotenv=True)
    assert bom.decode().startswith("\ufeff") and MARK not in bom.decode()


@pytest.mark.parametrize("backend, rel", [("claude", ".claude.json"), ("gemini", ".gemini/mcp-oauth-tokens.json"),
                                          ("opencode", ".local/share/opencode/mcp-auth.json")])
def test_a_file_nested_past_the_parser_refuses_in_one_line_not_a_traceback(sandbox: Sandbox, backend: str, rel: str) -> None:
    s = sandbox
    plant(s, rel, '{"a":' * 5000)
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    proc = s.relay(backend, "local", "--dry-run", "--json")
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 3 and len(lines) == 1 and f"~/{rel}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr


@pytest.mark.box
def test_claudes_own_backups_of_claude_json_never_enter_the_box(sandbox: Sandbox) -> None:
    """claude copies ~/.claude.json, credentials and all, to ~/.claude/backups/ on its writes: denied."""
    require_box()
    s = sandbox
    plant(s, ".claude/backups/.claude.json.backup.1764000000000", json.dumps(CLAUDE_JSON))
    plant(s, ".claude.json", json.dumps(CLAUDE_JSON))
    proc = s.box("grep -rl REAL''SECRET ~ 2>/dev/null | wc -l; ls ~/.claude/backups 2>&1 | head -1; cat ~/.claude.json | head -c 20; echo",
                 "claude", extra_env={"ANTHROPIC_API_KEY": "sk-ant-test-not-real"})
    first, second, third = proc.stdout.splitlines()[:3]
    assert first == "0" and "No such file" in second and third.startswith("{"), proc.stdout
    assert MARK in (s.home / ".claude" / "backups" / ".claude.json.backup.1764000000000").read_text()  # the host's, kept


@pytest.mark.box
def test_a_hostile_claude_json_from_the_box_never_skips_the_rest_of_the_teardown(sandbox: Sandbox) -> None:
    """The box leaves a ~/.claude.json nested past the parser: the sync-back of that file fails alone;
    the agent state (a transcript) still comes back, and the run dir is gone."""
    require_box()
    s = sandbox
    proc = s.box("mkdir -p ~/.claude/projects/p && echo '{}' > ~/.claude/projects/p/s.jsonl; "
                 "python3 -c 'import sys; open(sys.argv[1], \"w\").write(\"{\\\"a\\\":\" * 100000)' ~/.claude.json; echo DONE",
                 "claude", extra_env={"ANTHROPIC_API_KEY": "sk-ant-test-not-real"})
    assert "DONE" in proc.stdout and proc.returncode == 0, proc.stderr
    assert (s.home / ".claude" / "projects" / "p" / "s.jsonl").exists(), proc.stderr
    assert json.loads((s.home / ".claude.json").read_text()) == {"numStartups": 1}  # the host's, as it was
    assert not [p for p in Path(s.env["XDG_RUNTIME_DIR"]).glob("hive-relay-*") if p.is_dir()]  # the run dir is gone


# --- guarded settings: tokens there refuse, since the box's copy cannot mask them ---------------------------

UNMASKABLE = {
    "claude": (".claude/settings.json", {"env": {"GITHUB_TOKEN": f"ghp_{MARK}", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "8000"}},
               {"env": {"GITHUB_TOKEN": "$GITHUB_TOKEN", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "8000"}}),
    "gemini": (".gemini/settings.json", {"mcpServers": {"gh": {"httpUrl": "https://x", "headers": {"Authorization": f"Bearer {MARK}"}}}},
               {"mcpServers": {"gh": {"httpUrl": "https://x", "headers": {"Authorization": "Bearer $GH_TOKEN",
                                                                        "Content-Type": "application/json"}}}}),
    "opencode": (".config/opencode/opencode.json", {"provider": {"openai": {"options": {"apiKey": f"sk-{MARK}"}}}},
                 {"provider": {"openai": {"options": {"apiKey": "{env:OPENAI_API_KEY}"}}}}),
}


@pytest.mark.parametrize("backend", list(UNMASKABLE))
def test_a_token_in_a_guarded_settings_file_refuses_and_a_reference_does_not(sandbox: Sandbox, backend: str) -> None:
    """~/.claude/settings.json `env`, an MCP server's headers in gemini's settings, opencode's provider
    apiKey: the settings review compares the box's file with the host's, so a placeholder there could come
    back over the real value; a token there refuses (one line, exit 3). Twin: a `$VAR` or `{env:X}`
    reference, which the CLI resolves itself, and non-secret keys, run."""
    s = sandbox
    rel, secret, reference = UNMASKABLE[backend]
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    path = plant(s, rel, json.dumps(secret))
    proc = s.relay(backend, "local", "--dry-run", "--json", extra_env={KEYS.get(backend, "ANTHROPIC_API_KEY"): "sk-test-not-real"})
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 3 and len(lines) == 1 and f"~/{rel} holds credentials" in proc.stderr, proc.stderr
    assert MARK not in proc.stdout + proc.stderr
    opt = f"HIVE_RELAY_LOGIN_IN_BOX_{backend.upper()}"
    proc = s.relay(backend, "local", "--dry-run", "--json", extra_env={opt: "1"})
    assert proc.returncode == 0 and json.loads(proc.stdout)["login_files"][str(path)]["held"] == "in_box", proc.stderr
    path.write_text(json.dumps(reference))
    proc = s.relay(backend, "local", "--dry-run", "--json", extra_env={KEYS.get(backend, "ANTHROPIC_API_KEY"): "sk-test-not-real"})
    assert proc.returncode == 0 and str(path) not in json.loads(proc.stdout)["login_files"], proc.stderr


def test_jsonc_settings_are_read_with_their_comments_and_strings_kept() -> None:
    """gemini's and opencode's settings may carry comments and trailing commas; a string that looks like
    one (`"//x,}"`, an escaped quote) is kept as it is."""
    raw = b'{\n  // my servers\n  "a": "//not,}", /* c */ "b\\"//": [1, 2, /* x */ ],\n}\n'
    assert credential_files.parse_jsonc(raw) == {"a": "//not,}", 'b"//': [1, 2]}
    with pytest.raises(ValueError):
        credential_files.parse_jsonc(b'{"a": 1 /* open')
    with pytest.raises(ValueError):
        credential_files.parse_jsonc(b"{a: 1}")


def test_a_token_in_a_commented_or_linked_or_broken_settings_file_still_refuses(sandbox: Sandbox) -> None:
    """Attack: the token hides where a plain JSON reader cannot see it: a gemini settings file with
    comments, a claude settings.json that is a link to a file beside it in ~/.claude (the copy holds
    both), a file no reader can parse (the box would get it as it is). Each refuses (exit 3, one
    line, no value). Twins: the commented file with a reference runs; a broken file with the opt-in
    runs and says the file is in the box."""
    s = sandbox
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    key = {"GEMINI_API_KEY": "sk-test-not-real", "ANTHROPIC_API_KEY": "sk-test-not-real"}
    commented = ('{\n  // the GitHub MCP\n  "mcpServers": {"gh": {"httpUrl": "https://x",\n'
                 '    "headers": {"Authorization": "Bearer %s"}, /* mine */ },},\n}\n')
    path = plant(s, ".gemini/settings.json", commented % f"ghp_{MARK}")

    def refused(backend: str, what: str) -> None:
        proc = s.relay(backend, "local", "--dry-run", "--json", extra_env=key)
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        assert proc.returncode == 3 and len(lines) == 1 and what in proc.stderr, proc.stderr
        assert MARK not in proc.stdout + proc.stderr

    refused("gemini", "~/.gemini/settings.json holds credentials (mcpServers.gh.headers.Authorization)")
    path.write_text(commented % "$GH_TOKEN")
    proc = s.relay("gemini", "local", "--dry-run", "--json", extra_env=key)
    assert proc.returncode == 0 and str(path) not in json.loads(proc.stdout)["login_files"], proc.stderr

    path.write_text('{"mcpServers": {"gh": ' + f'"ghp_{MARK}"')  # cut short: no reader can parse it
    refused("gemini", "~/.gemini/settings.json cannot be checked for credentials")
    proc = s.relay("gemini", "local", "--dry-run", "--json", extra_env={"HIVE_RELAY_LOGIN_IN_BOX_GEMINI": "1"})
    assert proc.returncode == 0 and json.loads(proc.stdout)["login_files"][str(path)]["held"] == "in_box", proc.stderr

    target = plant(s, ".claude/settings.d/main.json", json.dumps({"env": {"GITHUB_TOKEN": f"ghp_{MARK}"}}))
    (s.home / ".claude" / "settings.json").unlink(missing_ok=True)
    (s.home / ".claude" / "settings.json").symlink_to("settings.d/main.json")
    refused("claude", "~/.claude/settings.d/main.json holds credentials (env.GITHUB_TOKEN)")
    target.write_text(json.dumps({"env": {"GITHUB_TOKEN": "${GITHUB_TOKEN}"}}))
    proc = s.relay("claude", "local", "--dry-run", "--json", extra_env=key)
    assert proc.returncode == 0, proc.stderr


# token shapes: (value, the argv element before it, the secret part found; None: not a secret)
SHAPES = [
    (f"ctx7sk-{MARK}0123", None, f"ctx7sk-{MARK}0123"),
    ("ghp_abcdefghijklmnopqrstu", None, "ghp_abcdefghijklmnopqrstu"),
    ("Bearer glpat-abcdefghijklmnop", None, "glpat-abcdefghijklmnop"),
    ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2ln", None, "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2ln"),
    ("AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", None, "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"),
    ("3f2a9c1e-uuid-key", "--api-key", "3f2a9c1e-uuid-key"),
    ("--token=abc123def456", None, "abc123def456"),
    ("Authorization: Bearer abc123def456", None, "abc123def456"),
    ("https://mcp.exa.ai/mcp?exaApiKey=k1&tools=web", None, "k1"),
    ("postgres://user:pw123@db/app", None, "pw123"),
    # twins: what an MCP server's argv and a settings file hold every day
    ("claude-sonnet-4-5-20250929", None, None), ("@upstash/context7-mcp@1.0.2", None, None), ("-y", None, None),
    ("/home/me/project", "--path", None), ("https://mcp.exa.ai/mcp?tools=web", None, None),
    ("$GITHUB_TOKEN", None, None), ("Bearer ${GH_TOKEN}", None, None), ("{env:OPENAI_API_KEY}", None, None),
    ("--api-key=${KEY}", None, None), ("Authorization: Bearer $T", None, None), ("https://u:${PW}@h/", None, None),
    ("Bash(git commit:*)", None, None), ("WebFetch(domain:github.com)", None, None), ("me@example.com", "--author", None),
    # inside a longer string (red team): argv as one string, NAME=value, JSON or headers in a string
    ("GITHUB_PERSONAL_ACCESS_TOKEN=ghp_abcdefghijklmnopqrstuvwxyz0123", "-e", "ghp_abcdefghijklmnopqrstuvwxyz0123"),
    ("npx -y @upstash/context7-mcp --api-key ctx7sk-abcdef0123456789", "-c", "ctx7sk-abcdef0123456789"),
    ("echo sk-ant-api03-abcdefghijklmnopqrstuvwxyz", None, "sk-ant-api03-abcdefghijklmnopqrstuvwxyz"),
    ('{"Authorization": "Bearer ntn_abcdefghijklmnop0123", "Notion-Version": "2022-06-28"}', None, "ntn_abcdefghijklmnop0123"),
    ("Authorization=Bearer abcd1234efgh", None, "abcd1234efgh"),
    ("/usr/bin/env BRAVE_API_KEY=BSAreal0123456789 npx -y server-brave-search", None, "BSAreal0123456789"),
    # the rest of a URL: user name, path segment, fragment, a percent-encoded name, a password with @
    ("https://ghp_abcdefghijklmnopqrstuvwxyz0123@github.com/o/r.git", None, "ghp_abcdefghijklmnopqrstuvwxyz0123"),
    ("https://mcp.firecrawl.dev/fc-0123456789abcdef0123456789abcdef/v2/mcp", None, "fc-0123456789abcdef0123456789abcdef"),
    ("https://x.example/mcp#token=hunter2", None, "hunter2"), ("https://x.example/mcp?api%5Fkey=hunter2", None, "hunter2"),
    ("postgresql://app:p@ssw0rd!x@db/app", None, "p@ssw0rd!x"),
    # twins: a flag about a secret is not one, nor is an id after an id's flag, nor a plain setting
    ("/run/secrets/gh", "--token-file", None), ("oauth", "--auth-type", None), ("GITHUB_TOKEN", "--api-key-env", None),
    ("prod/db", "--secret-name", None), ("none", "--auth", None),
    ("1BxiMVs0XRA5nFMdKvBdBZjgmUUqptlbs74OgvE2upms", "--spreadsheet-id", None),
    ("TOKENIZERS_PARALLELISM=false", None, None), ("NODE_TLS_REJECT_UNAUTHORIZED=0", None, None),
    # red team round 4: a header after --header is looked into; a shell's own references, permission
    # rules and prose are not secrets
    ("Authorization: Bearer ghp_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", "--header", "ghp_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"),
    ('curl -s -H "Authorization: Bearer $(gh auth token)" https://api.github.com/user', None, None),
    ("GITHUB_TOKEN=${GITHUB_TOKEN:-} ~/.claude/hooks/check.sh", None, None),
    ("Bash(security find-generic-password:*)", None, None), ("Bash(gh auth login --with-token < ~/token.txt)", None, None),
    ("Never reveal a password: ask the user. Options are key=value pairs; the token: is read from GITHUB_TOKEN.", None, None),
    ("x-api-key: {env:CONTEXT7_API_KEY}", None, None),
]


@pytest.mark.parametrize("value, before, secret", SHAPES)
def test_a_token_is_known_by_its_shape_where_no_key_names_it(value: str, before: str | None, secret: str | None) -> None:
    from relay.model import token_shapes

    spans = token_shapes.secret_spans(value, before)
    assert [value[a:b] for a, b in spans] == ([secret] if secret else []), spans


GATED = {
    "gemini": (".gemini/settings.json", {"mcpServers": {"c7": {"command": "npx", "args": ["-y", "c7", "--api-key", f"k{MARK}"]}}},
               {"mcpServers": {"c7": {"command": "npx", "args": ["-y", "c7", "--api-key", "$C7_KEY"]}}}, "mcpServers.c7.args.3"),
    "opencode": (".config/opencode/opencode.json", {"mcp": {"exa": {"type": "remote", "url": f"https://mcp.exa.ai/mcp?exaApiKey={MARK}"}}},
                 {"mcp": {"exa": {"type": "remote", "url": "https://mcp.exa.ai/mcp?exaApiKey={env:EXA_API_KEY}"}}}, "mcp.exa.url"),
    "opencode.jsonc": (".config/opencode/opencode.jsonc", '{\n  // GitHub\n  "mcp": {"gh": {"type": "remote", "url": "https://x",\n'
                       f'    "headers": {{"Authorization": "Bearer ghp_{MARK}abcdef"}}}}}},\n}}\n',
                       '{\n  "mcp": {"gh": {"type": "remote", "url": "https://x", "headers": {"Authorization": "Bearer {env:GH}"}}},\n}\n',
                       "mcp.gh.headers.Authorization"),
    "codex": (".codex/config.toml", f'model = "o3"\n[mcp_servers.gh]\nurl = "https://api.githubcopilot.com/mcp/"\nbearer_token = "ghp_{MARK}abc"\n',
              'model = "o3"\n[mcp_servers.gh]\nurl = "https://api.githubcopilot.com/mcp/"\nbearer_token_env_var = "GH_TOKEN"\n',
              "mcp_servers.gh.bearer_token"),
}


@pytest.mark.parametrize("backend", list(GATED))
def test_a_token_in_an_mcp_servers_args_url_or_toml_refuses_and_a_reference_runs(sandbox: Sandbox, backend: str) -> None:
    """Attack: a token in an MCP server's argv (`--api-key k…`), in a remote server's url query, or in
    codex's TOML config (`bearer_token`): each is readable in the box's copy, so the run refuses (exit 3,
    one line naming the path, never the value). Twin: the same server reading its key from a variable."""
    s = sandbox
    rel, secret, reference, at = GATED[backend]
    backend = backend.split(".")[0]
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    path = plant(s, rel, secret if isinstance(secret, str) else json.dumps(secret))
    key = {KEYS[backend]: "sk-test-not-real"}
    proc = s.relay(backend, "local", "--dry-run", "--json", extra_env=key)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 3 and len(lines) == 1 and f"~/{rel} holds credentials ({at})" in proc.stderr, proc.stderr
    assert MARK not in proc.stdout + proc.stderr
    path.write_text(reference if isinstance(reference, str) else json.dumps(reference))
    proc = s.relay(backend, "local", "--dry-run", "--json", extra_env=key)
    assert proc.returncode == 0 and str(path) not in json.loads(proc.stdout)["login_files"], proc.stderr


@pytest.mark.parametrize("backend, rel, settings", [
    ("claude", ".claude/settings.json", {"apiKeyHelper": "~/bin/key.sh", "model": "claude-sonnet-4-5-20250929",
                                         "env": {"CLAUDE_CODE_API_KEY_HELPER_TTL_MS": "3600000", "CLAUDE_CODE_USE_VERTEX": "1",
                                                 "GOOGLE_APPLICATION_CREDENTIALS": "/home/me/.config/gcloud/adc.json"},
                                         "permissions": {"allow": ["Bash(git commit:*)", "WebFetch(domain:github.com)"]}}),
    ("gemini", ".gemini/settings.json", {"mcpServers": {"q": {"command": "uvx", "args": ["mcp-server-qdrant", "--auth-type", "oauth"],
                                                              "env": {"TOKENIZERS_PARALLELISM": "false", "NODE_TLS_REJECT_UNAUTHORIZED": "0"}},
                                                        "git": {"command": "uvx", "args": ["mcp-server-git"],
                                                                "env": {"GIT_AUTHOR_NAME": "Jane Doe", "GIT_AUTHOR_EMAIL": "jane@example.com",
                                                                        "AZURE_KEYVAULT_URL": "https://myvault.vault.azure.net/",
                                                                        "AUTH_TYPE": "oauth", "TOKEN_ENDPOINT": "https://auth.example.com/oauth/token"},
                                                                "description": "Never reveal a password: ask the user first."}}}),
    ("claude", ".claude/settings.json", {"permissions": {"allow": ["Bash(security find-generic-password:*)"],
                                                         "deny": ["Bash(kubectl get secret:*)", "Bash(gh auth login --with-token < ~/token.txt)"]},
                                         "hooks": {"SessionStart": [{"hooks": [{"type": "command", "command":
                                                   'curl -s -H "Authorization: Bearer $(gh auth token)" https://api.github.com/user'}]}],
                                                   "PreToolUse": [{"matcher": "Bash", "hooks": [{"type": "command", "command":
                                                   "GITHUB_TOKEN=${GITHUB_TOKEN:-} ~/.claude/hooks/check.sh"}]}]},
                                         "env": {"GOOGLE_APPLICATION_CREDENTIALS": "C:\\Users\\alice\\AppData\\Roaming\\gcloud\\adc.json"}}),
    ("codex", ".codex/config.toml", '[model_providers.azure]\nname = "Azure"\nbase_url = "https://my.openai.azure.com/openai"\n'
                                    'env_key = "AZURE_OPENAI_API_KEY"\nquery_params = { api-version = "2025-04-01-preview" }\n'
                                    '[mcp_servers.notion]\nurl = "https://mcp.notion.com/mcp"\nbearer_token_env_var = "NOTION_TOKEN"\n'
                                    'http_headers = { "Notion-Version" = "2022-06-28" }\n'),
])
def test_everyday_settings_with_secret_sounding_names_run(sandbox: Sandbox, backend: str, rel: str, settings: object) -> None:
    """The twin of the refusals (red team): a TTL, a path to a credentials file, `false` and `0` under
    names with KEY, TOKEN, AUTH or CREDENTIAL in them, an Azure api-version and a Notion-Version header
    are settings, not secrets: the run goes on."""
    s = sandbox
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    plant(s, rel, settings if isinstance(settings, str) else json.dumps(settings))
    proc = s.relay(backend, "local", "--dry-run", "--json", extra_env={KEYS[backend]: "sk-test-not-real"})
    assert proc.returncode == 0, proc.stderr


def test_restore_owns_a_url_by_its_server_and_a_placeholder_keeps_no_passphrase() -> None:
    """A box that adds another MCP server leaves the untouched servers' urls and args to come back as
    the host's (their owner is the server, not the whole map). A passphrase's words are not a
    vendor prefix: the placeholder keeps none of them."""
    host = {"mcpServers": {"exa": {"url": f"https://mcp.exa.ai/mcp?exaApiKey={MARK}-1234"},
                           "c7": {"command": "npx", "args": ["--api-key", f"ctx7sk-{MARK}0123"]}}}
    written: list = []
    masked, _ = credential_files.mask(json.dumps(host).encode(), table("claude", ".claude.json"), written=written)
    box = json.loads(masked)
    box["mcpServers"]["new"] = {"command": "x"}
    out = json.loads(credential_files.restore(json.dumps(box).encode(), json.dumps(host).encode(), written))
    assert out["mcpServers"]["exa"] == host["mcpServers"]["exa"] and out["mcpServers"]["c7"] == host["mcpServers"]["c7"]
    for secret in ("correct-horse-battery-staple", "Summer_2024_db"):
        fake = credential_files.placeholder_for(secret)
        assert len(fake) == len(secret) and not any(w in fake for w in ("correct", "horse", "battery", "Summer", "2024"))
    assert credential_files.placeholder_for("sk-ant-api03-" + "a" * 95).startswith("sk-ant-api03-")


def test_a_key_the_box_holds_anyway_is_no_reason_to_refuse_and_a_token_beside_it_is(sandbox: Sandbox) -> None:
    """The caller points claude at their own base URL, so its key goes into the box as set (said in the
    plan). ~/.claude.json's `customApiKeyResponses` keeps that key's last 20 characters: nothing more is in
    the box, so the run goes on (the TUI's approval still holds). Attack twin: an MCP server's token in
    the same file is not in the box otherwise: refused."""
    s = sandbox
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    key = "sk-ant-api03-" + "k" * 20 + "0123456789abcdefghij"
    path = plant(s, ".claude.json", json.dumps({"customApiKeyResponses": {"approved": [key[-20:]], "rejected": []}}))
    env = {"ANTHROPIC_API_KEY": key, "ANTHROPIC_BASE_URL": "http://fake-api.test:1"}
    proc = s.relay("claude", "local", "--dry-run", "--json", extra_env=env)
    assert proc.returncode == 0 and str(path) not in json.loads(proc.stdout)["login_files"], proc.stderr
    path.write_text(json.dumps({"customApiKeyResponses": {"approved": [key[-20:]]},
                                "mcpServers": {"gh": {"type": "http", "url": "https://x", "headers": {"Authorization": f"Bearer {MARK}"}}}}))
    proc = s.relay("claude", "local", "--dry-run", "--json", extra_env=env)
    assert proc.returncode == 3 and "mcpServers.gh.headers.Authorization" in proc.stderr and MARK not in proc.stderr, proc.stderr


def test_a_grants_variable_is_not_in_the_box_so_the_same_token_in_a_file_is_masked(sandbox: Sandbox) -> None:
    """Red team: an `auth:` grant withholds its variable from the box even when the profile passes it;
    the same token in ~/.claude.json (an MCP server's env) is then nowhere else in the box, so the file is
    masked. And a Console login beside a base URL the caller set refuses with the fix that works."""
    s = sandbox
    pat = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text(
        "version: 1\nprofiles:\n  agent:\n    env: [PATH, HOME, LANG, TERM, USER, SHELL, GH_TOKEN]\n"
        "auth:\n  github:\n    host: github.com\n    secret: {env: [GH_TOKEN]}\n    send: authorization-basic\n")
    path = plant(s, ".claude.json", json.dumps({"mcpServers": {"gh": {"command": "npx", "env": {"GITHUB_PERSONAL_ACCESS_TOKEN": pat}}}}))
    proc = s.relay("claude", "local", "--dry-run", "--json", extra_env={"GH_TOKEN": pat, "ANTHROPIC_API_KEY": "sk-ant-test-not-real"})
    plan = json.loads(proc.stdout)
    assert proc.returncode == 0 and plan["login_files"][str(path)]["held"] == "masked", proc.stderr
    assert "GH_TOKEN" not in plan["env_pass"]
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    path.write_text(json.dumps({"primaryApiKey": f"sk-ant-api03-{MARK}" + "k" * 40}))
    proc = s.relay("claude", "local", "--dry-run", "--json", extra_env={"ANTHROPIC_BASE_URL": "https://gw.example"})
    assert proc.returncode == 3 and "fix: unset ANTHROPIC_BASE_URL" in proc.stderr and "log in on the host" not in proc.stderr
    assert MARK not in proc.stderr
