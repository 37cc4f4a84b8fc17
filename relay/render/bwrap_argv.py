"""Render a filesystem plan and identity options into a bubblewrap argv (nothing is run here)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from relay.model.mounts import Mount
from relay.model.vocab import MountKind

# A read-only mask holds nothing, but every tmpfs gets a size.
MASK_SIZE = 4096


def mount_args(mounts: Iterable[Mount], fd_binds: Mapping[tuple[str, str], int] | None = None) -> list[str]:
    """`fd_binds` maps (dst, src) of a read-only bind to the fd bwrap gets it on instead of its path
    (`--ro-bind-fd`: an --allow-socket socket, opened and checked by the runner without following links)."""
    args: list[str] = []
    fd_binds = fd_binds or {}
    for m in mounts:
        if m.kind == MountKind.RO_BIND and (m.dst, m.src) in fd_binds:
            args += ["--ro-bind-fd", str(fd_binds[(m.dst, m.src)]), m.dst]
        elif m.kind == MountKind.RO_BIND:
            args += ["--ro-bind", m.src or m.dst, m.dst]
        elif m.kind in (MountKind.BIND, MountKind.PRIVATE_BIND):
            args += ["--bind", m.src or m.dst, m.dst]
        elif m.kind == MountKind.TMPFS:
            args += (["--size", str(m.size)] if m.size else []) + ["--tmpfs", m.dst]
        elif m.kind == MountKind.MASK_DIR:
            args += ["--perms", "0555", "--size", str(MASK_SIZE), "--tmpfs", m.dst, "--remount-ro", m.dst]
        elif m.kind == MountKind.MASK_FILE:
            args += ["--ro-bind", "/dev/null", m.dst]
        elif m.kind == MountKind.DEV:
            # bwrap's /dev is an unsized tmpfs: keep it read-only (device nodes still work) and give
            # shared memory its own sized tmpfs.
            args += ["--dev", m.dst]
            if m.size:
                args += ["--size", str(m.size), "--tmpfs", f"{m.dst}/shm", "--remount-ro", m.dst]
        elif m.kind == MountKind.PROC:
            # pid 1 is bwrap's init: same uid as the box, dumpable, so /proc/1/mem would let the box
            # rewrite it (and drop its die-with-parent). An empty read-only tmpfs hides it.
            args += ["--proc", m.dst, "--perms", "0555", "--size", str(MASK_SIZE), "--tmpfs", f"{m.dst}/1",
                     "--remount-ro", f"{m.dst}/1"]
        else:
            raise ValueError(f"unknown mount kind {m.kind!r}")
    return args


def build(
    *, bwrap: str, mounts: Iterable[Mount], workdir: str, box_uid: int | None, seccomp_fd: int, info_fd: int,
    block_fd: int, fd_binds: Mapping[tuple[str, str], int] | None = None,
) -> list[str]:
    """The bwrap part of the command line, up to and including `--`.

    All namespaces are unshared (only `lo` exists, so the proxy fd is the way out), the box
    dies with its launcher, and it never holds capabilities: a root caller gets a non-root
    uid inside a user namespace, so it cannot remount a read-only bind writable.
    The box reports its pid on `info_fd` and waits on `block_fd` until the launcher has put it
    in its cgroup and opened the proxy listener in its network namespace.
    """
    args = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--cap-drop", "ALL",
            "--hostname", "hive-relay"]
    if box_uid is not None:
        args += ["--uid", str(box_uid), "--gid", str(box_uid)]
    args += mount_args(mounts, fd_binds)
    args += ["--seccomp", str(seccomp_fd), "--info-fd", str(info_fd), "--block-fd", str(block_fd),
             "--chdir", workdir, "--"]
    return args
