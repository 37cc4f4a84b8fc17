"""The vocabularies the plan is made of, as enums: a misspelt tier or mount kind is a NameError at
import time, not a silently false comparison in the runner.

Each member *is* its string (a `str` subclass whose str() and format() are the plain value), so
`--dry-run --json`, the golden plans and every argv stay byte for byte what they were.
"""

from __future__ import annotations

from enum import Enum


class _Word(str, Enum):
    __str__ = str.__str__
    __format__ = str.__format__


class Tier(_Word):
    """How a box is enforced (see relay/tiers.py for which one a host gets, and why not)."""

    PROCESS = "process"  # Landlock + seccomp + rlimits, no namespaces
    SUPERVISED = "supervised"  # bubblewrap: all namespaces, seccomp, the host-side proxy
    CONTAINER = "container"  # podman or docker, the same policy
    VM = "vm"  # a KVM microVM (issue 20): only on explicit request, refused where KVM cannot run it
    UNSANDBOXED = "unsandboxed"  # the CLI's own sandbox only, behind an explicit opt-in


class MountKind(_Word):
    """One filesystem operation in the box (relay/fsplan.py's Mount)."""

    RO_BIND = "ro-bind"
    BIND = "bind"
    PRIVATE_BIND = "private-bind"  # a writable bind of a per-run dir: like tmpfs, no host state
    TMPFS = "tmpfs"
    MASK_FILE = "mask-file"
    MASK_DIR = "mask-dir"
    DEV = "dev"
    PROC = "proc"


class LimitsMethod(_Word):
    """How memory and process limits are enforced (the banner says which)."""

    CGROUP_V2 = "cgroup-v2"
    CGROUP_V1 = "cgroup-v1"
    RLIMIT = "rlimit"


class EngineKind(_Word):
    PODMAN = "podman"
    DOCKER = "docker"
