"""The exit report: files the box left in the workdir that git review misses and host tools run.

`git status` and `git diff` are how a user reviews a box's work, but they do not show ignored files,
and a new file in an ignored or untracked place can run on the host later: a `.pth` or
`sitecustomize.py` in a virtualenv runs at every Python start, a `node_modules/.bin` entry runs
at `npm run`/`npx`, a package's `postinstall` at the next install or rebuild, a `conftest.py` at
the next `pytest`, an `invoke.py` at the next `invoke`, a `.devcontainer/` at the next editor start.
What counts is one table, relay/model/runs_later.py, shared with the staged workdir's review flags.

The box cannot silence it:
- files are signed with their ctime as well as mtime, size, mode and inode: `touch -d` sets the
  mtime back but moves the ctime forward, and nothing but the kernel's clock sets a ctime;
- new entries are found by the directory's ctime, which every create, rename and unlink moves
  forward (its mtime the box can set back); a directory's new or re-written executables count;
- a directory the walk cannot read, or a walk over its budget, makes the report say it is partial.

Cheap by construction. One pruned walk at start and one at exit, of the workdir only:
- `.git` and `__pycache__` are not entered; `node_modules` is not entered beyond `.bin/` and each
  top-level package's `package.json`; `site-packages` is read one level deep; a virtualenv's
  `bin/` is watched whole;
- files are stat'ed only where they can matter: watched names everywhere, and at exit, every file
  of a directory whose ctime changed (a new entry), for a new executable;
- a budget bounds the walk on huge trees (the report then says it is partial).
Tracked-ness comes from git's index as it was at start (read as bytes, parsed only if needed), so
the box cannot hide a file by staging it. Nothing here follows a link or reads a special file:
directories are opened beneath the workdir with no link on any component (safefs), entries are
lstat'ed, and the only contents read (package.json, the index, agent config) are bounded
regular-file reads. Agent config the box created or changed is moved aside (relay/trust/workdir_aside.py)
before the report is made.
"""

from __future__ import annotations

import json
import os
import stat
import time

from relay.host import safefs
from relay.model import runs_later
from relay.model.record import field, record

SKIP_DIRS = {".git", "__pycache__"}
SITE_DIRS = {"site-packages", "dist-packages"}
LIFECYCLE = ("preinstall", "install", "postinstall", "prepare", "preprepare", "postprepare")
MAX_ENTRIES = 400_000  # directory entries looked at per walk
MAX_INDEX = 64 << 20
MAX_PACKAGE_JSON = 1 << 20
MAX_LISTED = 500
# Agent config is snapshotted at start, so a changed or deleted file can be put back as it was.
MAX_ORIGINAL = 1 << 20
ORIGINALS_BUDGET = 16 << 20

Sig = tuple[int, int, int, int, int]  # mtime_ns, ctime_ns, size, mode, inode


def _sig(st: os.stat_result) -> Sig:
    return st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_mode, st.st_ino


def _kind_of(rel: str) -> str | None:
    flags = runs_later.by_name(rel)
    return flags[0].cls.value if flags else None


@record(frozen=False)
class Walk:
    """One bounded walk of the workdir: directory times, names and watched files, to tell what the box added."""

    dirs: dict[str, int] = field(default_factory=dict)  # rel dir -> ctime_ns
    names: dict[str, frozenset[str]] = field(default_factory=dict)  # rel dir -> its entry names
    watched: dict[str, tuple[str, Sig]] = field(default_factory=dict)  # rel file -> (kind, signature)
    new_exec: list[tuple[str, str]] = field(default_factory=list)  # (rel, kind)
    unreadable: list[str] = field(default_factory=list)  # dirs that could not be opened or listed
    entries: int = 0
    over_budget: bool = False

    @property
    def partial(self) -> bool:
        return self.over_budget or bool(self.unreadable)


@record(frozen=False)
class Watch:
    """The workdir as it was when the box started, to compare against at exit (live runs)."""

    root: str
    started_ns: int
    before: Walk
    index: bytes | None  # git's index at start; None: no usable index (everything counts as untracked)
    ms_start: float = 0.0
    originals: dict[str, bytes] = field(default_factory=dict)  # agent config at start: rel -> content
    # Placeholders (ours and other boxes'): empty mount points the host made, never the box's work. One
    # that is another box's mount point must not be touched: renaming it detaches that box's mask.
    ignore: set[str] = field(default_factory=set)


