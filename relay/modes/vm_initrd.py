"""The guest's initramfs: a static busybox, the kernel modules the guest needs (with their
dependencies, in load order), and a POSIX init. Built once per kernel into the VM cache.

Why an initramfs at all: Debian's kernels build every virtio driver, 9p and ext4 as modules
(checked in the 6.1 generic and cloud configs), so the guest cannot mount anything before it
loads them. Why this module writes the cpio itself: Debian 12 has no `cpio` by default, and the
newc format is a 110-byte header per file; no tool and no shell string needed.

The init (GUEST_INIT) is the guest half of the design in docs/isolation.md, "The VM tier": root is container
mode's image as a read-only ext4 disk under a tmpfs overlay, the workdir and the home grants come
in as 9p shares (a denied path is simply not shared), the only NIC is qemu's user network with
`restrict=on` and one guestfwd to the host-side proxy, and the exit code leaves through qemu's
isa-debug-exit port, which also ends qemu at once.
"""

from __future__ import annotations

import gzip
import os
import re
import stat
from collections.abc import Iterable

# What the guest mounts and talks through; everything else stays unloaded.
GUEST_MODULES = ("virtio_mmio", "virtio_blk", "virtio_net", "9pnet_virtio", "9p", "crc32c_generic", "ext4", "overlay")
BUSYBOX = "/bin/busybox"
_DEPENDS = re.compile(rb"(?:^|\x00)depends=([^\x00]*)\x00")

