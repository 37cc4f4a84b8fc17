"""The run dirs (`hive-relay-RUNID` under $XDG_RUNTIME_DIR or /tmp) a launcher leaves while its box
runs: where they are, and the sweep every launch runs for those whose launcher is gone (owner
identity is relay/host/liveness.py's).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from relay.host import safefs
from relay.host.liveness import gone

PREFIX = "hive-relay-"


def base(env: Mapping[str, str]) -> str:
    """Where run dirs live: the caller's runtime dir, else /tmp."""
    return env.get("XDG_RUNTIME_DIR") or "/tmp"


def bases(env: Mapping[str, str]) -> list[str]:
    """Every place a run dir of this caller may be (one made before XDG_RUNTIME_DIR was set is in /tmp)."""
    return list(dict.fromkeys(p for p in (env.get("XDG_RUNTIME_DIR"), "/tmp") if p))


def path_for(env: Mapping[str, str], run_id: str) -> str:
    """The run dir of one run."""
    return os.path.join(base(env), PREFIX + run_id)


def run_id_of(path: str) -> str:
    """The run id in a run dir's name (`hive-relay-RUNID`); "" for a path that is not one."""
    name = os.path.basename(path.rstrip("/"))
    return name[len(PREFIX):] if name.startswith(PREFIX) else ""


def names(where: str) -> list[str]:
    """The entries of `where` named like run dirs, sorted (oldest run ids first); none when unreadable.
    Whose each is and whether it is a dir are the caller's checks (lstat, no link followed)."""
    try:
        return sorted(e.name for e in os.scandir(where) if e.name.startswith(PREFIX))
    except OSError:
        return []


def run_dirs(base: str) -> int:
    """Remove this user's run dirs (`hive-relay-RUNID` under `base`) whose launcher is gone."""
    removed = 0
    for name in names(base):
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != os.getuid() or not stat.S_ISDIR(st.st_mode):
            continue
        if gone(name, PREFIX, st.st_ctime):
            remove_run_dir(path)
            removed += 1
    return removed


def remove_run_dir(run_dir: str) -> None:
    """The run dir and all below it, no link followed, whatever shape the box gave the parts it wrote
    (its git dir): relay/host/safefs.py remove_tree. What cannot be removed that way is left to
    rmtree's best effort (fd-based as well), and what even that leaves to the next sweep."""
    parent, name = os.path.split(run_dir.rstrip("/"))
    try:
        pfd = os.open(parent or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        safefs.remove_tree(pfd, name)
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        import shutil

        try:
            shutil.rmtree(run_dir, ignore_errors=True)
        except RecursionError:  # its own recursion, on a tree too deep
            pass
    finally:
        os.close(pfd)
