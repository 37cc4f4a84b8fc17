"""Per-box copies of the agents' state dirs, and what of them comes back.

The box never sees the host's `~/.claude`, `~/.codex`, `~/.gemini`, `~/.config/opencode`, ... :
before it starts, each state dir the backend names (`home.rw`) is copied into the run's private
$HOME, so boxes of one backend never clobber each other and nothing the box writes there is live
on the host. At exit, only what the box created or changed is looked at:

- a file matching the backend's `home.keep` allowlist (sessions, history, transcripts, refreshed
  logins) is synced back if the host's file is still what was copied in (or absent both times);
  an append-only log (`*.jsonl`) both sides appended to is merged; anything else is a conflict,
  kept aside, never overwritten;
- a guarded settings file (`home.guard`) is judged key by key against its CLI's inventory
  (relay/config/settings_keys.py): the host's file gets the box's changes to data keys (theme, model); if the
  box changed anything else, its whole version is also kept aside for review (below);
- everything else (plugins, extensions, commands, agents, skills, settings, `.env`, new files,
  links) is KEPT ASIDE in `~/.local/state/hive-relay/kept/RUN/` and listed in one summary line;
  `python -m relay accept-state RUN` (or `invoke accept-state RUN`) takes it after review.

A missing state dir is created on the host first, so a first login persists. The copy is bounded
(COPY_BUDGET bytes; the newest files first): a file left out is invisible to the box, and whatever
the box writes at its path is a conflict, kept aside. Every host-side touch goes through safefs:
no link followed on any component, regular files only, O_EXCL under unguessable names.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import time
from collections.abc import Iterator

from relay.config import settings_keys
from relay.host import safefs
from relay.host.liveness import RUN_ID_RE
from relay.model import credential_files
from relay.model.backend import LoginFile
from relay.model.hashing import sha256
from relay.model.record import field, record
from relay.model.refusal import ENTRY
from relay.policy.egress import CREDENTIAL_PLACEHOLDER
from relay.trust import guard, logins, state_scan

# The copy-in bound (bytes): a realistic ~/.claude with months of transcripts fits; beyond it the
# oldest files are left out (and said so), so the run dir cannot fill the disk or the tmpfs it is on.
COPY_BUDGET = 512 << 20
# What one run may keep aside for review; beyond it, files are only listed in the manifest.
KEPT_BUDGET = 64 << 20
MANIFEST = "kept.json"
# A box that leaves a million files behind does not get a million-entry manifest: past this many
# changed entries, the rest are counted, not handled (none of them comes back).
MAX_CHANGES = 20000
SQLITE_SUFFIXES = ("-wal", "-shm", "-journal")
RUN_ID = re.compile(f"^{RUN_ID_RE}$")

Ident = tuple[int, int, int, int, int]


def _ident(st: os.stat_result) -> Ident:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@record(frozen=False)
class Copied:
    """One entry of the copy: what the host had (identity, None: absent) and what the copy was."""

    host: Ident | None
    copy: Ident | None = None  # None: left out of the copy (over the budget or unreadable)
    link: str | None = None  # a symlink, copied as a symlink
    before: bytes | None = None  # guarded files only: the host's bytes at copy-in


@record(frozen=False)
class AgentState:
    """What the launcher and the janitor know about one run's state copies (decided by the plan)."""

    home: str
    dirs: tuple[str, ...]  # relative to home: ".claude", ".config/opencode", ...
    keep: tuple[str, ...]  # home.keep patterns, relative to home
    guard: tuple[str, ...]  # home.guard paths, relative to home
    kept_dir: str  # ~/.local/state/hive-relay/kept/RUN
    run_id: str
    exclude: tuple[str, ...] = ()  # denied paths (relative to home): never copied in, never synced back
    lock_dir: str = ""
    files: dict[str, Copied] = field(default_factory=dict)
    copied_bytes: int = 0
    left_out: int = 0
    copy_seconds: float = 0.0
    overflow: int = 0  # changed entries past MAX_CHANGES: neither synced nor kept
    notes: list[str] = field(default_factory=list)
    extra_kept: list[tuple[str, str]] = field(default_factory=list)  # synced files kept aside: (rel, why)
    # Login files the proxy holds (relay/trust/logins.py): (path relative to home, its spec). The box's copy
    # holds placeholders; whatever the box leaves there is kept aside, never synced over the host's.
    logins: tuple[tuple[str, LoginFile], ...] = ()
    # Credential files whose copy is masked (plan.login_files, held `masked`): (path relative to home,
    # the JSON paths of their secrets). Placeholders of the same shape; kept aside at exit like logins.
    secret_files: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # The host's real secrets (relay/trust/state_scan.py): a file of the state that holds one stays out
    # of the box; `memo_env` finds the cache dir of the memo of files already found clean.
    secrets: tuple = ()
    memo_env: dict[str, str] | None = None
    needles_made: object = None  # state_scan.Needles of `secrets`, made on first need (~10 ms): `needles()`
    scanned_bytes: int = 0
    scan_seconds: float = 0.0


def new(home: str, dirs: tuple[str, ...], keep: tuple[str, ...], guarded: tuple[str, ...], state_dir: str,
        run_id: str, exclude: tuple[str, ...] = ()) -> AgentState:
    def rel(path: str) -> str:
        return os.path.relpath(path, home) if safefs.beneath(path, home) else ""

    settings_keys.inventory()  # read before the box runs: nothing it writes can change the rule

    return AgentState(
        home=home, dirs=tuple(r for r in map(rel, dirs) if r), keep=tuple(r for r in map(rel, keep) if r),
        guard=tuple(r for r in map(rel, guarded) if r), kept_dir=os.path.join(state_dir, "kept", run_id),
        run_id=run_id, lock_dir=state_dir, exclude=tuple(r for r in map(rel, exclude) if r),
    )


