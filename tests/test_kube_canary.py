"""doctor --mode kube: the canary's verdict is a pure decision over what it saw, checked against
both setups for real under podman kube play: an enforcing one (the box pod on --network none, the
proxy its only way out) and a non-enforcing one (the box pod on the host's network, as a CNI
that ignores NetworkPolicy lets it out; the host network rather than a bridge, so that it runs
rootless too). The non-enforcing one refuses with exit 3 unless the backend's opt-in is set.
Root and unprivileged alike (CI runs both)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from relay.config.load import get_backend, load_matrix
from relay.host.fs_view import HostFs
from relay.host.probe import probe
from relay.model.errors import EXIT_REFUSED
from relay.modes import kube_canary, kube_podman, kube_proxy_image
from relay.modes.image_tag import with_image
from relay.modes.kube_canary import CanaryProbe, decide, parse
from relay.modes.kube_run import kube_run_for, make_bundle
from relay.plan.resolve import Request, resolve

from .conftest import podman_env

REPO = Path(__file__).resolve().parent.parent


def test_decide_refuses_what_is_not_enforced_unless_opted_in() -> None:
    good = CanaryProbe(direct_egress=False, proxy_reachable=True, seccomp_profile=True)
    assert decide(good, "claude", "HIVE_RELAY_UNSANDBOXED_CLAUDE", False).exit_code == 0
    leaky = CanaryProbe(direct_egress=True, proxy_reachable=True, seccomp_profile=True)
    refused = decide(leaky, "claude", "HIVE_RELAY_UNSANDBOXED_CLAUDE", False)
    assert refused.exit_code == EXIT_REFUSED and "NOT enforced" in refused.lines[0] and "fix:" in refused.lines[0]
    waived = decide(leaky, "claude", "HIVE_RELAY_UNSANDBOXED_CLAUDE", True)
    assert waived.exit_code == 0 and waived.lines[0].startswith("WARN")
    for bad in (CanaryProbe(False, False, True), CanaryProbe(False, True, False), CanaryProbe(False, True, True, False),
                CanaryProbe(None, None, True)):
        assert decide(bad, "claude", "X", True).exit_code == EXIT_REFUSED  # the opt-in waives only the policy
    assert parse("noise\ndirect=fail\nproxy=ok\n", True) == CanaryProbe(False, True, True)
    assert parse("", True) == CanaryProbe(None, None, True)


def test_doctor_mode_kube_without_a_cluster_is_one_line_exit_3(tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}
    proc = subprocess.run([sys.executable, "-c", "import sys; from relay.commands.doctor import doctor; sys.exit(doctor(mode='kube'))"],
                          capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("\n") == 1 and "context" in proc.stderr and "fix:" in proc.stderr


def _public_stand_in() -> tuple[socket.socket, str]:
    """A listener on the host's own address: the 'public address' the canary must not reach directly."""
    ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]
    srv = socket.create_server((ip, 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"{ip}:{srv.getsockname()[1]}"


@pytest.mark.parametrize("network, enforcing", [("none", True), ("host", False)])
def test_the_canary_under_podman_kube_play(tmp_path: Path, image: str, network: str, enforcing: bool) -> None:
    srv, target = _public_stand_in()
    work = tmp_path / "w"
    work.mkdir()
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run(["git", "-C", str(work), "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q",
                    "--allow-empty", "-m", "i"], check=True)
    env = podman_env()
    req = Request("claude", mode="kube", workdir=str(work), run_id=f"canary-{os.getpid()}-{os.urandom(3).hex()}",
                  prompt="x", argv_override=("/bin/bash", "-c", kube_canary.canary_script(target)))
    matrix = load_matrix(env, workdir=None)
    facts = with_image(probe(env), matrix, req, env)
    backend = get_backend(matrix, "claude")
    plan = resolve(backend, matrix, req, facts, env, fs=HostFs())
    run = kube_podman.local_run(kube_run_for(plan, req.run_id, 1, 1, env), env)
    kube_proxy_image.build_proxy_image(["podman"], run.image, env)
    try:
        played = kube_podman.play(plan, run, make_bundle(str(work)), env, str(tmp_path / "play"), timeout=180,
                                  box_network=network)
    finally:
        srv.close()
    log = played.logs[0]
    seen = parse(log, seccomp_profile=True)
    assert seen.proxy_reachable is True, log
    assert seen.direct_egress is (not enforcing), log
    verdict = decide(seen, "claude", backend.opt_in, opted_in=False)
    assert verdict.exit_code == (0 if enforcing else EXIT_REFUSED), verdict.lines
    if not enforcing:
        assert decide(seen, "claude", backend.opt_in, opted_in=True).exit_code == 0
    # Played on runc: had gVisor been asked for, this cluster would be refused (never silently weaker).
    on_runc = parse(log, seccomp_profile=True, runtime_class=True, gvisor=True)
    assert on_runc.gvisor is False and decide(on_runc, "claude", backend.opt_in, True).exit_code == EXIT_REFUSED


def test_decide_refuses_a_cluster_that_does_not_run_the_box_on_gvisor() -> None:
    """--isolation gvisor: a missing RuntimeClass refuses, and so does a class whose box ran on another
    kernel (a `gvisor` class with a runc handler): never silently weaker. The twin: gVisor's kernel passes."""
    good = parse("direct=fail\nproxy=ok\nkernel=gvisor\n", True, runtime_class=True, gvisor=True)
    assert good.gvisor is True and decide(good, "claude", "X", False).exit_code == 0
    assert any(line.startswith("ok   gvisor") for line in decide(good, "claude", "X", False).lines)
    for log, runtime in (("direct=fail\nproxy=ok\nkernel=other\n", True), ("direct=fail\nproxy=ok\n", True),
                         ("direct=fail\nproxy=ok\nkernel=gvisor\n", False)):
        verdict = decide(parse(log, True, runtime_class=runtime, gvisor=True), "claude", "X", True)
        assert verdict.exit_code == EXIT_REFUSED, (log, runtime, verdict.lines)
        assert any(line.startswith("MISS") and "fix:" in line for line in verdict.lines)
    # Not asked: the kernel line is not read.
    assert parse("direct=fail\nproxy=ok\nkernel=other\n", True).gvisor is None


def test_the_canary_names_the_kernel_that_answered_it() -> None:
    """The canary script's kernel check, run here: the host's kernel is not gVisor's."""
    script = kube_canary.canary_script("127.0.0.1:1", "127.0.0.1:1")
    out = subprocess.run(["/bin/bash", "-c", script], capture_output=True, text=True, timeout=60).stdout
    assert "kernel=other" in out and "kernel=gvisor" not in out
