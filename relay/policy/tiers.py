"""Which tier, and why not: the one place that turns host facts into what can be enforced here.

The planner (choose_tier), the launcher's profile fallback (cli) and `invoke doctor` all ask
this module, so a reason given for refusing a tier reads the same wherever it is shown. Pure:
facts and requests in, a choice or a reason out.
"""

from __future__ import annotations

from collections.abc import Mapping

from relay.config.profiles import resolve_profile
from relay.model.backend import Backend, Matrix
from relay.model.errors import RefusedError, UsageError
from relay.model.host_facts import HostFacts
from relay.model.record import record
from relay.model.vocab import Tier

TYPE_CHECKING = False  # avoids importing typing at launch
if TYPE_CHECKING:  # what this module reads of plan.Request (no import: resolve is a layer above)
    from typing import Protocol

    class Request(Protocol):
        mode: str
        profile: str | None
        isolation: str | None

ISOLATIONS = ("auto", "process", "supervised", "gvisor", "container", "vm")
# The VM tier's accelerators: KVM, or qemu's TCG (the CPU emulated: the same guest and boundary, a boot
# of tens of seconds) only when asked by name. relay/config/load.py CONFIG_VM_ACCELS keeps in step.
VM_ACCELS = ("kvm", "tcg")


def vm_accel(request: Request) -> str:
    """The VM tier's accelerator for this request: --vm-accel (already merged with the user config's
    `vm: {accel: ...}` by the CLI), else kvm. Never tcg unless asked. A bad word, or --vm-accel on
    another tier, is a usage error (exit 2)."""
    asked = getattr(request, "vm_accel", None)
    if asked is None:
        return "kvm"
    if asked not in VM_ACCELS:
        raise UsageError(f"--vm-accel {asked!r}: choose one of {', '.join(VM_ACCELS)}")
    if (request.isolation or "auto") != "vm":
        raise UsageError("--vm-accel applies to --isolation vm only; fix: add --isolation vm, or drop --vm-accel")
    return asked
DEFAULT_PROFILE = "default"  # fail-closed: no network, no backend state; what every fallback lands on


@record
class TierChoice:
    """The tier and profile one launch runs at, and the notes that say why (shown with the plan)."""

    tier: Tier
    profile: str
    notes: tuple[str, ...] = ()


def supervised_ok(facts: HostFacts) -> bool:
    """The bwrap box needs a working bwrap and seccomp."""
    return facts.bwrap is not None and facts.bwrap_error is None and facts.seccomp


def process_error(facts: HostFacts) -> str | None:
    """Why the process tier (Landlock + seccomp + limits) cannot run here, or None."""
    if facts.landlock_abi < 1:
        return "Landlock is unavailable (needs Linux 5.13+ with landlock in the LSM list)"
    if not facts.seccomp:
        return facts.seccomp_error or "seccomp is unavailable"
    if facts.uid == 0:
        return "the process tier cannot hide root-owned secrets from a root caller; run as a normal user"
    return None


def missing_supervised(facts: HostFacts) -> str:
    """Why the supervised box cannot run here, with the fix (only asked when it cannot)."""
    if facts.bwrap is None:
        return "bubblewrap is not installed; fix: apt-get install bubblewrap (or dnf install bubblewrap)"
    if facts.bwrap_error:
        fix = ("sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or add an AppArmor profile for bwrap"
               if facts.userns_restricted else "check that user namespaces are enabled (sysctl user.max_user_namespaces)")
        return f"{facts.bwrap_error}; fix: {fix}"
    return facts.seccomp_error or "seccomp is unavailable"


def auto_pick(facts: HostFacts) -> str:
    """What `--isolation auto` lands on here, in doctor's words."""
    if supervised_ok(facts):
        return "agent at supervised"
    return "default at process (with a note)" if process_error(facts) is None else "refused (exit 3)"


def opted_in(backend: Backend, matrix: Matrix, caller_env: Mapping[str, str]) -> bool:
    """The user's opt-in to run this backend without the box (its variable, or the user config)."""
    return caller_env.get(backend.opt_in) == "1" or backend.name in matrix.allow_unsandboxed


def profile_fallback(asked: str | None, planned: str, problem: str) -> tuple[str, str] | None:
    """(profile, note) when a plan's box failed its probe and the default profile may stand in:
    only for a profile hive relay picked, never one the user asked for (that one refuses)."""
    if asked is not None or planned == DEFAULT_PROFILE:
        return None
    return DEFAULT_PROFILE, (f"the {planned} profile failed its probe here ({problem}); using the fail-closed "
                             "default profile")


def choose_tier(request: Request, facts: HostFacts, backend: Backend, matrix: Matrix,
                caller_env: Mapping[str, str]) -> TierChoice:
    """Pick the tier and profile. Explicit choices are fail-closed: they run as asked or refuse."""
    isolation = request.isolation or "auto"
    if isolation not in ISOLATIONS:
        raise UsageError(f"--isolation {isolation!r}: choose one of {', '.join(ISOLATIONS)}")
    if isolation != "vm":
        vm_accel(request)  # --vm-accel without --isolation vm: a usage error, never silently ignored
    if request.mode in ("container", "kube") or isolation == "container":
        return _container(request, isolation, facts)
    if isolation == "vm":
        return _vm(request, facts)
    if isolation == "gvisor":
        return _gvisor(request, facts)
    if isolation == "supervised" or (isolation == "auto" and supervised_ok(facts)):
        if not supervised_ok(facts):
            raise RefusedError(f"--isolation supervised cannot be enforced: {missing_supervised(facts)}")
        return TierChoice(Tier.SUPERVISED, request.profile or "agent")
    return _without_box(request, isolation, facts, backend, matrix, caller_env)


