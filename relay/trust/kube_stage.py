"""kube mode's results as staged runs: each box's patch becomes a layer that `changes`, `diff`,
`apply` and `discard` treat like a local or container run's (relay/trust/changes.py).

A box's patch is box-written data, so it is never applied to the checkout here. It is applied to
a private index built from the commit the boxes cloned (`git apply --cached`: git checks every
path, no working tree is touched, the new blobs go to the object store, which is inert data), and
the index's difference from that commit is written out as an overlay-style upper layer in our
owner-only state dir: files with their mode, symlinks as symlinks, deletions as whiteouts. Review
then judges it as it judges any layer: flags, protected paths, links, sizes.

The boxes started from the commit, not from the checkout as it was: a path the user had changed
without committing, or changed during the run, differs from that commit. `base_blobs` records,
per changed path, the blob the box started from, and review calls a host file that differs from
it a conflict, so apply never overwrites the user's own work.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Mapping, Sequence

from relay.host import safefs
from relay.model.hashing import sha1, sha256
from relay.model.record import record
from relay.trust import staged

ZERO_OIDS = ("0" * 40, "0" * 64)
MAX_LINK = 4096  # a symlink target longer than PATH_MAX is not one the kernel would make
# `git apply` inflates every binary hunk in memory: a 1 MiB patch of deflated zeros is a 1 GiB
# blob, and MAX_PATCH (64 MiB) of them tens of GiB. Its heap is bounded (RLIMIT_DATA counts brk
# and private writable mappings, not the packs git maps read-only), and so is what we read back.
GIT_APPLY_DATA = 2 << 30
MAX_STAGED_BYTES = 1 << 30  # all new blobs of one box together, read into memory to be written out


@record
class Change:
    """One path of the box's result against the base commit (`git diff-index --raw`)."""

    path: str
    status: str  # A | M | T | D
    old_oid: str | None
    new_oid: str | None
    new_mode: str  # 100644 | 100755 | 120000 | 160000 | 000000


@record
class Outcome:
    """What became of one box's patch: a staged run, nothing to stage, or why it was not staged."""

    index: int
    run: str | None = None
    files: int = 0
    error: str | None = None


def bundle_head(bundle: bytes) -> str | None:
    """The commit the boxes start from, in a bundle we made (`# v2 git bundle` then `OID REF`
    lines): the snapshot of uncommitted changes when it has one (relay/kube_run.make_bundle), else HEAD."""
    heads: dict[str, str] = {}
    for line in bundle.split(b"\n", 16)[1:16]:
        if not line:
            break
        oid, _, ref = line.partition(b" ")
        if ref and len(oid) in (40, 64) and all(c in b"0123456789abcdef" for c in oid):
            heads[ref.decode(errors="replace")] = oid.decode()
    snap = [oid for ref, oid in heads.items() if ref.startswith("refs/hive-relay/snapshot")]
    return snap[0] if snap else heads.get("HEAD") or next(iter(heads.values()), None)


def stamp_ctime(env: Mapping[str, str]) -> int:
    """The kernel's clock now, as a file's ctime reads it: what review compares host ctimes with
    (relay/trust/staged.py). A temp file in the owner-only staged root, gone right after."""
    root = staged.staged_root(env)
    os.makedirs(root, mode=0o700, exist_ok=True)
    import tempfile  # staging only: a review of a local run never needs it

    fd, path = tempfile.mkstemp(prefix=".stamp-", dir=root)
    try:
        return os.fstat(fd).st_ctime_ns
    finally:
        os.close(fd)
        os.unlink(path)


def parse_raw(out: bytes) -> list[Change]:
    """`git diff-index -z --raw --no-renames` output: `:OLDMODE NEWMODE OLD NEW STATUS\\0PATH\\0`."""
    parts = out.split(b"\0")
    changes = []
    for head, path in zip(parts[0::2], parts[1::2], strict=False):
        fields = head.decode().lstrip(":").split()
        if len(fields) != 5 or not path:
            continue
        _, new_mode, old, new, status = fields
        changes.append(Change(path.decode("utf-8", "surrogateescape"), status[:1],
                              None if old in ZERO_OIDS else old, None if new in ZERO_OIDS else new, new_mode))
    return changes


def safe_rel(path: str) -> bool:
    """A relative path with no empty, `.`, `..` or `.git` component (git has checked; so do we)."""
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and all(p not in ("", ".", "..") for p in parts) \
        and all(p.lower() != ".git" for p in parts)


def blob_id(data: bytes, oid_len: int) -> str:
    """The git blob id of `data`, in the repository's object format (sha1 or sha256)."""
    h = sha256() if oid_len == 64 else sha1()  # noqa: S324 - git's own object ids
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def _bounded_heap() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_DATA, (GIT_APPLY_DATA, GIT_APPLY_DATA))


