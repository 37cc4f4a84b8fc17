"""What in a workdir runs on the host later: the one table of names, paths and kinds of entry that a
host tool executes, autoloads or trusts the next time the user builds, tests, commits or opens the
editor.

Shared by the exit report (relay/trust/exit_report.py: a `--live` run's workdir, watched at start and at
exit) and the staged workdir's review flags (issue 25). Each rule is a class (an enum, so a
misspelt class is an import-time error), a matcher on the path relative to the workdir, and a few
words on why it matters. Pure: a relative path and an lstat mode in, flags out. Extend the table,
not the callers.
"""

from __future__ import annotations

import stat
from enum import Enum

from relay.model.record import record


class RunsLater(str, Enum):
    """The classes of workdir entries that run on the host later."""

    __str__ = str.__str__
    __format__ = str.__format__

    EXECUTABLE = "executable"  # a new or changed file with an exec bit
    PACKAGE_SCRIPTS = "package-scripts"  # package-manager scripts, build files and their hooks
    HOOK_FRAMEWORK = "hook-framework"  # git hook managers: husky, pre-commit, lefthook
    CI_EDITOR = "ci-editor"  # CI definitions and editor task/launch files
    ENVIRONMENT = "environment"  # env and interpreter start-up files
    TASK_RUNNER = "task-runner"  # files test tools and task runners load by name
    AGENT_CONFIG = "agent-config"  # an agent CLI's project config, at any depth
    GIT_STEERING = "git-steering"  # filter/diff drivers and submodule URLs
    SPECIAL = "special"  # links that leave the workdir, FIFOs, devices, setuid/setgid, oversized


@record
class Rule:
    """One entry of the table. `names`: a path component equal to one of these (at any depth);
    `suffixes`: the last component ends with one of these; `prefixes`: the path starts with one of
    these components (relative to the workdir: `.github/workflows`); `under`: some component equal
    to this, with more below it (`node_modules/.bin/x`, `.husky/pre-commit`)."""

    cls: RunsLater
    why: str
    names: tuple[str, ...] = ()
    suffixes: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    under: tuple[str, ...] = ()


AGENT_CONFIG_NAMES = (".claude", ".codex", ".gemini", ".opencode", "opencode.json", "opencode.jsonc", ".mcp.json")

TABLE: tuple[Rule, ...] = (
    Rule(RunsLater.PACKAGE_SCRIPTS, "npm/yarn/pnpm run its scripts at install, test and build",
         names=("package.json", ".npmrc", ".yarnrc", ".yarnrc.yml", ".pnpmfile.cjs", "bunfig.toml")),
    Rule(RunsLater.PACKAGE_SCRIPTS, "Python builds run its build backend and hooks",
         names=("pyproject.toml", "setup.py", "setup.cfg", "pip.conf")),
    Rule(RunsLater.PACKAGE_SCRIPTS, "make/just/task run its recipes",
         names=("Makefile", "makefile", "GNUmakefile", "justfile", "Justfile", ".justfile"),
         suffixes=(".mk",)),
    Rule(RunsLater.PACKAGE_SCRIPTS, "task runs its tasks", names=("Taskfile.yml", "Taskfile.yaml", "Taskfile.dist.yml")),
    Rule(RunsLater.PACKAGE_SCRIPTS, "cargo, rake, bundler and gradle run it at build",
         names=("build.rs", "Rakefile", "Gemfile", "build.gradle", "build.gradle.kts", "settings.gradle",
                "settings.gradle.kts", "gradlew"), prefixes=(".cargo",)),
    Rule(RunsLater.HOOK_FRAMEWORK, "git hook managers run it at commit",
         names=(".pre-commit-config.yaml", "lefthook.yml", "lefthook.yaml", ".lefthook.yml"), under=(".husky",)),
    Rule(RunsLater.CI_EDITOR, "CI runs it with the project's secrets", prefixes=(".github/workflows",),
         names=(".gitlab-ci.yml",)),
    Rule(RunsLater.CI_EDITOR, "the editor runs its tasks and launch configs", under=(".vscode", ".idea"),
         names=(".vscode", ".idea")),
    Rule(RunsLater.TASK_RUNNER, "the devcontainer's initializeCommand runs on the host", under=(".devcontainer",),
         names=(".devcontainer", ".devcontainer.json")),
    Rule(RunsLater.ENVIRONMENT, "direnv and dotenv loaders apply it in the user's shell and tools",
         names=(".envrc", ".env")),
    Rule(RunsLater.ENVIRONMENT, "mise and asdf pick the tools, env and hooks of every command here",
         names=("mise.toml", ".mise.toml", ".tool-versions")),
    Rule(RunsLater.ENVIRONMENT, "Python runs it at every start", names=("sitecustomize.py", "usercustomize.py",
                                                                      "pyvenv.cfg"), suffixes=(".pth",)),
    Rule(RunsLater.ENVIRONMENT, "npm run and npx put it first on PATH", under=("node_modules/.bin",)),
    Rule(RunsLater.TASK_RUNNER, "pytest, tox, nox and invoke load it by name",
         names=("conftest.py", "noxfile.py", "tasks.py", "invoke.py", "invoke.yaml", "invoke.yml", "invoke.json",
                "fabfile.py", "pytest.ini", ".pytest.ini", "tox.ini")),
    Rule(RunsLater.AGENT_CONFIG, "an agent CLI loads hooks, MCP servers and permissions from it",
         names=AGENT_CONFIG_NAMES, under=AGENT_CONFIG_NAMES),
    Rule(RunsLater.GIT_STEERING, "git runs its filter and diff drivers, and fetches its submodules",
         names=(".gitattributes", ".gitmodules", ".lfsconfig")),
)


