"""The box's seccomp policy rendered as an OCI profile for podman/docker (container mode).

The engine's default profile is an allowlist (default ERRNO). We keep it and take away what the
local box's filter denies, so a container is never looser than the default and matches local mode:

- syscalls the policy always denies leave the allowlist (EPERM for them, as in local mode);
- `socket` is re-allowed only for families other than AF_UNIX/AF_VSOCK, which get EPERM;
- `ioctl` is re-allowed for every request except TIOCSTI/TIOCLINUX/TIOCSETD, which get EPERM;
- `clone` is re-allowed only without CLONE_NEWUSER; `clone3` falls to ENOSYS (libc falls back).

OCI runtimes OR together two comparisons on the same argument (libseccomp cannot AND them), so
"anything but these values" is written as a set of masked-equality prefixes, each its own rule.
Every comparison masks the low 32 bits, which is what the kernel reads for these int arguments:
high garbage bits cannot turn a refused value into an allowed one.
"""

from __future__ import annotations

import errno
import json

from relay.render.seccomp_bpf import AF_UNIX, AF_VSOCK, CLONE_NEWUSER, LOW32, TTY_DENIED, SeccompPolicy

DEFAULT_PROFILES = ("/usr/share/containers/seccomp.json", "/etc/containers/seccomp.json")
AF_MAX = 64  # families at or above this do not exist; they stay refused
EPERM = errno.EPERM


def prefix_cover(excluded: set[int], bits: int = 32, limit: int | None = None) -> list[tuple[int, int]]:
    """(mask, value) pairs whose union is [0, limit or 2**bits) minus `excluded`."""
    top = 1 << bits
    limit = top if limit is None else limit
    out: list[tuple[int, int]] = []

    def walk(base: int, size: int) -> None:
        if base >= limit:
            return
        inside = base + size <= limit and not any(base <= v < base + size for v in excluded)
        if inside:
            out.append(((top - size) & (top - 1), base))
        elif size > 1:
            walk(base, size // 2)
            walk(base + size // 2, size // 2)

    walk(0, top)
    return out


def _masked(index: int, mask: int, value: int) -> dict:
    return {"index": index, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


def _allow_except(name: str, index: int, excluded: set[int], limit: int | None = None) -> list[dict]:
    return [{"names": [name], "action": "SCMP_ACT_ALLOW", "args": [_masked(index, mask, value)]}
            for mask, value in prefix_cover(excluded, limit=limit)]


def _errno_for(name: str, index: int, values: tuple[int, ...]) -> list[dict]:
    return [{"names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM, "args": [_masked(index, LOW32, v)]}
            for v in values]


def default_profile() -> dict:
    """The engine's shipped default profile, or a minimal allow-all base when none is on disk
    (docker compiles its default in; our rules then still apply, as in local mode)."""
    for path in DEFAULT_PROFILES:
        try:
            with open(path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            continue
    return {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}


def render(policy: SeccompPolicy, base: dict) -> dict:
    """Merge the policy into a copy of `base` (an OCI seccomp profile)."""
    import copy  # here: a launch whose profile is memoized (relay/modes/container_runner.py) never renders

    profile = copy.deepcopy(base)
    restricted = set(policy.denied_syscalls) | {"socket", "ioctl"}
    if policy.deny_new_userns:
        restricted |= {"clone", "clone3", "unshare"}
    rules = []
    for rule in profile.get("syscalls", []):
        if rule.get("action") == "SCMP_ACT_ALLOW":
            names = [n for n in rule.get("names", []) if n not in restricted]
            if not names:
                continue
            rule = {**rule, "names": names}
        rules.append(rule)
    # Denials first and explicit (EPERM, not the profile's default errno), then the narrowed allows.
    rules += [{"names": sorted(policy.denied_syscalls), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}]
    families = tuple(f for f, on in ((AF_UNIX, policy.deny_af_unix_socket), (AF_VSOCK, policy.deny_af_vsock)) if on)
    rules += _errno_for("socket", 0, families)
    rules += _allow_except("socket", 0, set(families), limit=AF_MAX)
    requests = TTY_DENIED if policy.deny_tty_injection else ()
    rules += _errno_for("ioctl", 1, requests)
    rules += _allow_except("ioctl", 1, set(requests))
    if policy.deny_new_userns:
        rules += [{"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
                   "args": [_masked(0, CLONE_NEWUSER, CLONE_NEWUSER)]},
                  {"names": ["clone"], "action": "SCMP_ACT_ALLOW", "args": [_masked(0, CLONE_NEWUSER, 0)]},
                  {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
                  {"names": ["unshare"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM}]
    if profile.get("defaultAction") == "SCMP_ACT_ALLOW":
        rules = [r for r in rules if r["action"] != "SCMP_ACT_ALLOW"]
    profile["syscalls"] = rules
    if policy.native_arch_only:
        # The engine's default lets each host arch's compat ABIs in (x86_64: i386 and x32). Through
        # them the argument rules above do not hold: i386's socketcall(SYS_SOCKET) takes its family
        # from memory, which no filter reads, so AF_UNIX came back. Native only, as local mode's
        # filter; a foreign-arch call is refused by the engine's bad-arch action. It also compiles
        # one filter instead of three (~15 ms of every container start).
        profile["archMap"] = [{**entry, "subArchitectures": []} for entry in profile.get("archMap") or []]
        profile.pop("architectures", None)
    return profile
