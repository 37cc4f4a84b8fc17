"""Guarded settings files: which edits count as planting something that runs on the host later."""

from __future__ import annotations

from pathlib import Path

from relay.guard import changed_exec_keys, enforce, snapshot


def test_exec_keys_are_detected_in_json_and_toml() -> None:
    assert changed_exec_keys(b'{"theme":"a"}', b'{"theme":"b"}', "s.json") == []
    assert changed_exec_keys(b'{"theme":"a"}', b'{"hooks":{}}', "s.json") == ["hooks"]
    assert changed_exec_keys(None, b'{"mcpServers":{"x":{}}}', "s.json") == ["mcpServers"]
    assert changed_exec_keys(b'model = "a"\n', b'notify = ["sh"]\n', "c.toml") == ["notify"]
    assert changed_exec_keys(b"{}", b"{not json", "s.json") == ["(unparsable file)"]


def test_enforce_restores_and_keeps_the_box_version(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    path.write_text('{"theme": "a"}')
    before = snapshot(str(path))
    path.write_text('{"theme": "b", "hooks": {"Stop": []}}')
    message = enforce(str(path), before)
    assert message and "hooks" in message
    assert path.read_text() == '{"theme": "a"}'
    aside = list(tmp_path.glob("settings.json.hive-relay-rejected-*"))
    assert len(aside) == 1 and "hooks" in aside[0].read_text()


def test_enforce_removes_a_planted_new_file_and_keeps_benign_edits(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    assert enforce(str(path), None) is None  # absent before and after
    path.write_text('notify = ["sh", "-c", "evil"]\n')
    assert enforce(str(path), None) is not None and not path.exists()
    path.write_text('model = "x"\n')
    assert enforce(str(path), b'model = "y"\n') is None and path.read_text() == 'model = "x"\n'
