"""Git's index, read and rewritten so the index the box hands back cannot hide an edit from the host.

The index is a cache: for each tracked path it holds a blob id, the file's stat data when git
last read it, and flags. Host git trusts all of it. A box that writes the index can therefore
make `git status` and `git diff` on the host report a clean tree over an edited `Makefile`:
- `assume-unchanged` (CE_VALID) and `skip-worktree` tell git not to look at the file at all;
- a forged stat cache (the edited file's own stat data, `touch -d` back, with the blob id patched
  to the original) tells git the file is the blob, so it never reads it;
- extensions: the untracked cache (UNTR) hides untracked files behind stat data of directories,
  the fsmonitor bitmap (FSMN) marks entries valid without a stat, a split index (`link`) puts the
  entries in another file, sparse-directory entries stand for whole trees, the cache tree (TREE)
  stands in for the entries when git compares a directory with HEAD.

So the host never takes the box's index as it is (`sanitize`):
- hiding bits are cleared: assume-unchanged always; skip-worktree unless the index at start had
  it on that path and nothing is there in the worktree (a sparse checkout, which the box cannot
  widen: `info/sparse-checkout` is read-only in it);
- extensions are kept by allowlist: resolve-undo (REUC, data), the cache tree only when no entry
  changed and it is the one the host had; every other optional one is dropped (git rebuilds its
  caches), a split index or an unknown required one refuses the index, sparse-directory entries
  refuse it unless the host had the very same entry;
- the stat data of every entry the box changed (relative to the index at start: any field, the
  flags, a new path) is zeroed, git's own "smudged" form, so host git reads the file before it
  calls it clean; so is that of an unchanged entry whose file no longer has that stat data (a host
  git with `core.trustctime=false` would miss an in-place rewrite with the mtime set back);
- THE LIE RULE: an entry the box changed whose stat data says the worktree file is clean (same
  file type, same size and mtime to the nanosecond, and not racy: its mtime is before the index
  file's, where git itself would re-read) must name that file's content, as git's blob id of the
  bytes, of the bytes with CRLF turned into LF, or of a git-lfs pointer to them. If it does not,
  the index is refused: kept aside for review, the host keeps its own. Files over the hashing
  budget are not checked, only smudged (the smudge alone already makes git read them).

Every read is bounded by the data: the entry count by the bytes that hold it, each field by a
check before it is read, each path to 4096 bytes. Pure apart from `WorkTree`, which reads the
worktree through safefs (no link followed on any component, regular files only, bounded).
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterable
from typing import Protocol

from relay.host import safefs
from relay.model.hashing import sha1, sha256
from relay.model.record import field, record, replace

SIGNATURE = b"DIRC"
VERSIONS = (2, 3, 4)
MAX_PATH = 4096
STAT_FIELDS = 10  # ctime s, ns, mtime s, ns, dev, ino, mode, uid, gid, size: 32 bits each
ASSUME_VALID = 0x8000
EXTENDED = 0x4000
STAGE_MASK = 0x3000
NAME_MASK = 0x0FFF
SKIP_WORKTREE = 0x4000  # in the extended flags
INTENT_TO_ADD = 0x2000
KNOWN_XFLAGS = SKIP_WORKTREE | INTENT_TO_ADD
MODES = (0o100644, 0o100755, 0o120000, 0o160000)
SPARSE_DIR = 0o040000
GITLINK = 0o160000
SYMLINK = 0o120000
# Extensions kept as they are: data, never consulted to skip a file.
KEEP = (b"REUC",)
HASH_FILE_LIMIT = 64 << 20
HASH_BUDGET = 256 << 20
LFS_POINTER = b"version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n"


class BadIndex(ValueError):
    """Not an index git would write; the message says where and why."""


@record
class Entry:
    """One entry of git's index, as stored: its stat fields, mode, object id, flags and path."""

    ctime_s: int
    ctime_ns: int
    mtime_s: int
    mtime_ns: int
    dev: int
    ino: int
    mode: int
    uid: int
    gid: int
    size: int
    oid: bytes
    flags: int  # the on-disk 16 bits (assume-valid, extended, stage, name length)
    xflags: int  # the extended 16 bits (skip-worktree, intent-to-add); 0 when not extended
    name: bytes

    @property
    def stage(self) -> int:
        return (self.flags & STAGE_MASK) >> 12

    @property
    def path(self) -> str:
        return self.name.decode("utf-8", "surrogateescape")

    def smudged(self) -> Entry:
        """git's form for "stat never read" (size 0, which ie_modified() answers by reading)."""
        return replace(self, ctime_s=0, ctime_ns=0, mtime_s=0, mtime_ns=0, dev=0, ino=0, uid=0, gid=0, size=0)


