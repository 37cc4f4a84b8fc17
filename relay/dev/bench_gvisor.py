"""`invoke bench` rows for the gvisor tier (issue 31): our gvisor launch against a bare `runsc do true`
and against our supervised launch, paired round by round in the same run.

- bare runsc: `runsc do true` with the flags a run uses (platform, `--network=none`, rootless when not
  root), its state in a fresh temp dir: what gVisor itself costs here;
- our gvisor launch: `python -m relay shell local --isolation gvisor --prompt true` (the probe memo
  warm, as after a first launch), which adds the launcher, the bundle, the proxy and the in-box init;
- our supervised launch: the same command at the supervised tier.

Target (issue 31): our overhead over bare runsc at most +60 ms, the median of the paired differences.
Run alone: `python -m relay.dev.bench_gvisor [--quick]` (prints the rows).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

from relay.dev.measure import paired
from relay.host import runsc_host

TARGET_S = 0.060


def _relay(*args: str) -> list[str]:
    return [sys.executable, "-m", "relay", *args]


def measure(runs: int, env: dict[str, str]) -> dict:
    """Paired launch timings (see the module's docstring), or {"skipped": why}."""
    got = runsc_host.facts(env)
    if got["runsc_error"] is not None or got["runsc"] is None:
        return {"skipped": got["runsc_error"] or "no runsc"}
    work = tempfile.mkdtemp(prefix="hive-relay-bench-gvisor-")
    os.chmod(work, 0o755)
    state = tempfile.mkdtemp(prefix="hive-relay-bench-runsc-")
    box = ["shell", "local", "-q", "--live", "--workdir", work, "--prompt", "true"]
    cmds = {
        "bare runsc do true": [got["runsc"], "--root", state,
                               *runsc_host.base_flags(got["runsc_platform"] or "systrap", os.getuid() != 0),
                               "do", "--quiet", "true"],
        "gvisor launch": _relay(*box[:2], "--isolation", "gvisor", *box[2:]),
        "supervised launch": _relay(*box),
    }
    try:
        for argv in cmds.values():  # warm: the probe memo, the verified-plan memo, the page cache
            paired({"warm": argv}, 1, env, work)
        launch = paired(cmds, runs, env, work)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
    out: dict = {"platform": got["runsc_platform"], "version": got["runsc_version"], "launch": launch}
    ok = not launch["gvisor launch"]["failures"] and not launch["bare runsc do true"]["failures"]
    if ok:
        out["over_bare_runsc_s"] = statistics.median(
            a - b for a, b in zip(launch["gvisor launch"]["times"], launch["bare runsc do true"]["times"], strict=True))
    if ok and not launch["supervised launch"]["failures"]:
        out["over_supervised_s"] = statistics.median(
            a - b for a, b in zip(launch["gvisor launch"]["times"], launch["supervised launch"]["times"], strict=True))
    return out


def rows(r: dict) -> tuple[list[str], dict[str, tuple[str, bool]]]:
    """The table rows and the target."""
    if "skipped" in r:
        return [f"| gvisor tier | not measured | {r['skipped']} |"], {}
    lines = []
    for name, m in r["launch"].items():
        value = f"FAILED {m['failures']} of {len(m['exit_codes'])} runs" if m["failures"] else f"{m['median_s'] * 1000:.1f} ms"
        lines.append(f"| gvisor ({r['platform']}): {name} | {value} | |")
    targets: dict[str, tuple[str, bool]] = {}
    over = r.get("over_bare_runsc_s")
    targets["gvisor launch within 60 ms of bare runsc do true (median of paired differences)"] = (
        f"+{over * 1000:.0f} ms" if over is not None else "not measured (a run failed)",
        over is not None and over <= TARGET_S)
    if r.get("over_supervised_s") is not None:
        lines.append(f"| gvisor launch − supervised launch | +{r['over_supervised_s'] * 1000:.0f} ms | "
                     "median of paired differences |")
    return lines, targets


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    result = measure(5 if quick else 15, dict(os.environ))
    more, goals = rows(result)
    print("\n".join(more))
    for goal, (value, met) in goals.items():
        print(f"| {goal} | {value} | {'yes' if met else 'NO'} |")
    print(json.dumps({k: v for k, v in result.items() if k != "launch"}))
