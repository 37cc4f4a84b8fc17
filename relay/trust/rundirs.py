"""The run dirs (`hive-relay-RUNID` under $XDG_RUNTIME_DIR or /tmp) a launcher leaves while its box
runs: where they are, and the sweep every launch runs for those whose launcher is gone (owner
identity is relay/host/liveness.py's).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

from relay.host.liveness import gone

PREFIX = "hive-relay-"


def base(env: Mapping[str, str]) -> str:
    """Where run dirs live: the caller's runtime dir, else /tmp."""
    return env.get("XDG_RUNTIME_DIR") or "/tmp"


def run_dirs(base: str) -> int:
    """Remove this user's run dirs (`hive-relay-RUNID` under `base`) whose launcher is gone."""
    removed = 0
    try:
        entries = [e for e in os.scandir(base) if e.name.startswith(PREFIX)]
    except OSError:
        return 0
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != os.getuid() or not entry.is_dir(follow_symlinks=False):
            continue
        if gone(entry.name, PREFIX, st.st_ctime):
            shutil.rmtree(entry.path, ignore_errors=True)  # fd-based: no link inside is followed
            removed += 1
    return removed