@record
class Index:
    """A parsed git index: its version, hash length, entries and the extensions kept."""

    version: int
    hash_len: int  # 20: SHA-1, 32: SHA-256
    entries: tuple[Entry, ...]
    extensions: tuple[tuple[bytes, bytes], ...] = ()

    def extension(self, sig: bytes) -> bytes | None:
        return next((d for s, d in self.extensions if s == sig), None)


def _u32(data: bytes, pos: int) -> int:
    return int.from_bytes(data[pos:pos + 4], "big")


def _checksum_len(data: bytes) -> tuple[int, ...]:
    """The hash lengths whose checksum the trailer matches (zeros: git's `index.skipHash`)."""
    out = []
    for n, algo in ((20, sha1), (32, sha256)):
        if len(data) >= 12 + n and (data[-n:] == b"\0" * n or algo(data[:-n]).digest() == data[-n:]):
            out.append(n)
    return tuple(out)


def parse(data: bytes, hash_len: int | None = None) -> Index:
    """The index in `data`; BadIndex when it is not one git would write (bad checksum, unknown
    version or flag or mode, unordered or duplicate or unsafe paths, a truncated entry)."""
    if len(data) < 12 or data[:4] != SIGNATURE:
        raise BadIndex("no index signature")
    version = _u32(data, 4)
    if version not in VERSIONS:
        raise BadIndex(f"index version {version} is not 2, 3 or 4")
    lens = (hash_len,) if hash_len else _checksum_len(data)
    if not lens or (hash_len and hash_len not in _checksum_len(data)):
        raise BadIndex("the checksum does not match")
    last: BadIndex | None = None
    for n in lens:
        try:
            return _parse(data, version, n)
        except BadIndex as err:
            last = err
    assert last is not None
    raise last


def _decode_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """git's offset varint (varint.c): each continuation adds one before the shift."""
    if pos >= end:
        raise BadIndex("truncated name prefix")
    byte = data[pos]
    pos += 1
    value = byte & 0x7F
    while byte & 0x80:
        if pos >= end or value > (1 << 32):
            raise BadIndex("bad name prefix")
        byte = data[pos]
        pos += 1
        value = ((value + 1) << 7) | (byte & 0x7F)
    return value, pos


def _encode_varint(value: int) -> bytes:
    out = [value & 0x7F]
    value >>= 7
    while value:
        value -= 1
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    return bytes(reversed(out))


def _check_name(name: bytes, mode: int) -> None:
    if mode == SPARSE_DIR:
        if not name.endswith(b"/"):
            raise BadIndex("a directory entry whose name does not end with /")
        name = name[:-1]
    if not name or name.startswith(b"/") or name.endswith(b"/"):
        raise BadIndex(f"the path {name!r} is not a plain relative path")
    for part in name.split(b"/"):
        if part in (b"", b".", b"..") or part.lower() == b".git":
            raise BadIndex(f"the path {name!r} has an empty, `.`, `..` or `.git` component")