def _excluded(state: AgentState, rel: str) -> bool:
    return any(rel == e or rel.startswith(e + "/") for e in state.exclude)


# --- patterns -------------------------------------------------------------------------------------

def _part_regex(part: str) -> str:
    return "[^/]*".join(re.escape(p) for p in part.split("*"))


def compile_keep(patterns: tuple[str, ...]) -> re.Pattern[str]:
    """`a/**` matches everything below a; `*` matches within one path part."""
    alts = []
    for pattern in patterns:
        out = ""
        for i, part in enumerate(pattern.split("/")):
            if part == "**":
                out += "(?:/.*)?" if i else ".*"
            else:
                out += ("/" if i else "") + _part_regex(part)
        alts.append(out)
    return re.compile("^(?:" + "|".join(alts) + ")$" if alts else r"^(?!x)x$")


# --- a walk that follows nothing --------------------------------------------------------------------

def _walk(dfd: int, prefix: str = "", skip=None) -> Iterator[tuple[str, os.stat_result, int, str]]:  # noqa: ANN001
    """(relative path, lstat, parent dir fd, name) of every entry below dfd; links are reported, never
    followed, and a directory is entered by an O_NOFOLLOW open of that very name."""
    try:
        names = sorted(os.listdir(dfd))
    except OSError:
        return
    for name in names:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            continue
        rel = f"{prefix}{name}"
        if skip is not None and skip(rel):
            continue
        yield rel, st, dfd, name
        if stat.S_ISDIR(st.st_mode):
            try:
                sub = safefs.open_beneath(dfd, name, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue
            try:
                yield from _walk(sub, rel + "/", skip)
            finally:
                os.close(sub)


def _mkdirs(dfd: int, rel: str, mode: int = 0o700) -> int:
    """Make (no link followed) and open the directory `rel` beneath dfd; returns its fd."""
    fd = os.dup(dfd)
    try:
        for part in safefs._parts(rel):
            try:
                os.mkdir(part, mode, dir_fd=fd)
            except FileExistsError:
                pass
            nxt = safefs.open_beneath(fd, part, os.O_RDONLY | os.O_DIRECTORY)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


_FICLONE = 0x40049409
_CAN_CLONE = [True]


def _copy_fd(src: int, dst: int, size: int) -> None:
    """A reflink where the filesystem has them (btrfs, xfs: no data copied), else an in-kernel copy."""
    if _CAN_CLONE[0] and size:
        try:
            fcntl.ioctl(dst, _FICLONE, src)
            return
        except OSError as err:
            if err.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.ENOSYS):
                _CAN_CLONE[0] = False  # this filesystem cannot: do not ask again for every file
    done = 0
    while done < size:
        try:
            n = os.copy_file_range(src, dst, size - done)
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            n = os.sendfile(dst, src, None, size - done)
        if n == 0:
            break
        done += n


def _open_regular(dfd: int, name: str) -> tuple[int, os.stat_result]:
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY, dir_fd=dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise safefs.UnsafePath(errno.EINVAL, "not a regular file", name)
    return fd, st


def _copy_into(src_dfd: int, src_name: str, dst_dfd: int, dst_name: str, mode: int | None = None,
               replace: bool = False, source: list[os.stat_result] | None = None) -> os.stat_result:
    """Copy a regular file (no link followed) to a new name in dst_dfd (O_EXCL; with `replace`, a
    temporary under an unguessable name renamed over dst_name). Returns the new file's stat;
    `source` gets the source's fstat before and after the copy (the same identity: nothing wrote it
    meanwhile)."""
    src, st = _open_regular(src_dfd, src_name)
    if source is not None:
        source.append(st)
    try:
        target = safefs.unique_name(dst_name, "tmp") if replace else dst_name
        perm = (stat.S_IMODE(st.st_mode) & 0o700 | 0o600) if mode is None else mode
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, perm, dir_fd=dst_dfd)
        try:
            _copy_fd(src, dst, st.st_size)
            if source is not None:
                source.append(os.fstat(src))
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
            if replace:
                os.fsync(dst)
            out = os.fstat(dst)
        except BaseException:
            os.close(dst)
            os.unlink(target, dir_fd=dst_dfd)
            raise
        os.close(dst)
        if replace:
            try:
                os.rename(target, dst_name, src_dir_fd=dst_dfd, dst_dir_fd=dst_dfd)
            except BaseException:
                os.unlink(target, dir_fd=dst_dfd)
                raise
        return out
    finally:
        os.close(src)


# --- copy-in ------------------------------------------------------------------------------------------