class _Dir:
    """A directory opened beneath the workdir with no link followed, and its entries (lstat'ed
    through the same fd, so nothing is resolved again by path)."""

    def __init__(self, dfd: int, rel: str, w: Walk) -> None:
        self.fd = os.dup(dfd) if not rel else safefs.open_beneath(dfd, rel, os.O_RDONLY | os.O_DIRECTORY)
        try:
            w.dirs[rel] = os.fstat(self.fd).st_ctime_ns
            self.entries = list(os.scandir(self.fd))
            w.names[rel] = frozenset(e.name for e in self.entries)
        except BaseException:
            os.close(self.fd)
            raise
        w.entries += len(self.entries)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def __enter__(self) -> _Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def _watch(w: Walk, rel: str, kind: str, st: os.stat_result) -> None:
    w.watched[rel] = (kind, _sig(st))


def _watch_all(dfd: int, rel: str, kind: str, w: Walk) -> None:
    with _Dir(dfd, rel, w) as d:
        for e in d.entries:
            try:
                _watch(w, _join(rel, e.name), kind, d.lstat(e.name))
            except OSError:
                pass


def _node_modules(dfd: int, rel: str, w: Walk) -> None:
    """`.bin/` whole, and each top-level (or @scope/) package's package.json; nothing deeper."""
    with _Dir(dfd, rel, w) as d:
        subdirs = [e.name for e in d.entries if e.is_dir(follow_symlinks=False)]
    for name in subdirs:
        sub = _join(rel, name)
        if name == ".bin":
            _watch_all(dfd, sub, "node_modules/.bin entry", w)
            continue
        if name.startswith("@"):
            with _Dir(dfd, sub, w) as scope:
                pkgs = [_join(sub, e.name) for e in scope.entries if e.is_dir(follow_symlinks=False)]
        else:
            pkgs = [sub]
        for pkg in pkgs:
            st = safefs.lstat_beneath(dfd, pkg + "/package.json")
            if st is not None:
                _watch(w, pkg + "/package.json", "package lifecycle script", st)


def walk(root_fd: int, before: Walk | None = None, started_ns: int = 0, budget: int = MAX_ENTRIES) -> Walk:
    w = Walk()
    stack = [""]
    while stack:
        rel = stack.pop()
        if w.entries > budget:
            w.over_budget = True
            break
        try:
            d = _Dir(root_fd, rel, w)
        except OSError:
            w.unreadable.append(rel)  # e.g. a dir the box made unreadable: its files are unseen
            continue
        with d:
            _entries(root_fd, rel, d, w, before, started_ns, stack)
    return w


def _entries(root_fd: int, rel: str, d: _Dir, w: Walk, before: Walk | None, started_ns: int,
             stack: list[str]) -> None:
    name = rel.rsplit("/", 1)[-1]
    site = name in SITE_DIRS
    venv = any(e.name == "pyvenv.cfg" for e in d.entries)
    # A directory with an entry created, renamed or removed since the start (or new itself): its ctime
    # moved, whatever the box did to its mtime. Its new and re-written executables count.
    fresh = before is not None and before.dirs.get(rel) != w.dirs.get(rel)
    # Once per directory: does a component above put its files in a class (`.claude/`, `.husky/`)?
    context = bool(rel) and any(runs_later.watched_component(p) for p in rel.split("/"))
    for e in d.entries:
        sub = _join(rel, e.name)
        try:
            if e.is_dir(follow_symlinks=False):
                if e.name in SKIP_DIRS or site:
                    continue
                if e.name == "node_modules":
                    _node_modules(root_fd, sub, w)
                elif venv and e.name in ("bin", "Scripts"):
                    _watch_all(root_fd, sub, "virtualenv bin entry", w)
                else:
                    stack.append(sub)
                continue
            kind = _kind_of(sub) if context or runs_later.name_may_match(e.name) else None
            if kind is not None:
                _watch(w, sub, kind, d.lstat(e.name))
            elif fresh and not site:
                st = d.lstat(e.name)
                # New by name since the start, or written/chmod'ed during the run (ctime): a file the
                # host itself put there just before the launch is neither.
                new = before is not None and e.name not in before.names.get(rel, frozenset())
                if new or st.st_ctime_ns >= started_ns:
                    link = os.readlink(e.name, dir_fd=d.fd) if stat.S_ISLNK(st.st_mode) else None
                    flags = runs_later.by_entry(sub, st.st_mode, st.st_size, link)
                    if flags:
                        w.new_exec.append((sub, flags[0].cls.value))
        except OSError:
            w.unreadable.append(sub)


def _read_index(root_fd: int) -> bytes | None:
    try:
        return safefs.read_beneath(root_fd, ".git/index", MAX_INDEX)
    except OSError:
        return None


def tracked_paths(index: bytes) -> set[str] | None:
    """The paths in a git index; None when it is not one we can read (everything then counts as
    untracked: more is reported, never less). The one index parser is relay/trust/gitindex.py's."""
    from relay.trust.gitindex import BadIndex, parse

    try:
        return {e.path for e in parse(index).entries}
    except BadIndex:
        return None