def _git(workdir: str, index: str, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "GIT_INDEX_FILE": index, "LC_ALL": "C", "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run(["git", "-C", workdir, "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null",
                           *args], input=stdin, capture_output=True, env=env, timeout=300, preexec_fn=_bounded_heap)


def result_of(workdir: str, base: str, patch: bytes, scratch: str) -> list[Change] | str:
    """The box's patch applied to the base commit in a private index: the changed paths, or why
    it does not apply (one line)."""
    index = os.path.join(scratch, "index")
    steps: Sequence[tuple[tuple[str, ...], bytes | None]] = (
        (("read-tree", base), None),
        (("apply", "--cached", "--binary", "--whitespace=nowarn", "-"), patch),
    )
    for args, data in steps:
        proc = _git(workdir, index, *args, stdin=data)
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            return f"git {args[0]}: {err[0] if err else 'failed'}"
    proc = _git(workdir, index, "diff-index", "--cached", "-z", "--raw", "--no-renames", base)
    if proc.returncode != 0:
        return "git diff-index failed"
    return parse_raw(proc.stdout)


def _sizes(workdir: str, oids: Sequence[str]) -> dict[str, int]:
    """Each blob's size (`git cat-file --batch-check`), read before any content is."""
    proc = subprocess.run(["git", "-C", workdir, "cat-file", "--batch-check"], capture_output=True, timeout=300,
                          input="".join(f"{o}\n" for o in oids).encode(), env={**os.environ, "LC_ALL": "C"})
    sizes = {}
    for line in proc.stdout.splitlines():
        head = line.split()
        if len(head) == 3 and head[1] == b"blob" and head[2].isdigit():
            sizes[head[0].decode()] = int(head[2])
    return sizes


def _blobs(workdir: str, oids: Sequence[str], sizes: Mapping[str, int], limit: int) -> dict[str, bytes]:
    """The blobs' contents, by one `git cat-file --batch`; a blob over `limit` (by `sizes`, which
    `_sizes` asked before any content) is left out, and never read."""
    oids = [o for o in dict.fromkeys(oids) if sizes.get(o, limit + 1) <= limit]
    if not oids:
        return {}
    proc = subprocess.run(["git", "-C", workdir, "cat-file", "--batch"], input="".join(f"{o}\n" for o in oids).encode(),
                          capture_output=True, timeout=300, env={**os.environ, "LC_ALL": "C"})
    out, pos, blobs = proc.stdout, 0, {}
    for oid in oids:
        end = out.find(b"\n", pos)
        if end < 0:
            break
        head = out[pos:end].split()
        pos = end + 1
        if len(head) != 3 or head[1] != b"blob":
            continue
        size = int(head[2])
        if size <= limit:
            blobs[oid] = out[pos:pos + size]
        pos += size + 1
    return blobs


def unstageable(changes: Sequence[Change], sizes: Mapping[str, int], limit: int) -> list[str]:
    """Pure: why each change the upper layer cannot carry would be lost if the rest were staged
    (a rename whose new half is dropped deletes the user's file on apply). One reason per path."""
    out = []
    for c in changes:
        if c.status == "D":
            continue
        size = sizes.get(c.new_oid or "")
        if c.new_mode == "160000":
            out.append(f"{c.path}: a submodule pointer")
        elif size is None:
            out.append(f"{c.path}: its content is missing")
        elif size > limit:
            out.append(f"{c.path}: {size >> 20} MiB, over the {limit >> 20} MiB a staged file may have")
        elif c.new_mode == "120000" and size > MAX_LINK:
            out.append(f"{c.path}: a symbolic link target over {MAX_LINK} bytes")
    return out


def write_upper(upper: str, changes: Sequence[Change], blobs: Mapping[str, bytes]) -> int:
    """The changes as an overlay upper layer: a file (rwx bits only), a symlink, or a whiteout (a
    0:0 character device, which the kernel lets any user make). Returns how many were written;
    a path git would not have let through, a submodule pointer or a missing blob is skipped."""
    written = 0
    with safefs.base_dir(upper) as ufd:
        for c in sorted(changes, key=lambda c: (c.status != "D", c.path)):  # deletions first: a file may replace a dir
            if not safe_rel(c.path):
                continue
            if c.status != "D":
                _clear_whiteouts_above(ufd, c.path)
            with safefs.parent_of(ufd, c.path, create=True, mode=0o755) as (pfd, name):
                if c.status == "D":
                    os.mknod(name, stat.S_IFCHR | 0o600, os.makedev(0, 0), dir_fd=pfd)
                    written += 1
                    continue
                data = blobs.get(c.new_oid or "")
                if data is None or c.new_mode == "160000":
                    continue
                try:
                    st = os.lstat(name, dir_fd=pfd)
                except FileNotFoundError:
                    st = None
                if st is not None and stat.S_ISDIR(st.st_mode):  # a file where the base had a directory
                    safefs.remove_tree(pfd, name)
                elif st is not None:
                    os.unlink(name, dir_fd=pfd)
                if c.new_mode == "120000":
                    if len(data) <= MAX_LINK and b"\0" not in data:
                        os.symlink(os.fsdecode(data), name, dir_fd=pfd)
                        written += 1
                    continue
                safefs.create_new(pfd, name, data, 0o755 if c.new_mode == "100755" else 0o644, durable=False)
                written += 1
    return written


