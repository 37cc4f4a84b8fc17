"""Render a plan into a podman/docker `run` argv for container mode (nothing is run here).

Same policy as the local box, expressed in the engine's terms: the image's root read-only, the
host visible only through the plan's binds (workdir, home grants, protected paths read-only,
deny-listed paths masked), no capabilities, no network but the egress listener the launcher opens
inside the container's namespace, the box's seccomp rules merged into the engine's default
profile, and pids/memory limits.

`--isolation gvisor` (issue 31) runs the same container on gVisor's runsc (`podman --runtime runsc`),
so the agent's kernel is the Sentry, not the host's. What differs, and why (docs/isolation.md):
runsc runs with `network=none` (gVisor's own stack, a loopback only: no listener of ours can be
opened in it from the host), so the proxy's unix socket is bound in and the box's first process
after the entrypoint is local mode's gvisor init (relay/box/gvisor_init.py, run by the image's
python3), which binds the proxy port on that loopback, relays to the socket, and starts the agent
under the plan's seccomp program (the Sentry enforces it). The OCI seccomp profile is not passed:
runsc ignores it (without `--oci-seccomp`), and applied to the init it would refuse the relay's
AF_UNIX socket.
"""

from __future__ import annotations

from collections.abc import Iterable

from relay.model.limits import Limits
from relay.model.mounts import Mount
from relay.model.record import record
from relay.model.vocab import MountKind
from relay.render import gvisor_oci

CTL_DIR = "/run/hive-relay/ctl"  # in the container: the go FIFO the entrypoint waits on
ENTRYPOINT = "/opt/hive-relay/bin/container-entrypoint"
IMAGE_PATH = "/opt/hive-relay/npm/node_modules/.bin:/usr/local/bin:/usr/bin:/bin"
HOST_KINDS = (MountKind.BIND, MountKind.RO_BIND, MountKind.PRIVATE_BIND)
# Binds the container does not get: the host root, and the kernel filesystems the engine provides.
SKIPPED_KINDS = (MountKind.DEV, MountKind.PROC)
BOX_PYTHON = "/usr/bin/python3"  # the image's (relay/modes/image_tag.py BASE_PACKAGES): runs the gvisor init


@record
class ContainerRun:
    """The engine-facing facts of one container launch (in the plan, so --dry-run shows them)."""

    engine: str
    kind: str  # podman | docker
    rootless: bool
    name: str
    image: str
    user: str
    pidfile: str | None
    ctl_dir: str | None
    seccomp_profile: str | None
    limit_flags: tuple[str, ...]
    # --isolation gvisor: the OCI runtime (runsc's path) and its flags; None for the engine's default.
    runtime: str | None = None
    runtime_flags: tuple[str, ...] = ()
    # --isolation gvisor: host paths bound into the box for its init (relay/box/gvisor_init.py): the init
    # itself, the agent's seccomp program and the proxy's unix socket (None: a box without network).
    init_script: str | None = None
    seccomp_bpf: str | None = None
    proxy_socket: str | None = None

    def rm_argv(self) -> list[str]:
        return [self.engine, "rm", "-f", "-t", "0", self.name] if self.kind == "podman" else \
            [self.engine, "rm", "-f", self.name]


def uses_rlimits(kind: str, rootless: bool, cgroup: str | None, gvisor: bool = False) -> bool:
    """Engines enforce pids/memory with cgroups; rootless podman cannot on cgroup v1 (it ignores
    the flags with a warning), so there the same numbers become rlimits. Rootless runsc runs with
    `ignore-cgroups` (it cannot set them up), so there too, on any cgroup version; the Sentry
    enforces them on the processes it runs."""
    return kind == "podman" and rootless and (cgroup != "v2" or gvisor)


def limit_flags(kind: str, rootless: bool, cgroup: str | None, limits: Limits, nofile: int,
                gvisor: bool = False) -> tuple[tuple[str, ...], str]:
    """(flags, method): see uses_rlimits."""
    flags = ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={limits.pids}:{limits.pids}"]
    if uses_rlimits(kind, rootless, cgroup, gvisor):
        flags += ["--ulimit", f"data={limits.memory}:{limits.memory}"]
        return tuple(flags), "rlimit (podman --ulimit)"
    flags += ["--pids-limit", str(limits.pids), "--memory", str(limits.memory), "--memory-swap", str(limits.memory)]
    return tuple(flags), f"cgroup ({kind})"