def copy_in(state: AgentState, box_home: str) -> None:
    """Create missing state dirs on the host, then copy each into the box's private home."""
    t0 = time.monotonic()
    with safefs.base_dir(state.home) as hfd, safefs.base_dir(box_home) as bfd:
        plan: list[tuple[float, int, str, os.stat_result, int, str]] = []  # newest first
        opened: list[int] = []
        originals = _login_originals(state, hfd)
        try:
            for rel in state.dirs:
                try:
                    os.close(_mkdirs(hfd, rel))  # a first login then has a place to land
                    src = safefs.open_beneath(hfd, rel, os.O_RDONLY | os.O_DIRECTORY)
                except OSError as err:
                    state.notes.append(f"~/{rel} is not copied into the box ({err.strerror or err}); "
                                       "the box starts with an empty one and nothing of it is synced back")
                    state.dirs = tuple(d for d in state.dirs if d != rel)
                    os.close(_mkdirs(bfd, rel))
                    continue
                opened.append(src)
                os.close(_mkdirs(bfd, rel))
                for sub, st, pfd, name in _walk(src, skip=lambda p, r=rel: _excluded(state, f"{r}/{p}")):
                    path = f"{rel}/{sub}"
                    if stat.S_ISDIR(st.st_mode):
                        os.close(_mkdirs(bfd, path, stat.S_IMODE(st.st_mode) & 0o777 | 0o700))
                    elif stat.S_ISLNK(st.st_mode):
                        target = os.readlink(name, dir_fd=pfd)
                        state.files[path] = Copied(_ident(st), link=target)
                        try:
                            with safefs.parent_of(bfd, path) as (dfd, leaf):
                                os.symlink(target, leaf, dir_fd=dfd)
                        except OSError:
                            state.left_out += 1
                    elif stat.S_ISREG(st.st_mode):
                        copy_of = _copy_of_login(originals, path, st, hfd)
                        if copy_of:
                            state.files[path] = Copied(_ident(st))  # not in the box: a box write there is kept aside
                            state.notes.append(f"~/{path} is {copy_of}; it is not copied into the box")
                            continue
                        plan.append((-st.st_mtime, len(plan), path, st, src, sub))
            budget = COPY_BUDGET
            scan_memo = _ScanMemo(state) if state.secrets else None
            scan_budget = state_scan.Budget()
            for _, _, path, st, top, sub in sorted(plan):
                entry = Copied(_ident(st))
                state.files[path] = entry
                if st.st_size > budget:
                    state.left_out += 1
                    continue
                source: list[os.stat_result] = []
                try:
                    with safefs.parent_of(top, sub) as (sfd, name), safefs.parent_of(bfd, path) as (dfd, leaf):
                        entry.copy = _ident(_copy_into(sfd, name, dfd, leaf, source=source))
                except OSError:
                    state.left_out += 1
                    continue
                if scan_memo is not None and path not in originals:
                    held = _holds_secret(state, scan_memo, path, tuple(source), bfd, scan_budget)
                    if held:
                        safefs.unlink_beneath(bfd, path)
                        entry.copy = None
                        state.notes.append(f"~/{path} {held}; it is not copied into the box")
                        continue
                budget -= st.st_size
                state.copied_bytes += st.st_size
                if path in state.guard:
                    entry.before = safefs.read_beneath(hfd, path, guard.MAX_SETTINGS) if st.st_size <= guard.MAX_SETTINGS else None
            if scan_memo is not None:
                scan_memo.save()
        finally:
            for fd in opened:
                os.close(fd)
        _mask_logins(state, bfd)
    if state.left_out:
        state.notes.append(f"{state.left_out} files of the agent's state were not copied into the box (over the "
                           f"{COPY_BUDGET >> 20} MiB copy bound, oldest first, or unreadable); the box does not see "
                           "them, and what it writes at their paths is kept aside")
    state.copy_seconds = time.monotonic() - t0


class _ScanMemo:
    """Per file of the state (path relative to home), what its search found, by the identity of the
    host file that was copied (device, inode, size, mtime, ctime: a rewrite changes ctime, which
    cannot be set back without root): the digests of the secrets it was found clean of, or that it
    holds one (which), or that it cannot be searched (why: the format's, not the secrets'). Read and
    written through relay/host/memo.py: in the cache dir, trusted only when ours alone."""

    LIMIT = 32 << 20

    def __init__(self, state: AgentState) -> None:
        from relay.host import memo

        self.env = state.memo_env
        self.key = memo.key_of("state-scan", state.home, *state.dirs)
        self.digests = {state_scan.digest(s): s.name for s in state.secrets}
        self.files: dict[str, list] = {}
        self.seen: dict[str, list] = {}
        self.changed = False
        raw = memo.get(self.env, memo.MemoKind.STATE_SCAN, self.key, self.LIMIT) if self.env is not None else None
        try:
            data = json.loads(raw) if raw else {}
            files = data.get("files") if isinstance(data, dict) else None
            sets = data.get("sets") if isinstance(data, dict) else None
            sets = [x for x in sets if isinstance(x, list) and all(isinstance(d, str) for d in x)] \
                if isinstance(sets, list) else []
            if isinstance(files, dict):
                # Each file names its clearance by index into `sets`: most files share one, and a memo of
                # 50,000 files listing 20 digests each would outgrow LIMIT (red team round 3).
                self.files = {k: [*v[:5], sets[v[5]], v[6]] for k, v in files.items()
                              if isinstance(v, list) and len(v) == 7 and all(isinstance(x, int) for x in v[:6])
                              and 0 <= v[5] < len(sets) and isinstance(v[6], str)}
        except ValueError:
            self.files = {}

    @staticmethod
    def ident(st: os.stat_result) -> list[int]:
        return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def known(self, path: str, ident: list[int]) -> str | None:
        """What the memo already says of PATH at IDENT: "" clean of every current secret, "holds NAME",
        or "cannot ... (why)"; None: it must be searched."""
        got = self.files.get(path)
        if got is None or got[:5] != ident:
            return None
        verdict = got[6]
        if verdict.startswith("U:") or (verdict.startswith("H:") and verdict[2:] in self.digests) or (
                not verdict and set(self.digests) <= set(got[5])):
            self.seen[path] = got
            return self.said(verdict)
        return None

    def said(self, verdict: str) -> str:
        """The line a verdict gives ("" for clean)."""
        if verdict.startswith("U:"):
            return f"cannot be searched for the host's secrets ({verdict[2:]})"
        if verdict.startswith("H:"):
            return f"holds {self.digests.get(verdict[2:], 'a secret')} (a real credential of the host's)"
        return ""

    def record(self, path: str, ident: list[int], verdict: str) -> None:
        """Clean ("") keeps the secrets it was found clean of before, at the same identity (a launch
        with fewer secrets does not make the next one with more read everything again)."""
        old = self.files.get(path)
        clean = set(self.digests)
        if not verdict and old is not None and old[:5] == ident and not old[6]:
            clean |= set(old[5])
        self.seen[path] = [*ident, sorted(clean) if not verdict else [], verdict]
        self.changed = True

    def save(self) -> None:
        """Only the files of this copy are kept (a file gone from the state goes from the memo)."""
        if self.env is None or not (self.changed or len(self.seen) != len(self.files)):
            return
        from relay.host import memo

        sets: dict[tuple[str, ...], int] = {}
        files = {}
        for path, v in self.seen.items():
            files[path] = [*v[:5], sets.setdefault(tuple(v[5]), len(sets)), v[6]]
        memo.put(self.env, memo.MemoKind.STATE_SCAN, self.key,
                 json.dumps({"sets": [list(x) for x in sets], "files": files}).encode())


