"""A new contributor's first hour: no bubblewrap, the first npm install, an unreachable registry.

Real programs throughout: a PATH without bwrap (every other /usr/bin tool linked), the real npm
against a real local registry (a tiny package served from a thread) or a closed loopback port,
and a real terminal through pexpect.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import os
import socket
import socketserver
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest

from .conftest import REPO, Sandbox, require_tool

ROOT = os.getuid() == 0
PKG, VERSION, BIN = "tiny-cli", "1.0.0", "tiny-cli"
TINY_BACKEND = f"""
backends:
  tiny:
    command: [{BIN}]
    prompt_command: [{BIN}, "{{prompt}}"]
    install: {{npm: "{PKG}@{VERSION}", bin: {BIN}}}
"""


def path_without(root: Path, *missing: str) -> str:
    """A bin dir with every /usr/bin and /bin program linked in, except `missing` (e.g. bwrap)."""
    bindir = root / ("no-" + "-".join(missing))
    bindir.mkdir(exist_ok=True)
    for src in ("/usr/bin", "/bin"):
        for name in os.listdir(src):
            link = bindir / name
            if name not in missing and not link.exists() and not link.is_symlink():
                link.symlink_to(os.path.join(src, name))
    return str(bindir)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tarball() -> bytes:
    files = {
        "package/package.json": json.dumps({"name": PKG, "version": VERSION, "bin": {BIN: "cli.js"}}).encode(),
        "package/cli.js": b"#!/usr/bin/env node\nconsole.log('TINY ' + process.argv.slice(2).join(' '));\n",
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def registry() -> Iterator[str]:
    """A real npm registry for one package; the tarball comes after a pause, so npm is seen working."""
    tgz = _tarball()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server API
            base = f"http://127.0.0.1:{self.server.server_address[1]}"
            if self.path.endswith(".tgz"):
                time.sleep(1.0)
                body, kind = tgz, "application/octet-stream"
            elif self.path.lstrip("/") == PKG:
                dist = {"tarball": f"{base}/{PKG}/-/{PKG}-{VERSION}.tgz", "shasum": hashlib.sha1(tgz).hexdigest(),
                        "integrity": "sha512-" + base64.b64encode(hashlib.sha512(tgz).digest()).decode()}
                body = json.dumps({"name": PKG, "dist-tags": {"latest": VERSION}, "versions": {VERSION: {
                    "name": PKG, "version": VERSION, "bin": {BIN: "cli.js"}, "dist": dist}}}).encode()
                kind = "application/json"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def npm_env(s: Sandbox, registry: str) -> dict[str, str]:
    require_tool("npm")
    (s.home / ".config" / "hive-relay" / "config.yaml").write_text(TINY_BACKEND)
    return {"NPM_CONFIG_REGISTRY": registry, "NPM_CONFIG_CACHE": str(s.root / "npm-cache"),
            "NPM_CONFIG_USERCONFIG": str(s.root / "npmrc"), "HIVE_RELAY_TOOLS": str(s.root / "tools")}


# ---- bubblewrap missing: the behaviour, the message and the README agree -------------------------

def test_agent_without_bwrap_is_refused_with_exit_3_naming_the_opt_in_and_installs_nothing(sandbox: Sandbox) -> None:
    (sandbox.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")  # the real claude backend
    tools = sandbox.root / "tools"
    env = {"PATH": path_without(sandbox.root, "bwrap"), "HIVE_RELAY_TOOLS": str(tools),
           "NPM_CONFIG_REGISTRY": f"http://127.0.0.1:{closed_port()}/"}
    proc = sandbox.relay("claude", "local", "--prompt", "hi", extra_env=env)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hive-relay: error: claude needs its API hosts"), lines
    assert "bubblewrap is not installed; fix: apt-get install bubblewrap" in lines[0]
    assert "HIVE_RELAY_UNSANDBOXED_CLAUDE=1" in lines[0]
    assert not tools.exists()  # refused before the first-use install
    assert proc.stdout == ""


def test_shell_without_bwrap_runs_at_the_process_tier_or_is_refused_as_root(sandbox: Sandbox) -> None:
    proc = sandbox.relay("shell", "local", "--prompt", "echo RAN", extra_env={"PATH": path_without(sandbox.root, "bwrap")})
    if ROOT:
        assert proc.returncode == 3 and "root caller" in proc.stderr and "RAN" not in proc.stdout
    else:
        assert proc.returncode == 0, proc.stderr
        assert "RAN" in proc.stdout and "process · profile default" in proc.stderr


def test_bootstrap_without_bwrap_says_what_will_happen_and_the_run_agrees(sandbox: Sandbox) -> None:
    (sandbox.home / ".config" / "hive-relay" / "config.yaml").write_text("{}\n")
    # No bwrap, and no apt-get either (root would install bubblewrap): a host where it is simply missing.
    env = {**sandbox.env, "PATH": path_without(sandbox.root, "bwrap", "apt-get"),
           "HIVE_RELAY_TOOLS": str(sandbox.root / "tools")}
    proc = subprocess.run([str(REPO / "bin" / "contribute-hive"), "claude", "--prompt", "hi"], cwd=sandbox.workdir,
                          env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert "only --dry-run will work" not in proc.stderr
    assert "missing: bubblewrap; fix: sudo apt-get install bubblewrap" in proc.stderr
    assert "agent backends are refused (exit 3" in proc.stderr or (ROOT and "every run is refused (exit 3)" in proc.stderr)
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines()[-1].startswith("hive-relay: error: claude needs its API hosts")


def test_readme_promises_what_the_refusal_does() -> None:
    readme = (REPO / "README.md").read_text()
    assert "only --dry-run" not in readme
    assert "agent backend without bubblewrap is refused (exit 3)" in readme


# ---- the first-use npm install: visible, bounded, and never for a run that cannot work -----------

def test_first_use_install_shows_plain_progress_lines_without_a_tty(box_sandbox: Sandbox, registry: str) -> None:
    s = box_sandbox
    proc = s.relay("tiny", "local", "--quiet", "--prompt", "hello", extra_env=npm_env(s, registry))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "TINY hello"
    err = proc.stderr
    assert "\r" not in err and "\x1b" not in err
    assert f"hive-relay: first use of tiny: installing {PKG}@{VERSION} into {s.root / 'tools'} (npm, not global)" in err
    progress = [line for line in err.splitlines() if line.startswith(f"hive-relay: npm {PKG}@{VERSION}: ")]
    assert progress and all(line.endswith(" s") and " · " in line for line in progress), err
    assert any("resolving dependencies" in line or "downloading" in line for line in progress), err
    assert f"hive-relay: installed {BIN} ({PKG}@{VERSION}, 1 package) in " in err
    assert (s.root / "tools" / "node_modules" / ".bin" / BIN).exists()


def test_first_use_install_is_one_live_line_on_a_terminal(box_sandbox: Sandbox, registry: str) -> None:
    s = box_sandbox
    child = pexpect.spawn(sys.executable, ["-m", "relay", "tiny", "local", "--quiet", "--prompt", "hello"],
                          cwd=str(s.workdir), env={**s.env, **npm_env(s, registry)}, encoding="utf-8", timeout=120,
                          dimensions=(24, 120))
    child.expect(f"first use of tiny: installing {PKG}@{VERSION}")
    child.expect(f"\r\x1b\\[Khive-relay: npm {PKG}@{VERSION}: [^\r\n]+ · [0-9.]+ s")
    first = child.after
    # npm waits for the tarball: the same line is rewritten in place with the time going on.
    child.expect(f"\r\x1b\\[Khive-relay: npm {PKG}@{VERSION}: [^\r\n]+ · [0-9.]+ s")
    assert child.after != first
    child.expect(f"\r\x1b\\[Khive-relay: installed {BIN} \\({PKG}@{VERSION}, 1 package\\) in [0-9.]+ s\r\n")
    child.expect("TINY hello")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_unreachable_registry_fails_fast_with_one_line_naming_it(sandbox: Sandbox) -> None:
    registry = f"http://127.0.0.1:{closed_port()}/"
    env = npm_env(sandbox, registry)
    proc = sandbox.relay("tiny", "local", "--quiet", "--prompt", "hello", extra_env=env)
    assert proc.returncode == 127, proc.stderr
    err = proc.stderr
    assert "npm error" not in err  # npm's stack trace is not the message
    # npm's retries are bounded: one retry, not npm's default two spread over a minute.
    assert "attempt 1 failed (ECONNREFUSED)" in err and "attempt 3" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"hive-relay: error: npm could not install {PKG}@{VERSION} (exit 1: ")
    assert "ECONNREFUSED" in last and f"fix: check access to the npm registry ({registry};" in last
    assert not (sandbox.root / "tools" / "node_modules" / ".bin" / BIN).exists()


def test_refused_run_installs_nothing(sandbox: Sandbox) -> None:
    """An explicit profile that needs egress at the process tier is refused before npm is asked."""
    env = {**npm_env(sandbox, f"http://127.0.0.1:{closed_port()}/")}
    proc = sandbox.relay("tiny", "local", "--isolation", "process", "--profile", "agent", "--prompt", "x",
                         extra_env=env)
    assert proc.returncode == 3, proc.stderr
    assert "first use" not in proc.stderr and not (sandbox.root / "tools").exists()



# ---- invoke bench: a peer that cannot run is refused, and no ratio is taken against a failed run ---

def test_bench_takes_no_ratio_against_a_failed_run(tmp_path: Path) -> None:
    from relay.dev.bench import launch_report
    from relay.dev.measure import paired, ratio

    launch = paired({"bin/contribute-hive": ["true"], "srt true (peer)": ["false"]}, 3, dict(os.environ), str(tmp_path))
    assert launch["srt true (peer)"]["failures"] == 3 and launch["srt true (peer)"]["exit_codes"] == [1, 1, 1]
    assert launch["bin/contribute-hive"]["failures"] == 0
    assert ratio(launch, "bin/contribute-hive", "srt true (peer)") is None
    lines, targets = launch_report({"launch_scenarios": {"idle": launch}})
    target = targets["bin/contribute-hive ≤ 0.35× srt true (idle)"]
    assert target == ("no ratio: srt true (peer) failed 3 of 3 runs (exit [1])", False)
    assert any("FAILED 3 of 3 runs" in line for line in lines)


def test_bench_refuses_srt_without_ripgrep_naming_the_fix(tmp_path: Path) -> None:
    """No rg, and no apt-get to install it (root would install ripgrep): the peer is refused, not timed."""
    from relay.dev.bench import ensure_ripgrep

    env = {**os.environ, "PATH": path_without(tmp_path, "rg", "apt-get")}
    assert ensure_ripgrep(env) == "srt needs ripgrep (rg), which is not installed; fix: sudo apt-get install ripgrep"


def test_no_message_names_an_invoke_task_the_user_may_not_have() -> None:
    """Every hint names the entry the user can type (relay.model.refusal.ENTRY), never `invoke TASK`:
    invoke is not on a new user's PATH, and typed in a project it loads that project's tasks.py. Read
    from the sources: every string the code builds, docstrings and the bench's own text aside."""
    import ast
    import re

    task = re.compile(r"\binvoke (allow|deny|ask|accept-state|logs|clean|doctor|selftest|build-image|login|changes"
                      r"|diff|apply|discard)\b")
    found = []
    for path in sorted((REPO / "relay").rglob("*.py")):
        if "dev" in path.relative_to(REPO / "relay").parts[:1]:
            continue  # invoke bench's own output, for developers
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                    and task.search(node.value):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value[:80]}")
    assert not found, "\n".join(found)
