"""The inner layer: the deny list rendered into an agent CLI's own permission system.

Our box is the boundary; this is a second line of defence inside it, and the only one when a
backend runs unsandboxed under its opt-in. Native flag templates in the matrix may use:
  {claude_settings}   a Claude Code `--settings` JSON: permissions.deny for the deny list
                      (Read of secrets, Edit of write-protected workdir paths) and, when the run
                      is unsandboxed, sandbox.enabled with failIfUnavailable.
"""

from __future__ import annotations

import json
import os

from relay.policy.denylist import PROTECT_WORKDIR, SECRET_HOME, SECRET_SYSTEM


def _claude_path(path: str, home: str) -> str:
    """Claude Code rule paths: `~/x` under home, `//abs` for absolute paths."""
    if path.startswith("~/"):
        return path
    if home and path.startswith(home.rstrip("/") + "/"):
        return "~/" + path[len(home.rstrip("/")) + 1:]
    return "/" + path if path.startswith("/") else path


def claude_settings(*, home: str, uid: int, workdir: str, extra_deny: tuple[str, ...], sandboxed: bool) -> str:
    deny: list[str] = []
    for entry in SECRET_HOME + extra_deny + SECRET_SYSTEM:
        path = _claude_path(entry.replace("{uid}", str(uid)), home)
        deny += [f"Read({path})", f"Read({path}/**)"]
    for rel in PROTECT_WORKDIR:
        path = _claude_path(os.path.join(workdir, rel), home)
        deny += [f"Edit({path})", f"Edit({path}/**)"]
    settings: dict = {"permissions": {"deny": deny}}
    if sandboxed:
        settings["sandbox"] = {"enabled": True, "failIfUnavailable": True, "autoAllowBashIfSandboxed": False}
    return json.dumps(settings, separators=(",", ":"))


def render(flags: tuple[str, ...], *, home: str, uid: int, workdir: str, extra_deny: tuple[str, ...],
           unsandboxed: bool) -> list[str]:
    out = []
    for flag in flags:
        if "{claude_settings}" in flag:
            flag = flag.replace("{claude_settings}", claude_settings(
                home=home, uid=uid, workdir=workdir, extra_deny=extra_deny, sandboxed=unsandboxed))
        out.append(flag)
    return out