GUEST_INIT = r"""#!/bin/busybox sh
# hive relay's guest init: PID 1 of the VM. It mounts, then runs the command as the box user and
# reports its exit code on qemu's isa-debug-exit port (qemu exits with code*2+1 at once).
# Its only input is the read-only 9p share "hivectl" (never the kernel command line, which every
# host process can read). /ctl/mounts is the plan's filesystem, in order, one operation a line:
#   share TAG ro|rw PATH   a host dir over 9p (the workdir, a grant, a private per-run dir)
#   tmpfs SIZE MODE PATH   a sized tmpfs (/tmp, /run, ...)
#   file N PATH            a read-only copy of one host file (/ctl/files/N), bound over PATH
#   maskdir PATH / maskfile PATH   an empty read-only dir / /dev/null over a denied or protected path
B=/bin/busybox
fail() { $B echo "hive-relay guest: $*" >&2; report 70; }
report() { $B printf "\\$($B printf %o "$1")" | $B dd of=/dev/port bs=1 seek=244 count=1 2>/dev/null; $B poweroff -f; }
$B mkdir -p /proc /sys /dev /lower /upper /root /ctl
$B mount -t devtmpfs dev /dev && $B mount -t proc proc /proc && $B mount -t sysfs sys /sys || fail "no /dev, /proc or /sys"
while read -r m; do $B insmod "/modules/$m.ko" || fail "cannot load $m"; done < /modules/order
$B mount -t 9p -o trans=virtio,version=9p2000.L,ro hivectl /ctl || fail "no control share"
[ -s /ctl/time ] && $B date -s "@$($B cat /ctl/time)" >/dev/null  # TLS needs the host's clock, not 1970
$B mount -t ext4 -o ro,noload /dev/vda /lower || fail "no root image"
$B mount -t tmpfs -o size=25%,mode=755 upper /upper && $B mkdir -p /upper/u /upper/w || fail "no tmpfs"
$B mount -t overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w root /root || fail "no overlay"
$B mount -t tmpfs -o size=25%,mode=1777 tmp /root/tmp || fail "no /tmp"  # before the shares: a workdir may live under /tmp
while read -r kind a b c; do
  case "$kind" in
    share) $B mkdir -p "/root$c" && $B mount -t 9p -o "trans=virtio,version=9p2000.L,msize=262144,$b,access=any" \
             "$a" "/root$c" || fail "cannot mount $c";;
    tmpfs) $B mkdir -p "/root$c" && $B mount -t tmpfs -o "size=$a,mode=$b" tmpfs "/root$c" || fail "no tmpfs at $c";;
    file) { [ -e "/root$b" ] || { $B mkdir -p "/root${b%/*}" && $B touch "/root$b"; }; } 2>/dev/null || continue
          $B mount --bind "/ctl/files/$a" "/root$b" && $B mount -o remount,bind,ro "/root$b" || fail "cannot bind $b";;
    maskdir) { [ -e "/root$a" ] || $B mkdir -p "/root$a"; } 2>/dev/null || continue  # cannot be created: nothing to hide
             $B mount -t tmpfs -o ro,size=4k,mode=555 mask "/root$a" || fail "cannot mask $a";;
    maskfile) { [ -e "/root$a" ] || { $B mkdir -p "/root${a%/*}" && $B touch "/root$a"; }; } 2>/dev/null || continue
              $B mount --bind /dev/null "/root$a" && $B mount -o remount,bind,ro "/root$a" || fail "cannot mask $a";;
    *) fail "unknown mount line: $kind";;
  esac
done < /ctl/mounts
# The older form (tests): shares, then protected paths inside them as read-only binds.
[ -s /ctl/shares ] && while read -r tag mode path; do
  $B mkdir -p "/root$path" && $B mount -t 9p -o "trans=virtio,version=9p2000.L,msize=262144,$mode,access=any" \
    "$tag" "/root$path" || fail "cannot mount $path"
done < /ctl/shares
[ -s /ctl/protect ] && while read -r path; do
  [ -e "/root$path" ] || continue
  $B mount --bind "/root$path" "/root$path" && $B mount -o remount,bind,ro "/root$path" || fail "cannot protect $path"
done < /ctl/protect
$B mkdir -p /root/run/hivectl && $B mount --bind /ctl /root/run/hivectl || fail "no control dir"
$B mount -t proc proc /root/proc && $B mount -t devtmpfs dev /root/dev && $B mkdir -p /root/dev/pts \
  && $B mount -t devpts -o newinstance,ptmxmode=0666 devpts /root/dev/pts && $B ln -sf pts/ptmx /root/dev/ptmx \
  || fail "no /proc or /dev"
$B mount -t tmpfs -o size=64m,mode=1777 shm /root/dev/shm 2>/dev/null
$B hostname hive-relay
$B ip link set lo up
if [ -e /sys/class/net/eth0 ]; then $B ip link set eth0 up && $B ip addr add 10.0.2.15/24 dev eth0; fi
# The box's proxy address (127.0.0.1:3128, as in every tier) relays to qemu's one guestfwd, which
# reaches the host-side proxy; nothing else leaves the guest (restrict=on).
[ -e /ctl/proxy ] && { $B nc -ll -p 3128 -e /bin/proxy-relay </dev/null >/dev/null 2>&1 & }
[ -s /ctl/winsize ] && $B stty -F /dev/ttyS0 rows "$($B cut -d' ' -f1 /ctl/winsize)" cols "$($B cut -d' ' -f2 /ctl/winsize)"
uid=$($B cat /ctl/uid) && cd=$($B cat /ctl/cwd) || fail "no uid or cwd"
$B mkdir -p /root/run/hive && $B cp $B /root/run/hive/busybox || fail "no room for the launcher"
[ -e /ctl/ready ] && $B echo "hive-relay guest: ready" >/dev/ttyS0
$B setsid -c $B chroot /root /run/hive/busybox env -i /run/hive/busybox sh -c \
  'cd "$1" && set -a && . /run/hivectl/env && set +a && exec /usr/bin/setpriv --reuid="$2" --regid="$2" \
   --clear-groups --no-new-privs --inh-caps=-all --ambient-caps=-all --bounding-set=-all /bin/sh /run/hivectl/command' \
  hive "$cd" "$uid" </dev/ttyS0 >/dev/ttyS0 2>&1
report $?
"""
PROXY_RELAY = "#!/bin/busybox sh\nexec /bin/busybox nc 10.0.2.100 3128\n"


