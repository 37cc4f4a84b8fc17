"""First use installs the agent CLI: project-locally with npm (never `npm -g`), with visible progress."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping

from .config import Backend
from .errors import RelayError
from .paths import tool_dir

EXIT_MISSING = 127


class MissingToolError(RelayError):
    """A program the run needs is not installed and could not be installed."""

    exit_code = EXIT_MISSING


def cli_path(backend: Backend, env: Mapping[str, str]) -> str | None:
    if not backend.install_bin:
        return None
    tools = tool_dir(dict(env))
    return shutil.which(backend.install_bin, path=f"{tools}/node_modules/.bin:{env.get('PATH', os.defpath)}")


def find_npm(env: Mapping[str, str]) -> str | None:
    return shutil.which("npm", path=env.get("PATH", os.defpath))


def ensure_cli(backend: Backend, env: Mapping[str, str], program: str) -> None:
    """Install the backend's CLI into the tool dir when the run needs it (`program` is what the
    argv starts, which user config may have changed) and it is on neither the tool dir nor PATH."""
    if backend.install_npm is None or program != backend.install_bin or cli_path(backend, env):
        return
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
    proc = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--prefix", tools, backend.install_npm],
        stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr, env=dict(env),
    )
    if proc.returncode != 0 or not cli_path(backend, env):
        raise MissingToolError(
            f"npm could not install {backend.install_npm} (exit {proc.returncode}); fix: check access to the npm "
            f"registry, or install it yourself: npm install --prefix {tools} {backend.install_npm}"
        )
    print(f"hive-relay: installed {backend.install_bin}", file=sys.stderr, flush=True)
