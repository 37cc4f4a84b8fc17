"""The container engine on this host: which one, whether it answers, whether it is rootless, and
making sure the run's image exists before a container launch (built on first use, with progress)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from .container_argv import ContainerRun, engine_kind
from .errors import RefusedError


@dataclass(frozen=True)
class EngineInfo:
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


def ensure_ready(run: ContainerRun, matrix, env: Mapping[str, str]) -> None:  # noqa: ANN001 - Matrix
    """Build the image if this is its first use; refuse clearly if the engine does not answer.
    The image check alone is the fast path (~50 ms): `info` costs ~450 ms, so it runs only when
    the image is missing, to tell a broken engine from a first run."""
    from . import image

    engine = [run.engine]
    if image.exists(engine, run.image):
        return
    found = info(run.engine)
    if found.error:
        raise RefusedError(f"container mode cannot start: {found.error}; fix: `invoke doctor` shows the engine's "
                           "state (podman needs no daemon: apt-get install podman)")
    import os

    spec = image.spec_from_env(matrix.backends, os.getuid(), os.getgid(), env)
    image.say(f"first container run: building {spec.tag} (once; later runs reuse it)")
    image.build(engine, spec, env)
