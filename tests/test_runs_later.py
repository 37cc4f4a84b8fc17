"""The one table of what runs on the host later (relay/model/runs_later.py), and the exit report's use of it
(relay/trust/exit_report.py, relay/trust/workdir_aside.py) without a box: every class by name, the ctime signature
that a same-size rewrite with the mtime set back cannot pass, new entries found by a directory's
ctime, agent config moved aside and put back, and ordinary source quiet."""

from __future__ import annotations

import inspect
import json
import os
import stat
import time
from pathlib import Path

import pytest

from relay.model import runs_later
from relay.model.runs_later import RunsLater, by_entry, by_name
from relay.trust import exit_report, workdir_aside

CLASSED = {
    "package.json": RunsLater.PACKAGE_SCRIPTS, "sub/Makefile": RunsLater.PACKAGE_SCRIPTS,
    "x/rules.mk": RunsLater.PACKAGE_SCRIPTS, "setup.py": RunsLater.PACKAGE_SCRIPTS, ".npmrc": RunsLater.PACKAGE_SCRIPTS,
    ".cargo/config.toml": RunsLater.PACKAGE_SCRIPTS, "Taskfile.yml": RunsLater.PACKAGE_SCRIPTS,
    ".husky/pre-commit": RunsLater.HOOK_FRAMEWORK, ".pre-commit-config.yaml": RunsLater.HOOK_FRAMEWORK,
    ".github/workflows/ci.yml": RunsLater.CI_EDITOR, ".vscode/tasks.json": RunsLater.CI_EDITOR,
    ".envrc": RunsLater.ENVIRONMENT, "a/.env.local": RunsLater.ENVIRONMENT, "venv/lib/x.pth": RunsLater.ENVIRONMENT,
    "node_modules/.bin/tsc": RunsLater.ENVIRONMENT, "mise.toml": RunsLater.ENVIRONMENT,
    "conftest.py": RunsLater.TASK_RUNNER, "tests/deep/conftest.py": RunsLater.TASK_RUNNER,
    "noxfile.py": RunsLater.TASK_RUNNER, "invoke.py": RunsLater.TASK_RUNNER, "tasks.py": RunsLater.TASK_RUNNER,
    "pytest.ini": RunsLater.TASK_RUNNER, ".devcontainer/devcontainer.json": RunsLater.TASK_RUNNER,
    ".devcontainer.json": RunsLater.TASK_RUNNER,
    "pkg/.claude/settings.json": RunsLater.AGENT_CONFIG, "pkg/.codex/config.toml": RunsLater.AGENT_CONFIG,
    "pkg/.gemini/settings.json": RunsLater.AGENT_CONFIG, ".opencode/plugins/p.js": RunsLater.AGENT_CONFIG,
    "a/opencode.json": RunsLater.AGENT_CONFIG, "opencode.jsonc": RunsLater.AGENT_CONFIG,
    ".claude/skills/s/SKILL.md": RunsLater.AGENT_CONFIG, ".claude/rules/r.md": RunsLater.AGENT_CONFIG,
    ".claude/output-styles/o.md": RunsLater.AGENT_CONFIG, "deep/er/.mcp.json": RunsLater.AGENT_CONFIG,
    ".gitattributes": RunsLater.GIT_STEERING, "lib/.gitmodules": RunsLater.GIT_STEERING,
}
ORDINARY = ["app.py", "src/pkg/module.py", "README.md", "docs/conf.py", "node_modules/left-pad/index.js",
            "x/.github/workflows/ci.yml", "tests/test_app.py", "Makefile.bak", "claude.md", "environment.txt"]


@pytest.mark.parametrize("rel", sorted(CLASSED))
def test_each_class_by_name(rel: str) -> None:
    flags = by_name(rel)
    assert [f.cls for f in flags][:1] == [CLASSED[rel]], flags
    assert all(f.why for f in flags)


@pytest.mark.parametrize("rel", ORDINARY)
def test_ordinary_source_is_not_flagged(rel: str) -> None:
    assert by_name(rel) == []


