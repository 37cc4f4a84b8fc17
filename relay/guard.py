"""Guarded settings: the agent may edit its own settings in the box, but not plant what runs on the
host later. At exit, if a guarded file's execution-capable keys changed (hooks, MCP servers, notify
commands, credential helpers, status lines, env), the original is restored and the box's version is
kept aside with a note. Other edits (theme, model, permissions the user approved) are kept.
"""

from __future__ import annotations

import json
import os
import time

EXEC_KEYS = frozenset({
    # claude / gemini (JSON)
    "hooks", "mcpServers", "apiKeyHelper", "awsAuthRefresh", "awsCredentialExport", "otelHeadersHelper",
    "statusLine", "env", "tools",
    # codex (TOML)
    "notify", "mcp_servers", "shell_environment_policy", "profiles",
    # opencode (JSON)
    "mcp", "plugin", "command",
})


def snapshot(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def _parse(data: bytes | None, path: str) -> dict | None:
    """The settings as a mapping; None when absent, {} when empty; raises ValueError when unparsable."""
    if data is None:
        return None
    if not data.strip():
        return {}
    if path.endswith(".toml"):
        import tomllib

        return tomllib.loads(data.decode())
    value = json.loads(data)
    return value if isinstance(value, dict) else {"(not an object)": value}


def changed_exec_keys(before: bytes | None, after: bytes | None, path: str) -> list[str]:
    """Execution-capable keys that differ; an unparsable new file counts as changing all of them."""
    try:
        old = _parse(before, path) or {}
    except ValueError:
        old = {}
    try:
        new = _parse(after, path) or {}
    except ValueError:
        return ["(unparsable file)"]
    return sorted(k for k in EXEC_KEYS if old.get(k) != new.get(k))


def enforce(path: str, before: bytes | None) -> str | None:
    """Revert exec-key changes to `path`; returns a message for the user, or None."""
    after = snapshot(path)
    if after == before:
        return None
    keys = changed_exec_keys(before, after, path)
    if not keys:
        return None
    aside = f"{path}.hive-relay-rejected-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        if after is not None:
            with open(aside, "wb") as fh:
                fh.write(after)
        if before is None:
            os.unlink(path)
        else:
            tmp = f"{path}.hive-relay-{os.getpid()}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(before)
            os.replace(tmp, path)
    except OSError as err:
        return f"could not revert {path} ({', '.join(keys)} changed in the box): {err.strerror or err}"
    return (f"reverted {path}: the box changed {', '.join(keys)}, which would run on the host later; "
            f"its version is kept at {aside}")