def start(workdir: str, ignore: set[str] | None = None) -> Watch | None:
    """Snapshot the watched places of the workdir before the box runs; None when it cannot be read.
    `ignore`: paths (relative to the workdir) that are placeholders."""
    t0 = time.perf_counter()
    # File times use the kernel's coarse clock, a jiffy or so behind time_ns(): 20 ms of margin.
    started = time.time_ns() - 20_000_000
    try:
        with safefs.base_dir(workdir) as fd:
            before = walk(fd)
            index = _read_index(fd)
            originals = _originals(fd, before, ignore or set())
    except OSError:
        return None
    return Watch(workdir, started, before, index, (time.perf_counter() - t0) * 1000, originals, set(ignore or ()))


def _originals(root_fd: int, w: Walk, ignore: set[str]) -> dict[str, bytes]:
    """The agent config files as they are at start (bounded), to put back what the box changes."""
    out: dict[str, bytes] = {}
    budget = ORIGINALS_BUDGET
    for rel, (kind, sig) in sorted(w.watched.items()):
        if rel in ignore or kind != runs_later.RunsLater.AGENT_CONFIG or not stat.S_ISREG(sig[3]) or sig[2] > min(MAX_ORIGINAL, budget):
            continue
        try:
            data = safefs.read_beneath(root_fd, rel, MAX_ORIGINAL)
        except OSError:
            continue
        if data is not None:
            out[rel] = data
            budget -= len(data)
    return out


def _lifecycle(root_fd: int, rel: str) -> str | None:
    """The lifecycle scripts a package.json declares ("" for none); unreadable counts as suspicious."""
    try:
        data = json.loads(safefs.read_beneath(root_fd, rel, MAX_PACKAGE_JSON) or b"{}")
    except (OSError, ValueError):
        return "unreadable"
    scripts = data.get("scripts") if isinstance(data, dict) else None
    if not isinstance(scripts, dict):
        return ""
    return ",".join(k for k in LIFECYCLE if k in scripts)


@record(frozen=False)
class Findings:
    """What the exit check found the box left in a live workdir that could run later, and what was moved aside."""

    files: list[tuple[str, str]]  # (rel path, why it matters)
    partial: bool
    ms_start: float
    ms_exit: float
    unreadable: list[str] = field(default_factory=list)
    over_budget: bool = False
    aside: list[str] = field(default_factory=list)  # summary lines of what was moved aside


def finish(watch: Watch, kept: str | None = None, run_id: str = "") -> Findings:
    """Walk again and compare: new or changed watched files, new executables, minus what git tracked
    at start. With `kept` (the run's kept-aside dir), agent config the box created, changed or deleted
    is settled first (relay/trust/workdir_aside.py): moved aside, the original put back."""
    from relay.trust import workdir_aside

    t0 = time.perf_counter()
    found: dict[str, str] = {}
    aside: list[str] = []
    with safefs.base_dir(watch.root) as fd:
        after = walk(fd, watch.before, watch.started_ns)
        agent: list[tuple[str, str]] = []
        for rel, (kind, sig) in after.watched.items():
            old = watch.before.watched.get(rel)
            if (old is not None and old[1] == sig) or rel in watch.ignore:
                continue
            if kind == runs_later.RunsLater.AGENT_CONFIG:
                if not runs_later.is_agent_config(rel):
                    continue  # inert (a .gitignore)
                agent.append((rel, "created by the box" if old is None else "changed by the box"))
                continue
            if kind == "package lifecycle script":
                scripts = _lifecycle(fd, rel)
                if not scripts:
                    continue
                kind = f"package lifecycle script ({scripts})"
            found[rel] = kind
        deleted = [(rel, sig[3]) for rel, (kind, sig) in watch.before.watched.items()
                   if kind == runs_later.RunsLater.AGENT_CONFIG and rel not in after.watched and rel not in watch.ignore]
        for rel, kind in after.new_exec:
            if rel not in watch.ignore:
                    found.setdefault(rel, "new executable" if kind == runs_later.RunsLater.EXECUTABLE else kind)
        if kept is not None and (agent or deleted):
            settled = workdir_aside.settle(fd, watch.root, sorted(agent), deleted, watch.originals, kept, run_id)
            aside = workdir_aside.summary(settled, run_id, _shown)
            for rel, why in settled.failed:
                found[rel] = f"agent-config ({why})"
        else:
            found.update((rel, f"agent-config ({what})") for rel, what in agent)
    if found and watch.index is not None:
        tracked = tracked_paths(watch.index) or set()
        found = {rel: why for rel, why in found.items() if rel not in tracked or why.startswith("agent-config")}
    files = sorted(found.items())
    unreadable = watch.before.unreadable + [u for u in after.unreadable if u not in watch.before.unreadable]
    return Findings(files, watch.before.partial or after.partial, watch.ms_start, (time.perf_counter() - t0) * 1000,
                    unreadable, watch.before.over_budget or after.over_budget, aside)


