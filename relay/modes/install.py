"""First use installs the agent CLI: project-locally with npm (never `npm -g`), with visible progress.

npm runs with its own spinner off and its log on a pipe; we turn the log into one progress line
(package, version, what npm is doing, elapsed time): rewritten in place on a terminal, plain lines
otherwise. Its retries are bounded, so an unreachable registry fails in seconds, not minutes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping

from relay.host import procs
from relay.host.paths import tool_dir, which
from relay.model.backend import Backend
from relay.model.errors import EXIT_MISSING, RelayError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import TextIO

# npm's defaults (2 retries, 10 s to 60 s apart, 5 min per request) turn an unreachable registry
# into a minute of silence. One quick retry still rides out a blip; the user's own settings win.
NPM_BOUNDS = {"NPM_CONFIG_FETCH_RETRIES": "1", "NPM_CONFIG_FETCH_RETRY_MINTIMEOUT": "1000",
              "NPM_CONFIG_FETCH_RETRY_MAXTIMEOUT": "3000", "NPM_CONFIG_FETCH_TIMEOUT": "60000",
              "NPM_CONFIG_UPDATE_NOTIFIER": "false"}
# Network failures that mean "the registry cannot be reached", not "the package is broken".
UNREACHABLE = ("ECONNREFUSED", "ENOTFOUND", "EAI_AGAIN", "ETIMEDOUT", "ECONNRESET", "EHOSTUNREACH", "ENETUNREACH",
               "ERR_SOCKET_TIMEOUT")
UNTRUSTED = ("SELF_SIGNED_CERT_IN_CHAIN", "UNABLE_TO_GET_ISSUER_CERT_LOCALLY", "DEPTH_ZERO_SELF_SIGNED_CERT",
             "UNABLE_TO_VERIFY_LEAF_SIGNATURE", "CERT_HAS_EXPIRED")
TICK_TTY = 0.2
TICK_PLAIN = 10.0


class MissingToolError(RelayError):
    """A program the run needs is not installed and could not be installed."""

    exit_code = EXIT_MISSING


def cli_path(backend: Backend, env: Mapping[str, str]) -> str | None:
    if not backend.install_bin:
        return None
    tools = tool_dir(dict(env))
    return which(backend.install_bin, f"{tools}/node_modules/.bin:{env.get('PATH', os.defpath)}")


def find_npm(env: Mapping[str, str]) -> str | None:
    return which("npm", env.get("PATH", os.defpath))


def needs_install(backend: Backend, env: Mapping[str, str], program: str) -> bool:
    """The run starts the backend's own CLI (`program` is what the argv starts, which user config may
    have changed), which npm can install, and it is on neither the tool dir nor PATH."""
    return backend.install_npm is not None and program == backend.install_bin and not cli_path(backend, env)


def ensure_cli(backend: Backend, env: Mapping[str, str], program: str) -> None:
    """Install the backend's CLI into the tool dir when the run needs it."""
    if not needs_install(backend, env, program):
        return
    assert backend.install_npm is not None
    npm = find_npm(env)
    if npm is None:
        raise MissingToolError(
            f"{backend.install_bin} is not installed and npm is missing; fix: apt-get install nodejs npm "
            f"(or install Node.js 20+), then run again"
        )
    tools = tool_dir(dict(env))
    os.makedirs(tools, exist_ok=True)
    print(f"hive-relay: first use of {backend.name}: installing {backend.install_npm} into {tools} (npm, not global)",
          file=sys.stderr, flush=True)
    npm_env = {**NPM_BOUNDS, **env}
    progress = Progress(backend.install_npm, sys.stderr)
    rc = run_npm([npm, "install", "--no-audit", "--no-fund", "--progress=false", "--loglevel=silly",
                  "--prefix", tools, backend.install_npm], npm_env, progress)
    if rc != 0 or not cli_path(backend, env):
        progress.close(None)
        registry = npm_env.get("NPM_CONFIG_REGISTRY") or "npm config get registry"
        if progress.untrusted:
            fix = f"npm does not trust the registry's certificate ({registry}): set NPM_CONFIG_CAFILE to your CA bundle"
        elif progress.unreachable:
            fix = f"check access to the npm registry ({registry}; a proxy needs NPM_CONFIG_PROXY / HTTPS_PROXY)"
        else:
            fix = "read npm's log above"
        raise MissingToolError(
            f"npm could not install {backend.install_npm} (exit {rc}{': ' + progress.reason if progress.reason else ''}) "
            f"after {progress.elapsed():.1f} s; fix: {fix}, or install it yourself: "
            f"npm install --prefix {tools} {backend.install_npm}"
        )
    count = f", {progress.added} package{'s' if progress.added != 1 else ''}" if progress.added else ""
    progress.close(f"installed {backend.install_bin} ({backend.install_npm}{count}) in {progress.elapsed():.1f} s")


