"""The container engine on this host: which one, whether it answers, whether it is rootless.

(Making sure the run's image exists is relay/modes/image.py's `ensure_ready`: image depends on engine,
never the other way round.)"""

from __future__ import annotations

import json
import os
import subprocess

from relay.model.record import record


def engine_kind(path: str) -> str:
    """podman or docker, by the binary's name (a docker-compatible wrapper named docker* is docker)."""
    return "docker" if os.path.basename(path).startswith("docker") else "podman"


@record
class EngineInfo:
    """What the container engine on PATH is (podman or docker, rootless or not, its storage) or why none works."""

    path: str
    kind: str
    version: str | None
    rootless: bool
    storage_driver: str | None
    error: str | None

    def notes(self) -> list[str]:
        out = []
        if self.kind == "podman" and self.rootless and self.storage_driver == "vfs":
            out.append("rootless podman uses the vfs storage driver here: every launch copies the whole image "
                       "(~10 s); fix: set driver = \"overlay\" in ~/.config/containers/storage.conf and run "
                       "`podman system reset`")
        return out


def info(path: str) -> EngineInfo:
    """Ask the engine itself (`info`): a docker client without a daemon is not an engine."""
    kind = engine_kind(path)
    try:
        proc = subprocess.run([path, "info", "--format", "json"], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return EngineInfo(path, kind, None, False, None, f"{path} info failed: {err}")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return EngineInfo(path, kind, None, False, None, f"{kind} does not answer: {last}")
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        return EngineInfo(path, kind, None, False, None, f"{kind} info printed no JSON")
    if kind == "podman":
        host = data.get("host", {})
        return EngineInfo(path, kind, data.get("version", {}).get("Version"),
                          bool(host.get("security", {}).get("rootless")),
                          data.get("store", {}).get("graphDriverName"), None)
    options = data.get("SecurityOptions") or []
    return EngineInfo(path, kind, data.get("ServerVersion"), any("rootless" in o for o in options),
                      data.get("Driver"), None)
