"""The settings keys each agent CLI knows, read from the installed CLI package itself.

The upgrade tests (tests/test_settings_inventory.py) compare these with the inventories in
config/settings/: a key the CLI knows that the inventory does not classify fails the test, so a CLI
upgrade cannot widen what comes back from a box. Each reader looks at the real package: claude's zod
settings schema and its global-config key lists in the binary's embedded JS, codex's serde field names
of `ConfigToml` in its Rust binary, gemini's SETTINGS_SCHEMA in its bundle, opencode's Effect `Config`
schema in its binary. The readers are tiny JS-literal scanners, not evaluators: nothing of the CLI runs.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

OPEN, CLOSE = "({[", ")}]"
REGEX_BEFORE = "(,=:[!&|?{};"
KEY = re.compile(r"(?:\"([^\"]+)\"|'([^']+)'|([A-Za-z_$][\w$]*))\s*:")


def _skip_ws(d: str, k: int) -> int:
    while True:
        while k < len(d) and d[k] in " \n\t\r":
            k += 1
        if d.startswith("//", k):
            k = d.find("\n", k)
            k = len(d) if k < 0 else k
        elif d.startswith("/*", k):
            k = d.find("*/", k) + 2
        else:
            return k


def _string_end(d: str, k: int) -> int:
    q = d[k]
    k += 1
    while d[k] != q:
        if d[k] == "\\":
            k += 2
            continue
        if q == "`" and d.startswith("${", k):
            k = close(d, k + 1)
        k += 1
    return k


def _regex_end(d: str, k: int) -> int:
    k += 1
    inclass = False
    while True:
        ch = d[k]
        if ch == "\\":
            k += 2
            continue
        if ch == "[":
            inclass = True
        elif ch == "]":
            inclass = False
        elif ch == "/" and not inclass:
            return k
        k += 1


def close(d: str, j: int) -> int:
    """Index of the bracket closing the one at j (strings, templates, regexes and comments skipped)."""
    depth, k, prev = 0, j, ""
    while True:
        c = d[k]
        if c in "\"'`":
            k, prev = _string_end(d, k), c
        elif d.startswith("//", k) or d.startswith("/*", k):
            k = _skip_ws(d, k)
            continue
        elif c == "/" and prev in REGEX_BEFORE:
            k, prev = _regex_end(d, k), "/"
        elif c in OPEN:
            depth, prev = depth + 1, c
        elif c in CLOSE:
            depth, prev = depth - 1, c
            if depth == 0:
                return k
        elif not c.isspace():
            prev = c
        k += 1


def entries(d: str, j: int) -> list[tuple[str, str]]:
    """(key, value text) of the object literal whose '{' is at j; a spread is ('...', its text)."""
    end = close(d, j)
    k, out = j + 1, []
    while True:
        k = _skip_ws(d, k)
        if k >= end:
            return out
        if d.startswith("...", k):
            key, s = "...", k + 3
        else:
            m = KEY.match(d, k)
            if not m:
                raise ValueError(f"not an object literal near {d[k:k + 80]!r}")
            key, s = m.group(1) or m.group(2) or m.group(3), m.end()
        e, prev = s, ":"
        while e < end and d[e] != ",":
            c = d[e]
            if c in OPEN:
                e, prev = close(d, e) + 1, ")"
                continue
            if c in "\"'`":
                e, prev = _string_end(d, e) + 1, c
                continue
            if d.startswith("//", e) or d.startswith("/*", e):
                e = _skip_ws(d, e)
                continue
            if c == "/" and prev in REGEX_BEFORE:
                e = _regex_end(d, e)
            if not c.isspace():
                prev = c
            e += 1
        out.append((key, d[s:e]))
        k = e + 1


def _object_after(d: str, anchor: str, start: int = 0) -> int:
    i = d.find(anchor, start)
    if i < 0:
        raise LookupError(f"{anchor!r} not found: the CLI's layout changed; update tests/cli_keys.py")
    return d.find("{", i + len(anchor) - 1)


@functools.lru_cache(maxsize=2)
def _text(path: Path) -> str:
    return path.read_bytes().decode("latin-1")


# --- claude ---------------------------------------------------------------------------------------------

Tree = dict[str, "Tree | None"]  # key -> its known children (None: not descended)


def claude_binary(tools: Path) -> Path:
    for rel in ("@anthropic-ai/claude-code-linux-x64/claude", "@anthropic-ai/claude-code/bin/claude.exe",
                "@anthropic-ai/claude-code/cli.js"):
        if (tools / "node_modules" / rel).is_file():
            return tools / "node_modules" / rel
    raise FileNotFoundError(f"no claude package under {tools}")


def claude_settings(d: str) -> Tree:
    """The settings.json schema: the zod object whose first keys are $schema and apiKeyHelper."""
    m = re.search(r"return [\w$]+\.object\(\{\$schema:[\w$]+\.string\(\)\.optional\(\)\.describe\(\"JSON Schema "
                  r"reference for Claude Code settings\"\)", d)
    if not m:
        raise LookupError("claude's settings schema not found; update tests/cli_keys.py")
    tree: Tree = {}
    for key, value in entries(d, d.find("{", m.start())):
        if key != "...":
            tree[key] = None
            continue
        spread = value.strip()
        if "&&{" in spread:  # ...flag&&{key:...}: keys behind a feature flag count too
            for sub, _ in entries(spread, spread.index("&&{") + 2):
                tree[sub] = None
        elif re.fullmatch(r"[\w$]+\(e\)", spread):  # ...features(e): every feature's shape()
            tree.update(dict.fromkeys(_claude_feature_keys(d, "shape")))
        elif spread not in ("!1", "!0"):
            raise LookupError(f"claude settings: unknown spread {spread[:80]!r}")
    m = re.search(r"permissions:([\w$]+)\(e\)\.optional\(\)\.describe\(\"Tool usage permissions", d)
    if m:
        fn = _object_after(d, f"function {m.group(1)}(e){{return H.object({{")
        perms: Tree = {}
        for key, _value in entries(d, fn):
            if key == "...":
                perms.update(dict.fromkeys(_claude_feature_keys(d, "permissionsShape")))
            else:
                perms[key] = None
        tree["permissions"] = perms
    return tree


def _claude_feature_keys(d: str, which: str) -> list[str]:
    """Keys the settings gain per feature gate: the `shape`/`permissionsShape` of each feature table entry."""
    m = re.search(r"[\w$]+=\{autoMode:\{buildGate:", d)
    if not m:
        raise LookupError("claude's feature settings table not found; update tests/cli_keys.py")
    keys = []
    for _feature, spec in entries(d, m.end() - len("{autoMode:{buildGate:")):
        spec = spec.strip()
        for name, value in entries(spec, 0):
            if name == which:
                keys += [k for k, _ in entries(value, value.index("({") + 1)]
    return keys


def claude_global_config(d: str) -> tuple[set[str], set[str]]:
    """~/.claude.json: (top-level keys, keys of one projects.<path> entry), from the config module's
    exported GLOBAL_CONFIG_KEYS, PROJECT_CONFIG_KEYS and the two DEFAULT_* objects."""
    names = {}
    for export in ("GLOBAL_CONFIG_KEYS", "PROJECT_CONFIG_KEYS", "DEFAULT_GLOBAL_CONFIG", "DEFAULT_PROJECT_CONFIG"):
        m = re.search(re.escape(export) + r":\(\)=>([\w$]+)", d)
        if not m:
            raise LookupError(f"claude's {export} not found; update tests/cli_keys.py")
        names[export] = m.group(1)

    def array(var: str) -> set[str]:
        m = re.search(r"[,;\s]" + re.escape(var) + r"=\[", d)
        assert m, var
        j = m.end() - 1
        return set(re.findall(r"\"([^\"]+)\"", d[j:close(d, j)]))

    def obj(var: str) -> set[str]:
        m = re.search(r"[,;\s]" + re.escape(var) + r"=(\{|([\w$]+)\(\))", d)
        assert m, var
        # var={...}, or var=factory() with function factory(){return{...}}
        j = _object_after(d, f"function {m.group(2)}(){{return{{") if m.group(2) else m.end() - 1
        return {k for k, _ in entries(d, j) if k != "..."}

    top = array(names["GLOBAL_CONFIG_KEYS"]) | obj(names["DEFAULT_GLOBAL_CONFIG"])
    project = array(names["PROJECT_CONFIG_KEYS"]) | obj(names["DEFAULT_PROJECT_CONFIG"])
    top |= _saved_keys(d, "saveGlobalConfig fallback")
    project |= _saved_keys(d, "saveCurrentProjectConfig fal")
    return top, project


def _saved_keys(d: str, marker: str) -> set[str]:
    """Every key a caller of claude's config saver writes: `save((c)=>({...c, KEY: ...}))`."""
    m = None
    for hit in re.finditer(re.escape(marker), d):
        near = list(re.finditer(r"function ([\w$]+)\(e\)\{", d[max(0, hit.start() - 600):hit.start()]))
        if near:
            m = near[-1]
            break
    if m is None:
        raise LookupError(f"claude's config saver ({marker}) not found; update tests/cli_keys.py")
    saver = m.group(1)
    keys: set[str] = set()
    for call in re.finditer(r"(?<![\w$.])" + re.escape(saver) + r"\(\(([\w$])\)=>", d):
        i = d.find("({..." + call.group(1) + ",", call.end(), call.end() + 60)
        if i >= 0:
            keys |= {k for k, _ in entries(d, i + 1) if k != "..."}
        # ...and a conditional update a little further on: `return {...c, KEY: ...}`
        keys |= set(re.findall(r"\{\.\.\." + re.escape(call.group(1)) + r",([\w$]+):", d[call.end():call.end() + 400]))
    if not keys:
        raise LookupError(f"no callers of claude's config saver {saver}; update tests/cli_keys.py")
    return keys


