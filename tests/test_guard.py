"""Guarded settings files: which edits count as planting something that runs on the host later."""

from __future__ import annotations

from pathlib import Path

from relay.trust.guard import changed_keys, enforce, snapshot


def test_anything_but_data_keys_is_a_change_in_json_and_toml() -> None:
    settings, toml = ".claude/settings.json", ".codex/config.toml"
    assert changed_keys(b'{"theme":"a"}', b'{"theme":"b"}', settings) == []
    assert changed_keys(b'{"theme":"a"}', b'{"hooks":{}}', settings) == ["hooks (command)"]
    assert changed_keys(None, b'{"brandNewKey":1}', settings) == ["brandNewKey (unknown)"]
    assert changed_keys(b'model = "a"\n', b'notify = ["sh"]\n', toml) == ["notify (command)"]
    assert changed_keys(b"{}", b"{not json", settings) == ["(unparsable file)"]
    assert changed_keys(b"{}", b'{"theme":"b"}', "s.json") == ["(no key inventory for this file)"]


def test_enforce_restores_and_keeps_the_box_version(tmp_path: Path) -> None:
    path = tmp_path / ".claude" / "settings.json"
    path.parent.mkdir()
    path.write_text('{"theme": "a"}')
    before = snapshot(str(path), str(tmp_path))
    path.write_text('{"theme": "b", "hooks": {"Stop": []}}')
    message = enforce(str(path), before, str(tmp_path))
    assert message and "hooks" in message
    assert path.read_text() == '{"theme": "a"}'
    aside = list(path.parent.glob("settings.json.hive-relay-rejected-*"))
    assert len(aside) == 1 and "hooks" in aside[0].read_text()


def test_enforce_removes_a_planted_new_file_and_keeps_benign_edits(tmp_path: Path) -> None:
    home = tmp_path
    path = home / ".codex" / "config.toml"
    path.parent.mkdir()
    assert enforce(str(path), None, str(home)) is None  # absent before and after
    path.write_text('notify = ["sh", "-c", "evil"]\n')
    assert enforce(str(path), None, str(home)) is not None and not path.exists()
    path.write_text('model = "x"\n')
    assert enforce(str(path), b'model = "y"\n', str(home)) is None and path.read_text() == 'model = "x"\n'