def needles(state: AgentState) -> state_scan.Needles:
    """The secrets' search index, made once per run and only when a file must be searched."""
    if state.needles_made is None:
        state.needles_made = state_scan.Needles(state.secrets)
    assert isinstance(state.needles_made, state_scan.Needles)
    return state.needles_made


def _holds_secret(state: AgentState, scan_memo: _ScanMemo, path: str, source: tuple[os.stat_result, ...],
                  bfd: int, budget: state_scan.Budget) -> str | None:
    """Why the box's new copy of PATH must not stay (it holds a host secret, or cannot be searched), or
    None. The copy is what is searched: the box would read those bytes, and nothing but this launcher
    can change them before it starts. `source`: the host file's fstat before and after the copy; the
    memo speaks for the copy only when they are one identity (a file written meanwhile is searched)."""
    ident = _ScanMemo.ident(source[0])
    stable = len(source) == 2 and ident == _ScanMemo.ident(source[1])
    if stable:
        said = scan_memo.known(path, ident)
        if said is not None:
            return said or None
    t0 = time.monotonic()
    verdict = ""
    try:
        with safefs.parent_of(bfd, path) as (dfd, leaf):
            fd, _ = _open_regular(dfd, leaf)
        try:
            state.scanned_bytes += os.fstat(fd).st_size
            found = state_scan.search_fd(fd, needles(state), budget)
        finally:
            os.close(fd)
    except state_scan.Spent as err:
        return str(err)  # judged by a later launch: no verdict kept
    except state_scan.Unsearchable as err:
        found, verdict = None, f"U:{err}"
    except OSError as err:
        return f"could not be searched for the host's secrets ({err.strerror or err})"
    except Exception as err:  # noqa: BLE001 - a file the search trips on stays out; it never ends the launch
        return f"could not be searched for the host's secrets ({type(err).__name__})"
    finally:
        state.scan_seconds += time.monotonic() - t0
    if found:
        verdict = "H:" + next((d for d, name in scan_memo.digests.items() if name == found), "")
    if stable:
        scan_memo.record(path, ident, verdict)
    if found:  # by its name, which the digest's lookup above could not give back for a name it lacks
        return f"holds {found} (a real credential of the host's)"
    return scan_memo.said(verdict) or None


def _login_originals(state: AgentState, hfd: int) -> dict[str, os.stat_result]:
    """The host's login and credential files the box gets masked, by path relative to home."""
    out = {}
    for rel in {r for r, _ in state.logins} | {r for r, _ in state.secret_files}:
        st = safefs.lstat_beneath(hfd, rel)
        if st is not None and stat.S_ISREG(st.st_mode):
            out[rel] = st
    return out


def _copy_of_login(originals: dict[str, os.stat_result], path: str, st: os.stat_result, hfd: int) -> str | None:
    """Why PATH, a file of the state dirs, would carry a masked login into the box as it is (None: it
    would not). A login is masked by its file's name; its other names are not: a hard link to it, a
    copy beside it under its name plus a suffix (`auth.json.bak`, `auth.json~`, `.auth.json.swp`, an
    older version kept by hand or by an editor), or a byte-for-byte copy anywhere. Those stay out of
    the box. (A log or cache that recorded a token is not found this way: docs/credentials.md.)"""
    if path in originals:
        return None
    head, _, name = path.rpartition("/")
    for rel, orig in originals.items():
        if (st.st_dev, st.st_ino) == (orig.st_dev, orig.st_ino):
            return f"a hard link to ~/{rel}"
        ohead, _, oname = rel.rpartition("/")
        if head == ohead and name != oname and (name.startswith(oname) or name.lstrip(".").startswith(oname)):
            return f"a copy of ~/{rel} by its name"
        if st.st_size == orig.st_size and st.st_size <= credential_files.MAX_FILE:
            try:
                if safefs.read_beneath(hfd, path, credential_files.MAX_FILE) == \
                        safefs.read_beneath(hfd, rel, credential_files.MAX_FILE):
                    return f"a copy of ~/{rel}"
            except OSError:
                return f"unreadable beside ~/{rel}"
    return None


