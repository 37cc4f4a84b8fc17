"""Golden full vectors for the argv builders: the whole argv for a representative plan, not "this flag
is somewhere in the list". A change shows as a diff of tests/golden/argv/ to review like code;
regenerate with `HIVE_RELAY_GOLDEN=1 pytest tests/test_argv_golden.py`.

The inputs are a fake host's (tests/fakefs.py), so the vectors are the same on every machine.
These vectors are also what stands behind the plan goldens' `{"$rendered": ...}` markers
(tests/test_plan_golden.py): each renderer branch a plan's command uses has a whole vector here.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from relay.model.limits import Limits
from relay.model.mounts import Grant, Mount
from relay.policy.denylist import protected_paths, secret_paths
from relay.policy.fsplan import FsPlan, plan_filesystem
from relay.render import bwrap_argv, container_argv, gvisor_oci
from relay.render.container_argv import ContainerRun
from relay.render.gvisor_oci import GvisorRun

from .fakefs import HOME, TOOLS, WORKDIR, fake_host

GOLDEN = Path(__file__).parent / "golden" / "argv"
RUN_DIR = "/run/user/1000/hive-relay-1-golden"
STAGED = f"{HOME}/.staged/1-golden"  # short: a volume names it three times
SOCKET, SOCKET_HOST = "/run/hive-relay/sockets/ssh-agent", "/run/user/1000/ssh-agent.sock"


def _fsplan(home_source: str | None = f"{RUN_DIR}/home") -> FsPlan:
    """claude's box on the fake host: toolchain and state grants, the tool dir, a private git dir."""
    grants = [Grant(f"{HOME}/.gitconfig", False), Grant(f"{HOME}/.cargo/bin", False), Grant(f"{HOME}/.nvm", False),
              Grant(f"{HOME}/.config/git", False), Grant("/srv/shared", True)]
    git = [Mount("private-bind", f"{WORKDIR}/.git", f"{RUN_DIR}/git/0"),
           Mount("ro-bind", f"{WORKDIR}/.git/hooks", f"{WORKDIR}/.git/hooks"),
           Mount("bind", f"{WORKDIR}/.git/objects", f"{WORKDIR}/.git/objects")]
    return plan_filesystem(
        home=HOME, workdir=WORKDIR, home_source=home_source, grants=grants,
        secrets=secret_paths(HOME, 1000, (), "/run/user/1000/ssh-agent.sock"),
        protected=protected_paths(WORKDIR) + [f"{WORKDIR}/.git/modules/lib/config"],
        extra_binds=[Mount("ro-bind", TOOLS, TOOLS)], git_mounts=git, fs=fake_host(), tmpfs_size=2 << 30,
    )


def _run(kind: str, rootless: bool) -> ContainerRun:
    flags, _ = container_argv.limit_flags(kind, rootless, "v2" if kind == "docker" else None,
                                          Limits(8 << 30, 512, "cgroup-v2"), 524288)
    return ContainerRun(engine=f"/usr/bin/{kind}", kind=kind, rootless=rootless, name="hive-relay-1-golden",
                        image="localhost/hive-relay-contributor:0123456789ab-u1000",
                        user="1000:1000" if rootless else "0:0", pidfile=f"{RUN_DIR}/pid" if kind == "podman" else None,
                        ctl_dir=f"{RUN_DIR}/ctl", seccomp_profile=f"{RUN_DIR}/seccomp.json", limit_flags=flags)


def _container(kind: str, rootless: bool, interactive: bool) -> list[str]:
    return container_argv.build(
        run=_run(kind, rootless), backend="claude", workdir=WORKDIR, home=HOME, mounts=_fsplan().mounts,
        env_set={"HOME": HOME, "PATH": container_argv.IMAGE_PATH, "HIVE_RELAY": "1"},
        env_pass=("ANTHROPIC_API_KEY", "LANG"), interactive=interactive, tty=True,
        argv=["claude", "--settings", "{}"] if interactive else ["claude", "-p", "fix the bug"])


def _container_gvisor(rootless: bool, network: bool) -> list[str]:
    """`podman --runtime runsc`: the same policy, runsc's flags, the init's binds and argv before the agent's."""
    flags, _ = container_argv.limit_flags("podman", rootless, "v2", Limits(8 << 30, 512, "cgroup-v2"), 524288, True)
    run = replace(_run("podman", rootless), limit_flags=flags, seccomp_profile=None, runtime="/usr/bin/runsc",
                  runtime_flags=container_argv.runsc_flags("systrap", rootless),
                  init_script="/opt/hive-relay/relay/box/gvisor_init.py", seccomp_bpf=f"{RUN_DIR}/ctl/seccomp.bpf",
                  proxy_socket=f"{RUN_DIR}/ctl/proxy.sock" if network else None)
    return container_argv.build(
        run=run, backend="claude", workdir=WORKDIR, home=HOME, mounts=_fsplan().mounts[:6],
        env_set={"HOME": HOME, "PATH": container_argv.IMAGE_PATH, "HIVE_RELAY": "1"},
        env_pass=("ANTHROPIC_API_KEY",), interactive=True, tty=True, argv=["claude"],
        listen="127.0.0.1:3128" if network else None)


