"""What of an agent's settings file comes back from a box: an allowlist of data keys per CLI.

The CLIs add command-running, endpoint and permission settings every release, so a list of the
dangerous keys is always one release behind. Instead, config/settings/<cli>.yaml classifies every
key each CLI knows at its pinned version (inventoried from the CLI itself; tests/test_settings_inventory.py
fails when an installed CLI knows a key the inventory does not classify). At sync-back:

- the host's file is the start; of the box's version only changes to `data` keys are taken;
- if the box changed or added anything else (any other class, or a key not listed at all), the box's
  whole version is kept aside for review, and the live file gets only the data-key changes.

Pure functions: bytes before and after in, bytes to write and the keys to review out. The inventories
are read once per process (`inventory()`), before any box runs, so a box that can write this checkout
(our own repo as the workdir) cannot widen the rule it is judged by.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from relay.config.load import read_yaml
from relay.model.errors import ConfigError
from relay.model.record import record
from relay.model.vocab import KeyClass

INVENTORY_DIR = Path(__file__).resolve().parents[2] / "config" / "settings"
MISSING = object()  # a key absent on one side


@record
class Node:
    """The rule for one key: its class (when not judged below), its known children, or one rule for
    every child (a map such as ~/.claude.json's projects.<path>)."""

    cls: KeyClass | None = None
    keys: dict[str, Node] | None = None
    each: Node | None = None


@record
class Verdict:
    """`live`: the bytes the host's file should hold (None: absent); `review`: what the box changed
    that is not data (empty: the box's version is taken as it is)."""

    live: bytes | None
    review: tuple[str, ...]


def _node(raw: object, where: str) -> Node:
    if isinstance(raw, str):
        return Node(cls=_cls(raw, where))
    if not isinstance(raw, dict) or not raw or set(raw) - {"class", "keys", "each"}:
        raise ConfigError(f"{where}: a class name, or a mapping of class/keys/each")
    keys = raw.get("keys")
    if keys is not None and not isinstance(keys, dict):
        raise ConfigError(f"{where}.keys: a mapping of key names")
    return Node(cls=_cls(raw["class"], where) if "class" in raw else None,
                keys={str(k): _node(v, f"{where}.{k}") for k, v in keys.items()} if keys is not None else None,
                each=_node(raw["each"], f"{where}.*") if "each" in raw else None)


def _cls(name: object, where: str) -> KeyClass:
    try:
        return KeyClass(name)
    except ValueError:
        raise ConfigError(f"{where}: {name!r} is not one of {', '.join(c.value for c in KeyClass)}") from None


def load(directory: Path = INVENTORY_DIR, env: Mapping[str, str] | None = None) -> dict[str, Node]:
    """Every inventoried settings file, by its path relative to $HOME ('.claude/settings.json').
    With `env`, each file's parse may come from the memo of its exact bytes (`read_yaml`)."""
    files: dict[str, Node] = {}
    for path in sorted(directory.glob("*.yaml")):
        data = read_yaml(path, env=env)
        if not isinstance(data, dict) or set(data) != {"cli", "files"} or not isinstance(data["files"], dict):
            raise ConfigError(f"{path}: expected `cli:` and `files:`")
        for name, raw in data["files"].items():
            if not str(name).startswith("~/"):
                raise ConfigError(f"{path}: {name}: a path under ~/")
            files[str(name)[2:]] = _node(raw, f"{path.name}:{name}")
    return files


@functools.lru_cache(maxsize=1)
def inventory() -> dict[str, Node]:
    """The shipped inventories, read once per process (this process's environment names the cache
    dir of the memo)."""
    return load(env=os.environ)


# --- judging ------------------------------------------------------------------------------------------

def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _merge(node: Node | None, old: object, new: object, where: str, review: list[str]) -> object:
    """`old` with the data-key changes of `new` applied; every other change is listed in `review`."""
    if old == new:
        return old
    if node is None:
        review.append(f"{where} (unknown)")
        return old
    o = {} if old is MISSING else old
    n = {} if new is MISSING else new
    if (node.keys is not None or node.each is not None) and isinstance(o, dict) and isinstance(n, dict):
        out = dict(o)
        for key in [*o, *(k for k in n if k not in o)]:
            child = node.keys[key] if node.keys is not None and key in node.keys else node.each
            value = _merge(child, o.get(key, MISSING), n.get(key, MISSING), _join(where, key), review)
            if value is MISSING:
                out.pop(key, None)
            else:
                out[key] = value
        return MISSING if old is MISSING and not out else out
    if node.cls is KeyClass.DATA:
        return new
    review.append(f"{where} ({node.cls.value if node.cls else 'unknown'})")
    return old


def _parse(data: bytes | None, rel: str) -> object:
    if data is None:
        return MISSING
    if not data.strip():
        return {}
    try:
        if rel.endswith(".toml"):
            import tomllib

            return tomllib.loads(data.decode())
        return json.loads(data)
    except RecursionError:  # a box's file nested past the parser's depth: unparsable, not a crash
        raise ValueError("nested too deeply") from None


def settle(rel: str, before: bytes | None, after: bytes | None, files: dict[str, Node] | None = None) -> Verdict:
    """Judge the box's version (`after`, None: deleted) of the settings file `rel` (relative to $HOME)
    against the host's (`before`)."""
    if before == after:
        return Verdict(before, ())
    root = (inventory() if files is None else files).get(rel)
    if root is None:
        return Verdict(before, ("(no key inventory for this file)",))
    try:
        old = _parse(before, rel)
    except (ValueError, UnicodeDecodeError):
        return Verdict(before, ("(the host's file is unparsable)",))
    try:
        new = _parse(after, rel)
    except (ValueError, UnicodeDecodeError):
        return Verdict(before, ("(unparsable file)",))
    if not isinstance(old, dict) and old is not MISSING:
        return Verdict(before, ("(the host's file is not an object)",))
    if not isinstance(new, dict) and new is not MISSING:
        return Verdict(before, ("(not an object)",))
    review: list[str] = []
    merged = _merge(root, old, new, "", review)
    if not review:
        return Verdict(after, ())
    if merged == old:
        return Verdict(before, tuple(review))
    if merged is MISSING:
        return Verdict(None, tuple(review))
    return Verdict(_dump(merged, rel), tuple(review))


def review_keys(rel: str, before: bytes | None, after: bytes | None) -> list[str]:
    """What the box changed in `rel` that is not a data key (empty: nothing to review)."""
    return list(settle(rel, before, after).review)


def _dump(value: object, rel: str) -> bytes:
    if rel.endswith(".toml"):
        assert isinstance(value, dict)
        return toml_dumps(value).encode()
    return (json.dumps(value, indent=2) + "\n").encode()


# --- a TOML writer for the merged file (tomllib only reads) -------------------------------------------------

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(key: str) -> str:
    return key if _BARE.match(key) else json.dumps(key)


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    dt = sys.modules.get("datetime")  # a date can only come from tomllib, which loaded it (~1 ms a launch saved)
    if dt is not None and isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"not a TOML value: {type(value).__name__}")


def toml_dumps(data: dict, prefix: str = "") -> str:
    """Plain keys first, then each sub-table under its own [header]; arrays of tables inline."""
    lines = [f"{_key(k)} = {_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    out = "\n".join(lines) + ("\n" if lines else "")
    for key, value in data.items():
        if isinstance(value, dict):
            name = f"{prefix}.{_key(key)}" if prefix else _key(key)
            body = toml_dumps(value, name)
            out += f"\n[{name}]\n" + body if any(not isinstance(v, dict) for v in value.values()) or not value \
                else body
    return out
