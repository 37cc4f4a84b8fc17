"""Render a plan into a podman/docker `run` argv for container mode (nothing is run here)."""

from __future__ import annotations

from collections.abc import Iterable

from .fsplan import Mount

TYPE_CHECKING = False  # avoids importing typing (5 ms) at launch
if TYPE_CHECKING:
    from .plan import Limits

IMAGE = "localhost/hive-relay-contributor:latest"


def build(
    *,
    engine: str,
    backend: str,
    workdir: str,
    mounts: Iterable[Mount],
    env_set: dict[str, str],
    env_pass: Iterable[str],
    limits: Limits,
    interactive: bool,
    tty: bool,
    argv: list[str],
) -> list[str]:
    """Read-only root, no capabilities, no network but our proxy, the same binds as local mode."""
    args = [engine, "run", "--rm", "-i"]
    if interactive and tty:
        args.append("-t")
    args += ["--read-only", "--tmpfs", f"/tmp:size={limits.memory // 4}", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
             "--network", "none", "--pids-limit", str(limits.pids), "--memory", str(limits.memory),
             "--label", f"hive-relay.backend={backend}", "--workdir", workdir]
    for m in mounts:
        if m.kind in ("bind", "ro-bind", "private-bind") and m.dst != "/" and m.src:
            suffix = "rw" if m.kind == "bind" else "ro"
            args += ["--volume", f"{m.src}:{m.dst}:{suffix}"]
        elif m.kind == "mask-file":
            args += ["--volume", f"/dev/null:{m.dst}:ro"]
        elif m.kind == "mask-dir":
            args += ["--tmpfs", f"{m.dst}:ro"]
    for name in sorted(env_set):
        args += ["--env", f"{name}={env_set[name]}"]
    for name in env_pass:
        args += ["--env", name]
    args += [IMAGE, *argv]
    return args
