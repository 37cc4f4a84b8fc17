"""`invoke doctor --mode kube`: can this cluster enforce kube mode? A canary box says.

The canary is an ordinary box (the Job's pod spec, under the boxes' NetworkPolicy) whose command
tries two connections and prints what happened: one straight to a public address (must fail: the
policy allows the proxy only) and one to the proxy (must work). A CNI that ignores NetworkPolicy
lets the first through; kube mode then refuses (exit 3) unless the backend's opt-in to run without
our box is set, as everywhere else. The seccomp profile and the runtime class are checked too.

`--isolation gvisor` (issue 31) asks for the `gvisor` RuntimeClass, and a class of that name is not
proof: its handler could be runc. So the canary also says which kernel answered it: gVisor's Sentry
has its own /proc/version (release 4.4.0, a fixed build date) and its own boot log in dmesg. A box
that did not run on gVisor refuses the cluster (never silently weaker).

The decision is a pure function of the probe results (decide()); the canary runs on the cluster
(kube_run) or, in tests, under `podman kube play` (relay/modes/kube_podman.py).
"""

from __future__ import annotations

from relay.model.record import record
from relay.modes.kube_objects import PROXY_NAME, PROXY_PORT

# Public by default (a root DNS server's address: no name lookup needed, the box has no DNS).
DEFAULT_TARGET = "198.41.0.4:443"


# gVisor's Sentry: the build line its /proc/version always shows, and the first line of its boot log.
GVISOR_VERSION = "#1 SMP Sun Jan 10 15:06:54 PST 2016"
GVISOR_BOOT = "Starting gVisor"


def canary_script(target: str = DEFAULT_TARGET, proxy: str = f"{PROXY_NAME}:{PROXY_PORT}") -> str:
    """bash: `direct=ok|fail` and `proxy=ok|fail`, each a plain TCP connect with a 5 s limit, and
    `kernel=gvisor|other` (read by decide() only when gVisor was asked for)."""
    dhost, dport = target.rsplit(":", 1)
    phost, pport = proxy.rsplit(":", 1)
    return (f"if timeout 5 bash -c 'exec 3<>/dev/tcp/{dhost}/{dport}' 2>/dev/null; then echo direct=ok; "
            "else echo direct=fail; fi\n"
            f"if timeout 5 bash -c 'exec 3<>/dev/tcp/{phost}/{pport}' 2>/dev/null; then echo proxy=ok; "
            "else echo proxy=fail; fi\n"
            f"if grep -qF '{GVISOR_VERSION}' /proc/version 2>/dev/null || "
            f"dmesg 2>/dev/null | head -1 | grep -qF '{GVISOR_BOOT}'; then echo kernel=gvisor; "
            "else echo kernel=other; fi")


@record
class CanaryProbe:
    """What the cluster showed: None for a check that did not run (the canary never started)."""

    direct_egress: bool | None
    proxy_reachable: bool | None
    seccomp_profile: bool
    runtime_class: bool | None = None  # None: no runtime class asked for
    gvisor: bool | None = None  # the canary ran on gVisor's kernel; None: gVisor not asked for


@record
class Verdict:
    """The canary's answer: the exit code (0 or refused) and the lines that say why."""

    exit_code: int  # 0 or errors.EXIT_REFUSED
    lines: tuple[str, ...]


def parse(log: str, seccomp_profile: bool, runtime_class: bool | None = None, gvisor: bool = False) -> CanaryProbe:
    """The canary's log as probe results (the last word for each check wins; missing is None). With
    `gvisor` asked, a kernel the canary did not name as gVisor's is not gVisor's."""
    found: dict[str, bool] = {}
    for line in log.splitlines():
        key, _, value = line.strip().partition("=")
        if key in ("direct", "proxy") and value in ("ok", "fail"):
            found[key] = value == "ok"
        elif key == "kernel" and value in ("gvisor", "other"):
            found[key] = value == "gvisor"
    return CanaryProbe(found.get("direct"), found.get("proxy"), seccomp_profile, runtime_class,
                       found.get("kernel", False) if gvisor else None)


def decide(probe: CanaryProbe, backend: str, opt_in: str, opted_in: bool) -> Verdict:
    """Refuse what the cluster cannot enforce. The opt-in waives only the NetworkPolicy check
    (the box then relies on the proxy settings alone, as the backend's unsandboxed opt-in says);
    a missing proxy, seccomp profile or runtime class refuses regardless: the boxes would not run."""
    from relay.model.errors import EXIT_REFUSED

    lines: list[str] = []
    refused = False
    if probe.direct_egress is None or probe.proxy_reachable is None:
        return Verdict(EXIT_REFUSED, ("MISS canary: it did not report (did the pod start?); fix: kubectl describe "
                                      "the canary pod in its namespace",))
    if probe.direct_egress:
        if opted_in:
            lines.append(f"WARN network policy: NOT enforced (the canary reached a public address directly); "
                         f"{opt_in}=1 is set, so {backend} runs with egress pinned by proxy settings only")
        else:
            refused = True
            lines.append(f"MISS network policy: NOT enforced (the canary reached a public address directly); fix: "
                         f"use a CNI that enforces NetworkPolicy (Calico, Cilium), or set {opt_in}=1 to accept "
                         "that the boxes can bypass the proxy")
    else:
        lines.append("ok   network policy: enforced (no direct route out)")
    if probe.proxy_reachable:
        lines.append("ok   proxy: reachable from a box")
    else:
        refused = True
        lines.append("MISS proxy: a box cannot reach it; fix: check that the CNI allows pod-to-pod traffic on port "
                     f"{PROXY_PORT} and that the proxy pod is ready")
    if probe.seccomp_profile:
        lines.append("ok   seccomp profile: present on the node")
    else:
        refused = True
        lines.append("MISS seccomp profile: not on the node; fix: copy the profile (`--dry-run --json` key "
                     "kube.seccomp_profile names it) under /var/lib/kubelet/seccomp/ on every node")
    if probe.runtime_class is False:
        refused = True
        lines.append("MISS runtime class: not found; fix: create it, or unset HIVE_RELAY_KUBE_RUNTIME_CLASS")
    elif probe.runtime_class:
        lines.append("ok   runtime class: present")
    if probe.gvisor is False:
        refused = True
        lines.append("MISS gvisor: the canary box did not run on gVisor's kernel (the runtime class is missing or its "
                     "handler is not runsc); fix: install gVisor on the nodes and a RuntimeClass `gvisor` with handler "
                     "runsc (https://gvisor.dev/docs/user_guide/containerd/quick_start/), or drop --isolation gvisor")
    elif probe.gvisor:
        lines.append("ok   gvisor: the canary box runs on gVisor's kernel")
    return Verdict(EXIT_REFUSED if refused else 0, tuple(lines))
