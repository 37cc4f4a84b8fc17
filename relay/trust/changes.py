"""Review and apply a staged run from the host: what the box changed, the diff, and an apply that
trusts nothing the box wrote.

The upper layer is the box's work, so every byte and every name in it is hostile input:
- it is read relative to a directory fd with no link followed (relay/host/safefs.py), special files are
  never opened, sizes are bounded;
- a symlink the box made is recreated as a symlink (never followed, never copied through) and
  flagged when it leaves the workdir; FIFOs, sockets and devices are refused;
- modes are cut to the rwx bits (no setuid, setgid or sticky bit lands);
- each file lands by a rename within its directory, and the staged copy is dropped only after, so
  an interrupted apply run again gives the same result;
- a host path the user changed during the run (its ctime is not older than the run's stamp, see
  relay/trust/staged.py) is a conflict: reported, left as the user made it, the box's version kept staged;
- the protected and denied paths of the run's plan, and `.git` (its state comes back with a later
  apply of git), are never written.

Cost: a walk of the upper layer (what changed) plus one lstat and hash per changed path on the host;
nothing is proportional to the size of the checkout.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import stat
import time
from collections.abc import Iterator, Mapping, Sequence

from relay.host import safefs
from relay.model.errors import RelayError, UsageError
from relay.model.hashing import sha256
from relay.model.record import asdict, field, record
from relay.model.refusal import ENTRY
from relay.trust import staged
from relay.trust.checkout_owner import checkout_owner, give, missing_parents

MAX_ENTRIES = 200_000  # an upper layer with more entries is not reviewed entry by entry
APPLY_LIMIT = 256 << 20  # a file larger than this is kept staged (copy it by hand after review)
DIFF_LIMIT = 4 << 20
OPAQUE = ("user.overlay.opaque", "trusted.overlay.opaque")
REDIRECT = ("user.overlay.redirect", "trusted.overlay.redirect")
GIT = ".git"


@record(frozen=False)
class Entry:
    """One changed path. `kind`: added | modified | deleted | mode | symlink | dir | special."""

    path: str
    kind: str
    mode: int | None = None
    before_mode: int | None = None
    size: int = 0
    link: str | None = None
    sha256: str | None = None
    flags: list[dict] = field(default_factory=list)
    conflict: str | None = None
    refused: str | None = None
    base: dict | None = None  # the host's version now: ino, size, mtime_ns, ctime_ns, sha256
    note: str | None = None  # git results: what was done with the box's objects, refs, HEAD, index

    @property
    def flagged(self) -> bool:
        return bool(self.flags)

    def to_json(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if v not in (None, [])}
        for key in ("mode", "before_mode"):
            if key in data:
                data[key] = oct(data[key] & 0o7777)
        return data


@record(frozen=False)
class Review:
    """What a staged run changed, read from its upper layer: the entries the user reviews before anything lands."""

    run: staged.Run
    entries: list[Entry]
    git: int = 0  # entries under .git (objects, refs): staged, applied by a later version
    opaque: list[str] = field(default_factory=list)  # dirs the box removed and made again
    notes: list[str] = field(default_factory=list)  # what the git apply did


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _xattr(fd: int, names: Sequence[str]) -> bool:
    for name in names:
        try:
            os.getxattr(fd, name)  # fgetxattr: on the dir fd itself (an lgetxattr of /proc/self/fd/N
            # would read the magic link's own xattrs: none, so no opaque dir was ever seen)
            return True
        except OSError:
            continue
    return False


def _hash_fd(fd: int, limit: int) -> str | None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        return None
    h = sha256()
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)


def hash_beneath(dirfd: int, rel: str, limit: int = APPLY_LIMIT) -> str | None:
    """sha256 of a regular file under dirfd, no link followed, never blocking; None if not one."""
    try:
        fd = safefs.open_beneath(dirfd, rel, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        return _hash_fd(fd, limit)
    finally:
        os.close(fd)


def _walk(ufd: int, rel: str, budget: list[int]) -> Iterator[tuple[str, os.stat_result, int | None]]:
    """(rel path, lstat, dir fd or None) of every entry under the upper dir fd, parents first. A
    directory's fd is open while its children are walked (for its xattrs), then closed."""
    with os.scandir(ufd) as it:
        items = sorted((e.name, e.stat(follow_symlinks=False)) for e in it)
    for name, st in items:
        budget[0] -= 1
        if budget[0] < 0:
            raise RelayError(f"the staged layer has more than {MAX_ENTRIES} entries; review it by hand")
        path = f"{rel}/{name}" if rel else name
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=ufd)
            try:
                yield path, st, fd
                yield from _walk(fd, path, budget)
            finally:
                os.close(fd)
        else:
            yield path, st, None


