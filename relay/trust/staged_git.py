"""A staged run's git results, applied to the host repository: objects, then branches, then HEAD
and the index, each only where the host did not move meanwhile.

In a staged box the workdir's `.git` is the allowlisted private dir of relay/trust/gitdir.py, but the
read-write binds inside it (`objects/`, `refs/`, `logs/`) stack on the overlay, so what git wrote
there is in the layer's `upper/.git/`, and the state files (HEAD, index, ...) were kept in the
layer's `git/` at exit (relay/trust/staged.py). Nothing of it touched the host until now:

- objects (loose `objects/xx/...`, `objects/pack/pack-*.{pack,idx,rev}`) are inert data named by
  their hash: copied into the host's object store, never over an existing file;
- a branch or tag the box wrote moves on the host only if the host's ref did not change during the
  run (its loose file, or packed-refs when it has none, is older than the run's stamp); otherwise
  the box's ref lands as `refs/heads/hive-relay/RUN/<name>`, and the result says so;
- HEAD and the index come back, validated as gitdir.validate does, only if the host's copy did not
  change during the run; otherwise they stay in the layer, and the result names the fix.

Only the workdir's own repository (`.git` a directory) is handled; linked worktrees and
submodules stay staged, said in one line. Every host touch goes through safefs.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess

from relay.host import safefs
from relay.trust import staged
from relay.trust.gitdir import valid_refname, validate

_HEX = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_LOOSE = re.compile(r"objects/[0-9a-f]{2}/(?:[0-9a-f]{38}|[0-9a-f]{62})")
_PACK = re.compile(r"objects/pack/pack-(?:[0-9a-f]{40}|[0-9a-f]{64})\.(?:pack|idx|rev)")
OBJECT_LIMIT = 4 << 30
GIT = ".git"


def _files(ufd: int, rel: str) -> list[tuple[str, os.stat_result]]:
    """Regular files under upper/REL (relative to REL), no link followed."""
    out: list[tuple[str, os.stat_result]] = []
    try:
        fd = safefs.open_beneath(ufd, rel, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return out

    def walk(dfd: int, prefix: str) -> None:
        for name in sorted(os.listdir(dfd)):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            path = f"{prefix}{name}"
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    walk(sub, path + "/")
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                out.append((path, st))
    try:
        walk(fd, "")
    finally:
        os.close(fd)
    return out


def _unchanged(gfd: int, rel: str, base_ctime: int) -> bool:
    """The host's file did not change during the run (absent counts as unchanged)."""
    st = safefs.lstat_beneath(gfd, rel)
    return st is None or (stat.S_ISREG(st.st_mode) and st.st_ctime_ns < base_ctime)


def _packed_value(gfd: int, ref: str) -> bool:
    try:
        data = safefs.read_beneath(gfd, "packed-refs", 64 << 20) or b""
    except OSError:
        return False
    return any(line.endswith(b" " + ref.encode()) for line in data.splitlines())


