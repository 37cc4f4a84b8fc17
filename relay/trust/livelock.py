"""One live box per checkout: a second `--live` box on a workdir that already has one is refused.

Two live boxes in one checkout lose work: each keeps a private copy of the git index, so the second
one's commit reverts the first one's edit, and each sees the other's mask placeholders as real
files. Staged boxes (the default) each have a layer of their own and never meet.

The lock is an flock on a file in hive relay's state dir (owner-only, beyond every box's reach),
named by a hash of the workdir's real path, held by the launcher for the run's life: a launcher
that dies, even by `kill -9`, lets go of it, so there is no stale lock to clear by hand.
- a plain live box takes it exclusively, then keeps it shared, so that `--shared-live` boxes may
  join it while another plain one is still refused;
- a `--shared-live` box takes it shared;
- the file names the run that took it last, for the refusal's line.
"""

from __future__ import annotations

import errno
import fcntl
import os

from relay.host import safefs
from relay.model.errors import RefusedError
from relay.model.hashing import sha256

FIX = ("fix: drop --live (staged boxes each get their own layer of the checkout), wait for that box "
       "to end, or add --shared-live to start a second live box anyway")


def lock_path(state_dir: str, workdir: str) -> str:
    """Pure: where the lock of `workdir` (its real path) lives."""
    digest = sha256(os.fsencode(workdir)).hexdigest()[:32]
    return os.path.join(state_dir, "live", f"{digest}.lock")


def hold(state_dir: str, workdir: str, run_id: str, shared: bool) -> int:
    """Take the checkout's live lock; returns the fd to keep open for the run (close it at the end).
    Raises RefusedError naming the running box when another plain live box holds it."""
    path = lock_path(state_dir, workdir)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    try:
        if shared:
            fcntl.flock(fd, fcntl.LOCK_SH)  # a plain box holds it exclusively only while it converts
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            other = _holder(path)
            raise RefusedError(f"--live: another live box{f' (run {other})' if other else ''} is writing {workdir}; "
                               "two live boxes overwrite each other's git index and see each other's "
                               f"placeholder files; {FIX}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, run_id.encode()[:200], 0)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _holder(path: str) -> str:
    """The run id the lock file names (bounded, printable only); empty when it cannot be read."""
    try:
        data = safefs.read_file(path, 256) or b""
    except OSError:
        return ""
    text = data.decode("ascii", errors="replace")
    return "".join(c for c in text if c.isalnum() or c in "-_.")[:80]
