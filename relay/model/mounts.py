"""One filesystem operation in the box (Mount) and one granted path (Grant): what the planner decides and every renderer reads."""

from __future__ import annotations

from relay.model.record import record
from relay.model.vocab import MountKind


@record
class Mount:
    """One filesystem operation in the box.

    kinds: ro-bind, bind, tmpfs, mask-file, mask-dir, dev, proc, and private-bind (a writable
    bind of a per-run directory that is deleted afterwards, so like tmpfs it holds no host state).
    """

    kind: MountKind
    dst: str
    src: str | None = None
    size: int | None = None  # tmpfs (and dev: its /dev/shm) only: bytes, so a disk fill cannot eat the host's memory


@record
class Grant:
    """A path of the host the user or profile lets into the box, read-only or writable."""

    path: str
    writable: bool
