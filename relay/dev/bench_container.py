"""`invoke bench` container rows (issues 25 and 27): what a container launch costs against a bare
engine run of the same image, in the same run.

- warm launch: `shell container true` (staged, the default), the same with `--live`, and a bare
  `podman run --rm IMAGE true`, in paired rounds (the order rotated each round, ratios taken round
  by round, so drift on a shared machine hits all three alike). Target: at most 1.5x the bare run.
  Staged against live is the median of the paired differences;
- a new rootless user (opt-in, `--new-user`: it builds the image, minutes): the first and the
  second launch with podman storage, relay state and caches all fresh (a HOME of its own), each as
  a ratio against the same run's bare engine run in that storage. The first launch does whatever
  first use does: overlay storage set up (relay/host/podman_storage.py), the base loaded or bootstrapped and
  the image built (relay/modes/image.py).

Run alone: `python -m relay.dev.bench_container [--quick] [--new-user]` (prints the rows and JSON).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BARE = "bare {engine} run true"
STAGED = "relay shell container true"
LIVE = "relay shell container --live true"
TARGET = 1.5  # a warm container launch, at most this many times the bare engine run
FIRST_TIMEOUT = 1800  # a new user's first launch builds the image (seconds)


def _relay(*args: str) -> list[str]:
    """The README's entry, as a user starts it: bin/contribute-hive (its bootstrap checks included),
    not `python -m relay`, which pays ~6 ms for runpy that no user's launch does."""
    from relay.host.paths import IN_CHECKOUT, PACKAGE_ROOT

    if IN_CHECKOUT:
        return [str(PACKAGE_ROOT / "bin" / "contribute-hive"), *args]
    return [sys.executable, "-m", "relay", *args]  # an installed package ships no bin/contribute-hive


def bare_argv(engine: str, tag: str, rootless: bool) -> list[str]:
    """The engine's own run of our image, with the options a bare run needs here (the host's
    default ulimits fail as root on this cgroup-v1 host; rootless keeps its uid as ours does)."""
    argv = [engine, "--log-level=error", "run", "--rm", "--pull=never", "--network", "none", "--read-only",
            "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=512:512"]
    return [*argv, *(["--userns", "keep-id"] if rootless else []), tag, "true"]


def launch_commands(engine: str, tag: str, work: str, allow: str | None) -> dict[str, list[str]]:
    box = ["shell", "container", "-q", "--workdir", work, *(["--allow-host", allow] if allow else []), "--prompt"]
    return {BARE.format(engine=os.path.basename(engine)): bare_argv(engine, tag, os.getuid() != 0),
            STAGED: _relay(*box, "true"),
            LIVE: _relay(*box[:2], "--live", *box[2:], "true")}