def test_every_class_but_the_kinds_has_a_rule_and_the_shared_signatures_hold() -> None:
    """The staged workdir imports by_name/by_entry: their signatures are a contract."""
    assert {r.cls for r in runs_later.TABLE} == set(RunsLater) - {RunsLater.EXECUTABLE, RunsLater.SPECIAL}
    assert list(inspect.signature(by_name).parameters) == ["rel"]
    assert list(inspect.signature(by_entry).parameters) == ["rel", "mode", "size", "link", "before_mode"]


def test_by_entry_kinds() -> None:
    reg = stat.S_IFREG
    assert [f.cls for f in by_entry("build/tool", reg | 0o755)] == [RunsLater.EXECUTABLE]
    assert RunsLater.SPECIAL in [f.cls for f in by_entry("x", reg | 0o4755)]
    assert [f.cls for f in by_entry("fifo", stat.S_IFIFO | 0o644)] == [RunsLater.SPECIAL]
    assert [f.cls for f in by_entry("a/key", stat.S_IFLNK | 0o777, link="/home/u/.ssh/id_rsa")] == [RunsLater.SPECIAL]
    assert [f.cls for f in by_entry("a/key", stat.S_IFLNK | 0o777, link="../../x")] == [RunsLater.SPECIAL]
    assert by_entry("a/b/ok", stat.S_IFLNK | 0o777, link="../c") == []
    assert by_entry("big.bin", reg | 0o644, size=runs_later.MAX_REVIEW_BYTES + 1)[0].cls == RunsLater.SPECIAL
    assert by_entry("app.py", reg | 0o644) == []
    assert runs_later.watched_component(".claude") and runs_later.watched_component("node_modules")
    assert not runs_later.watched_component("src")


# --- the exit report without a box ------------------------------------------------------------------------

def _tree(w: Path) -> None:
    (w / "build").mkdir()
    (w / "build" / "old").write_text("#!/bin/sh\n")
    (w / "build" / "old").chmod(0o755)
    (w / "conftest.py").write_text("x = 1\n")
    (w / "pkg" / ".claude").mkdir(parents=True)
    (w / "pkg" / ".claude" / "settings.json").write_text('{"permissions": {"deny": ["Bash(rm:*)"]}}\n')
    (w / "app.py").write_text("print(1)\n")
    # The start signature allows the kernel's coarse clock 20 ms: files made just before it count as
    # changed. A host's files predate a launch by more (a wait only makes this surer on a busy machine).
    time.sleep(0.05)


def _same_size_rewrite_mtime_back(path: Path, data: bytes) -> None:
    st = path.stat()
    assert len(data) == st.st_size
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_same_size_rewrite_with_mtime_set_back_and_a_new_executable_in_a_dir_with_mtime_reset_are_named(
        tmp_path: Path) -> None:
    w = tmp_path / "w"
    w.mkdir()
    _tree(w)
    watch = exit_report.start(str(w))
    assert watch is not None
    _same_size_rewrite_mtime_back(w / "conftest.py", b"y = 2\n")
    dst = (w / "build").stat()
    (w / "build" / "evil").write_text("#!/bin/sh\nid\n")
    (w / "build" / "evil").chmod(0o755)
    os.utime(w / "build", ns=(dst.st_atime_ns, dst.st_mtime_ns))
    (w / "invoke.py").write_text("import os\n")
    found = exit_report.finish(watch)
    files = dict(found.files)
    assert files.get("conftest.py") == "task-runner" and files.get("build/evil") == "new executable"
    assert files.get("invoke.py") == "task-runner" and "build/old" not in files and not found.partial