# --- gemini ---------------------------------------------------------------------------------------------

def gemini_settings(tools: Path) -> Tree:
    """Every SETTINGS_SCHEMA in the bundle (chunks may carry copies), merged; `properties` descended."""
    bundle = tools / "node_modules" / "@google" / "gemini-cli" / "bundle"
    tree: Tree = {}
    found = 0
    for path in sorted(bundle.glob("*.js")):
        d = _text(path)
        i = d.find("var SETTINGS_SCHEMA = {")
        if i < 0:
            continue
        found += 1
        _merge(tree, _gemini_props(d, d.find("{", i)))
    if not found:
        raise LookupError("gemini's SETTINGS_SCHEMA not found; update tests/cli_keys.py")
    return tree


def _gemini_props(d: str, j: int) -> Tree:
    tree: Tree = {}
    for key, value in entries(d, j):
        if key == "...":
            raise LookupError(f"gemini settings: a spread {value[:60]!r}")
        body = value.strip()
        sub = None
        if body.startswith("{"):
            for name, inner in entries(body, 0):
                if name == "properties" and inner.strip().startswith("{"):
                    inner = inner.strip()
                    sub = _gemini_props(inner, 0)
        tree[key] = sub
    return tree


def _merge(into: Tree, more: Tree) -> None:
    for key, sub in more.items():
        if isinstance(sub, dict):
            existing = into.get(key)
            if not isinstance(existing, dict):
                existing = into[key] = {}
            _merge(existing, sub)
        else:
            into.setdefault(key, None)


