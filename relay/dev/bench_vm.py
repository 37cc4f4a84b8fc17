"""`invoke bench` rows for the vm tier under TCG (issue 31): boot-to-prompt, a figure and not a target.

- our vm launch: `python -m relay shell local --isolation vm --vm-accel tcg --live --prompt true`, the
  whole launch: plan, the guest's control dir, the proxy, qemu, the guest kernel's boot, the init's
  mounts and the command's start, to the exit code back on the host (`true` itself is instant, so
  this is boot-to-prompt plus the teardown);
- a bare boot (full run only): the same kernel, initramfs and root disk booted by
  relay/modes/vm_boot.py with `true` and no shares, no proxy, no launcher: what qemu's TCG costs
  itself, paired round by round with ours.

Cheap in CI's `bench --quick`: one launch, no bare boot (each boot is 16-37 s here). No launch is
made when the host cannot boot the guest under TCG (no qemu, kernel or image): the row says why.
Run alone: `python -m relay.dev.bench_vm [--quick]`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from relay.host import vm_host


def _relay(*args: str) -> list[str]:
    return [sys.executable, "-m", "relay", *args]


def _timed(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, stdin=subprocess.DEVNULL, timeout=900)
    return time.perf_counter() - start, proc.returncode


def _bare_boot(plan: dict, env: dict[str, str], work: str) -> float | None:
    """One boot of the guest with `true` through vm_boot alone; None when it did not report 0."""
    from relay.modes import vm_boot

    vm = plan["vm"]
    root = os.path.join(vm["cache"], f"root-{vm['image'].rsplit(':', 1)[-1]}.ext4")
    if not os.path.exists(root):
        return None
    ctl = tempfile.mkdtemp(prefix="ctl-", dir=work)
    vm_boot.write_ctl(ctl, (), os.getuid(), "/", {"PATH": "/usr/bin:/bin"}, "true")
    guest = vm_boot.Guest(qemu=vm["qemu"], kernel=vm["kernel"], initrd=vm_boot.ensure_initrd(vm["cache"], vm["kernel"]),
                          root_image=root, ctl_dir=ctl, shares=(), memory_mb=vm["memory_mb"], accel="tcg")
    start = time.perf_counter()
    code, _, _ = vm_boot.boot(guest, timeout=900, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start if code == 0 else None


def measure(quick: bool, env: dict[str, str]) -> dict:
    """Boot-to-prompt under TCG (see the module's docstring), or {"skipped": why}."""
    why = vm_host.vm_error(env, "tcg")
    if why:
        return {"skipped": why}
    work = tempfile.mkdtemp(prefix="hive-relay-bench-vm-")
    os.chmod(work, 0o755)
    box = ["shell", "local", "-q", "--isolation", "vm", "--vm-accel", "tcg", "--live", "--workdir", work]
    try:
        dry = subprocess.run(_relay(*box, "--dry-run", "--json"), env=env, cwd=work, capture_output=True, text=True)
        if dry.returncode != 0:
            return {"skipped": (dry.stderr.strip().splitlines() or ["the vm plan failed"])[-1]}
        plan = json.loads(dry.stdout)
        launches: list[float] = []
        bare: list[float] = []
        failures = 0
        for _ in range(1 if quick else 3):
            took, rc = _timed(_relay(*box, "--prompt", "true"), env, work)
            failures += rc != 0
            launches.append(took)
            if not quick:
                got = _bare_boot(plan, env, work)
                if got is None:
                    failures += 1
                else:
                    bare.append(got)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    out: dict = {"accel": "tcg", "kernel": os.path.basename(plan["vm"]["kernel"]), "launch_s": launches,
                 "median_s": statistics.median(launches), "failures": failures}
    if bare:
        out["bare_boot_s"] = bare
        out["bare_median_s"] = statistics.median(bare)
        if len(bare) == len(launches):
            out["over_bare_s"] = statistics.median(a - b for a, b in zip(launches, bare, strict=True))
    return out


def rows(r: dict) -> tuple[list[str], dict[str, tuple[str, bool]]]:
    """The table rows; no target (issue 31: boot-to-prompt under TCG is a figure)."""
    if "skipped" in r:
        return [f"| vm tier (TCG) | not measured | {r['skipped']} |"], {}
    n = len(r["launch_s"])
    value = f"FAILED {r['failures']} of {n}" if r["failures"] else f"{r['median_s']:.1f} s"
    lines = [f"| vm (TCG, emulated): boot-to-prompt, our launch of `true` | {value} | "
             f"median of {n}, {r['kernel']}; a figure, not a target |"]
    if "bare_median_s" in r:
        over = f"; ours − bare {r['over_bare_s']:+.1f} s (paired)" if "over_bare_s" in r else ""
        lines.append(f"| vm (TCG): bare qemu boot of the same guest | {r['bare_median_s']:.1f} s | "
                     f"median of {len(r['bare_boot_s'])}{over} |")
    return lines, {}


if __name__ == "__main__":
    result = measure("--quick" in sys.argv, dict(os.environ))
    print("\n".join(rows(result)[0]))
    print(json.dumps(result))