def _clear_whiteouts_above(ufd: int, rel: str) -> None:
    """A directory where the base had a file: the file's whiteout gives way to the directory."""
    parts = rel.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        above = "/".join(parts[:i])
        try:
            st = safefs.lstat_beneath(ufd, above)
        except OSError:
            return
        if st is None or stat.S_ISDIR(st.st_mode):
            continue
        with safefs.parent_of(ufd, above) as (pfd, name):
            os.unlink(name, dir_fd=pfd)
        return


def stage_box(workdir: str, base: str, patch: bytes, run_id: str, meta: Mapping[str, object], base_ctime_ns: int,
              env: Mapping[str, str], limit: int) -> Outcome:
    """One box's patch as the staged run `run_id` (see the module's docstring)."""
    index = int(run_id.rsplit("-", 1)[1])
    root = staged.staged_root(env)
    os.makedirs(root, mode=0o700, exist_ok=True)
    import tempfile

    with tempfile.TemporaryDirectory(prefix=".kube-", dir=root) as scratch:
        changes = result_of(workdir, base, patch, scratch)
        if isinstance(changes, str):
            return Outcome(index, error=f"the patch does not apply to the commit the box started from ({changes})")
        unsafe = [c.path for c in changes if not safe_rel(c.path)]
        if unsafe:
            return Outcome(index, error=f"the patch touches a path no layer may hold ({unsafe[0]!r})")
        if not changes:
            return Outcome(index)
        oids = [c.new_oid for c in changes if c.new_oid and c.new_mode != "160000"]
        sizes = _sizes(workdir, oids) if oids else {}
        lost = unstageable(changes, sizes, limit)
        if not lost and sum(sizes.get(o, 0) for o in set(oids)) > MAX_STAGED_BYTES:
            lost = [f"{MAX_STAGED_BYTES >> 20} MiB of new content in all"]
        if lost:
            more = f" and {len(lost) - 1} more" if len(lost) > 1 else ""
            return Outcome(index, error=f"part of the patch cannot be staged ({lost[0]}{more}); nothing of it is, "
                                        "so no half of it lands (apply the patch file by hand after review)")
        blobs = _blobs(workdir, oids, sizes, limit)
    base_blobs = {c.path: c.old_oid for c in changes}
    layer = staged.for_run(env, run_id)
    record = {**meta, "base_commit": base, "base_blobs": base_blobs, "oid_len": len(base), "kube_index": index}
    staged.create(layer, workdir, record, base_ctime_ns=base_ctime_ns)
    return Outcome(index, run_id, write_upper(layer.upper, changes, blobs))


def host_differs(meta: Mapping[str, object], wfd: int, rel: str, host: os.stat_result | None, limit: int) -> bool:
    """For a run staged from a commit: True when the host's `rel` is not the blob the box started
    from (the user's own uncommitted or new work, made before or during the run)."""
    blobs = meta.get("base_blobs")
    if not isinstance(blobs, dict) or rel not in blobs:
        return False
    base = blobs[rel]
    if host is None:
        return base is not None
    if base is None:
        return True
    if stat.S_ISLNK(host.st_mode):
        try:
            with safefs.parent_of(wfd, rel) as (pfd, name):
                data = os.fsencode(os.readlink(name, dir_fd=pfd))
        except OSError:
            return True
    elif stat.S_ISREG(host.st_mode):
        try:
            data = safefs.read_beneath(wfd, rel, limit)
        except OSError:
            return True
        if data is None:
            return True
    else:
        return True
    oid_len = meta.get("oid_len")
    if blob_id(data, oid_len if isinstance(oid_len, int) else 40) == base:
        return False
    return _cleaned_id(str(meta.get("workdir") or ""), rel, data) != base


def _cleaned_id(workdir: str, rel: str, data: bytes) -> str | None:
    """The blob id git would store for these bytes at `rel` (line-ending conversion, clean filters
    such as git-lfs): a host file equal to the commit once cleaned is not the user's own change.
    The bytes are piped in (read already, with no link followed); git opens no file of the checkout."""
    if not workdir:
        return None
    try:
        proc = subprocess.run(["git", "-C", workdir, "hash-object", f"--path={rel}", "--stdin"], input=data,
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.decode().strip() if proc.returncode == 0 else None
