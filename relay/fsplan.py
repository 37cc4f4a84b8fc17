"""Plan the box's filesystem: what is bound, read-only or writable, and what is masked.

The rules, in order: the host read-only; private /tmp, /run and $HOME; the workdir and the
profile's grants bound back (parents first); then write protections inside the workdir;
then the deny list, which always wins. The workdir's git dir is planned by relay/gitdir.py (a
private copy with an allowlist of writable parts) and enters here as `git_mounts`. Symlinks are resolved first so that a link cannot
carry a denied path into the box, and a missing denied path that could be created under a
writable bind is masked at its first missing component.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from .vocab import MountKind


@dataclass(frozen=True)
class Mount:
    """One filesystem operation in the box.

    kinds: ro-bind, bind, tmpfs, mask-file, mask-dir, dev, proc, and private-bind (a writable
    bind of a per-run directory that is deleted afterwards, so like tmpfs it holds no host state).
    """

    kind: MountKind
    dst: str
    src: str | None = None
    size: int | None = None  # tmpfs (and dev: its /dev/shm) only: bytes, so a disk fill cannot eat the host's memory


@dataclass(frozen=True)
class Grant:
    path: str
    writable: bool


@dataclass
class FsView:
    """Every question the planner asks of the host filesystem, and the only way it asks one.

    resolve() and everything it calls read the host through this view alone, so a test can hand
    it a fake (tests/fakefs.py) and prove the planner pure: no other file is touched. The real
    one asks the host on demand."""

    def kind(self, path: str) -> str:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return "missing"
        if stat.S_ISDIR(mode):
            return "dir"
        return "file"

    def realpath(self, path: str) -> str:
        return os.path.realpath(path)

    def is_symlink(self, path: str) -> bool:
        return os.path.islink(path)

    def lkind(self, path: str) -> str:
        """Like kind, but a symbolic link is "link" (not followed)."""
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return "missing"
        if stat.S_ISLNK(mode):
            return "link"
        return "dir" if stat.S_ISDIR(mode) else "file"

    def lstat(self, path: str) -> tuple[str, int] | None:
        """(kind, owner uid) of `path` itself, a link not followed: kind is socket, link, dir, file
        or other; None when it does not exist (relay/sockets.py checks `--allow-socket` with it)."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        mode = st.st_mode
        kind = ("socket" if stat.S_ISSOCK(mode) else "link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode)
                else "file" if stat.S_ISREG(mode) else "other")
        return kind, st.st_uid

    def readlink(self, path: str) -> str | None:
        try:
            return os.readlink(path)
        except OSError:
            return None

    def which(self, name: str, path: str) -> str | None:
        """The executable `name` would run as on `path` (a PATH string), as shutil.which finds it."""
        import shutil

        return shutil.which(name, path=path)

    def listdir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except OSError:
            return []

    def read_small(self, path: str) -> bytes | None:
        """A small regular file's bytes, read with no link followed (None: absent or not a file)."""
        return self.read_bounded(path, 4096)

    def read_bounded(self, path: str, limit: int) -> bytes | None:
        from . import safefs

        try:
            return safefs.read_file(path, limit)
        except OSError:
            return None


@dataclass(frozen=True)
class FsPlan:
    mounts: tuple[Mount, ...]
    placeholders: tuple[str, ...]
    denied: tuple[str, ...]
    protected: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())


PRIVATE_DIRS = ("/tmp", "/var/tmp", "/run")
DIR_LIKE = frozenset({".git", ".vscode", ".idea", ".claude", ".gemini", ".codex", "hooks", "commands", "agents",
                      "modules", "worktrees", "hive-relay", ".venv", ".cache", "node_modules", "relay", "bin",
                      "config", ".ci", "npm", ".opencode", "skills", "rules", "output-styles"})
# Mount kinds that show the box nothing of the host's persistent files.
PRIVATE_KINDS = (MountKind.TMPFS, MountKind.PRIVATE_BIND, MountKind.DEV, MountKind.PROC, MountKind.MASK_FILE, MountKind.MASK_DIR)


def _under(path: str, root: str) -> bool:
    return path == root or root == "/" or path.startswith(root.rstrip("/") + "/")


def _depth(path: str) -> int:
    return len([p for p in path.split("/") if p])