def runsc_flags(platform: str, rootless: bool) -> tuple[str, ...]:
    """podman's `--runtime-flag`s for runsc, local mode's choices (relay/host/runsc_host.base_flags):
    the host's platform (systrap, else ptrace; never kvm), no directfs (it truncated a file in a
    read-only bind before answering EROFS), gVisor's own network stack with a loopback only
    (`network=none`: as root, runsc refuses podman's `--network none` otherwise, "cannot run with
    network enabled in root network namespace"), host unix sockets reachable only where a mount
    shows one (the proxy's), and rootless no cgroup setup (runsc cannot make them there)."""
    flags = [f"platform={platform}", "directfs=false", "network=none", "host-uds=open"]
    if rootless:
        flags.append("ignore-cgroups")
    return tuple(x for f in flags for x in ("--runtime-flag", f))


def gvisor_volumes(run: ContainerRun) -> list[str]:
    """The gvisor init's binds, at local mode's box paths (relay/render/gvisor_oci.py): read-only but
    the socket (connect() needs write on it)."""
    assert run.init_script and run.seccomp_bpf
    args = ["--volume", f"{run.init_script}:{gvisor_oci.box_init(run.init_script)}:ro",
            "--volume", f"{run.seccomp_bpf}:{gvisor_oci.BOX_SECCOMP}:ro"]
    if run.proxy_socket:
        args += ["--volume", f"{run.proxy_socket}:{gvisor_oci.BOX_SOCKET}:rw"]
    return args


def gvisor_init_argv(run: ContainerRun, listen: str | None) -> list[str]:
    """What the entrypoint execs after its deny-list check: the init, then `--`, then the agent's argv."""
    assert run.init_script
    return [*gvisor_oci.init_words(run.init_script, BOX_PYTHON), gvisor_oci.BOX_SOCKET if run.proxy_socket else "-",
            listen if run.proxy_socket and listen else "-", gvisor_oci.BOX_SECCOMP, "--"]


def staged_volume(src: str, dst: str, upper: str, work: str) -> list[str]:
    """--staged: a host dir as podman's overlay volume with an upper dir of ours (relay/trust/staged.py),
    which podman keeps, unlike a plain `:O`'s. podman passes no metacopy or redirect_dir option, so
    the kernel's defaults hold (relay/modes/container_runner.py refuses when they are on)."""
    return ["--volume", f"{src}:{dst}:O,upperdir={upper},workdir={work}"]


def staged_binds(mounts: Iterable[Mount], workdir: str) -> list[Mount]:
    """The writable binds inside the workdir (the .git allowlist's objects/, refs/, ...). In a local
    box they are resolved through the overlay; an engine resolves a volume's source on the host,
    so each becomes an overlay volume of its own, its upper dir at its place in the run's upper
    layer: the layout, and so the review and the git apply, are local mode's."""
    inside = workdir.rstrip("/") + "/"
    return [m for m in mounts if m.kind == MountKind.BIND and m.src and m.src.startswith(inside) and m.src == m.dst]


def staged_work(work: str, i: int) -> str:
    """The scratch dir of the i-th writable bind's overlay (next to the workdir's own)."""
    return f"{work}-{i}"


