"""The workdir's git dir by allowlist: the box records work, it cannot change what git runs later.

Git reads much more in its git dir than the work it records: `config` (core.fsmonitor,
core.hooksPath, filters, aliases), `hooks/`, `commondir` and `gitdir` (which redirect it to
another git dir and so to another config), `config.worktree`, `info/attributes`,
`objects/info/alternates`, the git dirs of submodules (`modules/*`) and of linked worktrees
(`worktrees/*`), legacy `remotes/` and `branches/`, rebase todo lists with `exec` lines. A deny
list of those is never complete, so the box gets an allowlist instead:

- it sees a PRIVATE git dir (a directory in the run dir) at the host git dir's path;
- inside it, read-write binds of the host's `objects/`, `refs/`, `logs/` (and `rr-cache/`,
  `lfs/` when present): what git writes there is data, named by hash or by ref;
- read-only binds of everything else the host git dir holds (config, hooks, info, ...);
- copies of the allowlisted state files (HEAD, index, ORIG_HEAD, FETCH_HEAD, MERGE_HEAD,
  packed-refs, COMMIT_EDITMSG, ...). Git replaces them by writing `NAME.lock` and renaming it onto
  `NAME` in the git dir itself, so they cannot be single-file binds (EBUSY); in the private dir
  the rename works;
- submodule and worktree git dirs get the same treatment, nested in the private copy.

At exit (the box is dead by then) the janitor syncs back ONLY the allowlisted state files, each
read through safefs (no link on any component, regular, bounded) and validated (HEAD is a ref or an
object id, packed-refs is well formed, the index is judged and rewritten by relay/trust/gitindex.py so
no flag, cache or stat data in it hides an edit, ...). A state file that
the host changed during the session is a conflict: the box's copy is kept aside, never written
over the host's. Everything else the box created or changed in its private git dir (a config,
a hook, `commondir`, a rebase todo list, a worktree whose `commondir`/`gitdir` points elsewhere) is
kept aside too, in a reviewable directory under hive relay's state dir, and one line says so.
Nothing of it is ever live on the host.

Around that, after the box (it is dead by then, so nothing races the janitor):
- links and special files it left in `logs/`, `refs/`, `rr-cache/` (trees it shared with the host,
  where host git appends reflogs or writes through a link) are recorded aside and removed;
- when its packed-refs conflicts with the host's, the refs it packed out of their loose files are
  written back as loose refs, so `git pack-refs` in the box never loses a branch;
- a `.git` that is a symbolic link (no mount can make a link read-only) is put back if replaced;
- a gitlink it staged whose checkout has a `.git` of its own (a repository it made, with its own
  config, which the host's `git status` would recurse into) has that `.git` moved aside.

The host side of a redirect that already exists (a `.git` file of a linked worktree, a
`commondir`) is followed the way git follows it, so the box's git works on the same repository;
the `.git` file itself is read-only in the box.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from relay.host import safefs
from relay.model.fs_view import FsView
from relay.model.hashing import sha256
from relay.model.mounts import Mount
from relay.model.record import field, record
from relay.model.vocab import MountKind
from relay.trust import gitindex

# Written by git as data: object store, refs and their logs, rerere's cache, git-lfs's store.
RW_COMMON = ("objects", "refs", "logs", "rr-cache", "lfs")
RW_WORKTREE = ("refs", "logs")
# Replaced by git with NAME.lock + rename: copied in, validated and synced back.
STATE_COMMON = ("HEAD", "ORIG_HEAD", "FETCH_HEAD", "MERGE_HEAD", "MERGE_MSG", "MERGE_MODE", "MERGE_RR",
                "AUTO_MERGE", "CHERRY_PICK_HEAD", "REVERT_HEAD", "SQUASH_MSG", "COMMIT_EDITMSG", "TAG_EDITMSG",
                "index", "packed-refs", "shallow")
STATE_WORKTREE = tuple(n for n in STATE_COMMON if n not in ("packed-refs", "shallow"))
# Every hook git runs (githooks(5), git 2.39): protected one by one where `hooks` is a link into
# a writable place (`.git/hooks -> ..`), so the workdir is not frozen and no hook can be planted.
HOOK_NAMES = ("applypatch-msg", "pre-applypatch", "post-applypatch", "pre-commit", "pre-merge-commit",
              "prepare-commit-msg", "commit-msg", "post-commit", "pre-rebase", "post-checkout", "post-merge",
              "pre-push", "pre-receive", "update", "proc-receive", "post-receive", "post-update",
              "reference-transaction", "push-to-checkout", "pre-auto-gc", "post-rewrite", "sendemail-validate",
              "fsmonitor-watchman", "p4-changelist", "p4-prepare-changelist", "p4-post-changelist",
              "p4-pre-submit", "post-index-change")
INFO_NAMES = ("attributes", "exclude", "grafts", "sparse-checkout")
# Inside the writable object store: files that send git to other object stores.
OBJECT_REDIRECTS = ("objects/info/alternates", "objects/info/http-alternates")

# An empty regular file in the run dir: what a missing redirect file shows in the box (a /dev/null
# mask would fail git's reads with EACCES on a nodev mount and make it warn on every command).
EMPTY = "git/empty"
ORIG = "git-orig"  # run dir copies of what the box started from (not bound into the box)
INDEX_LIMIT = 256 << 20
STATE_LIMIT = 16 << 20
TEXT_LIMIT = 1 << 20
MAX_ENTRIES = 2000  # worktrees + modules + names: a git dir with more is not planned entry by entry
ASIDE_LIMIT = 64 << 20


@record
class GitDir:
    """One git dir the box sees through a private copy. `private` is relative to the run dir."""

    host: str
    private: str
    kind: str  # "common" (a repository's git dir, submodules too) | "worktree" (worktrees/<id>)
    state: tuple[str, ...]  # allowlisted names, relative: copied in, synced back
    top: bool  # bound at `host` itself (else part of its parent's private copy)


@record
class GitPlan:
    """`gitlinks`: the submodule paths (relative to the workdir) that had their own `.git` at launch;
    any other gitlink that has one after the box is a repository the box made, with its own config."""

    dirs: tuple[GitDir, ...]
    mounts: tuple[Mount, ...]
    mount_points: tuple[tuple[str, str], ...]  # (private rel path, "dir" | "file"), created before the box
    protect: tuple[str, ...]  # host paths for the planner's protected-path machinery
    dotgit: str  # the workdir's `.git`
    common: str  # the main repository's git dir (worktrees must point back at it)
    notes: tuple[str, ...] = field(default=())
    gitlinks: tuple[str, ...] = ()
    dotgit_link: str | None = None  # `.git` was this symbolic link: a link cannot be made read-only
    index: str = ""  # the index of the workdir's own checkout (its gitlinks are checked at exit)


def _read_pointer(fs: FsView, path: str) -> str | None:
    """The first line of a small redirect file (`.git`, `commondir`), read with no link followed."""
    data = fs.read_small(path)
    if data is None:
        return None
    line = data.decode("utf-8", errors="replace").split("\n", 1)[0].strip()
    return line or None


def locate(workdir: str, fs: FsView) -> tuple[str, str, str] | None:
    """(kind of `.git`: "dir" | "file", its git dir, its common dir); None when there is none."""
    dotgit = os.path.join(workdir, ".git")
    kind = fs.lkind(dotgit)
    if kind == "link":
        kind = fs.kind(dotgit)
        if kind == "missing":
            return None
        gitdir = fs.realpath(dotgit) if kind == "dir" else None
    elif kind == "missing":
        return None
    else:
        gitdir = dotgit if kind == "dir" else None
    if kind == "file":
        pointer = _read_pointer(fs, dotgit)
        if not pointer or not pointer.startswith("gitdir:"):
            return None
        gitdir = os.path.normpath(os.path.join(workdir, pointer[len("gitdir:"):].strip()))
        if fs.kind(gitdir) != "dir":
            return None
    assert gitdir is not None
    if not _looks_like_gitdir(fs, gitdir):
        # Git itself needs HEAD to call it a repository: an empty `.git` is another box's placeholder
        # (it masks the missing `.git/hooks` of a workdir that is no repository), not a git dir.
        return None
    common = gitdir
    pointer = _read_pointer(fs, os.path.join(gitdir, "commondir"))
    if pointer:
        common = os.path.normpath(os.path.join(gitdir, pointer))
        if fs.kind(common) != "dir":
            common = gitdir
    return kind, gitdir, common


def _looks_like_gitdir(fs: FsView, path: str) -> bool:
    return fs.lkind(os.path.join(path, "HEAD")) == "file"


class _Planner:
    def __init__(self, workdir: str, fs: FsView) -> None:
        self.workdir = workdir
        self.fs = fs
        self.dirs: list[GitDir] = []
        self.mounts: list[Mount] = []
        self.points: list[tuple[str, str]] = []
        self.protect: list[str] = []
        self.notes: list[str] = []
        self.count = 0

    def add(self, host: str, private: str, kind: str, top: bool) -> None:
        fs = self.fs
        if top:
            self.mounts.append(Mount(MountKind.PRIVATE_BIND, host, private))
        self.points.append((private, "dir"))
        names = fs.listdir(host)
        rw = RW_COMMON if kind == "common" else RW_WORKTREE
        allow = STATE_COMMON if kind == "common" else STATE_WORKTREE
        state = [n for n in allow]
        if kind == "worktree" and "logs" not in names:
            state.append("logs/HEAD")  # a worktree that never logged HEAD: its reflog is a state file
        nested: list[tuple[str, str, str]] = []
        for name in sorted(names):
            self.count += 1
            if self.count > MAX_ENTRIES:
                raise _TooBig()
            if name in allow:
                continue  # a copy in the private dir
            path = os.path.join(host, name)
            rel = os.path.join(private, name)
            lkind = fs.lkind(path)
            kind_ = fs.kind(path)
            if kind_ == "missing":
                continue  # a dangling link: the box sees nothing there
            if name in ("worktrees", "modules") and lkind == "dir" and kind == "common":
                self.points.append((rel, "dir"))
                nested += [(name, path, rel)]
                continue
            if name in rw and lkind == "dir":
                self.mounts.append(Mount(MountKind.BIND, path, fs.realpath(path)))
                self.points.append((rel, "dir"))
                if name == "objects":
                    self.protect += [os.path.join(host, r) for r in OBJECT_REDIRECTS]
                continue
            if lkind == "link" and name in rw:
                self.notes.append(f"{path} is a symbolic link, so it is read-only in the box (git cannot "
                                  "record work there)")
            self.mounts.append(Mount(MountKind.RO_BIND, path, fs.realpath(path)))
            self.points.append((rel, "dir" if kind_ == "dir" else "file"))
            if lkind == "link":
                self._protect_link_target(name, path, kind_)
        self.dirs.append(GitDir(host=host, private=private, kind=kind, state=tuple(state), top=top))
        for name, path, rel in nested:
            if name == "worktrees":
                for wt in sorted(fs.listdir(path)):
                    sub = os.path.join(path, wt)
                    if fs.lkind(sub) == "dir":
                        self.add(sub, os.path.join(rel, wt), "worktree", False)
            else:
                self._modules(path, rel, 0)

    def _modules(self, path: str, rel: str, depth: int) -> None:
        """Submodule git dirs live at modules/<name>, where a name may hold slashes."""
        for name in sorted(self.fs.listdir(path)):
            sub, subrel = os.path.join(path, name), os.path.join(rel, name)
            if self.fs.lkind(sub) != "dir":
                if self.fs.lkind(sub) != "missing":
                    self.mounts.append(Mount(MountKind.RO_BIND, sub, self.fs.realpath(sub)))
                    self.points.append((subrel, "file" if self.fs.kind(sub) == "file" else "dir"))
                continue
            if _looks_like_gitdir(self.fs, sub):
                self.add(sub, subrel, "common", False)
            elif depth < 8:
                self.points.append((subrel, "dir"))
                self._modules(sub, subrel, depth + 1)

    def _protect_link_target(self, name: str, path: str, kind: str) -> None:
        """A link in the git dir (`hooks -> ..`): its target is what the host's git reads, so the
        target is protected where the box could write it. A target that holds the workdir is
        protected name by name, so the workdir stays writable."""
        target = self.fs.realpath(path)
        if kind != "dir":
            self.protect.append(target)
            return
        holds_workdir = safefs.beneath(self.workdir, target) or os.path.normpath(self.workdir) == target
        if name == "hooks":
            self.protect += [os.path.join(target, h) for h in HOOK_NAMES]
        elif name == "info":
            self.protect += [os.path.join(target, n) for n in INFO_NAMES]
        elif holds_workdir:
            self.notes.append(f"{path} links to {target}, which holds the workdir; it is not protected")
        else:
            self.protect.append(target)


class _TooBig(Exception):
    pass


def plan_git(workdir: str, fs: FsView) -> GitPlan | None:
    """The private git dirs for the workdir's repository; None when the workdir has no `.git`."""
    found = locate(workdir, fs)
    if found is None:
        return None
    kind, gitdir, common = found
    planner = _Planner(workdir, fs)
    dotgit = os.path.join(workdir, ".git")
    try:
        planner.add(common, "git/0", "common", True)
        if gitdir != common and not any(d.host == gitdir for d in planner.dirs):
            planner.add(gitdir, "git/1", "worktree", True)
    except _TooBig:
        planner = _Planner(workdir, fs)
        planner.mounts = [Mount(MountKind.RO_BIND, d, d) for d in dict.fromkeys((common, gitdir))]
        planner.notes.append(f"{common} has more than {MAX_ENTRIES} worktrees, submodules or entries; it is "
                             "read-only in the box")
        return GitPlan(dirs=(), mounts=tuple(planner.mounts), mount_points=(), protect=(), dotgit=dotgit,
                       common=common, notes=tuple(planner.notes))
    if kind == "file" or fs.lkind(dotgit) == "link":
        planner.protect.append(dotgit)
    # Submodules checked out in the workdir: `git status` on the host recurses into them, reading
    # their config. An embedded `.git` dir gets the same private treatment; a `.git` file (absorbed
    # into .git/modules) is read-only, so it cannot be pointed at another git dir.
    gitlinks: list[str] = []
    index = os.path.join(gitdir, "index")
    for i, path in enumerate(gitlinks_in(fs.read_bounded(index, INDEX_LIMIT) or b"")[:200]):
        sub = os.path.join(workdir, path, ".git")
        if not safefs.beneath(sub, workdir):
            continue
        lkind = fs.lkind(sub)
        if lkind == "dir" and _looks_like_gitdir(fs, sub):
            planner.add(sub, f"git/sub{i}", "common", True)
        elif lkind in ("file", "link"):
            planner.protect.append(sub)
        else:
            continue
        gitlinks.append(path)
    if gitdir != common and kind == "dir":
        planner.notes.append(f"{dotgit}/commondir sends git to {common}; the box works on that repository")
    planner.points.append((EMPTY, "file"))
    return GitPlan(dirs=tuple(planner.dirs), mounts=tuple(planner.mounts), mount_points=tuple(planner.points),
                   protect=tuple(dict.fromkeys(planner.protect)), dotgit=dotgit, common=common,
                   notes=tuple(planner.notes), gitlinks=tuple(gitlinks), index=index,
                   dotgit_link=fs.readlink(dotgit) if fs.lkind(dotgit) == "link" else None)