def _host_lstat(wfd: int, rel: str) -> os.stat_result | None | str:
    """The host's lstat of rel, no link followed on the way; "unsafe" when a link is in the way."""
    try:
        return safefs.lstat_beneath(wfd, rel)
    except safefs.UnsafePath:
        return "unsafe"
    except OSError:
        return "unsafe"


def _host_children(wfd: int, rel: str) -> list[str]:
    try:
        fd = safefs.open_beneath(wfd, rel, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)


def _protected(run: staged.Run, rel: str) -> bool:
    full = os.path.join(run.workdir, rel)
    for p in list(run.meta.get("protected") or []) + list(run.meta.get("denied") or []):
        if isinstance(p, str) and (full == p or full.startswith(p.rstrip("/") + "/")):
            return True
    return False


def _receipt(run: staged.Run) -> dict:
    return staged.read_json(run.layer.root, staged.RECEIPT) or {}


def _mine(st: os.stat_result | None, applied: Mapping[str, dict], rel: str) -> bool:
    """True when the host's path is what our own last apply of this run left there."""
    mine = applied.get(rel)
    return st is not None and bool(mine) and mine.get("ino") == st.st_ino and mine.get("ctime_ns") == st.st_ctime_ns


def _host_changed(st: os.stat_result, run: staged.Run, applied: Mapping[str, dict], rel: str) -> bool:
    """True when the user changed this host path during the run (or since our own last apply)."""
    if _mine(st, applied, rel):
        return False
    return st.st_ctime_ns >= run.base_ctime_ns


def _flags(rel: str, mode: int, size: int = 0, link: str | None = None, before: int | None = None) -> list[dict]:
    from relay.model import runs_later  # only for a run with entries to judge

    return [{"class": str(f.cls), "why": f.why} for f in runs_later.by_entry(rel, mode, size, link, before)]