def measure(engine: str, tag: str, env: dict[str, str], work: str, runs: int, allow: str | None = None) -> dict:
    """Paired warm launches; every command once first (the first run maps the image's layers)."""
    from relay.dev.measure import paired, ratio

    cmds = launch_commands(engine, tag, work, allow)
    for name, argv in cmds.items():
        proc = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=600)
        if proc.returncode != 0:
            return {"skipped": f"{name} exits {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    launch = paired(cmds, runs, env, work)
    bare = next(iter(cmds))
    out: dict = {"launch": launch, "ratios": {n: ratio(launch, n, bare) for n in (STAGED, LIVE)}}
    if not launch[STAGED]["failures"] and not launch[LIVE]["failures"]:
        out["staged_added_ms"] = statistics.median(
            (s - v) * 1000 for s, v in zip(launch[STAGED]["times"], launch[LIVE]["times"], strict=True))
    return out


def _fresh_env(env: dict[str, str], home: str, runtime: str) -> dict[str, str]:
    """A new user's environment: its own HOME (podman's rootless storage and config, the relay's
    state and caches live there) and runtime dir; nothing pointing elsewhere. The runtime dir's path
    is short, as /run/user/UID is: with one of 40-odd characters, podman 4.3's client waits out its
    20 s conmon timeout at every container exit (measured here)."""
    out = {k: v for k, v in env.items() if not k.startswith(("XDG_", "CONTAINERS_", "HIVE_RELAY_"))
           or k in ("HIVE_RELAY_TOOLS", "HIVE_RELAY_BASE_ARCHIVE", "HIVE_RELAY_BASE_IMAGE")}
    out.update(HOME=home, XDG_RUNTIME_DIR=runtime)
    return out


def _base_archive(engine: str, env: dict[str, str], work: str) -> tuple[str | None, str]:
    """How the new user gets the base image: the caller's $HIVE_RELAY_BASE_ARCHIVE; else this user's
    base saved to an archive (what `build-image --save-base` / `--base-archive` do for another
    account); else none, and the first launch bootstraps it (mmdebstrap)."""
    if env.get("HIVE_RELAY_BASE_ARCHIVE"):
        return env["HIVE_RELAY_BASE_ARCHIVE"], "loaded from $HIVE_RELAY_BASE_ARCHIVE"
    from relay.config.load import load_matrix
    from relay.modes.image import exists, save_base
    from relay.modes.image_tag import spec_from_env

    base = spec_from_env(load_matrix(env, workdir=None).backends, os.getuid(), os.getgid(), env).base
    if not exists([engine], base):
        return None, "bootstrapped (mmdebstrap: no base image to copy)"
    path = os.path.join(work, "base.tar")
    save_base([engine], base, path)
    return path, f"loaded from an archive of this user's {base} (as `build-image --base-archive` does)"


def _pause_processes(runtime: str) -> list[int]:
    """Our rootless podman pause processes started for this runtime dir (and no one else's)."""
    mark = f"XDG_RUNTIME_DIR={runtime}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if (Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"catatonit")
                    and mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")):
                found.append(int(pid))
        except OSError:
            continue
    return found


def _drop_storage(engine: str, fenv: dict[str, str], home: str) -> None:
    """Remove the new user's storage and the pause process its podman started, then its dirs."""
    run = [engine, "unshare", "rm", "-rf", home]
    subprocess.run([engine, "system", "reset", "-f"], env=fenv, stdin=subprocess.DEVNULL, capture_output=True,
                   timeout=600)
    subprocess.run(run, env=fenv, stdin=subprocess.DEVNULL, capture_output=True, timeout=600)
    for pid in _pause_processes(fenv["XDG_RUNTIME_DIR"]):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(fenv["XDG_RUNTIME_DIR"], ignore_errors=True)


def new_user(engine: str, env: dict[str, str], bare_runs: int = 5) -> dict:
    """The first and the second launch of a new rootless user, against a bare run in its storage."""
    if os.getuid() == 0:
        return {"skipped": "a new rootless user's launches need a rootless user (root's podman storage is the "
                           "system's); fix: run `invoke bench --new-user` as that user"}
    from relay.modes.image_tag import spec_from_env

    home = tempfile.mkdtemp(prefix="hive-relay-bench-newuser-")
    os.chmod(home, 0o755)
    fenv = _fresh_env(env, home, tempfile.mkdtemp(prefix="hr-", dir="/tmp"))  # mode 0700
    out: dict = {}
    try:
        archive, how = _base_archive(engine, env, home)
        if archive:
            fenv["HIVE_RELAY_BASE_ARCHIVE"] = archive
        out["base"] = how
        work = os.path.join(home, "work")
        os.mkdir(work, 0o755)
        argv = _relay("shell", "container", "-q", "--workdir", work, "--prompt", "true")
        for name in ("first launch", "second launch"):
            start = time.perf_counter()
            proc = subprocess.run(argv, env=fenv, cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=FIRST_TIMEOUT)
            out[name] = {"seconds": time.perf_counter() - start, "exit_code": proc.returncode,
                         "said": [line for line in proc.stderr.splitlines() if line.startswith("hive-relay:")][:12]}
            if proc.returncode != 0:
                out[name]["last_error"] = proc.stderr.strip()[-600:]
                return out
        from relay.config.load import load_matrix

        tag = spec_from_env(load_matrix(fenv, workdir=None).backends, os.getuid(), os.getgid(), fenv).tag
        bare = []
        for _ in range(bare_runs):
            start = time.perf_counter()
            rc = subprocess.run(bare_argv(engine, tag, True), env=fenv, cwd=work, stdin=subprocess.DEVNULL,
                                capture_output=True).returncode
            bare.append(time.perf_counter() - start)
            if rc:
                out["bare_failed"] = rc
                return out
        out["bare_s"] = statistics.median(bare)
        for name in ("first launch", "second launch"):
            out[name]["ratio"] = out[name]["seconds"] / out["bare_s"]
        driver = subprocess.run([engine, "info", "--format", "{{.Store.GraphDriverName}}"], env=fenv,
                                capture_output=True, text=True, stdin=subprocess.DEVNULL).stdout.strip()
        out["storage_driver"] = driver
        return out
    finally:
        _drop_storage(engine, fenv, home)


def rows(c: dict, new: dict | None = None) -> tuple[list[str], dict[str, tuple[str, bool]]]:
    """Markdown rows and targets for bench.report (the warm launch rows, and the new user's)."""
    lines: list[str] = []
    targets: dict[str, tuple[str, bool]] = {}
    if "skipped" in c:
        lines.append(f"| container launch | not measured | {c['skipped']} |")
    launch = c.get("launch", {})
    bare = next((k for k in launch if k.startswith("bare")), None)
    for name, m in launch.items():
        status = f"FAILED {m['failures']} runs" if m["failures"] else f"{m['median_s'] * 1000:.0f} ms"
        r = c.get("ratios", {}).get(name)
        note = "baseline" if name == bare else (f"{r:.2f}× bare engine run (paired rounds)" if r else "no ratio")
        lines.append(f"| container launch: {name} | {status} | {note} |")
    if "staged_added_ms" in c:
        lines.append(f"| container launch: staged − live | {c['staged_added_ms']:+.0f} ms | median of paired rounds |")
    r = c.get("ratios", {}).get(STAGED)
    if bare:
        targets[f"container launch ≤ {TARGET}× bare engine run (warm)"] = (f"{r:.2f}×" if r else "not measured",
                                                                            bool(r and r <= TARGET))
    if new:
        if "skipped" in new:
            lines.append(f"| container launch, new rootless user | not measured | {new['skipped']} |")
        for name in ("first launch", "second launch"):
            m = new.get(name)
            if not m:
                continue
            if m["exit_code"]:
                lines.append(f"| container launch, new rootless user: {name} | FAILED (exit {m['exit_code']}) | "
                             f"{m.get('last_error', '')[-200:]} |")
                continue
            ratio = f"{m['ratio']:.2f}× bare engine run in its storage" if "ratio" in m else "no bare run"
            lines.append(f"| container launch, new rootless user: {name} | {m['seconds'] * 1000:.0f} ms | {ratio} "
                         f"(base {new.get('base', '?')}; storage {new.get('storage_driver', '?')}) |")
    return lines, targets


def _main(argv: list[str]) -> int:
    from relay.dev.measure import container_image

    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + (
        ":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    found = container_image(env)
    if isinstance(found, str):
        print(f"bench: container mode is not measured: {found}", file=sys.stderr)
        return 1
    engine, tag = found
    work = tempfile.mkdtemp(prefix="hive-relay-bench-container-")
    try:
        os.chmod(work, 0o755)
        result: dict = {"warm": measure(engine, tag, env, work, 5 if "--quick" in argv else 15)}
        if "--new-user" in argv:
            result["new_user"] = new_user(engine, env)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    lines, targets = rows(result["warm"], result.get("new_user"))
    for line in lines:
        print(line)
    for name, (value, met) in targets.items():
        print(f"| {name} | {value} | {'yes' if met else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
