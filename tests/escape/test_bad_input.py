"""Hostile input to the config loader, the --allow-host parser and the proxy's request parser:
always a clear one-line error, never a traceback, never a widening."""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.config.load import apply_repo, load_shipped
from relay.model.errors import ConfigError

BASE = load_shipped()
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 70000), st.text(max_size=40),
                    st.sampled_from(["~/.ssh", "/etc", "api.anthropic.com", "*.evil.com", "evil.com:443", "..", "~/"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                        st.dictionaries(st.text(max_size=12), inner, max_size=5)),
                      max_leaves=20)
keys = st.sampled_from(["egress", "home", "deny", "env", "command", "ro", "rw", "sync", "guard", "pass", "set", "x"])
backend_body = st.dictionaries(keys, values, max_size=5)


@SETTINGS
@given(st.text(max_size=2000))
def test_any_text_as_a_config_file(tmp_path_factory, text: str) -> None:
    path = Path(tmp_path_factory.mktemp("cfg")) / "backends.yaml"
    path.write_text(text)
    try:
        load_shipped(path)
    except ConfigError as err:
        assert "\n" not in str(err) and str(path) in str(err)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["claude", "codex", "shell", "nope"]), backend_body, max_size=3))
def test_repo_config_never_widens(tmp_path_factory, data: dict) -> None:
    path = Path(tmp_path_factory.mktemp("repo")) / ".hive-relay.yaml"
    path.write_text(yaml.safe_dump({"backends": data}))
    try:
        result = apply_repo(dict(BASE), path)
    except ConfigError as err:
        assert "\n" not in str(err)
        return
    for name, backend in result.items():
        base = BASE[name]
        assert set(backend.egress) <= set(base.egress)
        assert set(backend.home_rw) <= set(base.home_rw) and set(backend.home_ro) <= set(base.home_ro)
        assert set(backend.home_sync) <= set(base.home_sync) and set(backend.env_pass) <= set(base.env_pass)
        assert set(base.deny) <= set(backend.deny)
        assert backend.home_guard == base.home_guard  # the host-side guard: no path added, none dropped
        assert backend.command == base.command and backend.env_set == base.env_set


@SETTINGS
@given(st.binary(max_size=300))
def test_hostile_bytes_in_a_yaml_file(tmp_path_factory, blob: bytes) -> None:
    path = Path(tmp_path_factory.mktemp("bin")) / "backends.yaml"
    path.write_bytes(blob)
    try:
        load_shipped(path)
    except ConfigError as err:
        assert "\n" not in str(err)


def test_huge_and_nested_configs(tmp_path: Path) -> None:
    huge = tmp_path / "huge.yaml"
    huge.write_text("backends:\n" + "  x: 1\n" * 300000)
    deep = tmp_path / "deep.yaml"
    deep.write_text("backends: " + "[" * 5000 + "]" * 5000)
    for path in (huge, deep):
        try:
            load_shipped(path)
        except ConfigError as err:
            assert "\n" not in str(err)