def _mask_logins(state: AgentState, bfd: int) -> None:
    """The box's copy of each login file the proxy holds gets placeholders for its tokens (logins.mask).
    A copy that cannot be masked is removed: the box never holds the real token, even by mistake."""
    for rel, login in state.logins:
        if not login.refresh_url:
            continue  # a static key (codex's auth.json API key): secret_files gives it a placeholder of its shape
        entry = state.files.get(rel)
        if entry is None or entry.copy is None:
            continue
        try:
            raw = safefs.read_beneath(bfd, rel, logins.MAX_LOGIN_BYTES)
            masked = logins.mask(raw, login, CREDENTIAL_PLACEHOLDER)
            with safefs.parent_of(bfd, rel) as (dfd, leaf):
                safefs.replace_in(dfd, leaf, masked, 0o600, durable=False)
            st = safefs.lstat_beneath(bfd, rel)
            entry.copy = _ident(st) if st is not None else None
        except (OSError, ValueError) as err:
            safefs.unlink_beneath(bfd, rel)
            entry.copy = None
            state.notes.append(f"~/{rel} is not copied into the box ({err}); log in on the host again")
    for rel, paths in state.secret_files:
        entry = state.files.get(rel)
        if entry is None or entry.copy is None:
            continue
        try:
            raw = safefs.read_beneath(bfd, rel, credential_files.MAX_FILE + 1)
            masked, _ = credential_files.mask(raw, paths, keep=frozenset({CREDENTIAL_PLACEHOLDER}),
                                              dotenv=credential_files.is_dotenv(rel))
            with safefs.parent_of(bfd, rel) as (dfd, leaf):
                safefs.replace_in(dfd, leaf, masked, 0o600, durable=False)
            st = safefs.lstat_beneath(bfd, rel)
            entry.copy = _ident(st) if st is not None else None
        except (OSError, ValueError) as err:
            safefs.unlink_beneath(bfd, rel)  # never the real tokens, even by mistake
            entry.copy = None
            state.notes.append(f"~/{rel} is not copied into the box ({getattr(err, 'strerror', None) or err}); "
                               "its login is not available there")


# --- sync-back ------------------------------------------------------------------------------------------

@record(frozen=False)
class _Change:
    """One file of the box's private agent state, compared with the host's: what sync-back does with it and why."""

    rel: str
    kind: str  # "file" or "link"
    link: str | None = None
    action: str = ""  # sync, merge, keep, conflict, rejected, partial (data keys synced, the file kept aside)
    why: str = ""
    live: bytes | None = None  # partial: what the host's file gets (its data-key changes only)


def _sqlite_group(rel: str) -> str:
    for suffix in SQLITE_SUFFIXES:
        if rel.endswith(suffix):
            return rel[: -len(suffix)]
    return rel