def _container(request: Request, isolation: str, facts: HostFacts) -> TierChoice:
    """The engine's tier. `--isolation gvisor` keeps it, on runsc (container mode: `podman --runtime
    runsc`, which needs a runsc here that passed its probe, or it refuses; kube mode: the pods'
    `runtimeClassName: gvisor`, which the cluster's canary checks, not this host)."""
    if request.mode == "local" and isolation == "container":
        raise UsageError("--isolation container needs --mode container")
    if isolation in ("process", "supervised", "vm"):
        raise UsageError(f"--isolation {isolation} is a local-mode tier; fix: drop it, or use --mode local")
    if isolation == "gvisor" and request.mode == "container":
        error = gvisor_error(facts)
        if error is not None:
            raise RefusedError(f"--isolation gvisor cannot be enforced in container mode: {error}")
    return TierChoice(Tier.CONTAINER, request.profile or "agent")


def _vm(request: Request, facts: HostFacts) -> TierChoice:
    """Only ever on explicit request (auto never lands here: a VM is slower to start). Fail-closed:
    a host where KVM cannot run the guest refuses with the fix, like every other tier."""
    vm_accel(request)
    if facts.vm_error is not None:
        raise RefusedError(f"--isolation vm cannot be enforced: {facts.vm_error}")
    return TierChoice(Tier.VM, request.profile or "agent")


def gvisor_error(facts: HostFacts) -> str | None:
    """Why the gvisor tier cannot run here (with the fix), or None: a runsc that passed its probe run
    (relay/host/runsc_host.py), and seccomp to compile the agent's filter (the Sentry loads it)."""
    if facts.runsc_error is not None:
        return facts.runsc_error
    if not facts.seccomp:
        return facts.seccomp_error or "seccomp is unavailable (the agent's filter cannot be compiled)"
    return None


def _gvisor(request: Request, facts: HostFacts) -> TierChoice:
    """Only ever on explicit request (auto never lands here: a sandbox start costs ~150 ms more than
    bwrap's). Fail-closed: no runsc, or one that fails its probe, refuses; it never falls back."""
    error = gvisor_error(facts)
    if error is not None:
        raise RefusedError(f"--isolation gvisor cannot be enforced: {error}")
    return TierChoice(Tier.GVISOR, request.profile or "agent")


def _without_box(request: Request, isolation: str, facts: HostFacts, backend: Backend, matrix: Matrix,
                 caller_env: Mapping[str, str]) -> TierChoice:
    """No supervised box: either the user asked for the process tier, or auto fell through."""
    missing = missing_supervised(facts) if isolation == "auto" else "--isolation process was asked for"
    if request.profile is not None and resolve_profile(request.profile, matrix.profiles).network:
        raise RefusedError(
            f"profile {request.profile!r} needs egress pinned to {backend.name}'s hosts, which only the supervised "
            f"tier enforces: {missing}"
        )
    if isolation == "auto" and request.profile is None and backend.egress and opted_in(backend, matrix, caller_env):
        return TierChoice(Tier.UNSANDBOXED, "none", (f"{backend.opt_in} is set: {backend.name} runs without the box",))
    error = process_error(facts)
    if isolation == "auto" and request.profile is None and backend.egress:
        # An agent needs its API hosts; at the process tier it would start with no network and fail.
        raise RefusedError(
            f"{backend.name} needs its API hosts, which only the supervised box can allow: {missing}. "
            f"To run {backend.name} without the box anyway, set {backend.opt_in}=1 (its own sandbox only)"
            + ("; --isolation process runs it with no network" if error is None else "")
        )
    if error is not None:
        raise RefusedError(
            f"no enforceable box on this host: {missing}; and {error}"
            + (f". To run {backend.name} without the box anyway, set {backend.opt_in}=1" if backend.egress else "")
        )
    notes: list[str] = []
    if request.profile is None:
        why = missing if isolation == "auto" else "the process tier cannot enforce egress"
        note = f"using the fail-closed default profile at the process tier: {why}"
        if backend.egress:
            note += (f"; {backend.name} needs its API hosts, which the default profile blocks; "
                     f"to run {backend.name} without the box set {backend.opt_in}=1")
        notes.append(note)
    notes.append("the process tier cannot write-protect .git/hooks and friends inside the workdir, and host "
                 "processes stay visible; install bubblewrap for the supervised box")
    return TierChoice(Tier.PROCESS, request.profile or DEFAULT_PROFILE, tuple(notes))


def choose_engine(facts: HostFacts, caller_env: Mapping[str, str]) -> str:
    """podman first (rootless, daemonless), docker otherwise; $HIVE_RELAY_ENGINE picks one."""
    wanted = caller_env.get("HIVE_RELAY_ENGINE")
    if wanted:
        path = {"podman": facts.podman, "docker": facts.docker}.get(wanted) if "/" not in wanted else wanted
        if not path:
            raise RefusedError(f"HIVE_RELAY_ENGINE={wanted}: not installed; fix: install it or unset HIVE_RELAY_ENGINE")
        return path
    if facts.podman:
        return facts.podman
    if facts.docker:
        return facts.docker
    raise RefusedError("container mode needs podman or docker; fix: apt-get install podman (or use local mode)")