def gitlinks_in(data: bytes) -> list[str]:
    """The paths of the gitlink entries (mode 160000: submodules) of an index (relay/trust/gitindex.py).
    An index we cannot parse has none that we know of."""
    return [path for path, mode in gitindex.paths(data) if mode == gitindex.GITLINK]


# ---------------------------------------------------------------------------------------------
# Host side: copy in before the box, sync back after it. Every touch goes through safefs.

def _digest(data: bytes | None) -> str | None:
    return None if data is None else sha256(data).hexdigest()


def _limit(name: str) -> int:
    base = os.path.basename(name)
    if base == "index":
        return INDEX_LIMIT
    if base in ("COMMIT_EDITMSG", "MERGE_MSG", "SQUASH_MSG", "TAG_EDITMSG", "MERGE_MODE"):
        return TEXT_LIMIT
    return STATE_LIMIT


UNSAFE = "unsafe"  # the host's copy was a link, a special or a huge file: never synced


@contextmanager
def host_dir(path: str, workdir: str) -> Iterator[int]:
    """A host git dir's fd: beneath the workdir with no link followed on any component when it lies
    there (a box could have swapped a parent for a link), as a trusted base otherwise."""
    if not safefs.beneath(path, workdir):
        with safefs.base_dir(path) as fd:
            yield fd
        return
    with safefs.base_dir(workdir) as wfd:
        fd = safefs.open_beneath(wfd, os.path.relpath(path, workdir), os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def prepare(plan: GitPlan, run_dir: str, workdir: str) -> dict[str, str | None]:
    """Make the private git dirs (mount points, copies of the state files). Returns the copy-in
    digests, keyed by private rel path (None: absent on the host; UNSAFE: not copied). Scratch in
    the run dir, never fsynced: a crash loses the run dir with it, and the host's own files are
    only written by the sync back, durably."""
    before: dict[str, str | None] = {}
    with safefs.base_dir(run_dir) as rfd:
        for rel, kind in plan.mount_points:
            with safefs.parent_of(rfd, rel, create=True, mode=0o755) as (pfd, name):
                if kind == "dir":
                    try:
                        os.mkdir(name, 0o755, dir_fd=pfd)
                    except FileExistsError:
                        pass
                else:
                    safefs.create_new(pfd, name, b"", 0o444, durable=False)
        for g in plan.dirs:
            with host_dir(g.host, workdir) as hfd:
                for name in g.state:
                    key = os.path.join(g.private, name)
                    try:
                        data = safefs.read_beneath(hfd, name, _limit(name))
                    except OSError:
                        before[key] = UNSAFE
                        continue
                    before[key] = _digest(data)
                    if data is not None:
                        with safefs.parent_of(rfd, key, create=True, mode=0o755) as (pfd, leaf):
                            safefs.create_new(pfd, leaf, data, 0o644, durable=False)
                    if name in ("packed-refs", "index"):
                        # The host's copy as the box found it, outside the box's reach (the index
                        # that comes back is judged against it, relay/trust/gitindex.py).
                        with safefs.parent_of(rfd, os.path.join(ORIG, key), create=True) as (pfd, leaf):
                            safefs.create_new(pfd, leaf, data or b"", 0o600, durable=False)
    return before


_HEX = rb"(?:[0-9a-f]{40}|[0-9a-f]{64})"
_BAD_REF = re.compile(rb"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//|/\.|\.lock(?:/|$)|^/|/$|\.$")


def valid_refname(name: bytes) -> bool:
    return name.startswith(b"refs/") and len(name) < 1024 and not _BAD_REF.search(name)


def _lines(data: bytes) -> list[bytes] | None:
    if not data.endswith(b"\n"):
        return None
    return data[:-1].split(b"\n")


def validate(name: str, data: bytes) -> str | None:
    """None when `data` is a well-formed NAME; else why not."""
    base = os.path.basename(name)
    if name == "index" or base == "index":
        try:
            gitindex.parse(data)
        except gitindex.BadIndex as err:
            return f"not an index git writes ({err})"
        return None
    if base in ("COMMIT_EDITMSG", "MERGE_MSG", "SQUASH_MSG", "TAG_EDITMSG", "MERGE_MODE", "MERGE_RR"):
        return None
    lines = _lines(data)
    if lines is None:
        return "does not end with a newline"
    if base == "HEAD" and name != "logs/HEAD":
        line = lines[0] if len(lines) == 1 else b""
        if re.fullmatch(_HEX, line) or (line.startswith(b"ref: ") and valid_refname(line[5:])):
            return None
        return "neither `ref: refs/...` nor an object id"
    if base in ("ORIG_HEAD", "AUTO_MERGE", "CHERRY_PICK_HEAD", "REVERT_HEAD", "MERGE_HEAD", "shallow"):
        one = base not in ("MERGE_HEAD", "shallow")
        ok = all(re.fullmatch(_HEX, ln) for ln in lines) and (len(lines) == 1 or not one)
        return None if ok else "not object ids"
    if base == "FETCH_HEAD":
        ok = all(re.fullmatch(_HEX + rb"\t(?:not-for-merge)?\t[^\x00]*", ln) for ln in lines)
        return None if ok else "not FETCH_HEAD lines"
    if base == "packed-refs":
        for i, ln in enumerate(lines):
            if i == 0 and ln.startswith(b"# pack-refs with:"):
                continue
            if re.fullmatch(b"\\^" + _HEX, ln):
                continue
            m = re.fullmatch(b"(" + _HEX + b") (.+)", ln)
            if not m or not valid_refname(m.group(2)):
                return "not packed-refs lines"
        return None
    if name.endswith("logs/HEAD"):
        ok = all(re.fullmatch(_HEX + b" " + _HEX + b" [^\x00]*", ln) for ln in lines)
        return None if ok else "not reflog lines"
    if base == "commondir":
        return None if lines == [b"../.."] else "points somewhere other than this repository"
    return "not an allowlisted file"


@record(frozen=False)
class SyncResult:
    """What syncing the private .git back did: refs synced, what was kept aside, and the lines to print."""

    synced: list[str] = field(default_factory=list)
    aside: list[str] = field(default_factory=list)  # host-style names of what was kept aside
    messages: list[str] = field(default_factory=list)


class _Aside:
    """The reviewable place: <state>/git-aside/<run>/, a mirror of the private git dirs."""

    def __init__(self, root: str, tag: str) -> None:
        self.root = root
        self.dir = os.path.join(root, tag)
        self.used = 0

    def put(self, rel: str, data: bytes) -> None:
        self.used += len(data)
        if self.used > ASIDE_LIMIT:
            raise safefs.UnsafePath(errno.EFBIG, "too much to keep aside", rel)
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        with safefs.base_dir(self.root) as dfd, safefs.parent_of(dfd, os.path.join(os.path.basename(self.dir), rel),
                                                                create=True) as (pfd, name):
            try:
                safefs.create_new(pfd, name, data)
            except FileExistsError:
                safefs.create_new(pfd, safefs.unique_name(name, "dup"), data)


def _write_host(hfd: int, name: str, data: bytes | None, before: str | None) -> bool:
    """Replace (or remove) the host's NAME the way git does: take `NAME.lock` with O_EXCL (a git on
    the host holding it makes this a conflict), check that the host's copy is still the one we
    copied in, then rename the lock onto it. False on a conflict."""
    with safefs.parent_of(hfd, name, create=True, mode=0o755) as (pfd, leaf):
        lock = leaf + ".lock"
        try:
            safefs.create_new(pfd, lock, data or b"", 0o644)
        except FileExistsError:
            return False
        try:
            try:
                current = safefs.read_beneath(pfd, leaf, _limit(name))
            except OSError:
                return False
            if _digest(current) != before:
                return False
            if data is None:
                os.unlink(leaf, dir_fd=pfd)
            else:
                os.rename(lock, leaf, src_dir_fd=pfd, dst_dir_fd=pfd)
                return True
            return True
        finally:
            try:
                os.unlink(lock, dir_fd=pfd)
            except OSError:
                pass


def _walk_private(rfd: int, rel: str, out: list[str], budget: list[int]) -> None:
    """Every non-directory entry under the private dir `rel` (no link followed)."""
    try:
        fd = safefs.open_beneath(rfd, rel, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        names = os.listdir(fd)
    finally:
        os.close(fd)
    for name in sorted(names):
        budget[0] -= 1
        if budget[0] < 0:
            return
        sub = os.path.join(rel, name)
        st = safefs.lstat_beneath(rfd, sub)
        if st is None:
            continue
        if stat.S_ISDIR(st.st_mode):
            _walk_private(rfd, sub, out, budget)
        else:
            out.append(sub)


def sync_back(plan: GitPlan, run_dir: str, before: dict[str, str | None], aside_root: str, tag: str,
              workdir: str) -> SyncResult:
    """After the box: the allowlisted state files go back (validated, conflicts kept aside), new
    well-formed worktrees are registered, everything else the box left is kept aside."""
    result = SyncResult()
    aside = _Aside(aside_root, tag)
    known = {rel for rel, _ in plan.mount_points}

    def keep(rel: str, data: bytes, why: str) -> None:
        try:
            aside.put(rel, data)
            result.aside.append(f"{rel} ({why})")
        except OSError as err:
            result.messages.append(f"could not keep {rel} aside: {err.strerror or err}")

    with safefs.base_dir(run_dir) as rfd:
        for g in plan.dirs:
            try:
                with host_dir(g.host, workdir) as hfd:
                    for name in g.state:
                        key = os.path.join(g.private, name)
                        known.add(key)
                        if name == "index":
                            _sync_index(rfd, hfd, g, key, before.get(key), keep, result, _worktree_of(g, plan, workdir),
                                        workdir)
                        else:
                            _sync_one(rfd, hfd, g, name, key, before.get(key), keep, result)
            except OSError as err:
                result.messages.append(f"could not sync {g.host} back: {err.strerror or err}")
            if g.kind == "common":
                _new_worktrees(rfd, g, plan, known, before, keep, result, workdir)
        leftovers: list[str] = []
        for g in plan.dirs:
            if g.top:
                _walk_private(rfd, g.private, leftovers, [20000])
        for rel in leftovers:
            if rel in known:
                continue
            try:
                data = safefs.read_beneath(rfd, rel, TEXT_LIMIT * 8)
            except OSError as err:
                keep(rel + ".not-a-file", f"{err.strerror or err}\n".encode(), "not a regular file")
                continue
            keep(rel, data or b"", "not on the allowlist")
    _sweep_links(plan, aside, result)
    _restore_dotgit_link(plan, workdir, result)
    _quarantine_new_gitlinks(plan, workdir, result)
    if result.aside:
        # One line: each file with its reason, the first few shown, and where they all are.
        shown = "; ".join(f"{a.split(' (', 1)[0].split('/', 2)[-1]}: {a.split(' (', 1)[1].rstrip(')')}"
                          for a in result.aside[:4])
        more = f"; and {len(result.aside) - 4} more" if len(result.aside) > 4 else ""
        result.messages.append(f"git: {len(result.aside)} file(s) the box left in .git were not synced back "
                               f"({shown}{more}); kept for review in {aside.dir}")
    return result


# Host git appends to reflogs and rerere writes its images through a symbolic link, and writes a
# ref's lock file into a linked directory: in these trees a link the box made is removed.
SWEPT = ("logs", "refs", "rr-cache")


def _sweep_links(plan: GitPlan, aside: _Aside, result: SyncResult) -> None:
    """Symbolic links and special files the box left in the writable trees it shared with the host
    (the box is dead by now, so none comes back): recorded aside, then removed."""
    budget = [200000]
    for m in plan.mounts:
        if m.kind != MountKind.BIND or os.path.basename(m.dst) not in SWEPT:
            continue
        try:
            with safefs.base_dir(m.dst) as dfd:
                _sweep_dir(dfd, "", m.dst, aside, result, budget)
        except OSError:
            continue


def _sweep_dir(dfd: int, rel: str, root: str, aside: _Aside, result: SyncResult, budget: list[int]) -> None:
    try:
        fd = safefs.open_beneath(dfd, rel, os.O_RDONLY | os.O_DIRECTORY) if rel else os.dup(dfd)
    except OSError:
        return
    try:
        names = os.listdir(fd)
        for name in names:
            budget[0] -= 1
            if budget[0] < 0:
                return
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            sub = os.path.join(rel, name)
            if stat.S_ISDIR(st.st_mode):
                _sweep_dir(dfd, sub, root, aside, result, budget)
                continue
            if stat.S_ISREG(st.st_mode):
                continue
            what = f"-> {os.readlink(name, dir_fd=fd)}" if stat.S_ISLNK(st.st_mode) else "a special file"
            os.unlink(name, dir_fd=fd)
            label = os.path.join(os.path.basename(root), sub)
            try:
                aside.put(os.path.join("removed", label), f"{os.path.join(root, sub)} {what}\n".encode())
            except OSError:
                pass
            result.aside.append(f"{label} (a link or special file in a tree host git writes through; removed)")
    except OSError:
        return
    finally:
        os.close(fd)


def _restore_dotgit_link(plan: GitPlan, workdir: str, result: SyncResult) -> None:
    """A `.git` that is a symbolic link cannot be made read-only (a mount follows it): if the box
    replaced it, its replacement is moved aside and the link put back."""
    if plan.dotgit_link is None:
        return
    try:
        with safefs.base_dir(workdir) as wfd:
            try:
                st = os.stat(".git", dir_fd=wfd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode) and os.readlink(".git", dir_fd=wfd) == plan.dotgit_link:
                    return
                moved = safefs.unique_name(".git", "rejected")
                safefs.rename_noreplace(wfd, ".git", moved)
            except FileNotFoundError:
                moved = None
            os.symlink(plan.dotgit_link, ".git", dir_fd=wfd)
    except OSError as err:
        result.messages.append(f"git: the box replaced the link {workdir}/.git and it could not be put back "
                               f"({err.strerror or err}); do not run git in the workdir before checking it")
        return
    where = f"; the box's .git is at {os.path.join(workdir, moved)} for review" if moved else ""
    result.messages.append(f"git: the box replaced the link {workdir}/.git; the link is back{where}")


def _quarantine_new_gitlinks(plan: GitPlan, workdir: str, result: SyncResult) -> None:
    """A gitlink the box staged whose checkout has its own `.git`: the host's `git status` would
    recurse into it and run what its config says. That `.git` is renamed out of git's sight."""
    try:
        data = safefs.read_file(plan.index, INDEX_LIMIT)
    except OSError:
        return
    for path in gitlinks_in(data or b"")[:1000]:
        if path in plan.gitlinks:
            continue
        rel = os.path.join(path, ".git")
        if not safefs.beneath(os.path.join(workdir, rel), workdir):
            continue
        try:
            with safefs.base_dir(workdir) as wfd, safefs.parent_of(wfd, rel) as (pfd, name):
                try:
                    os.stat(name, dir_fd=pfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                moved = safefs.unique_name(name, "rejected")
                safefs.rename_noreplace(pfd, name, moved)
        except OSError as err:
            result.messages.append(f"git: could not move {os.path.join(workdir, rel)} aside: {err.strerror or err}; "
                                   "do not run git in the workdir before removing it")
            continue
        result.messages.append(f"git: the box added {path} as a submodule with a git dir of its own (its config "
                               f"could run commands); moved to {os.path.join(workdir, path, moved)} for review")


def _sync_one(rfd: int, hfd: int, g: GitDir, name: str, key: str, before: str | None, keep, result) -> None:  # noqa: ANN001
    try:
        box = safefs.read_beneath(rfd, key, _limit(name))
    except OSError as err:
        keep(key + ".not-a-file", f"{err.strerror or err}\n".encode(), "not a regular file")
        return
    if before == UNSAFE or _digest(box) == before:
        return
    if box is not None:
        why = validate(name, box)
        if why:
            keep(key, box, why)
            return
    try:
        ok = _write_host(hfd, name, box, before)
    except OSError as err:
        ok = False
        result.messages.append(f"could not sync {os.path.join(g.host, name)} back: {err.strerror or err}")
    if ok:
        result.synced.append(os.path.join(g.host, name))
    elif box is not None:
        keep(key, box, "changed on the host during the session")
        if name == "packed-refs":
            _restore_packed(hfd, box, g, result, _orig_packed(rfd, key))


def _worktree_of(g: GitDir, plan: GitPlan, workdir: str) -> str | None:
    """The checkout whose files this git dir's index describes, when the host can reach it here:
    the workdir's own, or an embedded submodule's (`<workdir>/<path>/.git`)."""
    if plan.index and os.path.dirname(plan.index) == g.host:
        return workdir
    if os.path.basename(g.host) == ".git" and safefs.beneath(g.host, workdir):
        return os.path.dirname(g.host)
    return None


@contextmanager
def _tree_fd(tree: str, workdir: str) -> Iterator[int]:
    """The worktree's fd: beneath the workdir with no link followed, or the workdir itself."""
    with safefs.base_dir(workdir) as wfd:
        if os.path.normpath(tree) == os.path.normpath(workdir):
            yield wfd
            return
        fd = safefs.open_beneath(wfd, os.path.relpath(tree, workdir), os.O_RDONLY | os.O_DIRECTORY)
        try:
            yield fd
        finally:
            os.close(fd)


def _judge_index(box: bytes, start: bytes | None, tree: str | None, workdir: str,
                 mtime_ns: int) -> gitindex.Outcome:
    if tree is None:
        return gitindex.sanitize(box, start, None, mtime_ns)
    try:
        with _tree_fd(tree, workdir) as tfd, gitindex.WorkTree(tfd) as files:
            return gitindex.sanitize(box, start, files, mtime_ns)
    except OSError:
        return gitindex.sanitize(box, start, None, mtime_ns)  # no worktree to look at: smudge all it changed


def _shown_paths(paths: list[str], n: int = 3) -> str:
    more = f" and {len(paths) - n} more" if len(paths) > n else ""
    return ", ".join(paths[:n]) + more


def _sync_index(rfd: int, hfd: int, g: GitDir, key: str, before: str | None, keep, result: SyncResult,  # noqa: ANN001
                tree: str | None, workdir: str) -> None:
    """The box's index, judged and rewritten by relay/trust/gitindex.py before it reaches the host:
    hiding bits cleared, hiding extensions dropped, every entry it changed re-read by host git,
    and an index that lies about a file's content refused (the host keeps a safe one)."""
    host_name = os.path.join(g.host, "index")
    try:
        box = safefs.read_beneath(rfd, key, INDEX_LIMIT)
        st = safefs.lstat_beneath(rfd, key)
    except OSError as err:
        keep(key + ".not-a-file", f"{err.strerror or err}\n".encode(), "not a regular file")
        return
    if before == UNSAFE:
        return
    try:
        start = safefs.read_beneath(rfd, os.path.join(ORIG, key), INDEX_LIMIT)
    except OSError:
        start = None
    untouched = _digest(box) == before
    if box is None:
        _sync_one(rfd, hfd, g, "index", key, before, keep, result)  # removed in the box: removed on the host
        return
    outcome = _judge_index(box, start, tree, workdir, st.st_mtime_ns if st is not None else 0)
    if outcome.refused:
        if untouched:
            return  # the host's own (a split index, say): nothing of the box's to refuse
        keep(key, box, "refused, see the line above")
        result.messages.append(f"git: the box's index was not synced back: {outcome.refused}. It is kept for "
                               "review with the rest the box left in .git; the host keeps its own index, so what "
                               "the box staged is not staged on the host (its commits are there)")
        # The host's own index, made safe against the files as they are now.
        if start is not None:
            safe = _judge_index(start, start, tree, workdir, 0)
            if safe.data is not None and safe.data != start:
                try:
                    _write_host(hfd, "index", safe.data, before)
                except OSError:
                    pass
        return
    data = outcome.data
    assert data is not None
    if outcome.cleared:
        result.messages.append(f"git: the box's index marked {_shown_paths(outcome.cleared)}, which hides "
                               "edits from git status and git diff on the host; the marks were cleared")
    if data == box and untouched:
        return
    try:
        ok = _write_host(hfd, "index", data, before)
    except OSError as err:
        ok = False
        result.messages.append(f"could not sync {host_name} back: {err.strerror or err}")
    if ok:
        if not untouched:
            result.synced.append(host_name)
    elif not untouched:
        keep(key, box, "changed on the host during the session")


def _orig_packed(rfd: int, key: str) -> bytes:
    try:
        return safefs.read_beneath(rfd, os.path.join(ORIG, key), STATE_LIMIT) or b""
    except OSError:
        return b""


def _packed_names(data: bytes) -> set[bytes]:
    return {ln.split(b" ", 1)[1] for ln in data.split(b"\n") if b" " in ln and not ln.startswith(b"#")}


def _restore_packed(hfd: int, box: bytes, g: GitDir, result: SyncResult, orig: bytes) -> None:
    """The box packed refs (deleting the loose ones, live) but its packed-refs conflicts with the
    host's: each ref it packed that was loose when it started (or that it made) and that the host
    now has nowhere is written back as a loose ref. A ref that was packed already is the host's
    to delete."""
    try:
        host = safefs.read_beneath(hfd, "packed-refs", STATE_LIMIT) or b""
    except OSError:
        return
    held = _packed_names(host) | _packed_names(orig)
    restored = 0
    for line in box.split(b"\n"):
        m = re.fullmatch(b"(" + _HEX + b") (.+)", line)
        if not m or m.group(2) in held or not valid_refname(m.group(2)):
            continue
        ref = m.group(2).decode()
        try:
            if safefs.lstat_beneath(hfd, ref) is not None:
                continue
            with safefs.parent_of(hfd, ref, create=True, mode=0o755) as (pfd, leaf):
                safefs.create_new(pfd, leaf + ".lock", m.group(1) + b"\n", 0o644)
                try:
                    safefs.rename_noreplace(pfd, leaf + ".lock", leaf)
                    restored += 1
                finally:
                    try:
                        os.unlink(leaf + ".lock", dir_fd=pfd)
                    except OSError:
                        pass
        except OSError:
            continue
    if restored:
        result.messages.append(f"git: {restored} ref(s) the box had packed were written back to {g.host} as loose refs")


def _new_worktrees(rfd: int, g: GitDir, plan: GitPlan, known: set[str], before: dict[str, str | None], keep,  # noqa: ANN001
                   result: SyncResult, workdir: str) -> None:
    """`git worktree add` in the box: registered on the host when its `commondir` is `../..`, its
    `gitdir` names a `.git` file inside the workdir that points back here, and its state is valid."""
    existing = {d.private for d in plan.dirs}
    wt_rel = os.path.join(g.private, "worktrees")
    st = safefs.lstat_beneath(rfd, wt_rel)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return
    fd = safefs.open_beneath(rfd, wt_rel, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ids = sorted(os.listdir(fd))
    finally:
        os.close(fd)
    for wid in ids:
        rel = os.path.join(wt_rel, wid)
        if rel in existing or not re.fullmatch(r"[A-Za-z0-9._-]{1,200}", wid) or wid.startswith("."):
            continue
        try:
            pointer = safefs.read_beneath(rfd, os.path.join(rel, "gitdir"), 4096)
            common = safefs.read_beneath(rfd, os.path.join(rel, "commondir"), 4096)
        except OSError:
            continue
        if pointer is None or common is None or validate("commondir", common):
            continue
        target = pointer.decode("utf-8", errors="replace").strip()
        if not (os.path.isabs(target) and os.path.basename(target) == ".git" and safefs.beneath(target, workdir)):
            continue
        try:
            dotgit = safefs.read_file(target, 4096, base=workdir)
        except OSError:
            continue
        expected = f"gitdir: {os.path.join(g.host, 'worktrees', wid)}".encode()
        if dotgit is None or dotgit.strip() != expected:
            continue
        host_wt = os.path.join(g.host, "worktrees", wid)
        try:
            with host_dir(g.host, workdir) as hfd:
                if safefs.lstat_beneath(hfd, os.path.join("worktrees", wid)) is not None:
                    continue  # the host made one of that name meanwhile: kept aside below
                datas = {}
                for name in (*STATE_WORKTREE, "logs/HEAD"):
                    data = safefs.read_beneath(rfd, os.path.join(rel, name), _limit(name))
                    if data is not None and validate(name, data):
                        raise ValueError(name)
                    if data is not None and name == "index":
                        # No start and no checkout looked at: every entry is re-read by host git.
                        data = gitindex.sanitize(data, None).data
                        if data is None:
                            raise ValueError(name)
                    datas[name] = data
                if datas.get("HEAD") is None:
                    continue
                with safefs.parent_of(hfd, os.path.join("worktrees", wid, "x"), create=True, mode=0o755) as (pfd, _):
                    safefs.create_new(pfd, "commondir", b"../..\n", 0o644)
                    safefs.create_new(pfd, "gitdir", (target + "\n").encode(), 0o644)
                for name, data in datas.items():
                    if data is not None:
                        with safefs.parent_of(hfd, os.path.join("worktrees", wid, name), create=True,
                                              mode=0o755) as (pfd, leaf):
                            safefs.create_new(pfd, leaf, data, 0o644)
        except (OSError, ValueError):
            continue
        result.synced.append(host_wt)
        known.update(os.path.join(rel, n) for n in (*STATE_WORKTREE, "logs/HEAD", "commondir", "gitdir"))
