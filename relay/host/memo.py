"""Content-addressed memos of launch work that only depends on its inputs: the parsed YAML of a
config file, the compiled seccomp program of a policy.

Why a memo at all: every launch paid ~20 ms to import PyYAML and ~18 ms to import pyseccomp (and
load libseccomp through ctypes) for answers that change only when their inputs do.

Why it is safe to trust one (DESIGN: "no trusted artefact in a box-writable place"):
- It lives in the cache dir, which is one of `paths.own_paths`: read-only in every box, even where a
  writable grant or the workdir covers it, and absent from container, kube and VM boxes.
- It is named by the sha256 of everything its value depends on (the file's bytes, the policy and
  the compiler's identity), so a changed input is a different name: a memo is never stale, and
  nothing the box wrote in a config file can make an old answer apply to it.
- It is read through safefs (no link followed, no special file, bounded, and the cache dir, each
  folder down and the file owned by us alone) and checked for shape by its caller; anything wrong
  is recomputed, never trusted, and written again.

Writing is best effort (a read-only home still launches) and never fsynced: a lost memo costs a
recompute, and a torn one fails its caller's shape check.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import Enum

from relay.host import safefs
from relay.host.paths import cache_dir
from relay.model.hashing import sha256


class MemoKind(str, Enum):
    """One folder per kind of answer, so a key of one kind can never be read as another."""

    PARSED_CONFIG = "parsed-config"  # JSON of a YAML file's data
    SECCOMP_BPF = "seccomp-bpf"  # libseccomp's exported BPF program
    SECCOMP_OCI = "seccomp-oci"  # a container's OCI seccomp profile, as JSON
    STATE_SCAN = "state-scan"  # per file of an agent's state: found clean of which secrets (relay/trust/state_scan.py)
    ENGINE_ARGV = "engine-argv"  # a command line's last podman argv, to prestart (relay/modes/container_prestart.py)


def key_of(*parts: bytes | str) -> str:
    """The sha256 of PARTS, each length-prefixed (no two inputs share a key by concatenation)."""
    digest = sha256()
    for part in parts:
        data = part.encode("utf-8", "surrogateescape") if isinstance(part, str) else part
        digest.update(b"%d:" % len(data))
        digest.update(data)
    return digest.hexdigest()


def file_identity(path: str) -> str | None:
    """What a memo key holds of a file it depends on: its real path, inode, size and ctime (a
    replaced or rewritten file is another identity; ctime cannot be set back without root)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{os.path.realpath(path)}:{st.st_ino}:{st.st_size}:{st.st_ctime_ns}"


def module_identity(name: str) -> str | None:
    """`file_identity` of the top-level module NAME would load, found without importing it."""
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec(name)
    return file_identity(spec.origin) if spec is not None and spec.origin else None


def _path(env: Mapping[str, str], kind: MemoKind, key: str) -> str:
    return os.path.join(str(cache_dir(env)), "memo", kind.value, key)


def get(env: Mapping[str, str], kind: MemoKind, key: str, limit: int) -> bytes | None:
    """The memo's bytes, or None (absent, unreadable, a link, a special file, over `limit`, or not
    ours alone: the cache dir, each folder down and the file owned by us and writable by no one else,
    so a root launch with another user's cache dir recomputes instead of taking that user's word)."""
    try:
        return safefs.read_owned(str(cache_dir(env)), os.path.join("memo", kind.value, key), limit)
    except (OSError, ValueError):
        return None


KEEP = 32  # memos per kind: each edit of a config file makes a new one, so the oldest go


def put(env: Mapping[str, str], kind: MemoKind, key: str, data: bytes) -> None:
    """Store DATA under KEY, then keep only the KEEP newest of its kind; any failure is ignored (the
    next launch recomputes). Runs only on a miss, so a launch that hits never lists the folder."""
    path = _path(env, kind, key)
    base = str(cache_dir(env))
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        if not safefs.owned_dir(base):
            return  # another user's cache dir: `get` would never trust what we put there
        safefs.write_file(path, data, 0o600, base=base, make_dirs=True, durable=False)
        _prune(base, os.path.join("memo", kind.value), keep=key)
    except (OSError, ValueError):
        pass


def _prune(base: str, rel: str, keep: str) -> None:
    """Unlink all but the KEEP newest entries of BASE/REL (never `keep`; unlink removes a name, never
    a link's target, and REL is opened with no link followed)."""
    with safefs.base_dir(base) as bfd:
        dfd = safefs.open_beneath(bfd, rel, os.O_RDONLY | os.O_DIRECTORY)
    try:
        entries = []
        for name in os.listdir(dfd):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            entries.append((st.st_mtime_ns, name))
        entries.sort(reverse=True)
        for _, name in entries[KEEP:]:
            if name != keep:
                try:
                    os.unlink(name, dir_fd=dfd)
                except OSError:
                    pass
    finally:
        os.close(dfd)