def _gvisor_run(rootless: bool, network: bool = True) -> GvisorRun:
    return GvisorRun(runsc="/usr/bin/runsc", platform="systrap", rootless=rootless, container_id="hive-relay-1-golden",
                     bundle=f"{RUN_DIR}/gvisor", state_root=f"{RUN_DIR}/gvisor/state",
                     init_script="/opt/hive-relay/relay/box/gvisor_init.py", python="/usr/bin/python3",
                     seccomp_file=f"{RUN_DIR}/gvisor/seccomp.bpf",
                     socket=f"{RUN_DIR}/gvisor/proxy.sock" if network else None, box_uid=gvisor_oci.BOX_UID)


def _gvisor_spec(rootless: bool, limits: Limits, moot: frozenset[str] = frozenset(), network: bool = True) -> dict:
    run = _gvisor_run(rootless, network)
    return gvisor_oci.spec(run, mounts=_fsplan().mounts, home=HOME,
                           args=[*run.init_argv("127.0.0.1:3128" if network else None), "claude"],
                           env={"HOME": HOME, "PATH": "/usr/bin:/bin", "HIVE_RELAY": "1"}, cwd=WORKDIR,
                           terminal=not rootless, limits=limits, nofile=524288, moot=moot)


VECTORS: dict[str, Callable[[], object]] = {
    "gvisor_oci.argv": lambda: [*_gvisor_run(False).argv(), *_gvisor_run(False).init_argv("127.0.0.1:3128")],
    "gvisor_oci.argv-rootless-no-network": lambda: [*_gvisor_run(True, False).argv(),
                                                    *_gvisor_run(True, False).init_argv(None)],
    "gvisor_oci.spec-root-cgroup": lambda: _gvisor_spec(False, Limits(8 << 30, 512, "cgroup-v1")),
    "gvisor_oci.spec-rootless-rlimit-moot": lambda: _gvisor_spec(
        True, Limits(8 << 30, 512, "rlimit"), frozenset({"/etc/shadow", "/etc/gshadow"}), network=False),
    "plan_filesystem": lambda: {"mounts": [{k: v for k, v in vars(m).items() if v is not None} for m in _fsplan().mounts],
                                **{k: list(getattr(_fsplan(), k)) for k in ("placeholders", "denied", "protected", "notes")}},
    "plan_filesystem-tmpfs-home": lambda: [vars(m) for m in _fsplan(home_source=None).mounts[:8]],
    "bwrap_argv.mount_args": lambda: bwrap_argv.mount_args(_fsplan().mounts),
    "bwrap_argv.mount_args-fd_binds": lambda: bwrap_argv.mount_args(
        [*_fsplan().mounts[:3], Mount("ro-bind", SOCKET, "/run/user/1000/ssh-agent.sock")], {(SOCKET, SOCKET_HOST): 6}),
    "bwrap_argv.build": lambda: bwrap_argv.build(bwrap="/usr/bin/bwrap", mounts=_fsplan().mounts, workdir=WORKDIR,
                                                 box_uid=None, seccomp_fd=3, info_fd=4, block_fd=5),
    "bwrap_argv.build-root": lambda: bwrap_argv.build(bwrap="/usr/bin/bwrap", mounts=_fsplan().mounts[:7],
                                                      workdir=WORKDIR, box_uid=1000, seccomp_fd=3, info_fd=4,
                                                      block_fd=5),
    "container_argv.volume_args-podman": lambda: container_argv.volume_args(_fsplan().mounts, HOME, "podman"),
    "container_argv.volume_args-docker": lambda: container_argv.volume_args(_fsplan().mounts, HOME, "docker"),
    "container_argv.volume_args-podman-staged": lambda: container_argv.volume_args(
        _fsplan().mounts, HOME, "podman", (WORKDIR, f"{STAGED}/upper", f"{STAGED}/work")),
    "container_argv.volume_args-podman-tmpfs-home": lambda: container_argv.volume_args(
        _fsplan(home_source=None).mounts, HOME, "podman"),
    "container_argv.volume_args-docker-tmpfs-home": lambda: container_argv.volume_args(
        _fsplan(home_source=None).mounts, HOME, "docker"),
    "container_argv.build-podman-rootless": lambda: _container("podman", True, True),
    "container_argv.build-docker-rootful-prompt": lambda: _container("docker", False, False),
    "container_argv.build-podman-gvisor-root": lambda: _container_gvisor(False, True),
    "container_argv.build-podman-gvisor-rootless-no-network": lambda: _container_gvisor(True, False),
}


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_whole_vector_matches_the_golden(name: str) -> None:
    text = json.dumps(VECTORS[name](), indent=1) + "\n"
    path = GOLDEN / f"{name}.json"
    if os.environ.get("HIVE_RELAY_GOLDEN") == "1":
        path.write_text(text)
    have = path.read_text() if path.is_file() else ""
    if text != have:
        diff = difflib.unified_diff(have.splitlines(), text.splitlines(), f"golden/argv/{name}.json", "built",
                                    lineterm="")
        pytest.fail("\n".join(diff) + "\n\nreview, then regenerate with HIVE_RELAY_GOLDEN=1", pytrace=False)


def test_no_stale_golden() -> None:
    """A vector that is gone leaves no golden behind (HIVE_RELAY_GOLDEN=1 deletes it)."""
    stale = sorted(p for p in GOLDEN.glob("*.json") if p.stem not in VECTORS)
    if os.environ.get("HIVE_RELAY_GOLDEN") == "1":
        for p in stale:
            p.unlink()
        stale = []
    assert stale == []