def _parse(data: bytes, version: int, hash_len: int) -> Index:
    count = _u32(data, 8)
    end = len(data) - hash_len
    head = struct.Struct(f">{STAT_FIELDS}I{hash_len}sH")
    fixed = head.size
    if count > (end - 12) // (fixed + 1 if version == 4 else fixed + 2):
        raise BadIndex(f"{count} entries cannot fit in {len(data)} bytes")
    pos, prev = 12, b""
    entries: list[Entry] = []
    for _ in range(count):
        start = pos
        if pos + fixed > end:
            raise BadIndex("truncated entry")
        *fields, oid, flags = head.unpack_from(data, pos)
        pos += fixed
        xflags = 0
        if flags & EXTENDED:
            if version < 3 or pos + 2 > end:
                raise BadIndex("extended flags in a version 2 index")
            xflags = int.from_bytes(data[pos:pos + 2], "big")
            pos += 2
            if xflags & ~KNOWN_XFLAGS:
                raise BadIndex(f"unknown extended flags {xflags:#06x}")
        namelen = flags & NAME_MASK
        if version == 4:
            strip, pos = _decode_varint(data, pos, end)
            if strip > len(prev):
                raise BadIndex("a name prefix longer than the previous name")
            nul = data.find(b"\0", pos, min(end, pos + MAX_PATH + 1))
            if nul < 0:
                raise BadIndex("a path that is not terminated or too long")
            name = prev[:len(prev) - strip] + data[pos:nul]
            pos = nul + 1
        else:
            nul = data.find(b"\0", pos, min(end, pos + MAX_PATH + 1))
            if nul < 0:
                raise BadIndex("a path that is not terminated or too long")
            name = data[pos:nul]
            pos = start + ((pos - start + len(name) + 8) & ~7)
            if pos > end or data[nul:pos].strip(b"\0"):
                raise BadIndex("bad entry padding")
        if len(name) > MAX_PATH or namelen != min(len(name), NAME_MASK):
            raise BadIndex("the name length in the flags is not the name's")
        mode = fields[6]
        if mode not in MODES and mode != SPARSE_DIR:
            raise BadIndex(f"unknown mode {mode:o} for {name!r}")
        entries.append(Entry(*fields, oid=oid, flags=flags, xflags=xflags, name=name))
        prev = name
    exts: list[tuple[bytes, bytes]] = []
    while pos < end:
        if pos + 8 > end:
            raise BadIndex("truncated extension header")
        sig, size = data[pos:pos + 4], _u32(data, pos + 4)
        pos += 8
        if size > end - pos:
            raise BadIndex(f"extension {sig!r} runs past the end")
        exts.append((sig, data[pos:pos + size]))
        pos += size
    if not any(sig == b"link" for sig, _ in exts):
        # A split index holds only changes to its shared index (names may be stripped there);
        # it is refused as a whole, so its entries are not judged one by one.
        for i, entry in enumerate(entries):
            _check_name(entry.name, entry.mode)
            if i:
                _check_order(entries[i - 1], entry)
    return Index(version=version, hash_len=hash_len, entries=tuple(entries), extensions=tuple(exts))


def _check_order(a: Entry, b: Entry) -> None:
    """git's check_ce_order(): sorted by name, then stage; a merged (stage 0) path appears once."""
    if a.name > b.name:
        raise BadIndex(f"unordered entries {a.name!r}, {b.name!r}")
    if a.name == b.name and (a.stage == 0 or a.stage >= b.stage):
        raise BadIndex(f"duplicate or unordered stages for {a.name!r}")


def serialize(index: Index) -> bytes:
    """The bytes git would write for `index` (names re-encoded, git's checksum appended)."""
    version = index.version
    if version == 2 and any(e.xflags for e in index.entries):
        version = 3
    out = [SIGNATURE, version.to_bytes(4, "big"), len(index.entries).to_bytes(4, "big")]
    pack = struct.Struct(f">{STAT_FIELDS}I{index.hash_len}sH").pack
    prev = b""
    for e in index.entries:
        flags = (e.flags & (ASSUME_VALID | STAGE_MASK)) | min(len(e.name), NAME_MASK)
        if e.xflags:
            flags |= EXTENDED
        head = pack(e.ctime_s, e.ctime_ns, e.mtime_s, e.mtime_ns, e.dev, e.ino, e.mode, e.uid, e.gid, e.size, e.oid,
                    flags) + (e.xflags.to_bytes(2, "big") if e.xflags else b"")
        if version == 4:
            common = len(os.path.commonprefix([prev, e.name]))
            out.append(head + _encode_varint(len(prev) - common) + e.name[common:] + b"\0")
        else:
            size = (len(head) + len(e.name) + 8) & ~7
            out.append(head + e.name + b"\0" * (size - len(head) - len(e.name)))
        prev = e.name
    for sig, data in index.extensions:
        out.append(sig + len(data).to_bytes(4, "big") + data)
    body = b"".join(out)
    algo = sha1 if index.hash_len == 20 else sha256
    return body + algo(body).digest()


def blob_id(content: bytes, hash_len: int) -> bytes:
    algo = sha1 if hash_len == 20 else sha256
    return algo(b"blob %d\0" % len(content) + content).digest()


def content_ids(content: bytes, hash_len: int) -> set[bytes]:
    """The blob ids git could record for a worktree file with these bytes: as they are, with CRLF
    turned to LF (core.autocrlf, `text` attributes), or as a git-lfs pointer."""
    ids = {blob_id(content, hash_len)}
    if b"\r\n" in content:
        ids.add(blob_id(content.replace(b"\r\n", b"\n"), hash_len))
    pointer = LFS_POINTER % (sha256(content).hexdigest().encode(), len(content))
    ids.add(blob_id(pointer, hash_len))
    return ids


# ---------------------------------------------------------------------------------------------
# The worktree as the host sees it.

@record
class FileFacts:
    """What lstat says about a work-tree path, the facts the index's lie rule compares against."""

    kind: str  # "file" | "link" | "dir" | "other"
    mode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int