def module_index(modules_dir: str) -> dict[str, str]:
    """Module name (dashes as underscores, as the kernel names them) -> path of its .ko."""
    index: dict[str, str] = {}
    for dirpath, _dirs, files in os.walk(modules_dir):
        for name in files:
            if name.endswith(".ko"):
                index[name[:-3].replace("-", "_")] = os.path.join(dirpath, name)
    return index


def depends(path: str) -> list[str]:
    """A module's `depends=` from its .modinfo section (no modinfo/depmod on the host needed)."""
    with open(path, "rb") as fh:
        data = fh.read()
    m = _DEPENDS.search(data)
    return [d.replace("-", "_") for d in m.group(1).decode().split(",") if d] if m else []


def load_order(index: dict[str, str], wanted: Iterable[str]) -> list[str]:
    """Every module `wanted` needs, dependencies first; a module missing from the package is an
    error (the kernel may have it built in, which the caller checks in modules.builtin)."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in path:
            raise ValueError(f"module dependency loop: {' -> '.join(path + (name,))}")
        if name not in index:
            raise KeyError(name)
        for dep in depends(index[name]):
            visit(dep, path + (name,))
        order.append(name)

    for name in wanted:
        visit(name, ())
    return order


def builtin(modules_dir: str) -> set[str]:
    """Modules compiled into the kernel (modules.builtin): nothing to load for those."""
    try:
        with open(os.path.join(modules_dir, "modules.builtin")) as fh:
            return {os.path.basename(line.strip())[:-3].replace("-", "_") for line in fh if line.strip()}
    except OSError:
        return set()


def _entry(name: str, mode: int, data: bytes, ino: int) -> bytes:
    """One newc record: header, NUL-terminated name and data, each padded to 4 bytes."""
    fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name) + 1, 0)
    header = b"070701" + b"".join(b"%08X" % f for f in fields)
    out = header + name.encode() + b"\0"
    out += b"\0" * (-len(out) % 4) + data
    return out + b"\0" * (-len(out) % 4)


def cpio(files: list[tuple[str, int, bytes]]) -> bytes:
    """A newc archive of (name, mode, data); directories have empty data."""
    parts = [_entry(name, mode, data, i + 1) for i, (name, mode, data) in enumerate(files)]
    parts.append(_entry("TRAILER!!!", 0, b"", 0))
    blob = b"".join(parts)
    return blob + b"\0" * (-len(blob) % 512)


def build(modules_dir: str, busybox: str = BUSYBOX, init: str = GUEST_INIT,
          wanted: Iterable[str] = GUEST_MODULES) -> bytes:
    """The gzipped initramfs for the kernel whose modules live in `modules_dir`."""
    index = module_index(modules_dir)
    skip = builtin(modules_dir)
    order = [m for m in load_order(index, [w for w in wanted if w not in skip]) if m not in skip]
    with open(busybox, "rb") as fh:
        bb = fh.read()
    if b"\x00.interp" in bb or b"/lib64/ld-linux" in bb:
        raise ValueError(f"{busybox} is dynamically linked; fix: apt-get install busybox-static")
    dirmode, exe = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o755
    files: list[tuple[str, int, bytes]] = [("bin", dirmode, b""), ("modules", dirmode, b""),
                                           ("bin/busybox", exe, bb), ("init", exe, init.encode()),
                                           ("bin/proxy-relay", exe, PROXY_RELAY.encode())]
    for name in order:
        with open(index[name], "rb") as fh:
            files.append((f"modules/{name}.ko", stat.S_IFREG | 0o644, fh.read()))
    files.append(("modules/order", stat.S_IFREG | 0o644, "".join(f"{m}\n" for m in order).encode()))
    return gzip.compress(cpio(files), compresslevel=6, mtime=0)