def _shown(text: str) -> str:
    """A box-chosen name, safe to print and to keep on one line."""
    return "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in text)


def publish(findings: Findings, workdir: str, state: str, run_id: str, log_path: str | None) -> list[str]:
    """Write the full list under our state dir, add a record to the run's JSON log, and return the
    summary lines for the user (none when there is nothing to say)."""
    lines: list[str] = list(findings.aside)
    if findings.over_budget:
        lines.append(f"exit report: partial: the workdir has more than {MAX_ENTRIES} entries; only part of it "
                     "was checked")
    if findings.unreadable:
        shown = ", ".join(_shown(u or ".") for u in findings.unreadable[:3]) + (", …" if len(findings.unreadable) > 3 else "")
        lines.append(f"exit report: partial: {len(findings.unreadable)} entries of the workdir could not be read "
                     f"({shown}); what lies in them was not checked, so review them before running tools there")
    if not findings.files:
        return lines
    report_path = os.path.join(state, "reports", f"{run_id}.txt")
    body = "".join(f"{why}\t{_shown(os.path.join(workdir, rel))}\n" for rel, why in findings.files)
    head = ("# hive relay exit report: files the box created or changed that git status/diff does not show\n"
            "# (ignored or untracked) and that host tools run or load. Review them before running tools here.\n")
    try:
        os.makedirs(state, mode=0o700, exist_ok=True)
        safefs.write_file(report_path, (head + body).encode(), 0o600, base=state, make_dirs=True)
    except OSError as err:
        report_path = f"(not written: {err.strerror or err})"
    if log_path:
        _log(log_path, state, findings, report_path)
    kinds: dict[str, int] = {}
    for _, why in findings.files:
        key = why.split(" (")[0]
        kinds[key] = kinds.get(key, 0) + 1
    what = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    first = ", ".join(_shown(rel) for rel, _ in findings.files[:3]) + (", …" if len(findings.files) > 3 else "")
    lines.append(f"the box left {len(findings.files)} file(s) that git does not show and host tools run or load "
                 f"({what}): {first}; full list: {report_path}")
    return lines


def _log(log_path: str, state: str, findings: Findings, report_path: str) -> None:
    """One more JSON line in the run's log (a file in our own state dir, appended with no link followed)."""
    record = {"time": round(time.time(), 3), "event": "exit-report", "count": len(findings.files),
              "report": report_path, "partial": findings.partial, "unreadable": findings.unreadable[:MAX_LISTED],
              "files": [{"path": rel, "why": why} for rel, why in findings.files[:MAX_LISTED]]}
    try:
        base = state if safefs.beneath(log_path, state) else os.path.dirname(log_path)
        rel = os.path.relpath(log_path, base)
        os.makedirs(os.path.dirname(log_path), mode=0o700, exist_ok=True)
        with safefs.base_dir(base) as dfd:
            fd = safefs.open_beneath(dfd, rel, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o600)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def _registered(state: str, workdir: str) -> set[str]:
    """Every box's placeholders in this workdir, from the shared registry (relay/trust/placeholders.py)."""
    try:
        data = json.loads(safefs.read_file(os.path.join(state, "placeholders.json"), 1 << 20, base=state) or b"{}")
    except (OSError, ValueError):
        return set()
    if not isinstance(data, dict):
        return set()
    return {os.path.relpath(p, workdir) for p in data if isinstance(p, str) and safefs.beneath(p, workdir)}


def begin(plan, caller_env=None) -> Watch | None:  # noqa: ANN001 - a plan.Plan (kept import-free of plan)
    """The runner's hook before the box starts (after the placeholders are made)."""
    if not plan.workdir:
        return None
    try:
        ignore = {os.path.relpath(p, plan.workdir) for p in plan.placeholders if safefs.beneath(p, plan.workdir)}
        if caller_env is not None:
            from relay.host.paths import state_dir

            ignore |= _registered(state_dir(dict(caller_env)), plan.workdir)
        return start(plan.workdir, ignore)
    except Exception:  # noqa: BLE001 - the report is advice; it never stops a box
        return None


def end(watch: Watch | None, plan, caller_env, run_id: str) -> list[str]:  # noqa: ANN001
    """The runner's hook after teardown: the summary lines (empty when there is nothing to say)."""
    if watch is None:
        return []
    from relay.host.paths import state_dir
    from relay.trust.workdir_aside import kept_dir

    state = state_dir(dict(caller_env))
    try:
        watch.ignore |= _registered(state, watch.root)
        return publish(finish(watch, kept_dir(state, run_id), run_id), plan.workdir, state, run_id, plan.log_path)
    except Exception as err:  # noqa: BLE001 - never lose the box's exit code to the report
        return [f"exit report failed: {err}"]
