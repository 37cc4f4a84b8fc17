"""Upgrade tests: every settings key the installed, pinned agent CLI knows is classified in its inventory
(config/settings/<cli>.yaml), so a CLI upgrade cannot widen what comes back from a box unnoticed.

The key sets are read from the real CLI packages (tests/cli_keys.py says how, per CLI). The packages are
installed like the other real-CLI tests do (relay.modes.install.ensure_cli under HIVE_RELAY_TOOLS); a missing
package is a failure, never a skip: CI must not pass with an upgrade check that did not run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from relay.config import settings_keys
from relay.config.load import load_shipped
from relay.modes.install import cli_path, ensure_cli

from . import cli_keys
from .conftest import REPO

TOOLS = Path(os.environ.get("HIVE_RELAY_TOOLS") or str(REPO / ".cache" / "npm"))


@pytest.fixture(scope="module")
def tools() -> Path:
    env = {**os.environ, "HIVE_RELAY_TOOLS": str(TOOLS)}
    backends = load_shipped()
    for name in ("claude", "codex", "gemini", "opencode"):
        ensure_cli(backends[name], env, backends[name].install_bin or name)
        assert cli_path(backends[name], env), f"{name} CLI missing after install"
    return TOOLS


def _pinned(name: str, tools: Path) -> None:
    """The inventory was taken at the version backends.yaml pins, and that is the version installed."""
    spec = load_shipped()[name].install_npm
    inv = yaml.safe_load((REPO / "config" / "settings" / f"{name}.yaml").read_text())
    assert inv["cli"] == spec, f"config/settings/{name}.yaml inventories {inv['cli']}, backends.yaml pins {spec}"
    package, version = spec.rsplit("@", 1)
    installed = json.loads((tools / "node_modules" / package / "package.json").read_text())["version"]
    assert installed == version, f"{package} {installed} is installed, {version} is pinned"


def _unclassified(known: cli_keys.Tree, node: settings_keys.Node, where: str = "") -> list[str]:
    """Keys the CLI knows at a level the inventory judges key by key, but which it does not list."""
    if node.keys is None:
        return []
    out = []
    for key, sub in known.items():
        child = node.keys.get(key)
        if child is None and node.each is None:
            out.append(f"{where}{key}")
        elif child is not None and isinstance(sub, dict):
            out += _unclassified(sub, child, f"{where}{key}.")
    return out


def test_claude_settings_json_keys_are_all_classified(tools: Path) -> None:
    _pinned("claude", tools)
    text = cli_keys._text(cli_keys.claude_binary(tools))
    known = cli_keys.claude_settings(text)
    assert {"apiKeyHelper", "hooks", "env", "permissions", "statusLine", "theme", "model"} <= set(known)
    assert len(known) > 100, len(known)
    missing = _unclassified(known, settings_keys.inventory()[".claude/settings.json"])
    assert not missing, f"claude knows settings.json keys config/settings/claude.yaml does not classify: {missing}"


def test_claude_json_keys_are_all_classified(tools: Path) -> None:
    _pinned("claude", tools)
    top, project = cli_keys.claude_global_config(cli_keys._text(cli_keys.claude_binary(tools)))
    assert {"numStartups", "theme", "env", "mcpServers", "userID"} <= top and len(top) > 80, sorted(top)
    assert {"hasTrustDialogAccepted", "allowedTools", "mcpServers", "lastCost"} <= project, sorted(project)
    node = settings_keys.inventory()[".claude.json"]
    assert node.keys is not None and "projects" in node.keys
    proj = node.keys["projects"].each
    assert proj is not None and proj.keys is not None
    missing = sorted(top - set(node.keys)) + sorted(f"projects.*.{k}" for k in project - set(proj.keys))
    assert not missing, f"claude knows ~/.claude.json keys config/settings/claude.yaml does not classify: {missing}"


def test_codex_config_toml_keys_are_all_classified(tools: Path) -> None:
    _pinned("codex", tools)
    run = cli_keys.codex_config_fields(cli_keys.codex_binary(tools).read_bytes())
    node = settings_keys.inventory()[".codex/config.toml"]
    assert node.keys is not None
    known = set(node.keys)
    assert len(run) > 1000 and b"approval_policy" in run and b"mcp_servers" in run, run[:200]
    left = cli_keys.codex_untiled(run, known, tail_words={"internally"})
    assert not left, f"codex's ConfigToml has a field config/settings/codex.yaml does not classify, at: {left}"
    # the check has teeth: without one classified key the run no longer tiles
    assert cli_keys.codex_untiled(run, known - {"notify"}, tail_words={"internally"})


def test_gemini_settings_keys_are_all_classified(tools: Path) -> None:
    _pinned("gemini", tools)
    known = cli_keys.gemini_settings(tools)
    assert {"mcpServers", "hooks", "ui", "security", "tools"} <= set(known), sorted(known)
    missing = _unclassified(known, settings_keys.inventory()[".gemini/settings.json"])
    assert not missing, f"gemini knows settings keys config/settings/gemini.yaml does not classify: {missing}"


def test_opencode_config_keys_are_all_classified(tools: Path) -> None:
    _pinned("opencode", tools)
    known = cli_keys.opencode_config(cli_keys._text(cli_keys.opencode_binary(tools)))
    assert {"provider", "formatter", "lsp", "permission", "plugin", "mcp", "model"} <= known, sorted(known)
    for rel in (".config/opencode/opencode.json", ".config/opencode/config.json"):
        node = settings_keys.inventory()[rel]
        assert node.keys is not None
        missing = sorted(known - set(node.keys))
        assert not missing, f"opencode knows config keys config/settings/opencode.yaml does not classify: {missing}"