def _innermost(path: str, mounts: Iterable[Mount]) -> Mount | None:
    """The last mount whose destination contains `path`: that is what the box sees there."""
    found = None
    for mount in mounts:
        if _under(path, mount.dst):
            found = mount
    return found


def _between(root: str, path: str) -> list[str]:
    """Directories strictly between `root` and `path`."""
    rel = path[len(root.rstrip("/")) + 1 :].split("/")[:-1]
    out, current = [], root.rstrip("/")
    for part in rel:
        current = f"{current}/{part}"
        out.append(current)
    return out


def _first_missing(path: str, root: str, fs: FsView) -> str | None:
    """The shallowest component of `path` below `root` that does not exist, if its parent is a dir."""
    parts = path[len(root.rstrip("/")) + 1 :].split("/")
    current = root.rstrip("/")
    for part in parts:
        parent, current = current or "/", f"{current}/{part}"
        kind = fs.kind(current)
        if kind == "missing":
            return current if fs.kind(parent) == "dir" else None
        if kind != "dir":
            return None
    return None


def plan_filesystem(
    *,
    home: str,
    workdir: str,
    home_source: str | None,
    grants: Iterable[Grant],
    secrets: Iterable[str],
    protected: Iterable[str],
    extra_binds: Iterable[Mount] = (),
    git_mounts: Iterable[Mount] = (),
    fs: FsView | None = None,
    tmpfs_size: int | None = None,
) -> FsPlan:
    """Turn grants and deny lists into ordered mounts; `home_source` replaces the $HOME tmpfs."""
    fs = fs or FsView()
    notes: list[str] = []
    secrets = list(secrets)
    secret_reals = {os.path.normpath(s) for s in secrets} | {fs.realpath(s) for s in secrets}
    mounts = _private_mounts(home, home_source, fs, tmpfs_size)
    mounts += _binds(grants, workdir, extra_binds, secret_reals, fs, notes)
    # The workdir's git dir by allowlist (relay/gitdir.py): its private copy and the binds inside it,
    # parents first. A bind whose source resolves into a denied path is left out.
    for m in git_mounts:
        if m.kind != MountKind.PRIVATE_BIND and m.src and any(_under(m.src, s) for s in secret_reals):
            notes.append(f"{m.dst} is not shown in the box: it resolves into a denied path")
            continue
        mounts.append(m)
    masker = _Masker(mounts, fs)
    protected_out = masker.protect(protected)
    denied = masker.deny(secrets)
    masker.pin()
    return FsPlan(
        mounts=tuple(masker.mounts),
        placeholders=tuple(dict.fromkeys(masker.placeholders)),
        denied=tuple(dict.fromkeys(denied)),
        protected=tuple(dict.fromkeys(protected_out)),
        notes=tuple(notes),
    )


def _private_mounts(home: str, home_source: str | None, fs: FsView, tmpfs_size: int | None) -> list[Mount]:
    """The host read-only, then the box's own /dev, /proc, /tmp, /var/tmp, /run and $HOME.

    Every writable tmpfs is sized, and together they stay within the profile's memory (for a caller
    on rlimits, tmpfs pages are charged to nothing else): $HOME and /tmp get `tmpfs_size` (a
    quarter of the memory), /var/tmp, /run and /dev/shm half of that each: 7/8 in all."""
    small = tmpfs_size // 2 if tmpfs_size else None
    mounts: list[Mount] = [Mount(MountKind.RO_BIND, "/", "/"), Mount(MountKind.DEV, "/dev", size=small), Mount(MountKind.PROC, "/proc")]
    mounts += [Mount(MountKind.TMPFS, d, size=tmpfs_size if d == "/tmp" else small) for d in PRIVATE_DIRS
               if fs.kind(d) == "dir"]
    mounts.append(Mount(MountKind.PRIVATE_BIND, home, home_source) if home_source else Mount(MountKind.TMPFS, home, size=tmpfs_size))
    return mounts


