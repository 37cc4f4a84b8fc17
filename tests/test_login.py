"""`contribute-hive login BACKEND` and the other subcommands of bin/contribute-hive (issue 27).

The login is the real, pinned codex CLI, in a real terminal (pexpect): it runs on the host, in no
box (the same mount and network namespaces as the test), in an empty private directory that is gone
afterwards, and prints its sign-in URL with the callback on the host's own 127.0.0.1:1455.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pexpect

from relay.commands.login import login_argv
from relay.config.load import load_shipped
from relay.host.procs import children

from .conftest import REPO, Sandbox

TOOLS = os.environ.get("HIVE_RELAY_TOOLS", "/var/cache/hive-relay/npm")
ENTRY = str(REPO / "bin" / "contribute-hive")


def test_login_runs_the_real_cli_on_the_host_in_an_empty_dir(sandbox: Sandbox) -> None:
    s = sandbox
    env = {**s.env, "HIVE_RELAY_TOOLS": TOOLS}
    child = pexpect.spawn(sys.executable, ["-m", "relay", "login", "codex"], cwd=str(s.workdir), env=env,
                          encoding="utf-8", timeout=90, dimensions=(40, 200))
    try:
        child.expect("outside any box")
        child.expect("https://auth.openai.com/oauth/authorize")
        child.expect("redirect_uri=http%3A%2F%2F127.0.0.1%3A1455")  # the callback: the host's own loopback
        codex = [p for p in sorted(children(child.pid)) if b"codex" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert codex, "the login is the codex CLI, a child of the launcher"
        pid = codex[0]
        cwd = os.readlink(f"/proc/{pid}/cwd")
        assert Path(cwd).name.startswith("hive-relay-login-codex-") and cwd != str(s.workdir)
        for ns in ("mnt", "net", "pid", "user"):  # no box: the host's own namespaces
            assert os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(f"/proc/self/ns/{ns}"), ns
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus not in (0, None) or child.signalstatus is not None
    deadline = time.monotonic() + 30
    while Path(cwd).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(cwd).exists()  # the empty dir went with it
    assert not [p for p in sorted(children(child.pid))]


def test_login_of_a_backend_without_one_names_the_variable(sandbox: Sandbox) -> None:
    for name, words in (("gemini", "GEMINI_API_KEY"), ("shell", "login_command"), ("nope", "unknown backend")):
        proc = sandbox.relay("login", name)
        assert proc.returncode == 2, proc.stderr
        line = proc.stderr.strip()
        assert "\n" not in line and words in line and ("fix:" in line or "choose one of" in line), line


def test_login_argv_is_the_pinned_cli() -> None:
    backends = load_shipped()
    env = {"HIVE_RELAY_TOOLS": TOOLS, "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    assert login_argv(backends["codex"], env) == [f"{TOOLS}/node_modules/.bin/codex", "login"]
    assert login_argv(backends["claude"], env)[1:] == ["auth", "login"]
    assert login_argv(backends["opencode"], env)[1:] == ["auth", "login"]


def test_every_task_is_a_subcommand_and_help_lists_them(sandbox: Sandbox) -> None:
    helped = subprocess.run([ENTRY, "--help"], capture_output=True, text=True, env=sandbox.env, timeout=60)
    assert helped.returncode == 0
    text = " ".join(helped.stdout.split())
    assert "supervised = a bubblewrap box" in text and "profile NAME (DIGEST)" in text  # the banner's words
    for sub in ("login BACKEND", "doctor", "selftest", "logs", "clean", "allow", "deny", "ask", "accept-state",
                "changes", "diff", "apply", "discard", "build-image", "bench", "completion"):
        assert sub in text, sub
    doctor = subprocess.run([ENTRY, "doctor", "--json"], capture_output=True, text=True, env=sandbox.env, timeout=120)
    assert doctor.returncode in (0, 1), doctor.stderr
    assert "bwrap" in json.dumps(json.loads(doctor.stdout))
    for sub in ("selftest", "bench", "login"):
        proc = subprocess.run([ENTRY, sub, "--help"], capture_output=True, text=True, env=sandbox.env, timeout=60)
        assert proc.returncode == 0 and f"contribute-hive {sub}" in proc.stdout, proc.stderr
    # A backend named like a subcommand is reached with --backend (here: there is none, so it says so).
    named = subprocess.run([ENTRY, "--backend", "doctor", "--dry-run"], capture_output=True, text=True,
                           env=sandbox.env, timeout=60)
    assert named.returncode == 2 and "unknown backend 'doctor'" in named.stderr
    bad = subprocess.run([ENTRY, "selftest", "--mode", "moon"], capture_output=True, text=True, env=sandbox.env,
                         timeout=60)
    assert bad.returncode == 2 and "unknown mode" in bad.stderr


def test_a_run_without_a_credential_says_what_to_set_or_which_login_to_run(sandbox: Sandbox) -> None:
    s = sandbox
    (s.home / ".codex" / "auth.json").unlink()  # the suite's fake codex login
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    for backend, words in (("claude", ["ANTHROPIC_API_KEY", f"{ENTRY} login claude"]),
                           ("codex", ["CODEX_API_KEY", f"{ENTRY} login codex"]),  # its ChatGPT login is routed
                           ("gemini", ["GEMINI_API_KEY"])):
        proc = s.relay(backend, "--dry-run")
        notes = [line for line in (proc.stdout + proc.stderr).splitlines() if "credentials: none" in line]
        assert len(notes) == 1 and all(w in notes[0] for w in words), proc.stderr
        assert backend != "gemini" or "login" not in notes[0]  # gemini has no login command (its TUI signs in)
    keyed = s.relay("claude", "--dry-run", extra_env={"ANTHROPIC_API_KEY": "sk-test-not-real"})
    assert keyed.returncode == 0 and "credentials: none" not in keyed.stdout + keyed.stderr


def test_an_interactive_banner_lists_what_the_box_holds_per_route(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    env = {**s.env, "ANTHROPIC_API_KEY": "sk-ant-test-not-real"}
    child = pexpect.spawn(sys.executable, ["-m", "relay", "claude", "local"], cwd=str(s.workdir), env=env,
                          encoding="utf-8", timeout=90, dimensions=(40, 200))
    try:
        child.expect(r"credential anthropic\s+ANTHROPIC_API_KEY -> api\.anthropic\.com:443")
        child.expect("the box holds a placeholder")
        child.sendline("echo KEY=$ANTHROPIC_API_KEY; exit")
        child.expect("KEY=hive-relay-placeholder")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert "sk-ant-test-not-real" not in (child.before or "")
