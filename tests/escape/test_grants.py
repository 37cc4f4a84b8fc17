"""`auth:` grants: a credential for another host, kept on the host and added by the proxy. Git over
HTTPS with no token in the box: the box's git rewrites https://github.com/ to the grant's plain-HTTP
route on its own loopback; the proxy adds Basic `x-access-token:TOKEN` and re-originates TLS.

The upstream is a real `git http-backend` behind a TLS server under the name github.com (throwaway CA,
SSL_CERT_FILE in the launcher's environment), pinned with `--allow-host github.com:443=127.0.0.1:PORT`.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import Sandbox
from ..git_server import GitServer, bare_repo
from .conftest import Report

TOKEN = "ghp_GRANT-TOKEN-ON-THE-HOST-ONLY"
GRANT = """
auth:
  github:
    host: github.com
    secret: {command: [gh, auth, token]}
    send: authorization-basic
    push: true
"""

BOX_SCRIPT = r"""
export GIT_TERMINAL_PROMPT=0
cd /tmp && git clone -q https://github.com/o/r.git c 2>&1; echo "clone=$?"
cd /tmp/c 2>/dev/null && echo box > f && git add f && git -c user.name=box -c user.email=box@example.com commit -qm "from the box" \
  && git push -q origin HEAD:main 2>&1; echo "push=$?"
env | grep -c GRANT-TOKEN
for f in /proc/[0-9]*/environ; do tr '\0' '\n' < "$f"; done 2>/dev/null | grep -c GRANT-TOKEN
grep -rl GRANT-TOKEN "$HOME" /tmp 2>/dev/null | wc -l
git config --get-regexp '^url\.' || echo "no rewrite"
git ls-remote http://127.0.0.1:3128/github/o/r.git >/dev/null 2>&1; echo "route=$?"
"""


@pytest.fixture
def github(ca, tmp_path: Path) -> Iterator[tuple[GitServer, Path]]:
    root = tmp_path / "srv"
    root.mkdir()
    bare = bare_repo(root)
    server = GitServer(root, TOKEN, ca[1]).start()
    yield server, bare
    server.shutdown()


def fake_gh(tmp_path: Path, token: str = TOKEN, rc: int = 0) -> str:
    """A `gh` on the launcher's PATH that prints the token, as `gh auth token` does."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    gh = bindir / "gh"
    gh.write_text("#!/bin/sh\n[ \"$1 $2\" = 'auth token' ] || exit 9\n"
                  + (f"echo {token}\n" if rc == 0 else f"echo 'not logged in to github.com' >&2\nexit {rc}\n"))
    gh.chmod(0o755)
    return f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"


def with_grant(box: Sandbox) -> None:
    cfg = box.home / ".config" / "hive-relay" / "config.yaml"
    cfg.write_text(cfg.read_text() + GRANT)


def head_of(bare: Path) -> str:
    return subprocess.run(["git", "--git-dir", str(bare), "log", "-1", "--format=%s", "main"],
                          capture_output=True, text=True, check=True).stdout.strip()


def run_box(box: Sandbox, ca, server: GitServer, tmp_path: Path, mode: str = "local", **gh) -> subprocess.CompletedProcess:
    return box.relay("shell", mode, "--quiet", "--prompt", BOX_SCRIPT,
                     "--allow-host", f"github.com:443=127.0.0.1:{server.port}", timeout=180,
                     extra_env={"SSL_CERT_FILE": str(ca[0]), "PATH": fake_gh(tmp_path, **gh)})


