"""Deny-list and protected entries that are symbolic links (issue 24, items 2 and 7).

A dotfiles manager makes `~/.aws`, a workdir's `.claude` or `.envrc` a link. The box must start,
hide (secrets) or write-protect (protected paths) what the link points to, and never let the box
unlink the link and put its own directory (with hooks) in its place: the link is pinned like a
directory (relay/box/linkpin.py). Each attack beside its legitimate twin; the persistence proof runs
the real claude on the host afterwards against the fake API.

Link targets "outside every grant" live in a scratch dir under the checkout (visible in the box
through the read-only root, unlike the tests' /tmp, which the box replaces with its own).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ..conftest import REPO, Sandbox, require_box

KEY = "PRIVATE-KEY-DO-NOT-LEAK"
TOKEN = "LINKED-TOKEN-DO-NOT-LEAK"


@pytest.fixture
def outside() -> Path:
    """A host dir outside every grant that the box sees read-only (through its read-only root)."""
    path = REPO / ".cache" / "test-links" / uuid.uuid4().hex[:12]
    path.mkdir(parents=True)
    path.parent.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _user_config(s: Sandbox, backend: str, extra: str) -> None:
    cfg = s.home / ".config" / "hive-relay" / "config.yaml"
    cfg.write_text(cfg.read_text().replace(f"  {backend}:\n", f"  {backend}:\n{extra}", 1)
                   if f"  {backend}:\n" in cfg.read_text() else cfg.read_text().replace(
                       "backends:\n", f"backends:\n  {backend}:\n{extra}", 1))


def _links(root: Path) -> dict[str, str]:
    return {str(p): os.readlink(p) for p in sorted(root.rglob("*")) if p.is_symlink()}


def _plan(s: Sandbox, backend: str, mode: str = "local", *args: str) -> tuple[int, dict, str]:
    proc = s.relay(backend, mode, "--dry-run", "--json", *args)
    return proc.returncode, (json.loads(proc.stdout) if proc.returncode == 0 else {}), proc.stderr


# --- secrets: a deny-list entry that is a link -------------------------------------------------------------

def _secret_links(s: Sandbox, outside: Path) -> None:
    """~/.aws -> outside (absolute); ~/dots (a rw grant) holding deny entries that are links: to a
    file outside every grant, a link to that link, a relative link, a link into the workdir, and a
    dangling one."""
    shutil.rmtree(s.home / ".aws")
    (outside / "aws").mkdir()
    (outside / "aws" / "credentials").write_text(TOKEN + "\n")
    (s.home / ".aws").symlink_to(outside / "aws")
    dots = s.home / "dots"
    dots.mkdir()
    (dots / "ok.txt").write_text("dotfile ok\n")
    (outside / "token").write_text(TOKEN + "\n")
    (dots / "token").symlink_to(outside / "token")
    (dots / "chain").symlink_to(dots / "token")
    (dots / "real-key").write_text(KEY + "\n")
    (dots / "rel").symlink_to("real-key")
    (s.workdir / "wkey.pem").write_text(KEY + "\n")
    (dots / "wkey").symlink_to(s.workdir / "wkey.pem")
    (dots / "gone").symlink_to(outside / "missing")
    _user_config(s, "shell", "    deny: [~/dots/token, ~/dots/chain, ~/dots/rel, ~/dots/wkey, ~/dots/gone]\n")
    cfg = s.home / ".config" / "hive-relay" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("profiles:\n", "profiles:\n  dots:\n    extends: default\n"
                                                         "    home: {rw: [~/dots]}\n", 1))


DOTS = ("--profile", "dots")


def test_the_plan_never_mounts_at_a_link(sandbox: Sandbox, outside: Path, report) -> None:
    _secret_links(sandbox, outside)
    _protected_links(sandbox, outside)
    code, plan, err = _plan(sandbox, "shell", "local", *DOTS)
    assert code == 0, err
    at_links = [m["dst"] for m in plan["mounts"] if m["kind"] != "private-bind" and os.path.islink(m["dst"])]
    through = [m["dst"] for m in plan["mounts"] if m["kind"] in ("mask-dir", "mask-file", "ro-bind")
               and m["dst"].startswith(str(sandbox.root)) and os.path.realpath(m["dst"]) != m["dst"]
               and not m["dst"].startswith(str(sandbox.home))]
    report.attack(not at_links and not through)
    assert not at_links and not through, (at_links, through)
    wd, home = str(sandbox.workdir), str(sandbox.home)
    # The targets are denied where they show; the replaceable links are pinned by the pre-stage.
    assert str(outside / "token") in plan["denied"] and str(outside / "aws") in plan["denied"]
    assert f"{home}/dots/real-key" in plan["denied"] and f"{wd}/wkey.pem" in plan["denied"]
    pre = plan["command"][:plan["command"].index("--")]
    assert pre[-1].endswith("relay/box/linkpin.py") or "relay/box/linkpin.py" in " ".join(pre)
    for name in ("token", "chain", "rel", "wkey", "gone"):
        assert f"{home}/dots/{name}" in pre
    for name in (".claude", ".vscode", ".envrc", ".codex", "cfg/codex-link", ".gemini"):
        assert f"{wd}/{name}" in pre
    assert f"{wd}/cfg/vscode" in plan["protected"]
    report.legit(f"{home}/dots" in [m["dst"] for m in plan["mounts"]])


def test_a_symlinked_secret_starts_the_box_and_stays_hidden(box: Sandbox, outside: Path, report) -> None:
    _secret_links(box, outside)
    before = _links(box.home / "dots")
    script = ('for f in ~/.aws/credentials ~/dots/token ~/dots/chain ~/dots/rel ~/dots/real-key ~/dots/wkey wkey.pem '
              f'{outside}/token {outside}/aws/credentials; do cat "$f" 2>/dev/null; done; '
              'for l in token chain rel wkey gone; do rm -f ~/dots/$l 2>/dev/null && echo "UNLINKED $l"; '
              'mv ~/dots/$l ~/dots/$l.x 2>/dev/null && echo "MOVED $l"; done; '
              'echo planted > ~/dots/gone 2>/dev/null && echo "WROTE gone"; '
              'cat ~/dots/ok.txt && echo more >> ~/dots/ok.txt && echo GRANT-WRITE-OK; cat README.md')
    proc = box.box(script, "shell", *DOTS, timeout=300)
    out = proc.stdout
    blocked = (proc.returncode == 0 and KEY not in out and TOKEN not in out and "UNLINKED" not in out
               and "MOVED" not in out and "WROTE" not in out and _links(box.home / "dots") == before
               and not (outside / "missing").exists())
    report.attack(blocked)
    assert blocked, (proc.returncode, out, proc.stderr, _links(box.home / "dots"))
    legit = "dotfile ok" in out and "GRANT-WRITE-OK" in out and "hello from the workdir" in out
    report.legit(legit)
    assert legit and (box.home / "dots" / "ok.txt").read_text() == "dotfile ok\nmore\n", out


# --- protected paths: a workdir whose .claude, .vscode, .codex, .envrc or .gemini is a link -----------------

HOOKS = {"hooks": {event: [{"hooks": [{"type": "command", "command": "echo {tag} >> {marker}"}]}]
                   for event in ("SessionStart", "UserPromptSubmit")}}


def _hooks(marker: Path, tag: str) -> str:
    return json.dumps(HOOKS).replace("{tag}", tag).replace("{marker}", str(marker))


def _protected_links(s: Sandbox, outside: Path) -> None:
    """.claude -> outside (absolute, outside every grant); .vscode -> cfg/vscode (into the workdir);
    .codex -> cfg/codex-link -> cfg/codex (a link to a link); .envrc -> cfg/envrc (a relative file
    link); .gemini -> outside/no-gemini (dangling)."""
    (outside / "claude").mkdir()
    (outside / "claude" / "CLAUDE.md").write_text("project memory\n")
    (s.workdir / ".claude").symlink_to(outside / "claude")
    cfg = s.workdir / "cfg"
    (cfg / "vscode").mkdir(parents=True)
    (cfg / "vscode" / "extensions.json").write_text("{}\n")
    (s.workdir / ".vscode").symlink_to("cfg/vscode")
    (cfg / "codex").mkdir()
    (cfg / "codex-link").symlink_to("codex")
    (s.workdir / ".codex").symlink_to("cfg/codex-link")
    (cfg / "envrc").write_text("export SAFE=1\n")
    (s.workdir / ".envrc").symlink_to("cfg/envrc")
    (s.workdir / ".gemini").symlink_to(outside / "no-gemini")


def _attack(marker: Path) -> str:
    evil = _hooks(marker, "BOX").replace("'", "")
    return (f"for l in .claude .vscode .codex .envrc .gemini cfg/codex-link; do rm -rf $l 2>/dev/null; "
            f"[ -L $l ] || echo \"REPLACED $l\"; mv $l $l.x 2>/dev/null && echo \"MOVED $l\"; done; "
            "mv cfg cfg.x 2>/dev/null && echo MOVED-CFG; mv cfg/vscode cfg/v2 2>/dev/null && echo MOVED-VSCODE; "
            f"mkdir -p .claude/hooks 2>/dev/null; echo '{evil}' > .claude/settings.json 2>/dev/null && echo WROTE-CLAUDE; "
            f"echo '{evil}' > .claude/settings.local.json 2>/dev/null && echo WROTE-CLAUDE-LOCAL; "
            "echo '{\"tasks\": []}' > .vscode/tasks.json 2>/dev/null && echo WROTE-VSCODE; "
            "echo '{\"tasks\": []}' > cfg/vscode/tasks.json 2>/dev/null && echo WROTE-VSCODE-TARGET; "
            "echo 'notify = [\"sh\"]' > .codex/config.toml 2>/dev/null && echo WROTE-CODEX; "
            "echo 'touch /tmp/x' >> .envrc 2>/dev/null && echo WROTE-ENVRC; "
            "echo evil >> cfg/envrc 2>/dev/null && echo WROTE-ENVRC-TARGET; "
            "mkdir -p .gemini 2>/dev/null; echo '{}' > .gemini/settings.json 2>/dev/null && echo WROTE-GEMINI; ")


TWIN = ("cat .claude/CLAUDE.md; ls .vscode; echo note > cfg/notes.txt && echo CFG-WRITE-OK; "
        "echo edit >> README.md && echo EDIT-OK; mkdir -p src && mv README.md src/ && mv src/README.md . && echo MV-OK")


def _planted(s: Sandbox, outside: Path) -> list[str]:
    wd = s.workdir
    bad = [str(p) for p in (outside / "claude" / "settings.json", outside / "claude" / "settings.local.json",
                            outside / "claude" / "hooks", wd / "cfg" / "vscode" / "tasks.json",
                            wd / "cfg" / "codex" / "config.toml", outside / "no-gemini", wd / "cfg.x", wd / "cfg" / "v2")
           if p.exists()]
    if (wd / "cfg" / "envrc").read_text() != "export SAFE=1\n":
        bad.append("cfg/envrc changed")
    return bad


EXPECTED_LINKS = {".claude": None, ".vscode": "cfg/vscode", ".codex": "cfg/codex-link", ".envrc": "cfg/envrc",
                  ".gemini": None, "cfg/codex-link": "codex"}


def _links_intact(s: Sandbox, outside: Path) -> bool:
    want = {**EXPECTED_LINKS, ".claude": str(outside / "claude"), ".gemini": str(outside / "no-gemini")}
    return all((s.workdir / n).is_symlink() and os.readlink(s.workdir / n) == t for n, t in want.items())


@pytest.mark.parametrize("backend", ["claude", "shell"])
def test_a_symlinked_protected_dir_is_pinned_like_a_dir(box: Sandbox, outside: Path, backend: str, report) -> None:
    _protected_links(box, outside)
    marker = box.root / "MARKER"
    proc = box.box(_attack(marker) + TWIN, backend, timeout=300)
    out = proc.stdout
    planted = _planted(box, outside)
    blocked = proc.returncode == 0 and "REPLACED" not in out and "MOVED" not in out and "WROTE" not in out \
        and not planted and _links_intact(box, outside)
    report.attack(blocked)
    assert blocked, (proc.returncode, out, proc.stderr[-2000:], planted)
    legit = all(w in out for w in ("project memory", "extensions.json", "CFG-WRITE-OK", "EDIT-OK", "MV-OK"))
    report.legit(legit)
    assert legit, out
    # The pins lived in the box's own mount namespace: the host has none left.
    with open("/proc/self/mountinfo") as f:
        assert str(box.workdir) not in f.read()


# --- the proof from the host: the real claude runs no hook the box planted ---------------------------------

@pytest.fixture
def claude_tools() -> str:
    """The pinned claude, installed as tests/escape/test_agent_state.py does."""
    from relay.config.load import load_shipped
    from relay.modes.install import cli_path, ensure_cli

    from .test_agent_state import TOOLS

    require_box()
    env = {**os.environ, "HIVE_RELAY_TOOLS": TOOLS}
    backend = load_shipped()["claude"]
    ensure_cli(backend, env, backend.install_bin or "claude")
    assert cli_path(backend, env), "claude CLI missing after install"
    return TOOLS


def test_real_claude_on_the_host_runs_no_hook_planted_through_a_symlinked_claude_dir(
        box: Sandbox, outside: Path, claude_tools: str, report) -> None:
    from ..fake_api import ANSWER, start

    api, port = start()
    try:
        box.env["HIVE_RELAY_TOOLS"] = claude_tools
        _protected_links(box, outside)
        marker = box.root / "MARKER"
        proc = box.box(_attack(marker) + "echo ATTEMPTED", "claude", timeout=300)
        assert "ATTEMPTED" in proc.stdout, proc.stderr[-2000:]
        env = {"HOME": str(box.home), "PATH": f"{claude_tools}/node_modules/.bin:/usr/bin:/bin", "LANG": "C.UTF-8",
               "ANTHROPIC_API_KEY": "sk-ant-fake", "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
        if os.getuid() == 0:
            env["IS_SANDBOX"] = "1"

        def host_claude() -> subprocess.CompletedProcess:
            return subprocess.run(["claude", "-p", "say"], cwd=box.workdir, env=env, capture_output=True, text=True,
                                  timeout=240, stdin=subprocess.DEVNULL)

        host = host_claude()
        assert host.returncode == 0 and ANSWER in host.stdout, host.stdout[-1500:] + host.stderr[-1500:]
        blocked = not marker.exists()
        report.attack(blocked)
        assert blocked, marker.read_text()
        # The twin: the user's own hook in the linked .claude (written on the host) does run, so the
        # check above was not vacuous.
        (outside / "claude" / "settings.json").write_text(_hooks(marker, "USER"))
        host = host_claude()
        ran = host.returncode == 0 and marker.exists() and "USER" in marker.read_text()
        report.legit(ran)
        assert ran, host.stdout[-1500:] + host.stderr[-1500:]
    finally:
        api.shutdown()


# --- container mode: an engine cannot pin a link -----------------------------------------------------------

def test_container_mode_refuses_a_link_it_cannot_pin_and_starts_without_one(sandbox: Sandbox, outside: Path,
                                                                            report) -> None:
    (outside / "claude").mkdir()
    (sandbox.workdir / ".claude").symlink_to(outside / "claude")
    code, _, err = _plan(sandbox, "claude", "container")
    refused = code == 3 and ".claude is a symbolic link" in err and "fix: --mode local" in err and len(err.strip().splitlines()) == 1
    report.attack(refused)
    assert refused, (code, err)
    code, _, err = _plan(sandbox, "claude", "kube")
    report.attack(code == 3 and "--mode kube cannot pin a link" in err)
    assert code == 3 and "--mode kube cannot pin a link" in err, (code, err)
    (sandbox.workdir / ".claude").unlink()
    (sandbox.workdir / ".claude").mkdir()
    # A secret link that only the container's own view could reach needs no pin: the box starts.
    shutil.rmtree(sandbox.home / ".aws")
    (sandbox.home / ".aws").symlink_to(outside)
    code, plan, err = _plan(sandbox, "claude", "container")
    report.legit(code == 0)
    assert code == 0, err
    assert not any(os.path.islink(m["dst"]) for m in plan["mounts"] if m["kind"] != "private-bind")


# --- rename(2) into the private .git: EXDEV, which git itself never meets ----------------------------------

GIT_OPS = ("set -e; echo a >> README.md; git add README.md; git commit -qm edit; echo b >> README.md; "
           "git stash -q; git stash pop -q; git commit -qam second; git checkout -qb topic HEAD~1; echo c > c.txt; "
           "git add c.txt; git commit -qm topic; git rebase -q main; git worktree add -q wt-inside -b wtb main; "
           "git -C wt-inside commit -q --allow-empty -m in-worktree; git tag -a v1 -m v1; git log --oneline topic | wc -l; "
           "echo GIT-OPS-OK; ")


def test_a_rename_into_dotgit_fails_with_exdev_and_git_never_renames_across(box: Sandbox, report) -> None:
    """.git in the box is a private copy (relay/trust/gitdir.py), a mount of its own: rename(2) from the
    workdir into it is a cross-device rename. `mv` (and shutil.move) fall back to copying; git only
    renames within .git (lock files, objects), which strace from the host shows."""
    from ..conftest import require_tool

    require_tool("strace")
    wd = box.workdir

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(wd), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    git("init", "-q", "-b", "main")
    git("add", ".")
    git("commit", "-qm", "init")
    script = ("export GIT_AUTHOR_NAME=t GIT_AUTHOR_EMAIL=t@t GIT_COMMITTER_NAME=t GIT_COMMITTER_EMAIL=t@t; " + GIT_OPS +
              "set +e; cp README.md mv-me; mv mv-me .git/mv-me && echo MV-OK; "
              "python3 -c 'import os; os.rename(\"c.txt\", \".git/rename-me\")' 2>&1 | tail -1")
    log = box.root / "strace.log"
    proc = subprocess.run(["strace", "-f", "-qq", "-e", "trace=rename,renameat,renameat2", "-o", str(log),
                           sys.executable, "-m", "relay", "shell", "local", "--quiet", "--prompt", script],
                          cwd=wd, env=box.env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert "GIT-OPS-OK" in out, out + proc.stderr[-3000:]
    lines = log.read_text().splitlines()
    exdev = [line for line in lines if "EXDEV" in line]
    git_renames = [line for line in lines if ".lock" in line and "= 0" in line]
    deliberate = all("mv-me" in line or "rename-me" in line for line in exdev)
    report.attack(deliberate and "Invalid cross-device link" in out)  # a clear error, for our own calls only
    assert exdev and deliberate, exdev
    assert "[Errno 18] Invalid cross-device link" in out
    report.legit("MV-OK" in out and len(git_renames) > 10)
    assert "MV-OK" in out and len(git_renames) > 10, (out, len(git_renames))


def test_container_mode_a_secret_link_into_the_workdir_and_git_in_the_box(csandbox: Sandbox, report) -> None:
    """Container mode: ~/.aws -> WORKDIR/aws-real starts the box, the target is masked in the
    workdir volume; git's own operations in the container's private .git all succeed (git fails on
    a cross-device rename instead of copying, so success is the proof) and a rename into .git is EXDEV."""
    s = csandbox
    wd = s.workdir
    shutil.rmtree(s.home / ".aws")
    (wd / "aws-real").mkdir()
    (wd / "aws-real" / "credentials").write_text(TOKEN + "\n")
    (s.home / ".aws").symlink_to(wd / "aws-real")

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(wd), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    (wd / ".gitignore").write_text("aws-real/\n")
    git("init", "-q", "-b", "main")
    git("add", ".")
    git("commit", "-qm", "init")
    script = ("cat aws-real/credentials 2>/dev/null; cat ~/.aws/credentials 2>/dev/null; "
              "export GIT_AUTHOR_NAME=t GIT_AUTHOR_EMAIL=t@t GIT_COMMITTER_NAME=t GIT_COMMITTER_EMAIL=t@t; "
              + GIT_OPS + "set +e; python3 -c 'import os; os.rename(\"c.txt\", \".git/rename-me\")' 2>&1 | tail -1")
    proc = s.relay("shell", "container", "--quiet", "--prompt", script, timeout=900)  # a busy rootless engine is slow
    out = proc.stdout
    report.attack(proc.returncode == 0 and TOKEN not in out)
    assert proc.returncode == 0 and TOKEN not in out, out + proc.stderr[-3000:]
    legit = "GIT-OPS-OK" in out and "[Errno 18] Invalid cross-device link" in out
    report.legit(legit)
    assert legit, out


def test_the_pin_stage_refuses_a_link_that_changed_since_planning(tmp_path: Path, report) -> None:
    """relay/box/linkpin.py pins only what the plan saw: a link swapped for a dir, or pointing elsewhere,
    is one line and exit 3, not a box planned for another filesystem; an unchanged one execs the box."""
    from relay.box import linkpin

    (tmp_path / "t").mkdir()
    (tmp_path / "link").symlink_to("t")
    (tmp_path / "dir").mkdir()
    script = [sys.executable, "-I", "-S", linkpin.__file__]
    moved = subprocess.run([*script, str(tmp_path / "link"), "elsewhere", "--", "true"], capture_output=True, text=True)
    swapped = subprocess.run([*script, str(tmp_path / "dir"), "t", "--", "true"], capture_output=True, text=True)
    (tmp_path / "parent-link").symlink_to(tmp_path)
    above = subprocess.run([*script, str(tmp_path / "parent-link" / "link"), "t", "--", "true"], capture_output=True,
                           text=True)
    refused = all(p.returncode == 3 and len(p.stderr.strip().splitlines()) == 1 and "fix:" in p.stderr
                  for p in (moved, swapped, above))
    report.attack(refused)
    assert refused, (moved.stderr, swapped.stderr, above.stderr)
    ok = subprocess.run([*script, str(tmp_path / "link"), "t", "--", "sh", "-c", "rm link; echo RC=$?"],
                        cwd=tmp_path, capture_output=True, text=True)
    report.legit(ok.returncode == 0 and "RC=1" in ok.stdout and (tmp_path / "link").is_symlink())
    assert "RC=1" in ok.stdout and (tmp_path / "link").is_symlink(), ok.stdout + ok.stderr
