"""What resolve() knows about the host, as plain data: probed once (relay/host/probe.py), or built by
tests. What each tier can enforce with these facts is relay/policy/tiers.py's answer, not theirs."""

from __future__ import annotations

from relay.model.record import asdict, field, record


@record
class HostFacts:
    """Everything resolve() needs to know about the host, as plain data (tests build their own)."""

    uid: int
    gid: int
    home: str
    user: str
    shell: str
    tty: bool
    bwrap: str | None = None
    bwrap_version: str | None = None
    bwrap_error: str | None = None
    userns_restricted: bool = False
    seccomp: bool = False
    seccomp_error: str | None = None
    landlock_abi: int = 0
    cgroup: str | None = None
    legacy_tiocsti: bool | None = None
    podman: str | None = None
    docker: str | None = None
    box_python: str | None = None
    notes: tuple[str, ...] = field(default=())
    # The hard RLIMIT_NOFILE, capped at 1 << 20: a container's --ulimit nofile (the engine refuses more).
    nofile: int = 1 << 20
    # Container mode's image tag (a digest of files): read before resolve() by plan.with_image, never in it.
    image: str | None = None
    # Why the VM tier cannot run here (relay/host/vm_host.py), or None: filled in before resolve() only
    # when --isolation vm is asked for (cli, doctor); facts probed or built otherwise never enable it.
    vm_error: str | None = "not probed"
    vm_qemu: str | None = None  # qemu-system-x86_64 and the guest kernel, probed with vm_error
    vm_kernel: str | None = None
    # runsc for the gvisor tier (relay/host/runsc_host.py): probed before resolve() only when
    # `--isolation gvisor` is asked for (or the user config says so); otherwise "not probed" refuses it.
    runsc: str | None = None
    runsc_version: str | None = None
    runsc_platform: str | None = None
    runsc_error: str | None = "not probed"
    # The gvisor box's compiled init (relay/host/native_init.py), found or built with runsc's facts; None:
    # the Python init (relay/box/gvisor_init.py) runs, and `gvisor_init_note` says why.
    gvisor_init: str | None = None
    gvisor_init_note: str | None = None

    @property
    def bwrap_ok(self) -> bool:
        return self.bwrap is not None and self.bwrap_error is None

    def to_json(self) -> dict:
        return asdict(self)
