"""Guarded settings: the agent may edit its own settings in the box, but not plant what runs on the
host later. At exit, if a guarded file's execution-capable keys changed (hooks, MCP servers, notify
commands, credential helpers, status lines, env), the original is restored and the box's version is
kept aside with a note. Other edits (theme, model, permissions the user approved) are kept.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass

from . import safefs

# Settings files are small; anything larger is not a settings file the host should parse.
MAX_SETTINGS = 4 << 20

EXEC_KEYS = frozenset({
    # claude / gemini (JSON)
    "hooks", "mcpServers", "apiKeyHelper", "awsAuthRefresh", "awsCredentialExport", "otelHeadersHelper",
    "statusLine", "env", "tools",
    # claude: plugins and marketplaces run code; project MCP approvals run a box-written .mcp.json
    "enabledPlugins", "extraKnownMarketplaces", "enableAllProjectMcpServers", "enabledMcpjsonServers",
    # codex (TOML): also where the API key goes (a provider's base_url) and what the agent may do unasked
    "notify", "mcp_servers", "shell_environment_policy", "profiles", "profile", "model_provider", "model_providers",
    "openai_base_url", "chatgpt_base_url", "approval_policy", "sandbox_mode", "sandbox_workspace_write",
    "experimental_instructions_file", "model_instructions_file", "otel", "features",
    # opencode (JSON)
    "mcp", "plugin", "command",
})


@dataclass(frozen=True)
class Snapshot:
    """What a guarded path was before the box ran: its bytes (None: absent), or the target of a
    link the user keeps there (dotfile managers do), plus the entry's identity to spot a swap."""

    data: bytes | None
    link: str | None = None
    ident: tuple[int, ...] | None = None


def _ident(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns)

# Nested keys: claude's `permissions.defaultMode: bypassPermissions` would make the next host session
# run every tool without asking (the rest of `permissions`, approvals the user gave, is kept).
EXEC_SUBKEYS = (("permissions", "defaultMode"),)


def snapshot(path: str, base: str | None = None) -> Snapshot:
    """Read a guarded file before the run, with no link followed below `base` (the user's home)."""
    base, rel = safefs._split(path, base if base and safefs.beneath(path, base) else None)
    try:
        with safefs.base_dir(base) as dfd:
            st = safefs.lstat_beneath(dfd, rel)
            if st is None:
                return Snapshot(None)
            if stat.S_ISLNK(st.st_mode):
                with safefs.parent_of(dfd, rel) as (pfd, name):
                    return Snapshot(None, link=os.readlink(name, dir_fd=pfd), ident=_ident(st))
            return Snapshot(safefs.read_beneath(dfd, rel, MAX_SETTINGS), ident=_ident(st))
    except OSError:
        return Snapshot(None, ident=(-1,))  # unreadable before the run: anything after it is a change



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
    keys = [k for k in EXEC_KEYS if old.get(k) != new.get(k)]
    keys += [f"{k}.{sub}" for k, sub in EXEC_SUBKEYS if _sub(old, k, sub) != _sub(new, k, sub)]
    return sorted(keys)


def _sub(data: dict, key: str, sub: str) -> object:
    value = data.get(key)
    return value.get(sub) if isinstance(value, dict) else None


def enforce(path: str, before: Snapshot | bytes | None, base: str | None = None) -> str | None:
    """Revert exec-key changes to `path`; returns a message for the user, or None.

    The box may have left anything at `path`: a link, a FIFO, a directory, a huge file. Whatever it
    is, it is never followed or read beyond a bound; anything we cannot judge counts as a change of
    every key. A change is moved aside whole (a rename within the directory, under a name the box
    cannot guess) and the original is restored; if that fails, the message says so loudly and the
    box's version is not left live: it is moved aside even when the original cannot come back.
    """
    if not isinstance(before, Snapshot):
        before = Snapshot(before)
    base, rel = safefs._split(path, base if base and safefs.beneath(path, base) else None)
    try:
        with safefs.base_dir(base) as dfd, safefs.parent_of(dfd, rel) as (pfd, name):
            return _enforce_in(pfd, name, path, before)
    except FileNotFoundError:
        return None  # the directory itself is gone: nothing of the box's can run from there
    except OSError as err:
        return (f"could not check {path} after the box ran: {err.strerror or err}; "
                f"fix: inspect it before starting the agent on the host")


def _enforce_in(pfd: int, name: str, path: str, before: Snapshot) -> str | None:
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is None and before.data is None and before.link is None:
        return None
    # No shortcut on (inode, size, mtime): the box owns the file and can rewrite it in place and set
    # its mtime back. The bytes are always compared.
    if st is not None and stat.S_ISREG(st.st_mode):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            try:
                after: bytes | None = safefs._read_fd(fd, MAX_SETTINGS, name)
            finally:
                os.close(fd)
        except OSError:
            after, keys = None, ["(unreadable or oversized file)"]
        else:
            if after == before.data:
                return None
            keys = changed_exec_keys(before.data, after, path)
            if not keys:
                return None
    elif st is None:
        keys = changed_exec_keys(before.data, None, path) if before.link is None else []
        if not keys:
            return None  # a deleted settings file runs nothing later
    elif stat.S_ISLNK(st.st_mode) and before.link is not None and _readlink(pfd, name) == before.link:
        return None  # the user's own link, as it was
    else:
        keys = ["(not a regular file)"]
    aside = safefs.unique_name(name, "rejected")
    moved = False
    if st is not None:
        try:
            safefs.rename_noreplace(pfd, name, aside)
            moved = True
        except OSError as err:
            return (f"could not revert {path} ({', '.join(keys)} changed in the box): {err.strerror or err}; "
                    f"fix: remove it by hand before starting the agent on the host")
    try:
        if before.link is not None:
            tmp = safefs.unique_name(name, "tmp")
            os.symlink(before.link, tmp, dir_fd=pfd)
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        elif before.data is not None:
            safefs.replace_in(pfd, name, before.data, 0o600 if st is None else stat.S_IMODE(st.st_mode) & 0o777)
    except OSError as err:
        where = f"; the box's version is kept at {os.path.join(os.path.dirname(path), aside)}" if moved else ""
        return (f"could not restore {path} ({', '.join(keys)} changed in the box): {err.strerror or err}{where}; "
                f"fix: restore it from your backup")
    if not moved:
        return f"restored {path}: the box removed it while it held {', '.join(keys)}"
    return (f"reverted {path}: the box changed {', '.join(keys)}, which would run on the host later; "
            f"its version is kept at {os.path.join(os.path.dirname(path), aside)}")


def _readlink(pfd: int, name: str) -> str | None:
    try:
        return os.readlink(name, dir_fd=pfd)
    except OSError:
        return None
