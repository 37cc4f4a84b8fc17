"""The docs keep up with the code: a README of one screen, links that lead somewhere, and every piece
of the public surface (options, tasks, exit codes, `--dry-run --json` keys) and every module of the
house written down where a reader looks for it.

Pure and fast (no box): the surfaces are read from the code that defines them (relay/commands/options.py,
tasks.py, relay/model/errors.py, a plan resolved against an in-memory host), so a new option, task, exit
code, plan key or module fails here, by name, until its doc says it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from relay.commands.options import OPTIONS
from relay.model import errors

from .test_grant_scope import grant, plan_for
from .test_house import LAYERS
from .test_plan_golden import fake_checkout  # noqa: F401 - fixture

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 150
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
MODULE_PATH = re.compile(r"\brelay/[a-z_]+/[a-z_0-9]+\.py\b")


def _docs() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _section(path: Path, heading: str) -> str:
    """The text of one `## heading` section of a doc (up to the next `## `), or "" if it has none."""
    match = re.search(rf"(?ms)^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", _text(path))
    return match.group(1) if match else ""


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"(?m)^#+ (.*)$", _text(path))}


def test_the_readme_fits_on_one_screen() -> None:
    lines = _text(README).count("\n")
    assert lines < README_MAX_LINES, (f"README.md has {lines} lines (limit {README_MAX_LINES}): move the detail "
                                      "into a docs/ file and link it")


def test_the_readme_links_every_doc() -> None:
    readme = _text(README)
    missing = [p.name for p in _docs() if f"(docs/{p.name})" not in readme]
    assert not missing, f"README.md does not link these docs/ files: {missing}"


def test_every_doc_says_what_it_is_and_links_back() -> None:
    bad = []
    for path in _docs():
        lines = _text(path).splitlines()
        if not lines or not lines[0].startswith("# "):
            bad.append(f"docs/{path.name}: does not start with a `# Title` line")
        elif len(lines) < 3 or not lines[2].strip() or "(../README.md)" not in lines[2]:
            bad.append(f"docs/{path.name}: line 3 is not a one-line summary that links ../README.md")
    assert not bad, "\n".join(bad)


def test_every_relative_link_leads_to_a_file_and_its_anchor() -> None:
    broken = []
    for source in [README, *_docs()]:
        for target in LINK.findall(_text(source)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (source.parent / file_part).resolve() if file_part else source
            where = f"{source.relative_to(REPO)}: link ({target})"
            if not dest.exists():
                broken.append(f"{where}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: no heading in {dest.relative_to(REPO)} makes the anchor #{anchor}")
    assert not broken, "\n".join(broken)


def test_every_option_of_contribute_hive_is_in_usage() -> None:
    table = _section(DOCS / "usage.md", "Options of `contribute-hive`")
    assert table, "docs/usage.md has no `## Options of `contribute-hive`` section"
    missing = []
    for dest, short, _ in OPTIONS:
        long = "--" + dest.replace("_", "-")
        if not re.search(rf"`{re.escape(long)}[`\s\[]", table):
            missing.append(long)
        if f"`-{short}`" not in table:
            missing.append(f"-{short} (short for {long})")
    assert not missing, f"docs/usage.md's options table lacks: {missing} (relay/commands/options.py OPTIONS)"


def test_every_invoke_task_is_documented() -> None:
    from invoke import Collection

    import tasks

    names = sorted(Collection.from_module(tasks).task_names)
    assert "contribute-hive" in names, names
    text = "\n".join(_text(p) for p in _docs())
    missing = [n for n in names if f"`{n}`" not in text and f"invoke {n}" not in text]
    assert not missing, f"these invoke tasks (tasks.py) appear in no docs/ file: {missing}"
    table = _section(DOCS / "usage.md", "The invoke tasks")
    unlisted = [n for n in names if f"`{n}`" not in table]
    assert not unlisted, f"docs/usage.md's task table (## The invoke tasks) lacks: {unlisted}"


def test_every_exit_code_is_in_the_exit_code_table() -> None:
    table = _section(DOCS / "usage.md", "Exit codes")
    assert table, "docs/usage.md has no `## Exit codes` section"
    rows = [line for line in table.splitlines() if line.startswith("|")]
    codes = {name: value for name, value in vars(errors).items() if name.startswith("EXIT_") and isinstance(value, int)}
    assert codes, "relay/model/errors.py defines no EXIT_* constant"
    missing = [f"{name} = {value}" for name, value in sorted(codes.items())
               if not any(f"`{value}`" in row for row in rows)]
    assert not missing, f"docs/usage.md's exit-code table has no row for: {missing} (relay/model/errors.py)"


@pytest.mark.usefixtures("fake_checkout")
def test_every_dry_run_json_key_is_documented() -> None:
    """The keys `--dry-run --json` prints (relay/commands/cli.py prints `plan.to_json()`): a staged
    plan with an `auth:` grant has every optional key (`staged`, `auth_grants`); kube mode adds `kube`."""
    keys = set(plan_for("claude", grant("docs")).to_json())
    keys |= set(plan_for("shell", live=True).to_json())
    kube_run = _text(REPO / "relay" / "modes" / "kube_run.py")
    assert 'data["kube"]' in kube_run, "kube_main no longer adds `kube` to the JSON plan: update this test"
    keys.add("kube")
    table = _section(DOCS / "usage.md", "The plan: `--dry-run --json`")
    assert table, "docs/usage.md has no `## The plan: `--dry-run --json`` section"
    missing = sorted(k for k in keys if f"`{k}`" not in table)
    assert not missing, f"docs/usage.md's `--dry-run --json` table lacks these top-level keys: {missing}"


def test_every_module_is_in_the_architecture() -> None:
    arch = _text(DOCS / "architecture.md")
    modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "relay").rglob("*.py")
                     if p.name not in ("__init__.py", "__main__.py"))
    listed = set(re.findall(r"(?m)^  - `(relay/[^`]+\.py)` — \S", arch))  # the house: one line per module
    missing = [m for m in modules if m not in listed]
    assert not missing, ("docs/architecture.md's house lacks these modules; add each line under its layer's "
                         "`relay/LAYER/` line (in file order):\n" + "\n".join(_house_line(m) for m in missing))
    gone = sorted(listed - set(modules))
    assert not gone, f"docs/architecture.md's house lists modules that do not exist (moved or renamed?): {gone}"


def _house_line(module: str) -> str:
    """The house's line for a module: its path and its docstring's first sentence."""
    doc = " ".join((ast.get_docstring(ast.parse((REPO / module).read_text(encoding="utf-8"))) or "").split())
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", doc)
    return f"  - `{module}` — {doc[:end.start()] if end else doc or 'NO DOCSTRING: write one first'}"


def test_every_layer_is_in_the_architecture() -> None:
    arch = _text(DOCS / "architecture.md")
    folders = sorted(p.name for p in (REPO / "relay").iterdir() if (p / "__init__.py").exists())
    missing = [f"relay/{layer}/" for layer in sorted(set(LAYERS) | set(folders)) if f"`relay/{layer}/`" not in arch]
    assert not missing, f"docs/architecture.md's house lacks these layer folders: {missing}"


def test_the_proxy_pods_file_set_is_the_image_s() -> None:
    from relay.modes.kube_proxy_image import PROXY_POD_FILES

    para = re.search(r"(?ms)^\*\*The proxy pod's file set\.\*\*(.*?)(?=^$)", _text(DOCS / "architecture.md"))
    assert para, "docs/architecture.md has no **The proxy pod's file set.** paragraph"
    listed = set(re.findall(r"`(relay/(?:[a-z_]+/)?[a-z_0-9]+\.py)`", para.group(1)))  # the list is in backticks
    shipped = {f"relay/{f}" for f in PROXY_POD_FILES if not f.endswith("/__init__.py")}
    assert listed == shipped, (f"docs/architecture.md's proxy pod file set differs from relay/modes/kube_proxy_image.py "
                               f"PROXY_POD_FILES: missing {sorted(shipped - listed)}, extra {sorted(listed - shipped)}")


def test_no_doc_names_a_module_that_is_gone() -> None:
    stale = []
    for source in [README, *_docs()]:
        for path in sorted(set(MODULE_PATH.findall(_text(source)))):
            if not (REPO / path).exists():
                stale.append(f"{source.relative_to(REPO)}: {path}")
    assert not stale, f"these docs name modules that do not exist (moved or renamed?): {stale}"