def _changes(state: AgentState, bfd: int) -> list[_Change]:
    changes: list[_Change] = []
    for rel in state.dirs:
        try:
            top = safefs.open_beneath(bfd, rel, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue  # the box replaced its copy of the dir by something else: nothing to take
        try:
            for sub, st, pfd, name in _walk(top):
                path = f"{rel}/{sub}"
                before = state.files.get(path)
                if len(changes) >= MAX_CHANGES:
                    state.overflow += 1
                    continue
                if stat.S_ISREG(st.st_mode):
                    if before is not None and before.copy is not None and before.copy[1:3] == (st.st_ino, st.st_size) \
                            and before.copy[4] == st.st_ctime_ns:
                        continue  # the very copy we made, untouched (ctime cannot be set back)
                    changes.append(_Change(path, "file"))
                elif stat.S_ISLNK(st.st_mode):
                    target = os.readlink(name, dir_fd=pfd)
                    if before is None or before.link != target:
                        changes.append(_Change(path, "link", link=target))
                elif path in state.guard:  # a guarded settings file replaced by a FIFO, directory, ...
                    changes.append(_Change(path, "special"))
        finally:
            os.close(top)
    return changes


def _host_now(hfd: int, rel: str) -> Ident | None:
    st = safefs.lstat_beneath(hfd, rel)
    return None if st is None else _ident(st)


def _decide(state: AgentState, hfd: int, bfd: int, change: _Change, keep: re.Pattern[str]) -> None:
    rel = change.rel
    before = state.files.get(rel)
    if rel in state.guard and change.kind != "file":
        change.action, change.why = "rejected", f"replaced it by a {'symbolic link' if change.kind == 'link' else 'special file or directory'}"
        return
    if change.kind != "file":
        change.action, change.why = "keep", "a symbolic link"
        return
    if _excluded(state, rel):
        change.action, change.why = "keep", "a denied path"
        return
    if any(rel == path for path, _ in state.logins + state.secret_files):
        change.action, change.why = "keep", "a login file the host holds (the host's file stays the truth)"
        return
    if rel in state.guard:
        old = before.before if before else None
        try:
            new = safefs.read_beneath(bfd, rel, guard.MAX_SETTINGS)
        except OSError:
            new = None
        verdict = settings_keys.settle(rel, old, new) if new is not None \
            else settings_keys.Verdict(old, ("(unreadable or oversized file)",))
        if verdict.review:
            change.why = "changed " + ", ".join(verdict.review[:4]) + (", …" if len(verdict.review) > 4 else "")
            if before is not None and before.copy is None:
                change.action = "conflict"
            elif _host_now(hfd, rel) == (before.host if before else None):
                change.action, change.live = "partial", verdict.live
            else:
                change.action = "conflict"
            return
    elif not keep.match(rel):
        if _same_as_host(hfd, bfd, rel):
            change.action = "same"
            return
        change.action, change.why = "keep", "not in home.keep"
        return
    host_before = before.host if before else None
    if _same_as_host(hfd, bfd, rel):
        change.action = "same"  # e.g. a file the CLI regenerates, byte for byte what the host has
        return
    if before is not None and before.copy is None:
        change.action, change.why = "conflict", "the host's file was not copied into the box"
        return
    if _host_now(hfd, rel) == host_before:
        change.action = "sync"
    elif rel.endswith(".jsonl") and before is not None and _appended_both(hfd, bfd, rel, before):
        change.action = "merge"
    else:
        change.action, change.why = "conflict", "changed on the host during the session"


def _same_as_host(hfd: int, bfd: int, rel: str) -> bool:
    """The box's file has exactly the bytes of the host's (a regular file there, read with no link)."""
    host, box = safefs.lstat_beneath(hfd, rel), safefs.lstat_beneath(bfd, rel)
    if host is None or box is None or not stat.S_ISREG(host.st_mode) or host.st_size != box.st_size \
            or host.st_size > safefs.DEFAULT_LIMIT:
        return False
    try:
        return safefs.read_beneath(hfd, rel) == safefs.read_beneath(bfd, rel)
    except OSError:
        return False


def _appended_both(hfd: int, bfd: int, rel: str, before: Copied) -> bool:
    """Both sides only appended to an append-only log: the first `size` bytes still agree."""
    size = before.host[2] if before.host else 0
    try:
        host = safefs.read_beneath(hfd, rel, safefs.DEFAULT_LIMIT * 4)
        box = safefs.read_beneath(bfd, rel, safefs.DEFAULT_LIMIT * 4)
    except OSError:
        return False
    return host is not None and box is not None and len(host) >= size and len(box) >= size \
        and host[:size] == box[:size]


def _write_host(hfd: int, bfd: int, change: _Change, before: Copied | None) -> None:
    rel = change.rel
    with safefs.parent_of(bfd, rel) as (sdfd, sname):
        hparent = os.path.dirname(rel)
        dfd = _mkdirs(hfd, hparent) if hparent else os.dup(hfd)
        try:
            name = os.path.basename(rel)
            if change.action == "merge":
                size = before.host[2] if before and before.host else 0
                box = safefs.read_beneath(bfd, rel, safefs.DEFAULT_LIMIT * 4) or b""
                fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        raise safefs.UnsafePath(errno.EINVAL, "not a regular file", rel)
                    safefs._write_all(fd, box[size:])
                finally:
                    os.close(fd)
            else:
                _copy_into(sdfd, sname, dfd, name, mode=0o600, replace=True)
        finally:
            os.close(dfd)


def _write_live(hfd: int, rel: str, data: bytes | None, before: bytes | None) -> None:
    """A settings file the box changed beyond its data keys: the host's file gets the data keys only."""
    if data == before:
        return
    parent = os.path.dirname(rel)
    dfd = _mkdirs(hfd, parent) if parent else os.dup(hfd)
    try:
        if data is None:
            try:
                os.unlink(os.path.basename(rel), dir_fd=dfd)
            except FileNotFoundError:
                pass
        else:
            safefs.replace_in(dfd, os.path.basename(rel), data, 0o600)
    finally:
        os.close(dfd)


def _keep_aside(kfd: int, bfd: int, change: _Change, budget: list[int]) -> bool:
    """Copy the box's version into the kept dir (a new tree we own); False when over the bound."""
    if change.kind == "link":
        return True
    if change.kind != "file":
        return False  # listed in the manifest with its target; no link is made
    st = safefs.lstat_beneath(bfd, change.rel)
    if st is None or st.st_size > budget[0]:
        return False
    with safefs.parent_of(bfd, change.rel) as (sdfd, sname):
        parent = os.path.dirname(change.rel)
        dfd = _mkdirs(kfd, parent) if parent else os.dup(kfd)
        try:
            _copy_into(sdfd, sname, dfd, os.path.basename(change.rel), mode=0o600)
        finally:
            os.close(dfd)
    budget[0] -= st.st_size
    return True


def _digest_host(hfd: int, rel: str) -> str | None:
    try:
        data = safefs.read_beneath(hfd, rel, safefs.DEFAULT_LIMIT * 4)
    except OSError:
        return "(unreadable)"
    return None if data is None else sha256(data).hexdigest()


def _lock(lock_dir: str) -> int:
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    with safefs.base_dir(lock_dir) as dfd:
        fd = safefs.open_beneath(dfd, "sync.lock", os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise safefs.UnsafePath(errno.EINVAL, "not a regular file", "sync.lock")
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def sync_back(state: AgentState, box_home: str, messages: list[str]) -> None:
    """Take back what home.keep allows, keep the rest aside; one summary line in `messages`."""
    keep = compile_keep(state.keep)
    try:
        lock = _lock(state.lock_dir)
    except OSError as err:
        messages.append(f"could not sync the agent's state back: {err.strerror or err}; the box's copy is lost")
        return
    try:
        with safefs.base_dir(state.home) as hfd, safefs.base_dir(box_home) as bfd:
            changes = _changes(state, bfd)
            for change in changes:
                try:
                    _decide(state, hfd, bfd, change, keep)
                except OSError as err:
                    change.action, change.why = "keep", f"unreadable: {err.strerror or err}"
            # A SQLite database and its -wal/-shm travel together: one conflict keeps the whole group aside.
            groups: dict[str, list[_Change]] = {}
            for change in changes:
                groups.setdefault(_sqlite_group(change.rel), []).append(change)
            for members in groups.values():
                if len(members) > 1 and any(c.action not in ("sync", "merge") for c in members):
                    for change in members:
                        if change.action in ("sync", "merge"):
                            change.action, change.why = "conflict", "part of a database kept aside"
            for change in changes:
                if change.action == "partial":
                    before = state.files.get(change.rel)
                    try:
                        _write_live(hfd, change.rel, change.live, before.before if before else None)
                    except OSError as err:
                        change.action, change.why = "conflict", f"{change.why}; could not write its data keys back: {err.strerror or err}"
                if change.action not in ("sync", "merge"):
                    continue
                try:
                    _write_host(hfd, bfd, change, state.files.get(change.rel))
                except OSError as err:
                    change.action, change.why = "conflict", f"could not write it back: {err.strerror or err}"
            for change in changes:
                if change.action == "rejected":
                    _reject(state, bfd, change, messages)
            # A rejected settings file is kept next to it (the guard's convention) and here, for accept-state.
            aside = [c for c in changes if c.action in ("keep", "conflict", "rejected", "partial")]
            dropped = _write_kept(state, hfd, bfd, aside) if aside else 0
            if aside or state.extra_kept or state.overflow:
                messages.append(_summary(state, aside, dropped))
    except OSError as err:
        messages.append(f"could not sync the agent's state back: {err.strerror or err}")
    finally:
        os.close(lock)


def _reject(state: AgentState, bfd: int, change: _Change, messages: list[str]) -> None:
    """A guarded settings file the box replaced by a link, FIFO or directory: the host's file stays as it
    was. (A regular file goes through the key allowlist instead: data keys live, the rest reviewed.)"""
    host_path = os.path.join(state.home, change.rel)
    if change.kind != "file":
        messages.append(f"reverted {host_path}: the box {change.why}; the host's file is as it was, nothing of it is taken")
        return
    try:
        data = safefs.read_beneath(bfd, change.rel, guard.MAX_SETTINGS)
        if data is None:
            return
        aside = safefs.keep_aside(host_path, data, "rejected", base=state.home)
    except OSError as err:
        messages.append(f"reverted {host_path}: the box {change.why}, which would run on the host later; "
                        f"its version could not be kept ({err.strerror or err})")
        return
    messages.append(f"reverted {host_path}: the box {change.why}, which would run on the host later; "
                    f"its version is kept at {aside}")


def _write_kept(state: AgentState, hfd: int, bfd: int, aside: list[_Change]) -> int:
    parent, run = os.path.split(state.kept_dir)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    with safefs.base_dir(parent) as pfd:
        kfd = _mkdirs(pfd, run)
    budget = [KEPT_BUDGET]
    try:
        manifest = _read_manifest_fd(kfd) or {"run": state.run_id, "home": state.home, "files": {}}
    except ValueError:
        manifest = {"run": state.run_id, "home": state.home, "files": {}}
    entries: dict[str, dict] = manifest["files"]
    try:
        for change in aside:
            before = state.files.get(change.rel)
            # partial: we just wrote its data keys, under the lock; accept-state expects what is live now
            host_unchanged = change.action == "partial" or _host_now(hfd, change.rel) == (before.host if before else None)
            try:
                stored = _keep_aside(kfd, bfd, change, budget)
            except OSError:
                stored = False
            entries[change.rel] = {
                "why": change.why, "kind": change.kind, "stored": stored,
                **({"target": change.link} if change.link is not None else {}),
                # A login the host holds: the box's copy has placeholders (or tokens the box chose), so
                # accept-state never lays it over the real one (see accept).
                **({"login": True} if any(change.rel == path for path, _ in state.logins + state.secret_files)
                   else {}),
                # What accept-state expects on the host (None: absent); a conflict never matches.
                "host_sha256": _digest_host(hfd, change.rel) if host_unchanged and change.action in ("keep", "rejected", "partial")
                else "(changed on the host during the session)",
            }
        safefs.replace_in(kfd, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    finally:
        os.close(kfd)
    dropped = sum(1 for c in aside if c.kind == "file" and not entries[c.rel]["stored"])
    return dropped


def _summary(state: AgentState, aside: list[_Change], dropped: int) -> str:
    names = ["~/" + c.rel + (f" ({c.why.removeprefix('changed ')})" if c.action == "partial" else "") for c in aside] \
        + ["~/" + rel + (f" ({why.removeprefix('changed ')})" if why.startswith("changed ") else "")
           for rel, why in state.extra_kept]
    conflicts = sum(1 for c in aside if c.action == "conflict")
    shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
    # Plain words first: nothing is needed of the user; the files wait, inert, until they want them.
    return (f"nothing needs you: {len(names)} file(s) the box changed in the agent's state are kept aside "
            "(yours are as they were, and nothing of the box's runs)"
            + (f"; {conflicts} in conflict with the host (its version stays)" if conflicts else "")
            + f": {shown}; to take them, review {state.kept_dir}, then `{ENTRY} accept-state {state.run_id}`"
            + (f" ({dropped} listed only: over the {KEPT_BUDGET >> 20} MiB bound)" if dropped else "")
            + (f"; {state.overflow} more entries were dropped unseen (over {MAX_CHANGES})" if state.overflow else ""))


# --- synced single files (~/.claude.json) ----------------------------------------------------------------

def filter_synced(state: AgentState, host_path: str, current: bytes | None, box: bytes) -> bytes | None:
    """A synced single file on its way back. One with a key inventory (~/.claude.json) is judged like a
    guarded settings file: the host's file gets the box's data-key changes only, and if the box changed
    anything else its whole version is kept aside for review. Returns what the host's file should hold
    (None: leave it absent); a file with no inventory passes as it is."""
    rel = os.path.relpath(host_path, state.home)
    if rel not in settings_keys.inventory():
        return box
    verdict = settings_keys.settle(rel, current, box)
    if verdict.review:
        why = "changed " + ", ".join(verdict.review[:4]) + (", …" if len(verdict.review) > 4 else "")
        try:
            keep_aside_file(state, rel, box, why, None if verdict.live is None else sha256(verdict.live).hexdigest())
            state.extra_kept.append((rel, why))
        except (OSError, ValueError):
            state.extra_kept.append((rel, why + " (the box's version could not be stored)"))
    return verdict.live


def keep_aside_file(state: AgentState, rel: str, data: bytes, why: str, host_sha256: str | None) -> str:
    """Keep one synced file's box version (e.g. ~/.claude.json with an MCP server) for review."""
    kept = state.kept_dir
    os.makedirs(os.path.dirname(kept), mode=0o700, exist_ok=True)
    with safefs.base_dir(os.path.dirname(kept)) as pfd:
        kfd = _mkdirs(pfd, os.path.basename(kept))
    try:
        parent = os.path.dirname(rel)
        dfd = _mkdirs(kfd, parent) if parent else os.dup(kfd)
        try:
            safefs.create_new(dfd, os.path.basename(rel), data)
        finally:
            os.close(dfd)
        manifest = _read_manifest_fd(kfd) or {"run": state.run_id, "home": state.home, "files": {}}
        manifest["files"][rel] = {"why": why, "kind": "file", "stored": True, "host_sha256": host_sha256}
        safefs.replace_in(kfd, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    finally:
        os.close(kfd)
    return os.path.join(kept, rel)


def _read_manifest_fd(kfd: int) -> dict | None:
    data = safefs.read_beneath(kfd, MANIFEST, 4 << 20)
    if data is None:
        return None
    value = json.loads(data)
    if not isinstance(value, dict) or not isinstance(value.get("files"), dict):
        raise ValueError("not a kept-state manifest")
    return value


# --- accept-state -------------------------------------------------------------------------------------------

def kept_runs(state_dir: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(os.path.join(state_dir, "kept")) if RUN_ID.match(n))
    except OSError:
        return []


def accept(state_dir: str, home: str, run: str, paths: tuple[str, ...] = ()) -> list[str]:
    """Take kept-aside files of one run into $HOME after review (all, or the named ones). Every file is
    checked first: one that changed on the host since the run refuses the whole call, so nothing is
    half-accepted. Returns what was accepted. Raises UsageError with the fix."""
    from relay.model.errors import UsageError

    runs = kept_runs(state_dir)
    listing = f"pick one of: {', '.join(runs[-5:])}" if runs else "nothing is kept aside at the moment"
    if not RUN_ID.match(run):
        raise UsageError(f"accept-state: {run!r} is not a run id; fix: {listing}")
    kept = os.path.join(state_dir, "kept", run)
    try:
        with safefs.base_dir(os.path.dirname(kept)) as pfd:
            kfd = safefs.open_beneath(pfd, run, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        raise UsageError(f"accept-state: no state is kept aside for run {run}; fix: {listing}") from None
    try:
        try:
            manifest = _read_manifest_fd(kfd)
        except (OSError, ValueError):
            manifest = None
        if not manifest:
            raise UsageError(f"accept-state: {kept}/{MANIFEST} is missing or unreadable; fix: review and copy the "
                             "files by hand, then delete that directory")
        files: dict[str, dict] = manifest["files"]
        wanted = [_rel_arg(p, home, files, kept) for p in paths] if paths else \
            sorted(rel for rel, entry in files.items() if not entry.get("login"))
        with safefs.base_dir(home) as hfd:
            for rel in wanted:
                entry = files[rel]
                if entry.get("login"):
                    raise UsageError(f"accept-state: ~/{rel} is a login the host holds; the box's copy has "
                                     f"placeholders, not your tokens, and never replaces the real one; fix: log in on "
                                     f"the host (`{ENTRY} login BACKEND`), and delete {kept}/{rel} once reviewed")
                if entry.get("kind") == "file" and not entry.get("stored"):
                    raise UsageError(f"accept-state: ~/{rel} was over the size bound and not stored; fix: let the "
                                     f"agent recreate it, or accept the other files by name")
                expected = entry.get("host_sha256")
                if _digest_host(hfd, rel) != expected:
                    raise UsageError(f"accept-state: ~/{rel} changed on the host since run {run} (or was in conflict); "
                                     f"fix: merge {kept}/{rel} into it by hand")
            for rel in wanted:
                entry = files[rel]
                parent = os.path.dirname(rel)
                dfd = _mkdirs(hfd, parent) if parent else os.dup(hfd)
                try:
                    name = os.path.basename(rel)
                    if entry.get("kind") == "link":
                        tmp = safefs.unique_name(name, "tmp")
                        os.symlink(str(entry.get("target", "")), tmp, dir_fd=dfd)
                        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                    else:
                        with safefs.parent_of(kfd, rel) as (sfd, sname):
                            _copy_into(sfd, sname, dfd, name, mode=0o600, replace=True)
                            os.unlink(sname, dir_fd=sfd)
                finally:
                    os.close(dfd)
                del files[rel]
        if files:
            safefs.replace_in(kfd, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    finally:
        os.close(kfd)
    if not files:
        import shutil

        shutil.rmtree(kept, ignore_errors=True)
    return ["~/" + rel for rel in wanted]


def kept_logins(state_dir: str, run: str) -> list[str]:
    """The login files still kept aside for RUN (never accepted; see accept), as ~/REL."""
    kept = os.path.join(state_dir, "kept", run)
    try:
        with safefs.base_dir(os.path.dirname(kept)) as pfd:
            kfd = safefs.open_beneath(pfd, run, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    try:
        manifest = _read_manifest_fd(kfd) or {}
    except (OSError, ValueError):
        manifest = {}
    finally:
        os.close(kfd)
    return ["~/" + rel for rel, entry in sorted(manifest.get("files", {}).items()) if entry.get("login")]


def _rel_arg(arg: str, home: str, files: dict[str, dict], kept: str) -> str:
    from relay.model.errors import UsageError

    rel = arg[2:] if arg.startswith("~/") else os.path.relpath(arg, home) if os.path.isabs(arg) else arg
    rel = os.path.normpath(rel)
    if rel not in files:
        shown = ", ".join("~/" + f for f in sorted(files)[:5]) + (", …" if len(files) > 5 else "")
        raise UsageError(f"accept-state: {arg} is not kept aside in this run; fix: name one of: {shown} "
                         f"(see {kept}/{MANIFEST})")
    return rel