def test_agent_config_is_moved_aside_the_original_put_back_and_accepted_back(tmp_path: Path) -> None:
    w, state = tmp_path / "w", tmp_path / "state"
    w.mkdir()
    _tree(w)
    original = (w / "pkg" / ".claude" / "settings.json").read_bytes()
    watch = exit_report.start(str(w))
    assert watch is not None
    (w / "pkg" / ".claude" / "settings.json").write_text('{"hooks": {"Stop": [{"command": "id"}]}}\n')
    (w / "pkg" / ".claude" / "skills" / "s").mkdir(parents=True)
    (w / "pkg" / ".claude" / "skills" / "s" / "SKILL.md").write_text("---\nallowed-tools: Bash(*)\n---\n")
    (w / "sub" / ".opencode" / "plugins").mkdir(parents=True)
    (w / "sub" / ".opencode" / "plugins" / "p.js").write_text("export default async () => ({})\n")
    os.symlink("/etc/passwd", w / "sub" / ".mcp.json")
    os.mkfifo(w / "sub" / "opencode.json")
    kept = workdir_aside.kept_dir(str(state), "1-0000000a")
    found = exit_report.finish(watch, kept, "1-0000000a")
    assert (w / "pkg" / ".claude" / "settings.json").read_bytes() == original
    for gone in ("pkg/.claude/skills/s/SKILL.md", "sub/.opencode/plugins/p.js", "sub/.mcp.json", "sub/opencode.json"):
        assert not os.path.lexists(w / gone), gone
    assert not found.files and len(found.aside) == 1 and "moved aside 5 agent config file(s)" in found.aside[0]
    assert not [n for n in os.listdir(w / "sub") if "hive-relay" in n]
    manifest = json.loads((Path(kept) / "workdir.json").read_text())
    assert manifest["files"]["sub/.mcp.json"] == {**manifest["files"]["sub/.mcp.json"], "kind": "link",
                                                  "target": "/etc/passwd"}
    assert manifest["files"]["sub/opencode.json"]["kind"] == "special"
    assert "hooks" in (Path(kept) / "files" / "pkg/.claude/settings.json").read_text()
    done = workdir_aside.accept(str(state), "1-0000000a", (str(w / "pkg/.claude/settings.json"),
                                                           "workdir:sub/.opencode/plugins/p.js"))
    assert len(done) == 2 and "hooks" in (w / "pkg" / ".claude" / "settings.json").read_text()
    assert (w / "sub" / ".opencode" / "plugins" / "p.js").exists()
    from relay.model.errors import UsageError

    with pytest.raises(UsageError, match="not stored"):
        workdir_aside.accept(str(state), "1-0000000a", ("workdir:sub/opencode.json",))


def test_deleted_agent_config_is_put_back(tmp_path: Path) -> None:
    w = tmp_path / "w"
    w.mkdir()
    _tree(w)
    original = (w / "pkg" / ".claude" / "settings.json").read_bytes()
    watch = exit_report.start(str(w))
    assert watch is not None
    (w / "pkg" / ".claude" / "settings.json").unlink()
    found = exit_report.finish(watch, workdir_aside.kept_dir(str(tmp_path / "s"), "1-0000000b"), "1-0000000b")
    assert (w / "pkg" / ".claude" / "settings.json").read_bytes() == original and not found.files
    assert found.aside == ["put back 1 agent config file(s) the box deleted in the workdir: pkg/.claude/settings.json"]


def test_ordinary_edits_are_quiet(tmp_path: Path) -> None:
    w = tmp_path / "w"
    w.mkdir()
    _tree(w)
    watch = exit_report.start(str(w))
    assert watch is not None
    (w / "app.py").write_text("print(2)\n")
    (w / "util.py").write_text("x = 1\n")
    (w / "src" / "pkg").mkdir(parents=True)
    (w / "src" / "pkg" / "__init__.py").write_text("")
    (w / "build" / "notes.txt").write_text("not executable\n")
    found = exit_report.finish(watch, workdir_aside.kept_dir(str(tmp_path / "s"), "1-0000000c"), "1-0000000c")
    assert found.files == [] and found.aside == [] and not found.partial


def test_a_directory_the_box_made_unreadable_makes_the_report_partial(tmp_path: Path) -> None:
    """Unprivileged, a mode-000 dir cannot be listed: the report says partial and names it. Root
    lists it anyway, so the file in it is named."""
    w = tmp_path / "w"
    w.mkdir()
    _tree(w)
    watch = exit_report.start(str(w))
    assert watch is not None
    (w / "hide").mkdir()
    (w / "hide" / "conftest.py").write_text("x\n")
    (w / "hide").chmod(0)
    try:
        found = exit_report.finish(watch)
        lines = exit_report.publish(found, str(w), str(tmp_path / "s"), "1-0000000d", None)
    finally:
        (w / "hide").chmod(0o755)
    if os.getuid() == 0:
        assert dict(found.files).get("hide/conftest.py") == "task-runner" and not found.partial
    else:
        assert found.partial and any("partial" in line and "hide" in line for line in lines)
