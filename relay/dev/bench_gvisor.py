"""`invoke bench` rows for the gvisor tier (issue 31): our gvisor launch against a bare `runsc do true`
and against our supervised launch, paired round by round in the same run.

- bare runsc: `runsc do true` with the flags a run uses (platform, `--network=none`, rootless when not
  root), its state in a fresh temp dir: what gVisor itself costs here;
- our gvisor launch: `python -m relay shell local --isolation gvisor --prompt true` (the probe memo
  warm, as after a first launch), which adds the launcher, the bundle, the proxy and the in-box init;
- our supervised launch: the same command at the supervised tier;
- our gvisor launch with the Python init (HIVE_RELAY_GVISOR_INIT=python): what the compiled init
  (relay/box/gvisor_init.c) saves, paired.

Targets (issue 31): our overhead over bare runsc at most +60 ms, the median of the paired differences;
a download through the proxy from a gvisor box (curl, plain HTTP from a loopback server) at least 0.5×
the same download direct, the median of paired rounds.
Container mode on gVisor (`measure_container`): our `shell container --live --isolation gvisor` launch
against a bare `podman --runtime runsc run --rm IMAGE true` of the same image with the same runsc flags,
and our container launch on runc, paired round by round; reported as ratios (no target: a figure).
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
PY_INIT = "gvisor launch, Python init"


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
        # The same launch with the Python init (relay/box/gvisor_init.py), the compiled one's fallback.
        PY_INIT: ["/usr/bin/env", "HIVE_RELAY_GVISOR_INIT=python", *_relay(*box[:2], "--isolation", "gvisor", *box[2:])],
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
    if ok and not launch[PY_INIT]["failures"]:
        out["compiled_vs_python_init_s"] = statistics.median(
            a - b for a, b in zip(launch["gvisor launch"]["times"], launch[PY_INIT]["times"], strict=True))
    if ok and not launch["supervised launch"]["failures"]:
        out["over_supervised_s"] = statistics.median(
            a - b for a, b in zip(launch["gvisor launch"]["times"], launch["supervised launch"]["times"], strict=True))
    return out


BARE_CONTAINER = "bare podman --runtime runsc run true"
CONTAINER_GVISOR = "relay shell container --isolation gvisor true"
CONTAINER_RUNC = "relay shell container true (runc)"


def container_commands(engine: str, tag: str, runsc: str, platform: str, work: str) -> dict[str, list[str]]:
    """The three launches of measure_container: the bare one is the engine's own run of our image on
    runsc with the flags our plan passes (relay/render/container_argv.runsc_flags)."""
    from relay.render.container_argv import runsc_flags

    rootless = os.getuid() != 0
    bare = [engine, "--log-level=error", "--runtime", runsc, *runsc_flags(platform, rootless), "run", "--rm",
            "--pull=never", "--network", "none", "--read-only", "--ulimit", "nofile=1024:1024", "--ulimit",
            "nproc=512:512", *(["--userns", "keep-id"] if rootless else []), tag, "true"]
    box = ["shell", "container", "-q", "--live", "--workdir", work, "--prompt", "true"]
    return {BARE_CONTAINER: bare, CONTAINER_GVISOR: _relay(*box[:2], "--isolation", "gvisor", *box[2:]),
            CONTAINER_RUNC: _relay(*box)}


def measure_container(runs: int, env: dict[str, str]) -> dict:
    """Container mode on runsc against the bare engine run on runsc, same image, same run; or {"skipped": why}."""
    import shutil
    import subprocess

    from relay.dev.measure import container_image, ratio

    got = runsc_host.facts(env)
    if got["runsc_error"] is not None or got["runsc"] is None:
        return {"skipped": got["runsc_error"] or "no runsc"}
    found = container_image(env)
    if isinstance(found, str):
        return {"skipped": found}
    engine, tag = found
    work = tempfile.mkdtemp(prefix="hive-relay-bench-gvisor-c-")
    os.chmod(work, 0o755)
    try:
        cmds = container_commands(engine, tag, got["runsc"], got["runsc_platform"] or "systrap", work)
        for name, argv in cmds.items():  # warm, and a command that cannot run is not timed
            proc = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=600)
            if proc.returncode != 0:
                return {"skipped": f"{name} exits {proc.returncode}: {proc.stderr.strip()[-300:]}"}
        launch = paired(cmds, runs, env, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out: dict = {"launch": launch, "ratios": {CONTAINER_GVISOR: ratio(launch, CONTAINER_GVISOR, BARE_CONTAINER),
                                              CONTAINER_RUNC: ratio(launch, CONTAINER_RUNC, BARE_CONTAINER)}}
    if not launch[CONTAINER_GVISOR]["failures"] and not launch[BARE_CONTAINER]["failures"]:
        out["over_bare_s"] = statistics.median(
            a - b for a, b in zip(launch[CONTAINER_GVISOR]["times"], launch[BARE_CONTAINER]["times"], strict=True))
    return out


def measure_throughput(rounds: int, blob_mb: int, env: dict[str, str]) -> dict:
    """One `blob_mb` download from a loopback HTTP server (bench/blobserver.py), direct on the host and
    from a gvisor box through the proxy (the init's relay, the unix socket, the proxy), in paired
    rounds, with two clients: bench/client.py (1 MiB reads, the main bench's client) and curl.

    Why both: every read is a system call the Sentry answers, and curl reads 16 KiB at a time, so in
    the box curl measures curl (~200-320 MB/s here even from gVisor's own loopback); the same client on
    both sides, reading as a download tool can, measures the tier. The target is judged on client.py."""
    import shutil
    import subprocess

    from relay.host.paths import PACKAGE_ROOT

    work = tempfile.mkdtemp(prefix="hive-relay-bench-gvisor-tp-")
    os.chmod(work, 0o755)
    big, mid = os.path.join(work, "big.bin"), os.path.join(work, "mid.bin")
    for path, size in ((big, blob_mb << 20), (mid, 1 << 20)):
        with open(path, "wb") as fh:
            fh.truncate(size)
    shutil.copy(os.path.join(str(PACKAGE_ROOT), "bench", "client.py"), work)
    server = subprocess.Popen([sys.executable, os.path.join(str(PACKAGE_ROOT), "bench", "blobserver.py"), big, mid],
                              stdout=subprocess.PIPE, text=True)
    out: dict = {"blob_mb": blob_mb}
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        url = f"http://blob.test:{port}/big"
        client = f"/usr/bin/python3 client.py get blob.test {port} 1"
        curl = "curl -s -o /dev/null -w '%{speed_download}'"
        runs = {"client.py": (client.split(), f"{client} 127.0.0.1:3128"),
                "curl": (["curl", "-s", "-o", "/dev/null", "-w", "%{speed_download}", f"http://127.0.0.1:{port}/big"],
                         f"{curl} {url}")}
        for name, (host_argv, box_script) in runs.items():
            direct, boxed = [], []
            for _ in range(rounds):
                got = subprocess.run(host_argv, capture_output=True, text=True, env=env, cwd=work)
                direct.append(_rate(got.stdout) if got.returncode == 0 else 0.0)
                got = subprocess.run(_relay("shell", "local", "-q", "--live", "--isolation", "gvisor", "--workdir", work,
                                            "--allow-host", f"blob.test:{port}=127.0.0.1:{port},tls=false", "--prompt",
                                            box_script), capture_output=True, text=True, env=env, cwd=work)
                boxed.append(_rate(got.stdout) if got.returncode == 0 else 0.0)
            ratios = [b / d for b, d in zip(boxed, direct, strict=True) if d]
            out[name] = {"direct_MBps": statistics.median(direct) / (1 << 20),
                         "gvisor_MBps": statistics.median(boxed) / (1 << 20),
                         "ratio": statistics.median(ratios) if ratios else 0.0}
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)
    return out


def _rate(stdout: str) -> float:
    """Bytes per second from client.py's JSON ([[bytes, seconds]]) or curl's speed_download."""
    text = stdout.strip()
    try:
        if text.startswith("["):
            (size, seconds), = json.loads(text.splitlines()[-1])
            return size / seconds if seconds else 0.0
        return float(text[-40:] or 0)
    except (ValueError, TypeError):
        return 0.0


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
    if over is not None:
        lines.append(f"| gvisor launch − bare runsc do true | +{over * 1000:.0f} ms | median of paired differences |")
    if r.get("compiled_vs_python_init_s") is not None:
        lines.append(f"| gvisor launch: compiled init − Python init | {r['compiled_vs_python_init_s'] * 1000:+.0f} ms | "
                     "median of paired differences (relay/box/gvisor_init.c against gvisor_init.py) |")
    if r.get("over_supervised_s") is not None:
        lines.append(f"| gvisor launch − supervised launch | +{r['over_supervised_s'] * 1000:.0f} ms | "
                     "median of paired differences |")
    c = r.get("container")
    if c and "skipped" in c:
        lines.append(f"| gvisor container launch | not measured | {c['skipped']} |")
    elif c:
        for name, m in c["launch"].items():
            if m["failures"]:
                value = f"FAILED {m['failures']} of {len(m['exit_codes'])} runs"
            else:
                value = f"{m['median_s'] * 1000:.0f} ms"
            got = c["ratios"].get(name)
            note = "baseline" if name == BARE_CONTAINER else (f"{got:.2f}× bare runsc run (paired rounds)" if got else "")
            lines.append(f"| gvisor container: {name} | {value} | {note} |")
        if c.get("over_bare_s") is not None:
            lines.append(f"| gvisor container launch − bare runsc run | +{c['over_bare_s'] * 1000:.0f} ms | "
                         "median of paired differences |")
    tp = r.get("throughput")
    if tp:
        for name in ("client.py", "curl"):
            t = tp.get(name)
            if t:
                lines.append(f"| gvisor throughput ({tp['blob_mb']} MB, {name} via the proxy) | {t['gvisor_MBps']:.0f} MB/s | "
                             f"{t['ratio']:.2f}× direct ({t['direct_MBps']:.0f} MB/s), paired rounds |")
        got = tp.get("client.py", {}).get("ratio", 0.0)
        targets["gvisor download through the proxy ≥ 0.5× direct"] = (f"{got:.2f}×", got >= 0.5)
    return lines, targets


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    result = measure(5 if quick else 15, dict(os.environ))
    if "skipped" not in result:
        result["throughput"] = measure_throughput(3 if quick else 5, 32 if quick else 200, dict(os.environ))
        result["container"] = measure_container(5 if quick else 15, dict(os.environ))
    more, goals = rows(result)
    print("\n".join(more))
    for goal, (value, met) in goals.items():
        print(f"| {goal} | {value} | {'yes' if met else 'NO'} |")
    print(json.dumps({k: v for k, v in result.items() if k != "launch"}, default=str))
