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
    """How a box is enforced (see relay/policy/tiers.py for which one a host gets, and why not)."""

    PROCESS = "process"  # Landlock + seccomp + rlimits, no namespaces
    SUPERVISED = "supervised"  # bubblewrap: all namespaces, seccomp, the host-side proxy
    CONTAINER = "container"  # podman or docker, the same policy
    GVISOR = "gvisor"  # runsc: gVisor's user-space kernel under the same policy; only on explicit request
    VM = "vm"  # a KVM microVM (issue 20): only on explicit request, refused where KVM cannot run it
    UNSANDBOXED = "unsandboxed"  # the CLI's own sandbox only, behind an explicit opt-in


class Mode(_Word):
    """Where the box runs: on this host (bwrap), in a container engine here, or on a cluster."""

    LOCAL = "local"
    CONTAINER = "container"
    KUBE = "kube"


MODES = tuple(m.value for m in Mode)  # the `--mode` words, in the order --help and completion show them


class HostStep(_Word):
    """One host-side step a launch makes before its box starts (relay/plan/host_steps.py), undone by
    the janitor in reverse order."""

    EXIT_WATCH = "exit-watch"  # a live run's snapshot of what in the workdir runs on the host later
    RUN_DIR = "run-dir"  # the private run dir (its tmp, the git excludes, the control socket's place)
    GIT_DIR = "git-dir"  # the private git dir: mount points and copies of the state files
    AGENT_STATE = "agent-state"  # the copy of the agent's state dirs the box works on
    SYNC_FILES = "sync-files"  # the copies of the synced files
    PASSWD = "passwd"  # a root caller's box user: passwd and group files of its own
    PLACEHOLDERS = "placeholders"  # placeholder files for missing protected paths (shared, counted)
    GUARD = "guard"  # the guarded settings files, as they were
    CGROUP = "cgroup"  # the run's cgroup


class RefreshBody(_Word):
    """How a login's refresh grant is posted to its token endpoint (relay/trust/logins.py)."""

    JSON = "json"  # {grant_type, refresh_token, client_id} as JSON: claude's and OpenAI's endpoints
    FORM = "form"  # application/x-www-form-urlencoded, RFC 6749's own form: Google's endpoint


class MountKind(_Word):
    """One filesystem operation in the box (relay/policy/fsplan.py's Mount)."""

    RO_BIND = "ro-bind"
    BIND = "bind"
    PRIVATE_BIND = "private-bind"  # a writable bind of a per-run dir: like tmpfs, no host state
    TMPFS = "tmpfs"
    MASK_FILE = "mask-file"
    MASK_DIR = "mask-dir"
    DEV = "dev"
    PROC = "proc"


class WorkdirMode(_Word):
    """Where the box's writes to the workdir land (relay/trust/staged.py, relay/plan/resolve.py `_workdir_mode`)."""

    STAGED = "staged"  # a private copy-on-write layer, reviewed and applied from the host (the default)
    LIVE = "live"  # the checkout itself (`--live`, or `workdir: live` in the user config)
    PATCHES = "patches"  # kube: the boxes run on the cluster; each one's changes come back as a patch file


class LimitsMethod(_Word):
    """How memory and process limits are enforced (the banner says which)."""

    CGROUP_V2 = "cgroup-v2"
    CGROUP_V1 = "cgroup-v1"
    RLIMIT = "rlimit"


class EngineKind(_Word):
    PODMAN = "podman"
    DOCKER = "docker"


class KeyClass(_Word):
    """What one key of an agent's settings file does on the host when the CLI next starts there
    (config/settings/*.yaml). Only DATA comes back from a box live; every other class is review."""

    DATA = "data"  # theme, model, counters, tips shown, onboarding flags: runs and widens nothing
    COMMAND = "command"  # a program the CLI runs (hooks, helpers, status lines, formatters)
    ENDPOINT = "endpoint"  # where requests (and the key) go: base URLs, providers, telemetry
    GRANT = "grant"  # a permission, approval mode, sandbox setting or path the agent may use
    ENV = "env"  # environment variables the CLI sets for itself or its tools
    TRUST = "trust"  # trust of a directory or project
    CODE = "code"  # code the CLI loads: MCP servers, plugins, extensions, skills, its own version
    STEER = "steer"  # text or files put into the model's context (instructions, memory, agents)
    POLICY = "policy"  # managed/enterprise policy and server-side feature gates
    CREDENTIAL = "credential"  # a login, key or credential store


class ExitChoice(_Word):
    """The answers at a staged run's interactive exit prompt (relay/ui/staged_exit.py)."""

    APPLY = "apply"  # what is not flagged lands; flagged entries and conflicts stay staged
    REVIEW = "review"  # the summary and the diff, then the question again
    KEEP = "keep"  # the default (Enter, Ctrl-C, end of input): review later with `changes RUN`
    DISCARD = "discard"  # after a y/N confirmation: the whole layer goes


class LoginHold(_Word):
    """How a credential file of the agent's state is held in this run (relay/model/credential_files.py)."""

    MASKED = "masked"  # the box's copy holds placeholders of the same shape; the host's file stays the truth
    IN_BOX = "in_box"  # copied as it is, under HIVE_RELAY_LOGIN_IN_BOX_<BACKEND>=1 (said in the banner)
