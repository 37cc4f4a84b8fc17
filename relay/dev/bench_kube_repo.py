"""`invoke bench --kube-repo`: kube mode on a real-sized checkout, on this machine.

A generated repository (by default 200 MB in 50,000 files, incompressible, one commit) fans out to
3 shell boxes through `podman kube play`, the proxy pod serving the bundle (relay/modes/kube_bundle.py).
Reported against the same run's baseline, a bare `podman run --rm IMAGE true` of the box image:

- the bundle's creation on the host (git's own work, paid once per run);
- the time from the play's start to the first box's agent running (the proxy pod up, the bundle
  streamed in, fetched, checked and cloned by the box's init container);
- the time until all boxes are done, and whether each brought back its patch.

A baseline that fails is not timed (the report says so instead of a ratio).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

from relay.host.fs_view import HostFs
from relay.host.paths import PACKAGE_ROOT


def make_repo(path: str, files: int, total_mb: int) -> None:
    """`files` files of random bytes, `total_mb` in all, under 100 directories, in one commit."""
    os.makedirs(path)
    size = max(1, (total_mb << 20) // files)
    for i in range(files):
        d = os.path.join(path, f"d{i % 100:02d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i}.bin"), "wb") as fh:
            fh.write(os.urandom(size))
    git = ["git", "-C", path, "-c", "user.email=b@b", "-c", "user.name=b"]
    subprocess.run(["git", "init", "-q", path], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "bench"], check=True)


def bench_kube_repo(files: int = 50_000, total_mb: int = 200, count: int = 3, env: dict[str, str] | None = None) -> dict:
    from relay.config.load import get_backend, load_matrix
    from relay.host.probe import probe
    from relay.modes import kube_podman, kube_proxy_image
    from relay.modes.image_tag import with_image
    from relay.modes.kube_run import kube_run_for, make_bundle, stage_results
    from relay.plan.resolve import Request, resolve
    from relay.trust import changes, staged
    from relay.trust.kube_stage import bundle_head, stamp_ctime

    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    work = tempfile.mkdtemp(prefix="hive-relay-bench-kube-repo-")
    try:
        repo = os.path.join(work, "checkout")
        start = time.perf_counter()
        make_repo(repo, files, total_mb)
        made = time.perf_counter() - start
        command = 'echo "started $(date +%s.%N)"; echo changed >> "d00/f${JOB_COMPLETION_INDEX}00.bin"'
        req = Request("shell", mode="kube", workdir=repo, run_id=f"benchrepo-{os.getpid()}-{os.urandom(3).hex()}",
                      prompt="x", argv_override=("/bin/bash", "-c", command))
        matrix = load_matrix(env, workdir=None)
        plan = resolve(get_backend(matrix, "shell"), matrix, req, with_image(probe(env), matrix, req, env), env, fs=HostFs())
        run = kube_podman.local_run(kube_run_for(plan, req.run_id, count, count, env), env)
        kube_proxy_image.build_proxy_image(["podman"], run.image, env)
        # The baseline as relay/dev/bench.py's container rows run it (this host's rlimits need the --ulimit).
        bare = ["podman", "--log-level=error", "run", "--rm", "--network", "none", "--read-only",
                "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=512:512",
                *(["--userns", "keep-id"] if os.getuid() else []), run.image, "true"]
        base = subprocess.run(bare, env=env, capture_output=True)
        baseline = None
        if base.returncode == 0:  # warm now; time the second
            t = time.perf_counter()
            ok = subprocess.run(bare, env=env, capture_output=True).returncode == 0
            baseline = time.perf_counter() - t if ok else None
        env = {**env, "XDG_STATE_HOME": os.path.join(work, "state")}  # the staged runs: this bench's own
        base_ctime = stamp_ctime(env)
        t = time.perf_counter()
        bundle = make_bundle(repo)
        bundled = time.perf_counter() - t
        t_wall = time.time()
        t = time.perf_counter()
        played = kube_podman.play(plan, run, bundle, env, os.path.join(work, "play"), timeout=1800)
        all_done = time.perf_counter() - t
        starts = []
        for log in played.logs.values():
            for line in log.splitlines():
                if line.startswith("started "):
                    starts.append(float(line.split()[1]) - t_wall)
        first = min(starts) if starts else None
        failures = sum(1 for r in played.results if r.exit_code != 0 or not r.patch) + count - len(played.results)
        untouched = subprocess.run(["git", "-C", repo, "status", "--porcelain"], capture_output=True,
                                   text=True).stdout == ""
        t = time.perf_counter()
        outcomes = stage_results(plan, run.run_id, bundle_head(bundle), base_ctime, played.results, env)
        staged_s = time.perf_counter() - t
        t = time.perf_counter()
        applied = held = 0
        for o in outcomes:
            if o.run:
                done, kept = changes.apply(staged.find(env, o.run))
                applied, held = applied + len(done), held + len(kept)
        applied_s = time.perf_counter() - t
        landed = len([ln for ln in subprocess.run(["git", "-C", repo, "status", "--porcelain"], capture_output=True,
                                                  text=True).stdout.splitlines() if ln.strip()])

        def ratio(x: float | None) -> float | None:
            return round(x / baseline, 1) if x is not None and baseline else None

        return {"files": files, "repo_MB": total_mb, "boxes": count, "bundle_MB": round(len(bundle) / (1 << 20), 1),
                "repo_made_s": round(made, 1), "bundle_s": round(bundled, 2),
                "first_box_running_s": round(first, 2) if first is not None else None,
                "all_done_s": round(all_done, 2),
                "podman_run_baseline_s": round(baseline, 3) if baseline else "failed: not timed",
                "first_box_over_podman_run": ratio(first), "bundle_plus_first_box_over_podman_run":
                    ratio(first + bundled) if first is not None else None,
                "checkout_untouched_before_apply": untouched, "staged_runs": sum(1 for o in outcomes if o.run),
                "stage_all_s": round(staged_s, 2), "apply_all_s": round(applied_s, 2), "applied": applied,
                "held": held, "files_changed_in_checkout_after_apply": landed,
                "failures": failures + sum(1 for o in outcomes if o.error)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
