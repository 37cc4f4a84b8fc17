"""The house's shape, checked: layered subpackages whose imports point one way, and no circle.

Every module of relay/ lives in one layer folder. A module may import its own layer and the layers
below it, never one above: imports made inside functions count too, because they are the same
dependency paid later. docs/architecture.md draws the same list.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

RELAY = Path(__file__).resolve().parent.parent / "relay"

# Bottom to top. Each layer's job is its folder's __init__.py docstring.
LAYERS = ("model", "host", "config", "policy", "render", "box", "trust", "plan", "egress", "ui", "modes", "dev",
          "commands")


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    out = {}
    for path in sorted(RELAY.rglob("*.py")):
        parts = path.relative_to(RELAY.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The relay modules one file imports, anywhere in it (absolute imports only: the house uses no
    relative ones, which test_no_relative_imports checks)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "relay":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "relay"}
    return found & set(MODULES)


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 else None  # relay.LAYER.module; the package and its faces have none


def test_every_module_is_in_a_layer_folder() -> None:
    loose = [n for n in MODULES if n not in ("relay", "relay.__main__") and n.count(".") == 1 and n[6:] not in LAYERS]
    assert not loose, f"modules outside any layer folder: {loose}"
    folders = sorted(p.name for p in RELAY.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(LAYERS), f"layer folders differ from the list: {folders}"
    for layer in LAYERS:
        face = RELAY / layer / "__init__.py"
        assert ast.get_docstring(ast.parse(face.read_text())), f"{face} must say its layer's job in a docstring"


def test_no_relative_imports() -> None:
    """Absolute imports only, so that an import names its layer where it stands."""
    relative = [f"{path.relative_to(RELAY.parent)}:{node.lineno}" for path in MODULES.values()
                for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative, relative


def test_no_import_points_up() -> None:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = []
    for name, deps in GRAPH.items():
        mine = _layer(name)
        if mine is None:
            continue
        for dep in deps:
            theirs = _layer(dep)
            if theirs is not None and rank[theirs] > rank[mine]:
                upward.append(f"{name} ({mine}) -> {dep} ({theirs})")
    assert not upward, "imports that point up a layer:\n" + "\n".join(sorted(upward))


def test_no_circle() -> None:
    """No module reaches itself through its imports (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_proxy_pods_file_set_is_closed_and_stdlib_only() -> None:
    """kube mode's proxy image holds an explicit file set (relay/modes/kube_podman.py): everything its
    two entries import, at module level only the standard library besides relay itself."""
    from relay.modes.kube_proxy_image import PROXY_POD_FILES

    held = {str(Path(f).with_suffix("")).replace("/", ".").removesuffix(".__init__") for f in PROXY_POD_FILES}
    held = {("relay." + h) if h != "__init__" else "relay" for h in held}
    for entry in ("relay.egress.proxy_main", "relay.modes.kube_bundle"):
        assert entry in held
    need = set()
    todo = ["relay.egress.proxy_main", "relay.modes.kube_bundle"]
    while todo:
        name = todo.pop()
        if name in need:
            continue
        need.add(name)
        todo += GRAPH[name]
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages on the way
    assert need <= held, f"the proxy pod imports files it does not hold: {sorted(need - held)}"
    assert held <= need, f"the proxy pod holds files it never imports: {sorted(held - need)}"
    foreign = []
    for name in held:
        for node in ast.parse(MODULES[name].read_text()).body:  # module level: what `import` runs at once
            mods = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            foreign += [f"{name}: {m}" for m in mods
                        if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "relay"]
    assert not foreign, f"the proxy pod's files import more than the standard library: {foreign}"
