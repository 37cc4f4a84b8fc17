"""Asking an engine about itself without leaving anything behind (`doctor`).

The first `podman info` of a rootless user starts a pause process (catatonit, which keeps the user
namespace alive) and creates ~/.config/cni, ~/.local/share/containers and run state under
$XDG_RUNTIME_DIR. A diagnosis must not change the host: `untouched()` notes which of those existed,
and afterwards stops a pause process that was started meanwhile and removes the dirs that are new.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from relay.host import safefs


def _candidates(env: Mapping[str, str], uid: int) -> list[str]:
    home = env.get("HOME", "/")
    config = env.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    local = os.path.join(home, ".local")
    data = env.get("XDG_DATA_HOME") or os.path.join(local, "share")
    runtime = env.get("XDG_RUNTIME_DIR")
    paths = [config, os.path.join(config, "containers"), os.path.join(config, "cni"), local, data,
             os.path.join(data, "containers"), f"/tmp/podman-run-{uid}", f"/tmp/containers-user-{uid}",
             f"/tmp/storage-run-{uid}", f"/run/user/{uid}/containers", f"/run/user/{uid}/libpod"]
    if runtime:
        paths += [os.path.join(runtime, "containers"), os.path.join(runtime, "libpod"),
                  os.path.join(runtime, "podman")]
    return list(dict.fromkeys(os.path.normpath(p) for p in paths))


def _parents(env: Mapping[str, str]) -> set[str]:
    home = env.get("HOME", "/")
    return {os.path.normpath(p) for p in (env.get("XDG_CONFIG_HOME") or os.path.join(home, ".config"),
                                          os.path.join(home, ".local"),
                                          env.get("XDG_DATA_HOME") or os.path.join(home, ".local", "share"))}


def _pause_files(env: Mapping[str, str], uid: int) -> list[str]:
    runtimes = [env.get("XDG_RUNTIME_DIR"), f"/run/user/{uid}", f"/tmp/podman-run-{uid}"]
    return [os.path.join(r, "libpod", "tmp", "pause.pid") for r in runtimes if r]


def _pause_pid(path: str, uid: int) -> int | None:
    """The pause process named by a pid file of ours, if it is alive and is ours."""
    try:
        data = safefs.read_file(path, 64)
    except OSError:
        return None
    if not data or not data.strip().isdigit():
        return None
    pid = int(data.strip())
    try:
        st = os.stat(f"/proc/{pid}")
        with open(f"/proc/{pid}/comm", encoding="utf-8") as fh:
            comm = fh.read().strip()
    except OSError:
        return None
    if st.st_uid != uid or comm not in ("catatonit", "podman", "podman pause"):
        return None
    return pid


def _remove_new(path: str, uid: int, parent: bool) -> None:
    """A new dir of the engine's goes with its contents; a new parent (~/.config, ~/.local) only
    when it is empty by then."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if st.st_uid != uid or stat.S_ISLNK(st.st_mode):
        return
    if parent:
        try:
            os.rmdir(path)
        except OSError:
            pass
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)  # fd-based, never follows a link (avoids_symlink_attacks)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


@contextmanager
def untouched(env: Mapping[str, str]) -> Iterator[None]:
    """Within the block, engine queries may create state; afterwards what they created is gone."""
    uid = os.getuid()
    candidates = _candidates(env, uid)
    existed = {p for p in candidates if os.path.lexists(p)}
    pause_before = {f: _pause_pid(f, uid) for f in _pause_files(env, uid)}
    try:
        yield
    finally:
        for f, before in pause_before.items():
            pid = _pause_pid(f, uid)
            if pid is not None and pid != before:
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
        # Deepest first, so a new ~/.local/share/containers goes before a new ~/.local.
        parents = _parents(env)
        for path in sorted((p for p in candidates if p not in existed), key=len, reverse=True):
            _remove_new(path, uid, path in parents)