class _Index:
    """The table compiled for the walk's hot loop: by_name() is asked once per file of the workdir,
    so most paths must be turned away by a set lookup or two."""

    def __init__(self, table: tuple[Rule, ...]) -> None:
        self.names: dict[str, list[Rule]] = {}
        for rule in table:
            for name in rule.names:
                self.names.setdefault(name, []).append(rule)
        self.suffixes = tuple(s for rule in table for s in rule.suffixes)
        # Any component here may put a path in a prefix or under rule.
        self.components = frozenset(p.split("/")[0] for rule in table for p in rule.prefixes + rule.under)


_INDEX = _Index(TABLE)


def name_may_match(name: str) -> bool:
    """False when a file of this name is in no class unless a directory above it puts it in one
    (see watched_component): the walk's fast path."""
    return name in _INDEX.names or name.endswith(_INDEX.suffixes) or name.startswith(".env.")


def watched_component(name: str) -> bool:
    """True when a directory of this name puts what lies below it in some class (`.claude`, `.husky`,
    `node_modules`...): a walk must enter it to see its files."""
    return name in _INDEX.components


# A file this large is not source to review in a diff.
MAX_REVIEW_BYTES = 16 << 20


@record
class Flag:
    """Why a path the box wrote runs later on the host (its class and the reason shown to the user)."""

    cls: RunsLater
    why: str


def _parts(rel: str) -> tuple[str, ...]:
    return tuple(p for p in rel.split("/") if p and p != ".")


def _under(parts: tuple[str, ...], below: str) -> bool:
    want = tuple(below.split("/"))
    n = len(want)
    return any(parts[i:i + n] == want for i in range(len(parts) - n))


def by_name(rel: str) -> list[Flag]:
    """The flags a path earns by its name alone (rel: relative to the workdir, '/'-separated)."""
    parts = _parts(rel)
    if not parts:
        return []
    last = parts[-1]
    if (last not in _INDEX.names and not last.endswith(_INDEX.suffixes) and not last.startswith(".env.")
            and _INDEX.components.isdisjoint(parts)):
        return []
    out: list[Flag] = []
    for rule in TABLE:
        hit = last in rule.names or any(last.endswith(s) for s in rule.suffixes) \
            or any(parts[: len(p.split("/"))] == tuple(p.split("/")) for p in rule.prefixes) \
            or any(_under(parts, u) for u in rule.under) \
            or (last.startswith(".env.") and ".env" in rule.names)
        if hit and all(f.cls is not rule.cls for f in out):
            out.append(Flag(rule.cls, rule.why))
    return out


# Inert inside an agent config dir: opencode writes `.opencode/.gitignore` at every start.
AGENT_CONFIG_INERT = (".gitignore",)


def is_agent_config(rel: str) -> bool:
    """An agent CLI's project config (at any depth): what the exit report moves aside when the box
    created or changed it."""
    return rel.rsplit("/", 1)[-1] not in AGENT_CONFIG_INERT and any(f.cls is RunsLater.AGENT_CONFIG for f in by_name(rel))


def by_entry(rel: str, mode: int, size: int = 0, link: str | None = None, before_mode: int | None = None) -> list[Flag]:
    """The flags of one entry as the box left it: its name, plus what its kind and mode say.
    `before_mode`: the mode it had before the box ran (None: it is new)."""
    out = by_name(rel)

    def add(cls: RunsLater, why: str) -> None:
        if all(f.cls is not cls or f.why != why for f in out):
            out.append(Flag(cls, why))

    if stat.S_ISLNK(mode):
        if link is not None and (link.startswith("/") or _leaves(rel, link)):
            add(RunsLater.SPECIAL, "a symbolic link that leaves the workdir")
    elif stat.S_ISREG(mode):
        if mode & 0o111:
            add(RunsLater.EXECUTABLE, "an executable, new or changed, runs when its name is typed")
        if mode & (stat.S_ISUID | stat.S_ISGID):
            add(RunsLater.SPECIAL, "a setuid or setgid bit")
        if size > MAX_REVIEW_BYTES:
            add(RunsLater.SPECIAL, f"over {MAX_REVIEW_BYTES >> 20} MiB, too large to review")
    elif not stat.S_ISDIR(mode):
        add(RunsLater.SPECIAL, "a FIFO, socket or device")
    return out


def _leaves(rel: str, link: str) -> bool:
    depth = len(_parts(rel)) - 1
    for part in link.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part and part != ".":
            depth += 1
    return False
