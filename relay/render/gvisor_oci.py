"""Render the gvisor tier's runsc command line and OCI runtime spec from the plan (nothing is run here).

The spec is the supervised tier's filesystem plan (relay/policy/fsplan.py) in OCI words: the host's
root read-only, the box-private tmpfs dirs, the grants, the workdir (its staged overlay included:
runsc starts inside the mount namespace that holds it), the private `.git`, the state copies, the
write protections and the deny list, in the plan's order (runsc mounts in spec order, parents first,
so a mask lands on top of the bind it masks). Three more read-only binds carry what the box's init
needs (relay/box/gvisor_init.py): the init itself, the agent's seccomp program, and the proxy's
unix socket.

Identity: the agent runs as the Sentry's uid 0 with every capability set empty and no_new_privs,
which is the caller on the host (a rootless runsc maps the caller to 0; a root caller is root). So it
owns what the caller owns in its binds, as the supervised box does (bwrap's uid 1000 of a root caller
is host root too), and without CAP_DAC_OVERRIDE the Sentry holds it to the owner bits elsewhere; the
deny list masks the system's secrets (/etc/shadow, host keys) as in every tier. No user namespace of
our own: with one (1000 mapped to root, gVisor's root to nobody), the gofer cannot open a file whose
group is unmapped (root:shadow /etc/shadow), so the mask over it fails and the box does not start.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from relay.model.limits import Limits
from relay.model.mounts import Mount
from relay.model.record import record, replace
from relay.model.vocab import MountKind

# Inside the box: where the init and what it needs are bound (read-only). /run is box-private tmpfs.
BOX_DIR = "/run/hive-relay"
BOX_INIT = f"{BOX_DIR}/gvisor-init.py"
BOX_INIT_NATIVE = f"{BOX_DIR}/gvisor-init"  # the compiled init (relay/box/gvisor_init.c)
BOX_SECCOMP = f"{BOX_DIR}/seccomp.bpf"
BOX_SOCKET = f"{BOX_DIR}/proxy.sock"
MASK_SIZE = 4096
BOX_UID = 0  # the Sentry's root, without capabilities: the caller on the host (see above)
HOSTNAME = "hive-relay"


def box_init(init: str) -> str:
    """Where the init at host path INIT is bound in the box: the Python one (a `.py`) or the compiled one."""
    return BOX_INIT if init.endswith(".py") else BOX_INIT_NATIVE


def init_words(init: str, python: str | None) -> list[str]:
    """How the box's first process starts its init: python3 (isolated, no site) on the script, or the
    compiled init itself (relay/host/native_init.py)."""
    return [python or "python3", "-I", "-S", BOX_INIT] if init.endswith(".py") else [BOX_INIT_NATIVE]


@record
class GvisorRun:
    """How one gvisor box is started: runsc and its flags, and the host paths of the run's bundle,
    runsc state, proxy socket and seccomp program (all in the run dir, which only the caller can
    open), and the in-box init's interpreter."""

    runsc: str
    platform: str
    rootless: bool
    container_id: str
    bundle: str  # the dir holding config.json
    state_root: str  # runsc --root
    init_script: str  # host path of the init: relay/box/gvisor_init.py, or the compiled one (native_init)
    python: str | None  # the box's python3 (on the host's read-only root), for the Python init
    seccomp_file: str  # written by the runner from the plan's policy
    socket: str | None  # the proxy's unix socket (None: a box without network)
    box_uid: int  # the uid the agent runs as in the box (BOX_UID)

    def moved(self, old: str, new: str) -> GvisorRun:
        """The same run with its run-dir paths under `new` instead of `old` (the verification run's dir)."""
        def move(path: str | None) -> str | None:
            return new + path[len(old):] if path and (path == old or path.startswith(old + "/")) else path

        return replace(self, bundle=move(self.bundle) or "", state_root=move(self.state_root) or "",
                       seccomp_file=move(self.seccomp_file) or "", socket=move(self.socket))

    def argv(self) -> list[str]:
        """`runsc ... run --bundle DIR ID`: the part of the plan's command before the box's own argv."""
        # --directfs=false: with directfs, runsc 20240729 truncates a file inside a read-only directory
        # bind (our own paths, .git/hooks) on open(O_TRUNC) and only then answers EROFS
        # (tests/test_memo.py); through the gofer the mount's ro is checked first.
        flags = [f"--platform={self.platform}", "--directfs=false", "--network=none", "--ignore-cgroups",
                 "--host-uds=open", *(["--rootless"] if self.rootless else [])]
        return [self.runsc, "--root", self.state_root, *flags, "run", "--bundle", self.bundle, self.container_id]

    def init_argv(self, listen: str | None) -> list[str]:
        """The box's first process: the init, then `--`, then the agent's argv (appended by the caller)."""
        return [*init_words(self.init_script, self.python), BOX_SOCKET if self.socket else "-", listen or "-",
                BOX_SECCOMP, "--"]