def run_npm(argv: list[str], env: Mapping[str, str], progress: Progress) -> int:
    """Run npm with its log on a pipe, feeding each line to `progress`; ticks the clock while npm is quiet."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(env))
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    pending = b""
    try:
        while True:
            if procs.readable(fd, progress.tick):
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    progress.feed(line.decode("utf-8", errors="replace"))
            progress.show()
        if pending:
            progress.feed(pending.decode("utf-8", errors="replace"))
        return proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        progress.close(None)
        raise
    finally:
        proc.stdout.close()


_HTTP_FETCH = re.compile(r"^npm http fetch GET (\d+) (\S+)")
_ATTEMPT = re.compile(r"^npm http fetch GET (\S+) attempt (\d+) failed with (\S+)")
_ADDED = re.compile(r"^(?:added|changed) (\d+) packages?")


class Progress:
    """What npm is doing, as one line: `hive-relay: npm PKG@VERSION: downloading (12 packages) · 4.2 s`."""

    def __init__(self, package: str, out: TextIO, tty: bool | None = None) -> None:
        self.package = package
        self.out = out
        self.tty = (out.isatty() and os.environ.get("TERM") != "dumb") if tty is None else tty
        self.tick = TICK_TTY if self.tty else TICK_PLAIN
        self.start = time.monotonic()
        self.phase = "starting npm"
        self.manifests = 0
        self.tarballs = 0
        self.added = 0
        self.reason = ""
        self.unreachable = False
        self.untrusted = False
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self._shown = ""
        self._last_plain = 0.0
        self._width = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def feed(self, line: str) -> None:
        line = line.rstrip("\r")
        if m := _ATTEMPT.match(line):
            self.phase = f"fetching {m.group(1)}: attempt {m.group(2)} failed ({m.group(3)})"
            self._network(m.group(3))
        elif m := _HTTP_FETCH.match(line):
            if m.group(2).endswith(".tgz"):
                self.tarballs += 1
                self.phase = f"downloading ({self.tarballs} tarballs)"
            else:
                self.manifests += 1
                self.phase = f"resolving dependencies ({self.manifests} manifests)"
        elif line.startswith("npm silly fetch manifest ") or line.startswith("npm silly idealTree"):
            self.phase = f"resolving dependencies ({self.manifests} manifests)"
        elif line.startswith("npm silly ADD ") or line.startswith("npm silly reify"):
            self.phase = "unpacking packages"
        elif line.startswith("npm info run ") and "{ code:" not in line:
            words = line.split()
            self.phase = f"running {words[4] if len(words) > 4 else 'install'} script of {words[3] if len(words) > 3 else '?'}"
        elif m := _ADDED.match(line):
            self.added = int(m.group(1))
            self.phase = "done"
        elif line.startswith("npm error"):
            self.errors.append(line)
            text = line.removeprefix("npm error").strip()
            if text.startswith("code "):
                self._network(text.removeprefix("code ").strip())
                self.reason = self.reason or text
            elif (text.startswith("FetchError:") or text.startswith("request to ") or text.startswith("404")
                  or "reason:" in text):
                self.reason = text.removeprefix("FetchError: ")
        elif line.startswith("npm warn") and "install-scripts" not in line:
            self.warnings.append(line)

    def _network(self, code: str) -> None:
        if code in UNREACHABLE:
            self.unreachable = True
        if code in UNTRUSTED:
            self.untrusted = True

    def text(self) -> str:
        return f"hive-relay: npm {self.package}: {self.phase} · {self.elapsed():.1f} s"

    def show(self) -> None:
        if self.tty:
            line = self.text()
            import shutil

            cols = shutil.get_terminal_size((80, 24)).columns
            line = line[: max(20, cols - 1)]
            if line != self._shown:
                self.out.write("\r\x1b[K" + line)
                self.out.flush()
                self._shown = line
            return
        # Plain output: a line when npm starts a new phase, and one every TICK_PLAIN seconds while it is quiet.
        now = time.monotonic()
        phase_word = self.phase.split(" (")[0]
        if phase_word != self._shown or now - self._last_plain >= TICK_PLAIN:
            self.out.write(self.text() + "\n")
            self.out.flush()
            self._shown = phase_word
            self._last_plain = now

    def close(self, final: str | None) -> None:
        """End the progress line; `final` replaces it (None: npm failed, its errors follow)."""
        if self.tty and self._shown:
            self.out.write("\r\x1b[K")
            self._shown = ""
        if final is None:
            for line in self.errors[-12:] if not (self.unreachable or self.untrusted) else []:
                self.out.write(line + "\n")
        else:
            self.out.write(f"hive-relay: {final}\n")
        self.out.flush()
