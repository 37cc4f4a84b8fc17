"""Agent config the box created or changed in the workdir, at any depth, moved aside for review.

The top-level agent config names are read-only in the box (relay/policy/denylist.py PROTECT_WORKDIR), but
an agent CLI also loads `pkg/.claude/settings.json`, `pkg/.codex/config.toml`, `.opencode/plugins/`,
`opencode.json` or `.mcp.json` below the top (from wherever it is started), and a `.gitignore` of `*`
hides them from `git status`. At exit, whatever the box created or changed there (the names come from
relay/model/runs_later.py, class AGENT_CONFIG) is taken off its live name and kept in
`~/.local/state/hive-relay/kept/RUN.workdir/` with a `workdir.json` manifest; a file that existed at
start is put back as it was (its content was read at start, bounded), and one the box deleted is put
back too. `accept-state RUN` takes the box's versions in after review.

Every touch goes through safefs: the entry is first renamed within its directory (no link followed on
any component, the entry itself moved whatever it is) to a name the box cannot guess and no loader
matches, so it stops being live before anything is read; then a regular file's bytes are read
(O_NONBLOCK, S_ISREG, bounded) into a new tree we own, a link's target is recorded, anything else is
listed; then the renamed entry is removed. Nothing is followed, nothing blocks.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat

from relay.host import safefs
from relay.model.hashing import sha256
from relay.model.record import field, record
from relay.model.refusal import ENTRY

MANIFEST = "workdir.json"
MAX_FILE = 4 << 20  # one kept file; a larger one is listed, not stored (and still taken off the live name)
BUDGET = 64 << 20  # all kept files of one run


def kept_dir(state_dir: str, run_id: str) -> str:
    """Beside the agent state's kept/RUN (relay/trust/agentstate.py), never inside it: the two are accepted,
    and cleaned up, independently."""
    return os.path.join(state_dir, "kept", f"{run_id}.workdir")


@record(frozen=False)
class Settled:
    """How the workdir's protected paths were settled at exit: moved aside, restored, failed, or kept."""

    moved: list[tuple[str, str]] = field(default_factory=list)  # (rel, what the box did)
    restored: list[str] = field(default_factory=list)  # deleted by the box, put back
    failed: list[tuple[str, str]] = field(default_factory=list)  # (rel, why it could not be handled)
    kept: str = ""


def _digest_at(root_fd: int, rel: str) -> str | None:
    try:
        data = safefs.read_beneath(root_fd, rel, MAX_FILE)
    except OSError:
        return "(unreadable)"
    return None if data is None else sha256(data).hexdigest()


def _open_kept(path: str) -> int:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with safefs.base_dir(os.path.dirname(path)) as pfd:
        try:
            os.mkdir(os.path.basename(path), 0o700, dir_fd=pfd)
        except FileExistsError:
            pass
        return safefs.open_beneath(pfd, os.path.basename(path), os.O_RDONLY | os.O_DIRECTORY)


def _store(kfd: int, rel: str, data: bytes) -> None:
    with safefs.parent_of(kfd, "files/" + rel, create=True) as (pfd, name):
        safefs.create_new(pfd, name, data)


def _take(root_fd: int, rel: str, kfd: int, budget: list[int]) -> dict:
    """Take one entry off its live name and keep what it was; returns its manifest entry."""
    with safefs.parent_of(root_fd, rel) as (pfd, name):
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            raise OSError(errno.EISDIR, "a directory", rel)
        tmp = safefs.unique_name(name, "aside")
        safefs.rename_noreplace(pfd, name, tmp)  # from here on nothing loads it
        entry: dict = {"mode": stat.S_IMODE(st.st_mode) & 0o777, "stored": False}
        try:
            if stat.S_ISLNK(st.st_mode):
                entry.update(kind="link", target=os.readlink(tmp, dir_fd=pfd), stored=True)
            elif stat.S_ISREG(st.st_mode):
                entry["kind"] = "file"
                fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=pfd)
                try:
                    limit = min(MAX_FILE, budget[0])
                    try:
                        data = safefs._read_fd(fd, limit, rel)
                    except safefs.UnsafePath:
                        data = None
                finally:
                    os.close(fd)
                if data is not None:
                    _store(kfd, rel, data)
                    budget[0] -= len(data)
                    entry.update(stored=True, sha256=sha256(data).hexdigest())
            else:
                entry["kind"] = "special"
        finally:
            os.unlink(tmp, dir_fd=pfd)
    return entry


def _put_back(root_fd: int, rel: str, data: bytes, mode: int) -> None:
    with safefs.parent_of(root_fd, rel, create=True, mode=0o755) as (pfd, name):
        safefs.replace_in(pfd, name, data, mode & 0o777)