def review(run: staged.Run) -> Review:
    """Every change in the run's upper layer, judged against the host checkout as it is now."""
    out = Review(run, [])
    applied = _receipt(run).get("applied_state") or {}
    try:
        ufd = os.open(run.layer.upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return out
    try:
        with safefs.base_dir(run.workdir) as wfd:
            for rel, st, dfd in _walk(ufd, "", [MAX_ENTRIES]):
                if rel == GIT or rel.startswith(GIT + "/"):
                    # The masks' placeholders under .git (objects/info/alternates...) are the plan's.
                    if not stat.S_ISDIR(st.st_mode) and not _placeholder(run, rel, st, dfd):
                        out.git += 1
                    continue
                e = _judge(run, ufd, wfd, rel, st, dfd, applied, out)
                if e is not None:
                    out.entries.append(e)
    finally:
        os.close(ufd)
    return out


def _placeholder(run: staged.Run, rel: str, st: os.stat_result, dfd: int | None) -> bool:
    """An empty file or dir at one of the plan's mask targets (relay/trust/staged.py): the plan made it
    there, under a read-only mask the box could not write through."""
    if os.path.join(run.workdir, rel) not in (run.meta.get("placeholders") or []):
        return False
    if stat.S_ISREG(st.st_mode):
        return st.st_size == 0
    return stat.S_ISDIR(st.st_mode) and dfd is not None and not os.listdir(dfd)


def _judge(run: staged.Run, ufd: int, wfd: int, rel: str, st: os.stat_result, dfd: int | None,
           applied: Mapping[str, dict], out: Review) -> Entry | None:
    host = _host_lstat(wfd, rel)
    if host is None and _placeholder(run, rel, st, dfd):
        return None
    if host == "unsafe":
        return Entry(rel, "modified", st.st_mode, refused="a symbolic link on the host is in the way")
    assert not isinstance(host, str)
    conflict = "changed on the host during the run" if host is not None and _host_changed(host, run, applied, rel) \
        else None
    from relay.trust import kube_stage  # only when an entry is judged against the host

    if conflict is None and not _mine(host, applied, rel) and kube_stage.host_differs(run.meta, wfd, rel, host,
                                                                                     APPLY_LIMIT):
        conflict = "differs on the host from the commit the box started from" if host is not None \
            else "deleted on the host (the box started from the commit, which has it)"
    before = host.st_mode if host is not None else None
    e = _judge_kind(run, ufd, wfd, rel, st, dfd, applied, out, host, conflict, before)
    if e is not None and host is not None:
        e.base = {"ino": host.st_ino, "size": host.st_size, "mtime_ns": host.st_mtime_ns,
                  "ctime_ns": host.st_ctime_ns,
                  "sha256": hash_beneath(wfd, rel) if stat.S_ISREG(host.st_mode) else None}
    return e


def _judge_kind(run: staged.Run, ufd: int, wfd: int, rel: str, st: os.stat_result, dfd: int | None,
                applied: Mapping[str, dict], out: Review, host: os.stat_result | None, conflict: str | None,
                before: int | None) -> Entry | None:
    if GIT in rel.split("/"):  # a repository the box made inside the checkout: its config and hooks run code
        return Entry(rel, "special", st.st_mode, before, flags=_flags(rel, st.st_mode),
                     refused="inside a .git directory (a repository's config and hooks run code)")
    if _is_whiteout(st):
        if host is None:
            return None  # gone on the host too
        e = Entry(rel, "deleted", None, before, conflict=conflict)
        if stat.S_ISDIR(host.st_mode):
            e.conflict = e.conflict or _tree_conflict(run, wfd, rel, applied)
        return e
    if stat.S_ISDIR(st.st_mode):
        assert dfd is not None
        if _xattr(dfd, REDIRECT):
            return Entry(rel, "dir", st.st_mode, before, refused="an overlay redirect (a renamed directory)")
        opaque = _xattr(dfd, OPAQUE)
        if host is not None and stat.S_ISDIR(host.st_mode):
            if opaque:  # the box removed the directory and made it again: what it had is deleted
                out.opaque.append(rel)
                upper = set(os.listdir(dfd))
                for name in _host_children(wfd, rel):
                    if name not in upper:
                        child = f"{rel}/{name}"
                        cst = _host_lstat(wfd, child)
                        if isinstance(cst, os.stat_result):
                            ce = Entry(child, "deleted", None, cst.st_mode)
                            if _host_changed(cst, run, applied, child):
                                ce.conflict = "changed on the host during the run"
                            elif stat.S_ISDIR(cst.st_mode):
                                ce.conflict = _tree_conflict(run, wfd, child, applied)
                            out.entries.append(ce)
            return None
        if host is None and os.listdir(dfd):
            return None  # made on the way by what lands inside it (and only then)
        e = Entry(rel, "dir", st.st_mode, before, flags=_flags(rel, st.st_mode))
        if host is not None:
            e.refused = "a directory where the host has a file: apply it by hand"
        return e
    if stat.S_ISLNK(st.st_mode):
        try:
            with safefs.parent_of(ufd, rel) as (pfd, name):
                link = os.readlink(name, dir_fd=pfd)
        except OSError:
            link = None
        if host is not None and stat.S_ISLNK(host.st_mode):
            try:
                with safefs.parent_of(wfd, rel) as (pfd, name):
                    if os.readlink(name, dir_fd=pfd) == link:
                        return None
            except OSError:
                pass
        flags = _flags(rel, st.st_mode, 0, link, before)
        return Entry(rel, "symlink", st.st_mode, before, link=link, flags=flags, conflict=conflict)
    if not stat.S_ISREG(st.st_mode):
        return Entry(rel, "special", st.st_mode, before, flags=_flags(rel, st.st_mode, 0, None, before),
                     refused="a FIFO, socket or device is never applied")
    digest = hash_beneath(ufd, rel)
    flags = _flags(rel, st.st_mode, st.st_size, None, before)
    if host is None:
        return Entry(rel, "added", st.st_mode, None, st.st_size, sha256=digest, flags=flags,
                     refused=None if digest else "too large to apply")
    if stat.S_ISREG(host.st_mode) and digest is not None and hash_beneath(wfd, rel) == digest:
        if (host.st_mode & 0o777) == (st.st_mode & 0o777):
            return None  # copied up, unchanged
        return Entry(rel, "mode", st.st_mode, before, st.st_size, sha256=digest, flags=flags, conflict=conflict)
    return Entry(rel, "modified", st.st_mode, before, st.st_size, sha256=digest, flags=flags, conflict=conflict,
                 refused=None if digest else "too large to apply")


def _tree_conflict(run: staged.Run, wfd: int, rel: str, applied: Mapping[str, dict]) -> str | None:
    """A host directory the box deleted: a conflict if anything in it changed during the run."""
    budget = [MAX_ENTRIES]
    try:
        fd = safefs.open_beneath(wfd, rel, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return "cannot be read on the host"
    try:
        for sub, st, _ in _walk(fd, rel, budget):
            if not stat.S_ISDIR(st.st_mode) and _host_changed(st, run, applied, sub):
                return f"{sub} changed on the host during the run"
    finally:
        os.close(fd)
    return None


# ---- apply and discard ------------------------------------------------------------------------

def select_entries(entries: list[Entry], paths: Sequence[str]) -> list[Entry]:
    if not paths:
        return entries
    want = [p.strip("/") for p in paths]
    for p in want:
        if not any(e.path == p or e.path.startswith(p + "/") for e in entries):
            raise UsageError(f"{p}: not a staged change of this run; fix: `{ENTRY} changes RUN` lists them")
    return [e for e in entries if any(e.path == p or e.path.startswith(p + "/") for p in want)]


def _lock(root: str) -> int:
    fd = os.open(os.path.join(root, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RelayError("another apply or discard of this run is under way; fix: wait for it") from None
    return fd


def _by() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _drop_upper(ufd: int, rel: str) -> None:
    """Remove rel from the upper layer (a tree for a directory), no link followed."""
    try:
        with safefs.parent_of(ufd, rel) as (pfd, name):
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                safefs.remove_tree(pfd, name)
            else:
                os.unlink(name, dir_fd=pfd)
    except FileNotFoundError:
        pass


def _prune_empty_dirs(ufd: int) -> None:
    """After an apply, copied-up directories left with nothing staged in them go (not opaque ones)."""
    def walk(fd: int) -> bool:
        empty = True
        for name in os.listdir(fd):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                try:
                    keep = not walk(sub) or _xattr(sub, OPAQUE + REDIRECT)
                finally:
                    os.close(sub)
                if keep:
                    empty = False
                else:
                    try:
                        os.rmdir(name, dir_fd=fd)
                    except OSError:
                        empty = False
            else:
                empty = False
        return empty
    walk(ufd)


def _apply_one(run: staged.Run, ufd: int, wfd: int, e: Entry,
               owner: tuple[int, int] | None = None) -> os.stat_result | None:
    """Land one entry on the host; returns the host's lstat after (None when it is gone)."""
    if e.kind != "deleted" and owner is not None:
        made = missing_parents(wfd, e.path)
        _land(ufd, wfd, e)
        give(wfd, [*made, e.path], owner)
        return safefs.lstat_beneath(wfd, e.path)
    return _land(ufd, wfd, e)


def _land(ufd: int, wfd: int, e: Entry) -> os.stat_result | None:
    if e.kind == "deleted":
        with safefs.parent_of(wfd, e.path) as (pfd, name):
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                safefs.remove_tree(pfd, name)
            else:
                os.unlink(name, dir_fd=pfd)
        return None
    with safefs.parent_of(wfd, e.path, create=True, mode=0o755) as (pfd, name):
        if e.kind == "dir":
            try:
                os.mkdir(name, (e.mode or 0o755) & 0o777, dir_fd=pfd)
            except FileExistsError:
                pass
        elif e.kind == "symlink":
            assert e.link is not None
            tmp = safefs.unique_name(name, "apply")
            os.symlink(e.link, tmp, dir_fd=pfd)
            try:
                os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
            except BaseException:
                os.unlink(tmp, dir_fd=pfd)
                raise
        else:
            data = safefs.read_beneath(ufd, e.path, APPLY_LIMIT)
            if data is None or sha256(data).hexdigest() != e.sha256:
                raise OSError(errno.EAGAIN, "the staged copy changed while it was applied")
            safefs.replace_in(pfd, name, data, (e.mode or 0o644) & 0o777)
        return os.stat(name, dir_fd=pfd, follow_symlinks=False)


def _under_any(rel: str, dirs: Sequence[str]) -> bool:
    return any(rel.startswith(d + "/") for d in dirs)


def _drop_settled_opaque(run: staged.Run, ufd: int, opaque: Sequence[str]) -> None:
    """An opaque directory whose whole tree now matches the host (all applied) leaves the layer."""
    if not opaque:
        return
    left = review(run).entries
    for d in sorted(opaque, key=len, reverse=True):
        if not any(e.path == d or e.path.startswith(d + "/") for e in left):
            _drop_upper(ufd, d)


def _held(e: Entry, skip_flagged: bool) -> str | None:
    if e.refused:
        return f"refused: {e.refused}"
    if e.conflict:
        return f"conflict: {e.conflict}; the host's version stays, the box's stays staged"
    if skip_flagged and e.flagged:
        return "flagged: kept staged (--skip-flagged)"
    return None


def apply(run: staged.Run, paths: Sequence[str] = (), skip_flagged: bool = False) -> tuple[list[Entry], list[tuple[Entry, str]]]:
    """Apply the run's changes (all, or under `paths`). Returns (applied, held back with why)."""
    lock = _lock(run.layer.root)
    try:
        rv = review(run)
        chosen = select_entries(rv.entries, paths)
        receipt = _receipt(run)
        state = receipt.setdefault("applied_state", {})
        done: list[Entry] = []
        held: list[tuple[Entry, str]] = []
        ufd = os.open(run.layer.upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            with safefs.base_dir(run.workdir) as wfd:
                owner = checkout_owner(wfd)
                for e in sorted(chosen, key=lambda x: (x.kind == "deleted", x.path)):
                    why = _held(e, skip_flagged) or ("protected: never written by an apply"
                                                    if _protected(run, e.path) else None)
                    if why:
                        held.append((e, why))
                        continue
                    try:
                        after = _apply_one(run, ufd, wfd, e, owner)
                    except OSError as err:
                        held.append((e, f"not applied: {err.strerror or err}"))
                        continue
                    if after is not None:
                        state[e.path] = {"ino": after.st_ino, "ctime_ns": after.st_ctime_ns}
                    # A directory goes when it is empty (below). Inside a directory the box made
                    # again (opaque), the applied copy stays: it now equals the host's, so the
                    # review no longer lists it, and the opaque directory still hides what it deleted.
                    if e.kind != "dir" and not _under_any(e.path, rv.opaque):
                        _drop_upper(ufd, e.path)
                    done.append(e)
                _drop_settled_opaque(run, ufd, rv.opaque)
                _prune_empty_dirs(ufd)
        finally:
            os.close(ufd)
        if not paths or any(p.strip("/") in (GIT, "") for p in paths):  # then git: its refs name the tree's state
            from relay.trust import staged_git

            try:
                lines, _ = staged_git.apply(run)
            except OSError as err:
                lines = [f"git: not applied: {err.strerror or err}"]
            for ln in lines:  # a ref or state file kept staged asks for the user's hand, like a conflict
                if "kept staged" in ln or "during the run" in ln or "not applied" in ln:
                    held.append((Entry(GIT, "git", note=ln), f"conflict: {ln}"))
                else:
                    done.append(Entry(GIT, "git", note=ln))
            receipt.setdefault("git_applied", []).extend({"line": ln, "at": time.time(), "by": _by()} for ln in lines)
        now = time.time()
        receipt.setdefault("applied", []).extend(
            {**e.to_json(), "at": now, "by": _by()} for e in done)
        _write_receipt(run, receipt, rv)
        return done, held
    finally:
        os.close(lock)


def discard(run: staged.Run, paths: Sequence[str] = (), box_ended: bool = False) -> list[str]:
    """Drop all of the run (its whole layer) or the staged changes under `paths`. `box_ended`: the
    caller is the run's own launcher, past its box's teardown (the exit prompt)."""
    if not paths:
        if run.running() and not box_ended:
            raise RelayError(f"run {run.layer.run} is still running; fix: end the box first, or name PATHs")
        lock = _lock(run.layer.root)
        try:
            staged.remove_layer(run.layer.root)
        finally:
            os.close(lock)
        return ["(all)"]
    lock = _lock(run.layer.root)
    try:
        rv = review(run)
        chosen = select_entries(rv.entries, paths)
        ufd = os.open(run.layer.upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for e in chosen:
                if e.kind == "deleted" and "/" in e.path and not _exists(ufd, e.path):
                    continue  # a child of an opaque directory: dropped with it
                _drop_upper(ufd, e.path)
            _prune_empty_dirs(ufd)
        finally:
            os.close(ufd)
        receipt = _receipt(run)
        receipt.setdefault("discarded", []).extend({"path": e.path, "at": time.time(), "by": _by()} for e in chosen)
        _write_receipt(run, receipt, rv)
        return [e.path for e in chosen]
    finally:
        os.close(lock)


def _exists(ufd: int, rel: str) -> bool:
    try:
        return safefs.lstat_beneath(ufd, rel) is not None
    except OSError:
        return False


# ---- receipt ----------------------------------------------------------------------------------

def receipt(run: staged.Run, rv: Review | None = None) -> dict:
    """The run's receipt: who, what policy, which base, what changed (with hashes and flags), and
    what was applied or discarded, when and by whom."""
    rv = rv or review(run)
    rec = _receipt(run)
    meta = run.meta
    return {
        "run": run.layer.run, "backend": meta.get("backend"), "profile_digest": meta.get("profile_digest"),
        "workdir": run.workdir, "layer": run.layer.root, "running": run.running(),
        "base": {"started": meta.get("started"), "ctime_ns": run.base_ctime_ns,
                 "rule": "a host path whose ctime is not older than the run's stamp changed during the run"},
        "changes": [e.to_json() for e in rv.entries], "git_entries": rv.git,
        "applied": rec.get("applied", []), "discarded": rec.get("discarded", []),
    }


def _write_receipt(run: staged.Run, rec: dict, rv: Review) -> None:
    rec.update({k: v for k, v in receipt(run, rv).items() if k not in ("applied", "discarded", "changes")})
    rec["changes_at_last_apply"] = [e.to_json() for e in rv.entries]
    try:
        staged.write_json(run.layer.root, staged.RECEIPT, rec)
    except OSError:
        pass