def _binds(grants: Iterable[Grant], workdir: str, extra_binds: Iterable[Mount], secret_reals: set[str],
           fs: FsView, notes: list[str]) -> list[Mount]:
    """The grants, the workdir and the extra binds, parents first (the workdir after a grant of
    equal depth). A grant that resolves into a denied path is skipped with a note."""
    binds: list[tuple[int, int, Mount]] = []
    for grant in grants:
        if fs.kind(grant.path) == "missing":
            continue
        real = fs.realpath(grant.path)
        leak = next((s for s in sorted(secret_reals) if _under(real, s)), None)
        if leak:
            notes.append(f"grant {grant.path} skipped: it resolves into denied {leak}")
            continue
        binds.append((_depth(grant.path), 0, Mount(MountKind.BIND if grant.writable else "ro-bind", grant.path, real)))
    real_workdir = fs.realpath(workdir)
    binds.append((_depth(real_workdir), 1, Mount(MountKind.BIND, real_workdir, real_workdir)))
    binds += [(_depth(m.dst), 0, m) for m in extra_binds if m.src and fs.kind(m.src) != "missing"]
    return [m for _, _, m in sorted(binds, key=lambda b: (b[0], b[1]))]


class _Masker:
    """Write protections and the deny list, laid over the binds: what lies under a writable bind is
    bound read-only or masked, and a missing path is masked at its first missing component."""

    def __init__(self, mounts: list[Mount], fs: FsView) -> None:
        self.mounts, self.fs = mounts, fs
        self.start = len(mounts)
        self.masked: set[str] = set()
        self.placeholders: list[str] = []
        # (writable bind root, protected/masked path): the dirs between them must not be renamable.
        self.anchors: list[tuple[str, str]] = []

    def mask(self, path: str, kind: str) -> None:
        if path in self.masked:
            return
        self.masked.add(path)
        self.mounts.append(Mount(MountKind.MASK_DIR if kind == "dir" else "mask-file", path))

    def mask_missing(self, target: str, cover: Mount) -> str | None:
        """Keep a missing path from being created under a writable bind: mask its first missing
        component (bwrap leaves an empty placeholder file there for the box's lifetime)."""
        first = _first_missing(target, cover.dst, self.fs)
        if first:
            # An ancestor (or a dir by nature) is masked as an empty read-only dir, so tools that
            # look inside it see "no such file" rather than "not a directory".
            is_dir = first != target or os.path.basename(first) in DIR_LIKE
            self.mask(first, "dir" if is_dir else "file")
            self.placeholders.append(first)
            self.anchors.append((cover.dst, first))
        return first

    def protect(self, protected: Iterable[str]) -> list[str]:
        """Bind read-only what the host runs later; returns what ended up protected."""
        out: list[str] = []
        for path in protected:
            # bwrap follows a link at a mount's destination, so a protected link is protected at its
            # target (where it lies under a writable bind); binding onto the link itself fails to start
            # the box when its target is outside it.
            target = self.fs.realpath(path) if self.fs.is_symlink(path) else path
            cover = _innermost(target, self.mounts)
            if cover is None or cover.kind != MountKind.BIND:
                continue  # read-only or private already
            if self.fs.kind(target) != "missing":
                if target not in self.masked:
                    self.masked.add(target)
                    self.mounts.append(Mount(MountKind.RO_BIND, target, target))
                out.append(target)
                self.anchors.append((cover.dst, target))
                continue
            first = self.mask_missing(target, cover)
            if first:
                out.append(first)
        return out

    def deny(self, secrets: Iterable[str]) -> list[str]:
        """Mask every deny-listed path the box could otherwise see (by its name and its target)."""
        denied: list[str] = []
        for path in secrets:
            candidates = [os.path.normpath(path)]
            real = self.fs.realpath(path)
            if real != candidates[0]:
                candidates.append(real)
            for target in candidates:
                cover = _innermost(target, self.mounts)
                if cover is None or cover.kind in PRIVATE_KINDS:
                    continue  # the box sees nothing of the host there
                kind = self.fs.kind(target)
                if kind != "missing":
                    self.mask(target, kind)
                    denied.append(target)
                    if cover.kind == MountKind.BIND:
                        self.anchors.append((cover.dst, target))
                elif cover.kind == MountKind.BIND:
                    first = self.mask_missing(target, cover)
                    if first:
                        denied.append(first)
        return denied

    def pin(self) -> None:
        """A protected path's parents inside a writable bind become mount points of their own (bound
        onto themselves), so `mv .git .git2 && mkdir -p .git/hooks` cannot sidestep the protection:
        rename and rmdir of a mount point fail with EBUSY. They go before the protections."""
        pinned = sorted({d for root, target in self.anchors for d in _between(root, target)
                         if self.fs.kind(d) == "dir"}, key=lambda d: (_depth(d), d))
        self.mounts[self.start:self.start] = [Mount(MountKind.BIND, d, d) for d in pinned]