def _have_object(git_dir: str, oid: str) -> bool:
    """The host repository has the object (its own git, on its own config)."""
    proc = subprocess.run(["git", "--git-dir", git_dir, "cat-file", "-e", oid], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={"PATH": os.environ.get(
                              "PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"})
    return proc.returncode == 0


def apply(run: staged.Run) -> tuple[list[str], bool]:
    """Apply the run's git results; returns (one line per thing done or held, any held)."""
    lines: list[str] = []
    held = False
    git_dir = os.path.join(run.workdir, GIT)
    with safefs.base_dir(run.workdir) as wfd:
        st = safefs.lstat_beneath(wfd, GIT)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return lines, False
    ufd = os.open(run.layer.upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        files = _files(ufd, GIT)
        base = run.base_ctime_ns
        with safefs.base_dir(git_dir) as gfd:
            from relay.trust.checkout_owner import checkout_owner, give, missing_parents

            owner = checkout_owner(gfd)  # root applying into a user's repository: the files stay the user's
            copied = 0
            for rel, _ in files:  # 1. objects: data named by their hash, never over an existing file
                if not (_LOOSE.fullmatch(rel) or _PACK.fullmatch(rel)):
                    continue
                if safefs.lstat_beneath(gfd, rel) is None:
                    data = safefs.read_beneath(ufd, f"{GIT}/{rel}", OBJECT_LIMIT)
                    if data is None:
                        continue
                    made = missing_parents(gfd, rel) if owner else []
                    with safefs.parent_of(gfd, rel, create=True, mode=0o755) as (pfd, name):
                        tmp = safefs.unique_name(name, "obj")
                        safefs.create_new(pfd, tmp, data, 0o444)
                        try:
                            safefs.rename_noreplace(pfd, tmp, name)
                        except FileExistsError:  # the host got it meanwhile: the same bytes by name
                            os.unlink(tmp, dir_fd=pfd)
                    give(gfd, [*made, rel], owner)
                    copied += 1
                _drop(ufd, f"{GIT}/{rel}")
            if copied:
                lines.append(f"git: {copied} object file(s) copied into {git_dir}/objects")
            for rel, _ in files:  # 2. branches and tags
                if not rel.startswith(("refs/heads/", "refs/tags/")) or rel.startswith("refs/heads/hive-relay/"):
                    continue
                ref = rel
                value = (safefs.read_beneath(ufd, f"{GIT}/{rel}", 4096) or b"").strip().decode(errors="replace")
                if not _HEX.fullmatch(value) or not valid_refname(ref.encode()) or not _have_object(git_dir, value):
                    lines.append(f"git: {ref} kept staged (not a valid ref to an object the host has)")
                    held = True
                    continue
                current = safefs.read_beneath(gfd, ref, 4096) if safefs.lstat_beneath(gfd, ref) else None
                if current is not None and current.strip().decode(errors="replace") == value:
                    _drop(ufd, f"{GIT}/{rel}")
                    continue
                moved = not _unchanged(gfd, ref, base) or (current is None and _packed_value(gfd, ref)
                                                           and not _unchanged(gfd, "packed-refs", base))
                target = ref if not moved else f"refs/heads/hive-relay/{run.layer.run}/{ref.split('/', 2)[2]}"
                made = missing_parents(gfd, target) if owner else []
                with safefs.parent_of(gfd, target, create=True, mode=0o755) as (pfd, name):
                    safefs.replace_in(pfd, name, (value + "\n").encode(), 0o644)
                give(gfd, [*made, target], owner)
                _drop(ufd, f"{GIT}/{rel}")
                lines.append(f"git: {ref} -> {value[:12]}" if not moved else
                             f"git: {ref} moved on the host during the run; the box's is {target} ({value[:12]})")
            # 3. HEAD and the index of the workdir's own checkout, from the layer's git/ state copy
            for name in ("HEAD", "index"):
                held |= _state(run, gfd, name, base, lines)
                if safefs.lstat_beneath(gfd, name) is not None:
                    give(gfd, [name], owner)
    finally:
        os.close(ufd)
    return lines, held


def _state(run: staged.Run, gfd: int, name: str, base: int, lines: list[str]) -> bool:
    gits = run.meta.get("git") or []
    top = next((g for g in gits if isinstance(g, dict) and g.get("host") == os.path.join(run.workdir, GIT)), None)
    if top is None:
        return False
    key = os.path.join(str(top.get("private")), name)
    try:
        with safefs.base_dir(os.path.join(run.layer.root, "git")) as sfd:
            data = safefs.read_beneath(sfd, key, 256 << 20)
    except OSError:
        return False
    if data is None:
        return False
    host = safefs.read_beneath(gfd, name, 256 << 20)
    if host == data:
        return False
    why = validate(name, data)
    if why:
        lines.append(f"git: the box's {name} kept staged ({why})")
        return True
    if not _unchanged(gfd, name, base):
        fix = "git reset (keeps your files)" if name == "index" else "git checkout as you need"
        lines.append(f"git: {name} changed on the host during the run; the box's stays in the layer; fix: {fix}")
        return True
    safefs.replace_in(gfd, name, data, 0o644)
    lines.append(f"git: {name} updated from the box")
    return False


def _drop(ufd: int, rel: str) -> None:
    try:
        safefs.unlink_beneath(ufd, rel, only_if=lambda st: stat.S_ISREG(st.st_mode))
    except OSError:
        pass