def logged(box: Sandbox) -> list[dict]:
    logs = sorted((box.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    return [json.loads(line) for p in logs for line in p.read_text().splitlines()]


def test_git_clone_and_push_over_https_with_no_token_in_the_box(box: Sandbox, ca, github, tmp_path: Path,
                                                                report: Report) -> None:
    server, bare = github
    with_grant(box)
    proc = run_box(box, ca, server, tmp_path)
    out = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    # legit: clone and push worked, and the host sees the box's commit in the bare repo.
    works = "clone=0" in out and "push=0" in out and head_of(bare) == "from the box"
    report.legit(works)
    assert works, proc.stdout + proc.stderr[-2000:]
    # attack: whatever runs in the box looks for the token in its environment, /proc, its home and /tmp.
    counts = out[out.index("push=0") + 1:][:3]
    clean = counts == ["0", "0", "0"] and TOKEN not in proc.stdout + proc.stderr
    report.attack(clean)
    assert clean, proc.stdout
    assert "url.http://127.0.0.1:3128/github/.insteadof https://github.com/" in out
    assert "route=0" in out
    # The server got the credential on every request, the real one; nothing else carried a key.
    assert server.heads and all("Authorization: Basic " in h for h in server.heads)
    # Every use of the credential is one line in the run's log: route, method, path, status; never the token.
    uses = [(e["method"], e["path"], e["status"]) for e in logged(box) if e.get("route") == "github"]
    assert ("GET", "/o/r.git/info/refs", 200) in uses and ("POST", "/o/r.git/git-receive-pack", 200) in uses
    assert all(e.get("grant") is True and e["host"] == "github.com" for e in logged(box) if e.get("route"))
    log_text = "".join(p.read_text() for p in (box.home / ".local" / "state" / "hive-relay" / "logs").glob("*"))
    assert TOKEN not in log_text and "eC1hY2Nlc3MtdG9rZW46" not in log_text  # nor its base64 (x-access-token:…)


def test_without_the_grant_the_push_fails_and_nothing_carries_a_token(box: Sandbox, ca, github, tmp_path: Path,
                                                                      report: Report) -> None:
    server, bare = github
    proc = run_box(box, ca, server, tmp_path)
    out = proc.stdout.splitlines()
    blocked = "clone=0" not in out and "push=0" not in out and head_of(bare) == "seed" and "no rewrite" in out
    report.attack(blocked)
    assert blocked, proc.stdout + proc.stderr[-2000:]
    # The box's git cannot even verify the server (it has no CA and no credential); no head reached it
    # with a key.
    assert all("Authorization" not in h for h in server.heads)
    # Asking the proxy's route by hand is refused too: this run has no grant, so no route /github.
    assert "route=0" not in out
    assert any("no credential route /github" in e["reason"] for e in logged(box))


def test_a_failing_secret_command_is_one_line_and_starts_no_box(box: Sandbox, ca, github, tmp_path: Path,
                                                               report: Report) -> None:
    server, _ = github
    with_grant(box)
    proc = run_box(box, ca, server, tmp_path, rc=4)
    lines = proc.stderr.strip().splitlines()
    clear = (proc.returncode == 3 and lines[-1] == "hive-relay: error: auth grant github: `gh auth token` failed with exit code "
             "4: not logged in to github.com; fix: run it on the host and fix what it says" and "clone=" not in proc.stdout)
    report.legit(clear)
    assert clear, proc.stderr


def test_the_dry_run_shows_the_grant_never_the_token(sandbox: Sandbox, tmp_path: Path) -> None:
    with_grant(sandbox)
    proc = sandbox.relay("shell", "--dry-run", "--json", extra_env={"PATH": fake_gh(tmp_path)})
    plan = json.loads(proc.stdout)
    assert plan["credentials"] == [{
        "route": "github", "upstream": "github.com:443", "send": "authorization-basic", "from": [],
        "box_url": "http://127.0.0.1:3128/github",
        "allows": {"methods": [], "paths": [], "push": True, "git": False, "summary": "any method and path"},
        "grant": True, "secret": {"command": ["gh", "auth", "token"]},
        "git_insteadof": "https://github.com/"}]
    env = plan["env_set"]
    keys = {env[k]: env[k.replace("KEY", "VALUE")] for k in env if k.startswith("GIT_CONFIG_KEY_")}
    assert keys["url.http://127.0.0.1:3128/github/.insteadOf"] == "https://github.com/"
    assert TOKEN not in proc.stdout + proc.stderr


def test_a_repo_config_cannot_add_a_grant(box: Sandbox, report: Report) -> None:
    (box.workdir / ".hive-relay.yaml").write_text(
        "auth:\n  github: {host: evil.example, secret: {env: [GH_TOKEN]}, send: authorization-bearer}\n")
    proc = box.relay("shell", "--dry-run", "--json", extra_env={"GH_TOKEN": TOKEN})
    blocked = proc.returncode == 2 and "key 'auth': unknown key" in proc.stderr
    report.attack(blocked)
    assert blocked, proc.stderr


READ_ONLY = """
auth:
  github:
    host: github.com
    secret: {command: [gh, auth, token]}
    send: authorization-basic
    git: true
"""


@pytest.mark.parametrize("mode", ["local", "container"])
def test_a_read_only_git_grant_clones_and_fetches_but_never_pushes(request: pytest.FixtureRequest, mode: str, ca,
                                                                   github, tmp_path: Path, report: Report) -> None:
    s: Sandbox = request.getfixturevalue("box" if mode == "local" else "csandbox")
    server, bare = github
    cfg = s.home / ".config" / "hive-relay" / "config.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text((cfg.read_text() if cfg.exists() else "") + READ_ONLY)
    proc = run_box(s, ca, server, tmp_path, mode=mode)
    out = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    # legit: clone (and the ls-remote fetch) through the grant work.
    works = "clone=0" in out and "route=0" in out
    report.legit(works)
    assert works, proc.stdout + proc.stderr[-2000:]
    # attack: the push is refused at the proxy, before the key is added; the server never saw it.
    refused = "push=0" not in out and head_of(bare) == "seed" and not any("receive-pack" in h for h in server.heads)
    report.attack(refused)
    assert refused, proc.stdout + proc.stderr[-2000:]
    rules = [e for e in logged(s) if e.get("route") == "github" and e["decision"] == "http-rule"]
    assert rules and all("git push (git-receive-pack) is not allowed" in e["reason"] for e in rules), logged(s)
    assert all(e["rule"] == "/github: git fetch only" for e in rules)


SCOPED = """
auth:
  github:
    host: github.com
    secret: {command: [gh, auth, token]}
    send: authorization-basic
    push: true
    backends: [%s]
  elsewhere:
    host: git.example.org
    secret: {command: ["false"]}
    send: authorization-bearer
    backends: [claude]
"""


def with_scoped_grants(box: Sandbox, github_for: str) -> None:
    cfg = box.home / ".config" / "hive-relay" / "config.yaml"
    cfg.write_text(cfg.read_text() + SCOPED % github_for)


@pytest.fixture(params=["local", "container"])
def mode_box(request: pytest.FixtureRequest) -> tuple[Sandbox, str]:
    if request.param == "local":
        return request.getfixturevalue("box"), "local"
    return request.getfixturevalue("csandbox"), "container"


def test_a_grant_scoped_to_this_backend_works_and_one_for_another_is_never_read(
        mode_box: tuple[Sandbox, str], ca, github, tmp_path: Path, report: Report) -> None:
    # legit: `github` is for shell, so the shell box clones and pushes through it. `elsewhere` is for
    # claude only: its secret command (`false`) would refuse the run if it ran; it does not, and the
    # box's git has no rewrite for its host.
    box, mode = mode_box
    server, bare = github
    with_scoped_grants(box, "shell, codex")
    proc = run_box(box, ca, server, tmp_path, mode)
    out = proc.stdout.splitlines()
    works = (proc.returncode == 0 and "clone=0" in out and "push=0" in out and head_of(bare) == "from the box"
             and "url.http://127.0.0.1:3128/github/.insteadof https://github.com/" in out)
    report.legit(works)
    assert works, proc.stdout + proc.stderr[-2000:]
    scoped_out = not any("git.example.org" in line or "/elsewhere/" in line for line in out)
    report.attack(scoped_out)
    assert scoped_out, proc.stdout


def test_a_grant_for_another_backend_gives_this_box_nothing(box: Sandbox, ca, github, tmp_path: Path,
                                                            report: Report) -> None:
    # attack: a shell box, both grants for claude only. The `gh auth token` on the PATH fails loudly
    # (exit 4) and `false` would too: neither runs, the box starts, and its git has no rewrite, its
    # push fails, and no request reached the server with a credential.
    server, bare = github
    with_scoped_grants(box, "claude")
    proc = run_box(box, ca, server, tmp_path, rc=4)
    out = proc.stdout.splitlines()
    blocked = (proc.returncode == 0 and "clone=0" not in out and "push=0" not in out and "no rewrite" in out
               and head_of(bare) == "seed" and all("Authorization" not in h for h in server.heads))
    report.attack(blocked)
    assert blocked, proc.stdout + proc.stderr[-2000:]
    assert "not logged in" not in proc.stderr and "auth grant github: not for backend shell" in proc.stderr


def test_no_grants_turns_every_grant_off_for_one_run(box: Sandbox, ca, github, tmp_path: Path,
                                                     report: Report) -> None:
    # legit twin of the run above: the grant is for this backend, --no-grants turns it off for this
    # run only (its failing secret command is not run), and the dry run says why.
    server, _ = github
    with_scoped_grants(box, "shell")
    dry = box.relay("shell", "--dry-run", "--json", "--no-grants", extra_env={"PATH": fake_gh(tmp_path, rc=4)})
    plan = json.loads(dry.stdout)
    assert plan["auth_grants"] == {
        "github": {"applies": False, "skipped": "off for this run (--no-grants)"},
        "elsewhere": {"applies": False, "skipped": "off for this run (--no-grants)"}}
    assert plan["credentials"] == []
    proc = box.relay("shell", "local", "--quiet", "-g", "--prompt", "git config --get-regexp '^url\\.' || echo 'no rewrite'",
                     timeout=120, extra_env={"PATH": fake_gh(tmp_path, rc=4)})
    off = proc.returncode == 0 and proc.stdout.split() == ["no", "rewrite"]
    report.legit(off)
    assert off, proc.stdout + proc.stderr[-2000:]
