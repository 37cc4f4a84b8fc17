"""Plan the box's filesystem: what is bound, read-only or writable, and what is masked.

The rules, in order: the host read-only; private /tmp, /run and $HOME; the workdir and the
profile's grants bound back (parents first); then write protections inside the workdir;
then the deny list, which always wins. The workdir's git dir is planned by relay/trust/gitdir.py (a
private copy with an allowlist of writable parts) and enters here as `git_mounts`. Symlinks are resolved first so that a link cannot
carry a denied path into the box, and a missing denied path that could be created under a
writable bind is masked at its first missing component.

A deny or protect entry that is (or passes through) a symbolic link is applied where its target
shows in the box, never at the link: bwrap and the engines follow a link at a mount's destination
(an absolute one against their own root, so the box failed to start), and a directory cannot be
mounted on a link at all. The links themselves, where the box could unlink and replace them (a
writable bind), are listed in `pinned_links`: relay/box/linkpin.py binds each onto itself before the
box starts, so unlink and rename get EBUSY, as for a pinned directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from relay.model.fs_view import FsView
from relay.model.mounts import Grant, Mount
from relay.model.record import field, record
from relay.model.vocab import MountKind


@record
class FsPlan:
    """The box's whole filesystem as a pure plan: mounts in order, placeholders to create, and what is denied or
    protected."""

    mounts: tuple[Mount, ...]
    placeholders: tuple[str, ...]
    denied: tuple[str, ...]
    protected: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())
    # Host paths of symbolic links (met on a deny or protect entry) that lie under a writable bind:
    # each is pinned by a bind onto itself before the box starts (relay/box/linkpin.py).
    pinned_links: tuple[str, ...] = field(default=())


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


def _host(box: str, cover: Mount) -> str:
    """The host path shown at box path `box`, which lies under `cover` (a host bind)."""
    src = cover.src or cover.dst
    rel = box[len(cover.dst.rstrip("/")):] if cover.dst != "/" else box
    return os.path.normpath(src.rstrip("/") + rel) if src != "/" else (rel or "/")


def _first_missing(path: str, cover: Mount, fs: FsView) -> str | None:
    """The shallowest component of box path `path` below `cover` that does not exist, if its parent
    is a dir (asked of the host at the paths `cover` shows there)."""
    root = cover.dst
    parts = path[len(root.rstrip("/")) + 1 :].split("/")
    current = root.rstrip("/")
    for part in parts:
        parent, current = current or "/", f"{current}/{part}"
        kind = fs.kind(_host(current, cover))
        if kind == "missing":
            return current if fs.kind(_host(parent, cover)) == "dir" else None
        if kind != "dir":
            return None
    return None


def links_on(path: str, fs: FsView, limit: int = 40) -> list[str]:
    """Every symbolic link met while resolving `path`, each named by its own link-free host path (a
    link to a link, a relative link, a link in a parent: all of them), asked through `fs` only.
    Dangling and looping links end the walk; nothing beyond the links' own text is read."""
    found: list[str] = []
    pending = [p for p in reversed(os.path.normpath(path).split("/")) if p]
    current, hops = "/", 0
    while pending:
        part = pending.pop()
        if part in (".", ""):
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        nxt = os.path.join(current, part)
        if fs.lkind(nxt) != "link":
            current = nxt
            continue
        hops += 1
        target = fs.readlink(nxt)
        if hops > limit or target is None:
            break
        if nxt not in found:
            found.append(nxt)
        if target.startswith("/"):
            current = "/"
        pending.extend(p for p in reversed(target.split("/")) if p)
    return found


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
    fs: FsView,
    tmpfs_size: int | None = None,
) -> FsPlan:
    """Turn grants and deny lists into ordered mounts; `home_source` replaces the $HOME tmpfs."""
    notes: list[str] = []
    secrets = list(secrets)
    secret_reals = {os.path.normpath(s) for s in secrets} | {fs.realpath(s) for s in secrets}
    mounts = _private_mounts(home, home_source, fs, tmpfs_size)
    mounts += _binds(grants, workdir, extra_binds, secret_reals, fs, notes)
    # The workdir's git dir by allowlist (relay/trust/gitdir.py): its private copy and the binds inside it,
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
        pinned_links=tuple(masker.pinned_links),
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
    bound read-only or masked, and a missing path is masked at its first missing component.

    Every entry is applied at each box path where its resolved host path shows (a host path can
    show at more than one: the root's read-only view, a grant, the workdir), never at a link."""

    def __init__(self, mounts: list[Mount], fs: FsView) -> None:
        self.mounts, self.fs = mounts, fs
        self.start = len(mounts)
        self.masked: set[str] = set()
        self.placeholders: list[str] = []
        self.pinned_links: list[str] = []
        # (writable bind, protected/masked box path): the dirs between them must not be renamable.
        self.anchors: list[tuple[Mount, str]] = []

    def locations(self, real: str) -> list[tuple[str, Mount]]:
        """(box path, the host bind it shows through) for each place host path `real` is seen."""
        out: list[tuple[str, Mount]] = []
        for m in self.mounts:
            if m.kind not in (MountKind.BIND, MountKind.RO_BIND) or not m.src or not _under(real, m.src):
                continue
            rel = real[len(m.src.rstrip("/")):] if m.src != "/" else real
            box = os.path.normpath(m.dst.rstrip("/") + rel) if m.dst != "/" else rel
            if _innermost(box, self.mounts) is m and box not in (b for b, _ in out):
                out.append((box, m))
        return out

    def mask(self, path: str, kind: str) -> None:
        if path in self.masked:
            return
        self.masked.add(path)
        self.mounts.append(Mount(MountKind.MASK_DIR if kind == "dir" else "mask-file", path))

    def mask_missing(self, target: str, cover: Mount) -> str | None:
        """Keep a missing path from being created under a writable bind: mask its first missing
        component (bwrap leaves an empty placeholder file there for the box's lifetime)."""
        first = _first_missing(target, cover, self.fs)
        if first:
            # An ancestor (or a dir by nature) is masked as an empty read-only dir, so tools that
            # look inside it see "no such file" rather than "not a directory".
            is_dir = first != target or os.path.basename(first) in DIR_LIKE
            self.mask(first, "dir" if is_dir else "file")
            self.placeholders.append(first)
            self.anchors.append((cover, first))
        return first

    def pin_links(self, path: str) -> list[str]:
        """The links on `path` that the box could unlink and replace (they lie under a writable
        bind) are pinned; returns their box paths."""
        out: list[str] = []
        for link in links_on(path, self.fs):
            for box, cover in self.locations(link):
                if cover.kind != MountKind.BIND:
                    continue
                if link not in self.pinned_links:
                    self.pinned_links.append(link)
                out.append(box)
                self.anchors.append((cover, box))
        return out

    def protect(self, protected: Iterable[str]) -> list[str]:
        """Bind read-only what the host runs later; returns what ended up protected."""
        out: list[str] = []
        for path in protected:
            out += self.pin_links(path)
            real = self.fs.realpath(path)
            exists = self.fs.kind(real) != "missing"
            for box, cover in self.locations(real):
                if cover.kind != MountKind.BIND:
                    continue  # read-only already
                if exists:
                    if box not in self.masked:
                        self.masked.add(box)
                        self.mounts.append(Mount(MountKind.RO_BIND, box, real))
                    out.append(box)
                    self.anchors.append((cover, box))
                    continue
                first = self.mask_missing(box, cover)
                if first:
                    out.append(first)
        return out

    def deny(self, secrets: Iterable[str]) -> list[str]:
        """Mask every deny-listed path the box could otherwise see, wherever its target shows; the
        links on the way are pinned where the box could replace them."""
        denied: list[str] = []
        for path in secrets:
            self.pin_links(path)
            real = self.fs.realpath(path)
            kind = self.fs.kind(real)
            for box, cover in self.locations(real):
                if kind != "missing":
                    self.mask(box, kind)
                    denied.append(box)
                    if cover.kind == MountKind.BIND:
                        self.anchors.append((cover, box))
                elif cover.kind == MountKind.BIND:
                    first = self.mask_missing(box, cover)
                    if first:
                        denied.append(first)
        return denied

    def pin(self) -> None:
        """A protected path's parents inside a writable bind become mount points of their own (bound
        onto themselves), so `mv .git .git2 && mkdir -p .git/hooks` cannot sidestep the protection:
        rename and rmdir of a mount point fail with EBUSY. They go before the protections."""
        pinned: dict[str, str] = {}
        for cover, target in self.anchors:
            for d in _between(cover.dst, target):
                host = _host(d, cover)
                if d not in pinned and self.fs.kind(host) == "dir":
                    pinned[d] = host
        order = sorted(pinned, key=lambda d: (_depth(d), d))
        self.mounts[self.start:self.start] = [Mount(MountKind.BIND, d, pinned[d]) for d in order]