# --- opencode -------------------------------------------------------------------------------------------

def opencode_binary(tools: Path) -> Path:
    path = tools / "node_modules" / "opencode-linux-x64" / "bin" / "opencode"
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def opencode_config(d: str) -> set[str]:
    """The Effect Schema struct annotated `identifier:"Config"` (opencode.json's top level)."""
    anchor = d.find('}).annotate({identifier:"Config"})')
    if anchor < 0:
        raise LookupError("opencode's Config schema not found; update tests/cli_keys.py")
    for m in reversed(list(re.finditer(r"\.Struct\(\{", d[max(0, anchor - 200_000):anchor]))):
        j = max(0, anchor - 200_000) + m.end() - 1
        if close(d, j) == anchor:
            return {k for k, _ in entries(d, j)}
    raise LookupError("opencode's Config struct not found; update tests/cli_keys.py")


# --- codex ----------------------------------------------------------------------------------------------

def codex_binary(tools: Path) -> Path:
    found = sorted((tools / "node_modules" / "@openai").glob("codex*/vendor/*linux*/bin/codex"))
    if not found:
        raise FileNotFoundError(f"no codex binary under {tools}")
    return found[0]


def codex_config_fields(data: bytes) -> bytes:
    """serde's field names of `ConfigToml`, as the compiler laid them out: one run of snake_case names
    with no separators, right after the struct's name and before the next type's. The boundaries are
    lost, so the caller checks that the known keys tile the run exactly (codex_untiled)."""
    m = re.search(rb"ConfigTomlmodelreview_model([a-z0-9_]+)", data)
    if not m:
        raise LookupError("codex's ConfigToml field names not found; update tests/cli_keys.py")
    return b"model" + b"review_model" + m.group(1)


def codex_untiled(run: bytes, known: set[str], tail_words: set[str]) -> list[str]:
    """What of `run` the known keys cannot tile: [] when every byte is one of them (longest tiling by
    dynamic programming). A trailing word of the next type's error text (`tail_words`) may end it."""
    text = run.decode()
    n = len(text)
    best: list[int | None] = [None] * (n + 1)  # best[i]: start of the last key of a tiling of text[:i]
    best[0] = 0
    for i in range(1, n + 1):
        for key in known:
            if len(key) <= i and best[i - len(key)] is not None and text.startswith(key, i - len(key)):
                best[i] = i - len(key)
                break
    for word in sorted(tail_words, key=len, reverse=True):
        if text.endswith(word) and best[n - len(word)] is not None:
            return []
    if best[n] is not None:
        return []
    reach = max(i for i in range(n + 1) if best[i] is not None)
    return [text[reach:reach + 60]]