def _bind(dst: str, src: str, ro: bool) -> dict:
    return {"destination": dst, "type": "bind", "source": src, "options": ["rbind", "ro" if ro else "rw"]}


def _tmpfs(dst: str, size: int | None, mode: str, owner: int | None, ro: bool = False) -> dict:
    opts = (["ro"] if ro else []) + ([f"size={size}"] if size else []) + [f"mode={mode}"]
    if owner is not None:
        opts += [f"uid={owner}", f"gid={owner}"]
    return {"destination": dst, "type": "tmpfs", "source": "tmpfs", "options": opts}


def oci_mounts(mounts: Iterable[Mount], home: str, box_uid: int, moot: frozenset[str] = frozenset()) -> tuple[str, list[dict]]:
    """(the root's host path, the spec's mounts) for the plan's mounts, in order. The first mount must be
    the read-only root. $HOME's tmpfs belongs to the box user; /tmp and /var/tmp are sticky and open.

    `moot`: masks left out because the box could not open their target anyway. A rootless box is the
    caller on the host, and runsc's gofer opens every mount point as the caller: a deny-list entry the
    caller cannot read (root's /etc/shadow) would stop the box from starting, while it hides nothing
    the caller's own rights do not (the runner checks each on the host: gvisor_runner.moot_masks)."""
    mounts = list(mounts)
    if not mounts or mounts[0].kind != MountKind.RO_BIND or mounts[0].dst != "/":
        raise ValueError("the gvisor spec needs the read-only root as the plan's first mount")
    root = mounts[0].src or "/"
    out: list[dict] = []
    for m in mounts[1:]:
        if m.kind == MountKind.RO_BIND:
            out.append(_bind(m.dst, m.src or m.dst, True))
        elif m.kind in (MountKind.BIND, MountKind.PRIVATE_BIND):
            out.append(_bind(m.dst, m.src or m.dst, False))
        elif m.kind == MountKind.TMPFS:
            mine = m.dst == home
            out.append(_tmpfs(m.dst, m.size, "0755" if mine else "1777", box_uid if mine else None))
        elif m.kind in (MountKind.MASK_DIR, MountKind.MASK_FILE) and m.dst in moot:
            continue
        elif m.kind == MountKind.MASK_DIR:
            out.append(_tmpfs(m.dst, MASK_SIZE, "0555", None, ro=True))
        elif m.kind == MountKind.MASK_FILE:
            out.append(_bind(m.dst, "/dev/null", True))
        elif m.kind == MountKind.DEV:
            # runsc brings its own /dev (null, zero, full, random, urandom, tty, ptmx, pts: the Sentry's
            # devices, not the host's); shared memory gets a sized tmpfs, as in bwrap.
            if m.size:
                out.append(_tmpfs(f"{m.dst}/shm", m.size, "1777", None))
        elif m.kind == MountKind.PROC:
            out.append({"destination": m.dst, "type": "proc", "source": "proc"})
        else:
            raise ValueError(f"unknown mount kind {m.kind!r}")
    return root, out


def spec(
    run: GvisorRun, *, mounts: Sequence[Mount], home: str, args: Sequence[str], env: Mapping[str, str], cwd: str,
    terminal: bool, limits: Limits, nofile: int, moot: frozenset[str] = frozenset(),
) -> dict:
    """The OCI runtime spec (config.json) of one gvisor box. Pure: the same inputs give the same dict."""
    root, oci = oci_mounts(mounts, home, run.box_uid, moot)
    extra = [_bind(box_init(run.init_script), run.init_script, True), _bind(BOX_SECCOMP, run.seccomp_file, True)]
    if run.socket:
        extra.append(_bind(BOX_SOCKET, run.socket, False))  # connect() needs write on the socket
    rlimits = [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}]
    if limits.method.startswith("rlimit"):
        # No cgroup for runsc here: the Sentry enforces these on the processes it runs (it counts its
        # own tasks, not the host's threads, so RLIMIT_NPROC is per box). RLIMIT_DATA, as the supervised
        # tier's (relay/box/resource_limits.py): node reserves ~10 GiB of address space per WebAssembly
        # instance (undici's fetch, gemini's HTTP parser), which RLIMIT_AS counts and refuses.
        rlimits += [{"type": "RLIMIT_NPROC", "hard": limits.pids, "soft": limits.pids},
                    {"type": "RLIMIT_DATA", "hard": limits.memory, "soft": limits.memory}]
    caps: dict[str, list[str]] = {k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")}
    uid = run.box_uid
    linux: dict = {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]}
    return {
        "ociVersion": "1.0.0",
        "process": {
            "terminal": terminal,
            "user": {"uid": uid, "gid": uid},
            "args": list(args),
            "env": [f"{k}={v}" for k, v in sorted(env.items())],
            "cwd": cwd,
            "capabilities": caps,
            "noNewPrivileges": True,
            "rlimits": rlimits,
        },
        "root": {"path": root, "readonly": True},
        "hostname": HOSTNAME,
        "mounts": oci + extra,
        "linux": linux,
    }