class WorkTree:
    """A checkout's files, reached from a directory fd with no link followed on any component.
    Each directory is opened once (openat2 beneath the root) and its entries stat'ed from there."""

    MAX_OPEN = 256

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._dirs: dict[str, int | None] = {}

    def close(self) -> None:
        for fd in self._dirs.values():
            if fd is not None:
                os.close(fd)
        self._dirs.clear()

    def __enter__(self) -> WorkTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _dir(self, rel: str) -> int | None:
        if not rel:
            return self.fd
        if rel not in self._dirs:
            if len(self._dirs) >= self.MAX_OPEN:
                self.close()
            try:
                self._dirs[rel] = safefs.open_beneath(self.fd, rel, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                self._dirs[rel] = None  # missing, or a link on the way: git stops there too
        return self._dirs[rel]

    def _lstat(self, name: bytes) -> os.stat_result | None:
        parent, _, leaf = os.fsdecode(name).rpartition("/")
        dfd = self._dir(parent)
        if dfd is None:
            return None
        try:
            return os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return None

    def facts(self, name: bytes) -> FileFacts | None:
        st = self._lstat(name)
        if st is None:
            return None
        kind = ("file" if stat.S_ISREG(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode)
                else "dir" if stat.S_ISDIR(st.st_mode) else "other")
        return FileFacts(kind, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)

    def content(self, name: bytes, kind: str, limit: int) -> bytes | None:
        rel = os.fsdecode(name)
        try:
            if kind == "link":
                with safefs.parent_of(self.fd, rel) as (pfd, leaf):
                    return os.fsencode(os.readlink(leaf, dir_fd=pfd))
            return safefs.read_beneath(self.fd, rel, limit)
        except OSError:
            return None


class Files(Protocol):
    """What `sanitize` asks of a worktree (WorkTree, or a test's fake)."""

    def facts(self, name: bytes) -> FileFacts | None: ...

    def content(self, name: bytes, kind: str, limit: int) -> bytes | None: ...


# ---------------------------------------------------------------------------------------------
# The rules.

@record(frozen=False)
class Outcome:
    """What checking the box's git index decided: the index to write back or why it is refused, and what was
    cleared."""

    data: bytes | None = None  # the index to write back; None when refused
    refused: str | None = None  # why the index is refused (one clause)
    cleared: list[str] = field(default_factory=list)  # paths whose hiding bit the box had set
    smudged: int = 0
    dropped: list[str] = field(default_factory=list)  # extensions dropped
    unverified: int = 0  # entries the lie rule could not hash (too large, over budget)


def _stat_key(e: Entry) -> tuple[int, ...]:
    return (e.ctime_s, e.ctime_ns, e.mtime_s, e.mtime_ns, e.dev, e.ino, e.uid, e.gid, e.size)


def _kind_matches(mode: int, facts: FileFacts) -> bool:
    if mode == SYMLINK:
        return facts.kind == "link"
    return facts.kind == "file"


def _low(v: int) -> int:
    return v & 0xFFFFFFFF


def _claims_clean(e: Entry, f: FileFacts) -> bool:
    """The fields every git configuration compares (core.checkStat=minimal keeps these, bar the
    nanoseconds, which only make this stricter) say the file is what the entry names."""
    return (_kind_matches(e.mode, f) and e.size == _low(f.size) and e.mtime_s == _low(f.mtime_ns // 10**9)
            and e.mtime_ns == f.mtime_ns % 10**9)


def _still_clean(e: Entry, f: FileFacts) -> bool:
    """Strictly unchanged since git recorded the entry: ctime too (the box cannot set it back),
    inode, size, mtime and, for a file, the executable bit."""
    if not (_claims_clean(e, f) and e.ctime_s == _low(f.ctime_ns // 10**9) and e.ctime_ns == f.ctime_ns % 10**9
            and e.ino == _low(f.ino)):
        return False
    return e.mode == SYMLINK or (e.mode == 0o100755) == bool(f.mode & 0o100)


def _same_tree(box: Index, start: Index) -> bool:
    key = [(e.name, e.stage, e.mode, e.oid, e.xflags & INTENT_TO_ADD) for e in box.entries]
    return key == [(e.name, e.stage, e.mode, e.oid, e.xflags & INTENT_TO_ADD) for e in start.entries]


def sanitize(box_data: bytes, start_data: bytes | None, files: Files | None = None,
             index_mtime_ns: int = 0) -> Outcome:
    """The index to write back on the host for the box's index (see the module docstring).
    `start_data`: the index as the box found it (None: there was none). `files`: the worktree
    this index describes (None: not reachable from here; then every changed entry is smudged and
    the lie rule is not applied). `index_mtime_ns`: the box's index file's mtime (racy entries)."""
    out = Outcome()
    try:
        box = parse(box_data)
    except BadIndex as err:
        out.refused = f"not an index git writes ({err})"
        return out
    start: Index | None = None
    if start_data is not None:
        try:
            start = parse(start_data, box.hash_len)
        except BadIndex:
            start = None
    before = {(e.name, e.stage): e for e in start.entries} if start else {}
    exts: list[tuple[bytes, bytes]] = []
    sparse_ok = False
    for sig, data in box.extensions:
        name = sig.decode("latin-1")
        if sig == b"link":
            out.refused = "it is a split index (its entries live in a sharedindex file the host would read)"
            return out
        if sig == b"sdir":
            sparse_ok = True
            exts.append((sig, data))
        elif sig in KEEP or (sig == b"TREE" and start is not None and start.extension(b"TREE") == data
                             and _same_tree(box, start)):
            exts.append((sig, data))
        elif b"A"[0] <= sig[0] <= b"Z"[0]:
            out.dropped.append(name)
        else:
            out.refused = f"it has the required extension {name!r}, which host git would have to obey"
            return out
    budget = [HASH_BUDGET]
    entries: list[Entry] = []
    for e in box.entries:
        old = before.get((e.name, e.stage))
        if e.mode == SPARSE_DIR:
            present = files.facts(e.name.rstrip(b"/")) if files is not None else None
            if not sparse_ok or old != e or present is not None:
                out.refused = (f"its sparse-directory entry {e.path} stands for a whole tree and is not the one "
                               "the host had")
                return out
            entries.append(e)
            continue
        facts = files.facts(e.name) if files is not None else None
        flags, xflags = e.flags & ~ASSUME_VALID, e.xflags
        if e.flags & ASSUME_VALID and not (old and old.flags & ASSUME_VALID):
            out.cleared.append(f"{e.path} (assume-unchanged)")
        if e.xflags & SKIP_WORKTREE:
            keep = (old is not None and old.xflags & SKIP_WORKTREE and old.oid == e.oid and old.mode == e.mode
                    and files is not None and facts is None)
            if not keep:
                xflags &= ~SKIP_WORKTREE
                if not (old and old.xflags & SKIP_WORKTREE):
                    out.cleared.append(f"{e.path} (skip-worktree)")
        changed = old is None or old != e
        clean = e if (flags, xflags) == (e.flags, e.xflags) else replace(e, flags=flags, xflags=xflags)
        if e.mode == GITLINK or e.stage != 0:
            entries.append(clean)  # a gitlink's stat is not consulted; unmerged entries are never clean
            continue
        if changed and facts is not None and not e.xflags & INTENT_TO_ADD:
            why = _lie(e, facts, files, box.hash_len, index_mtime_ns, budget, out)
            if why:
                out.refused = why
                return out
        if changed or (facts is not None and not _still_clean(e, facts)):
            if _stat_key(e) != _stat_key(e.smudged()):
                out.smudged += 1
            clean = clean.smudged()
        entries.append(clean)
    if not any(e.mode == SPARSE_DIR for e in entries):
        exts = [(s, d) for s, d in exts if s != b"sdir"]
    out.data = serialize(replace(box, entries=tuple(entries), extensions=tuple(exts)))
    return out


def _lie(e: Entry, facts: FileFacts, files: Files | None, hash_len: int, index_mtime_ns: int,
         budget: list[int], out: Outcome) -> str | None:
    """Why entry `e` lies (its stat says the file is clean, its blob is not the file), or None."""
    if files is None or not _claims_clean(e, facts):
        return None
    if index_mtime_ns and e.mtime_s * 10**9 + e.mtime_ns >= index_mtime_ns:
        return None  # racy: git itself re-reads such an entry
    if facts.size > HASH_FILE_LIMIT or facts.size > budget[0]:
        out.unverified += 1
        return None
    content = files.content(e.name, facts.kind, HASH_FILE_LIMIT)
    if content is None:
        out.unverified += 1
        return None
    budget[0] -= len(content)
    if e.oid in content_ids(content, hash_len):
        return None
    return (f"its entry for {e.path} names blob {e.oid.hex()[:12]}, which is not the file's content, while its "
            "stat data says the file is clean (a forged index hides an edit from git status)")


def paths(data: bytes) -> Iterable[tuple[str, int]]:
    """(path, mode) of every entry; empty for an index that does not parse."""
    try:
        return [(e.path, e.mode) for e in parse(data).entries]
    except BadIndex:
        return []