def settle(root_fd: int, workdir: str, changed: list[tuple[str, str]], deleted: list[tuple[str, int]],
           originals: dict[str, bytes], kept: str, run_id: str) -> Settled:
    """Move aside each (rel, what) in `changed` (restoring its original where one was read at start),
    and put back each (rel, mode) in `deleted` that has an original. Writes the manifest."""
    out = Settled(kept=kept)
    if not changed and not any(rel in originals for rel, _ in deleted):
        return out
    kfd = _open_kept(kept)
    try:
        try:
            manifest = json.loads(safefs.read_beneath(kfd, MANIFEST, 4 << 20) or b"null")
        except (OSError, ValueError):
            manifest = None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            manifest = {"run": run_id, "workdir": workdir, "files": {}}
        files: dict[str, dict] = manifest["files"]
        budget = [BUDGET]
        for rel, what in changed:
            try:
                entry = _take(root_fd, rel, kfd, budget)
            except OSError as err:
                out.failed.append((rel, err.strerror or str(err)))
                continue
            original = originals.get(rel)
            if original is not None:
                try:
                    _put_back(root_fd, rel, original, entry["mode"] | 0o600)
                    what += ", the original put back"
                except OSError as err:
                    out.failed.append((rel, f"moved aside, but the original could not be put back: "
                                            f"{err.strerror or err}"))
            entry.update(why=what, host_sha256=_digest_at(root_fd, rel))
            files[rel] = entry
            out.moved.append((rel, what))
        for rel, mode in deleted:
            original = originals.get(rel)
            if original is None:
                continue
            try:
                _put_back(root_fd, rel, original, mode | 0o600)
                out.restored.append(rel)
            except OSError as err:
                out.failed.append((rel, f"deleted by the box; could not put it back: {err.strerror or err}"))
        if files:
            safefs.replace_in(kfd, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    finally:
        os.close(kfd)
    if not files:
        shutil.rmtree(kept, ignore_errors=True)
    return out


def summary(settled: Settled, run_id: str, shown) -> list[str]:  # noqa: ANN001 - exitreport._shown
    lines = []
    if settled.moved:
        names = ", ".join(shown(rel) for rel, _ in settled.moved[:3]) + (", …" if len(settled.moved) > 3 else "")
        lines.append(f"moved aside {len(settled.moved)} agent config file(s) the box created or changed in the "
                     f"workdir: {names}; nothing of them runs until you review {settled.kept} and accept with "
                     f"`{ENTRY} accept-state {run_id}`")
    if settled.restored:
        names = ", ".join(shown(rel) for rel in settled.restored[:3]) + (", …" if len(settled.restored) > 3 else "")
        lines.append(f"put back {len(settled.restored)} agent config file(s) the box deleted in the workdir: {names}")
    for rel, why in settled.failed[:5]:
        lines.append(f"agent config {shown(rel)}: {why}; remove it by hand before running an agent CLI there")
    return lines


# --- accept-state -----------------------------------------------------------------------------------------

def pending(state_dir: str, run: str) -> dict | None:
    """The run's workdir manifest, or None when nothing of its workdir is kept aside."""
    try:
        with safefs.base_dir(os.path.join(state_dir, "kept")) as pfd:
            kfd = safefs.open_beneath(pfd, f"{run}.workdir", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        data = safefs.read_beneath(kfd, MANIFEST, 4 << 20)
        value = json.loads(data) if data else None
    except (OSError, ValueError):
        value = None
    finally:
        os.close(kfd)
    return value if isinstance(value, dict) and isinstance(value.get("files"), dict) else None


def owns(manifest: dict, arg: str) -> str | None:
    """The manifest key an accept-state PATH names (`workdir:REL`, or an absolute path in the workdir)."""
    workdir = str(manifest.get("workdir") or "")
    if arg.startswith("workdir:"):
        rel = os.path.normpath(arg[len("workdir:"):])
    elif os.path.isabs(arg) and workdir and safefs.beneath(arg, workdir):
        rel = os.path.relpath(os.path.normpath(arg), workdir)
    else:
        return None
    return rel


def accept(state_dir: str, run: str, paths: tuple[str, ...] = ()) -> list[str]:
    """Take the kept-aside workdir files of one run back into the workdir (all, or the named ones).
    Each is checked first: one whose path changed in the workdir since the run refuses the call."""
    from relay.model.errors import UsageError

    manifest = pending(state_dir, run)
    if manifest is None:
        return []
    kept = kept_dir(state_dir, run)
    files: dict[str, dict] = manifest["files"]
    workdir = str(manifest.get("workdir") or "")
    wanted = sorted(files) if not paths else []
    for arg in paths:
        rel = owns(manifest, arg)
        if rel not in files:
            raise UsageError(f"accept-state: {arg} is not kept aside from the workdir in run {run}; fix: name one "
                             f"of: {', '.join(sorted(files)[:5])} (see {kept}/{MANIFEST})")
        wanted.append(rel)
    with safefs.base_dir(workdir) as root_fd, safefs.base_dir(kept) as kfd:
        for rel in wanted:
            entry = files[rel]
            if not entry.get("stored"):
                raise UsageError(f"accept-state: {workdir}/{rel} was not stored ({entry.get('kind')}, or over the "
                                 f"size bound); fix: recreate it by hand, or accept the other files by name")
            if _digest_at(root_fd, rel) != entry.get("host_sha256"):
                raise UsageError(f"accept-state: {workdir}/{rel} changed since run {run}; fix: merge "
                                 f"{kept}/files/{rel} into it by hand")
        for rel in wanted:
            entry = files[rel]
            with safefs.parent_of(root_fd, rel, create=True, mode=0o755) as (pfd, name):
                if entry.get("kind") == "link":
                    tmp = safefs.unique_name(name, "tmp")
                    os.symlink(str(entry.get("target", "")), tmp, dir_fd=pfd)
                    os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
                else:
                    data = safefs.read_beneath(kfd, "files/" + rel, MAX_FILE) or b""
                    safefs.replace_in(pfd, name, data, (int(entry.get("mode", 0o644)) & 0o777) | 0o600)
            del files[rel]
        if files:
            safefs.replace_in(kfd, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    if not files:
        shutil.rmtree(kept, ignore_errors=True)
    return [os.path.join(workdir, rel) for rel in wanted]
