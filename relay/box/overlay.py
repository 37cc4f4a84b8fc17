"""The staged workdir's copy-on-write mount: the checkout as the lower layer, a private upper layer in
hive relay's state dir, mounted over the workdir's own path in a mount namespace of the box's own.

bubblewrap 0.8.0 (Debian 12) has no `--overlay`, so the launcher mounts it itself, in the forked
child that then execs bwrap: for root, a private mount namespace; for everyone else, a user
namespace of its own first (this kernel allows overlayfs there; a nested `bwrap --unshare-user`
on top works). The host's mount table never sees it, and it dies with the box. Every bind the
plan makes inside the workdir (protected paths, the .git allowlist, placeholders) is resolved by
bwrap in that namespace, so it stacks on the overlay as it stacked on the checkout.

The options are pinned: `metacopy=off` (an upper file always holds its whole content, so the
review reads the upper layer alone), `redirect_dir=off` (`nofollow` in a user namespace: a
renamed lower directory is copied, never pointed at), `index=off`, `xino=off`; `userxattr` in a user namespace, where `trusted.` xattrs
are not ours.

The fork, the caller's file actions and the exec around `enter` are relay/box/fork_spawn.py's.
"""

from __future__ import annotations

import ctypes
import os
import sys

from relay.box.overlay_layer import Layer

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_NOSUID = 0x2
MS_NODEV = 0x4


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _write(path: str, data: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


def enter(layer: Layer) -> None:
    """In the calling (forked, single-threaded) process: a mount namespace of its own (and, unless
    root, a user namespace mapping our uid and gid to themselves), then the overlay over the
    workdir. Raises OSError with what failed."""
    uid, gid = os.geteuid(), os.getegid()
    userns = uid != 0
    _check(_libc.unshare(CLONE_NEWNS | (CLONE_NEWUSER if userns else 0)), "unshare")
    if userns:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "making / private")
    _check(_libc.mount(b"overlay", layer.lower.encode(), b"overlay", MS_NOSUID | MS_NODEV,
                       layer.options(userns).encode()), f"mounting the staged layer on {layer.lower}")


if __name__ == "__main__":  # a manual probe: python -m relay.box.overlay LOWER UPPER WORK -- CMD...
    sep = sys.argv.index("--")
    lo, up, wk = sys.argv[1:sep]
    enter(Layer(lo, up, wk))
    os.execvp(sys.argv[sep + 1], sys.argv[sep + 1:])