def volume_args(mounts: Iterable[Mount], home: str, kind: str = "podman",
                staged: tuple[str, str, str] | None = None) -> list[str]:
    """Host binds become volumes, private dirs sized tmpfs. Deny-list masks apply everywhere, as
    in local mode: over the host binds they hide secrets, over the image's own files (its
    /etc/shadow) they keep the entrypoint's guard meaningful for every path. `staged` is
    (workdir, upper, work): the workdir's bind, and every writable bind inside it, become staged
    overlay volumes; the read-only binds and masks inside stack on top (podman orders mounts by
    destination)."""
    mounts = [m for m in mounts if m.kind not in SKIPPED_KINDS and not (m.kind == MountKind.RO_BIND and m.dst == "/")]
    inner = {m.dst: i for i, m in enumerate(staged_binds(mounts, staged[0]))} if staged else {}
    args: list[str] = []
    for m in mounts:
        if staged is not None and m.kind == MountKind.BIND and m.dst == staged[0] and m.src:
            args += staged_volume(m.src, m.dst, staged[1], staged[2])
        elif staged is not None and m.kind == MountKind.BIND and m.dst in inner and m.src:
            rel = m.dst[len(staged[0].rstrip("/")) + 1:]
            args += staged_volume(m.src, m.dst, f"{staged[1]}/{rel}", staged_work(staged[2], inner[m.dst]))
        elif m.kind in HOST_KINDS and m.src:
            suffix = "ro" if m.kind == MountKind.RO_BIND else "rw"
            args += ["--volume", f"{m.src}:{m.dst}:{suffix}"]
        elif m.kind == MountKind.TMPFS:
            size = f",size={m.size}" if m.size else ""
            # podman's U makes $HOME the container user's; docker has no U, so its $HOME is sticky 1777.
            mode = ("mode=0700,U" if kind == "podman" else "mode=1777") if m.dst == home else "mode=1777"
            args += ["--tmpfs", f"{m.dst}:rw,nosuid,nodev{size},{mode}"]
        elif m.kind == MountKind.MASK_FILE:
            args += ["--volume", f"/dev/null:{m.dst}:ro"]
        elif m.kind == MountKind.MASK_DIR:
            # podman's tmpfs copies up what lies beneath it (tmpcopyup) unless told not to: a mask
            # over a dir of a volume would show the very files it hides. docker never copies up.
            copyup = ",notmpcopyup" if kind == "podman" else ""
            args += ["--tmpfs", f"{m.dst}:ro,nosuid,nodev,size=4k,mode=0555{copyup}"]
    return args


def build(
    *,
    run: ContainerRun,
    backend: str,
    workdir: str,
    home: str,
    mounts: Iterable[Mount],
    env_set: dict[str, str],
    env_pass: Iterable[str],
    interactive: bool,
    tty: bool,
    argv: list[str],
    staged: tuple[str, str] | None = None,
    listen: str | None = None,
) -> list[str]:
    """Read-only root, no capabilities, no network but our proxy, the same binds as local mode."""
    # Engine warnings (e.g. rootless podman's "/ is not a shared mount") would land in the agent's
    # terminal on every launch; errors still do.
    # --pull=never: the image is ours, built locally (relay/modes/image.py); a missing one must fail at
    # once, never be fetched from whatever answers for its registry name (localhost/...).
    args = [run.engine, "--log-level=error"]
    if run.runtime:
        args += ["--runtime", run.runtime, *run.runtime_flags]
    args += ["run", "--rm", "-i", "--pull=never", "--name", run.name]
    if interactive and tty:
        args.append("-t")
    args += ["--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--network", "none",
             "--ipc", "private", "--user", run.user, "--workdir", workdir,
             "--label", f"hive-relay.backend={backend}", "--entrypoint", ENTRYPOINT]
    if run.kind == "podman":
        # --http-proxy: podman copies the host's proxy variables in by default; the box's own win.
        args += ["--http-proxy=false", "--read-only-tmpfs=false"]
        if run.rootless:
            args += ["--userns", "keep-id"]
        if run.pidfile:
            args += ["--pidfile", run.pidfile]
    if run.seccomp_profile:
        args += ["--security-opt", f"seccomp={run.seccomp_profile}"]
    args += list(run.limit_flags)
    args += volume_args(mounts, home, run.kind, (workdir, *staged) if staged else None)
    if run.runtime:
        args += gvisor_volumes(run)
    elif run.ctl_dir:
        args += ["--volume", f"{run.ctl_dir}:{CTL_DIR}:ro"]
    for name in sorted(env_set):
        args += ["--env", f"{name}={env_set[name]}"]
    for name in env_pass:
        args += ["--env", name]
    args += [run.image, *(gvisor_init_argv(run, listen) if run.runtime else []), *argv]
    return args
