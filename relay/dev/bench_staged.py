"""`invoke bench` rows for the staged workdir (issue 25): what staging costs at launch, what review
and apply cost, and the private copy the clone-based peers make instead, all in the same run.

- launch: `--staged` against live, paired rounds on one checkout (target: +10 ms at the median);
- review: `changes` (relay.trust.changes.review), `diff` and `apply` of a real box's 10 changed files in a
  10k- and a 100k-file checkout (target: under 100 ms each, flat in the size of the checkout);
- the peer's way: `cp -a` of the same checkout, timed here, against the staged launch's overhead.

Run alone: `python -m relay.dev.bench_staged [--quick]` (prints the rows as JSON).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from relay.host.paths import state_dir

SIZES = (10_000, 100_000)
EDITS = 10


def _relay(*args: str) -> list[str]:
    return [sys.executable, "-m", "relay", *args]


def _checkout(root: str, files: int) -> str:
    """A checkout of `files` small files, 100 per directory."""
    work = os.path.join(root, f"co-{files}")
    for i in range(files):
        d = os.path.join(work, f"d{i // 100:04d}")
        if i % 100 == 0:
            os.makedirs(d)
        with open(os.path.join(d, f"f{i % 100:02d}.txt"), "w") as fh:
            fh.write(f"line {i}\n")
    os.chmod(work, 0o755)
    return work


def _timed(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _box(env: dict[str, str], work: str, script: str, staged: bool, trace: str | None = None) -> float | None:
    """Run one box; with `trace`, return the launcher's own time from `run` to the box released
    (the runner's trace marks: the layer, the mount and bwrap's start, without Python's start-up)."""
    argv = _relay("shell", "local", "-q", "--workdir", work, *(["--staged"] if staged else []), "--prompt", script)
    proc = subprocess.run(argv, env={**env, **({"HIVE_RELAY_TRACE": trace} if trace else {})}, cwd=work,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench: staged box exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    if not trace:
        return None
    with open(trace) as fh:
        marks = json.load(fh)
    end = marks.get("proxy_started") or marks.get("spawned")
    return end - marks["run"] if end and "run" in marks else None


def _newest_run(env: dict[str, str]):  # noqa: ANN202 - staged.Run
    from relay.trust import staged

    return staged.runs(env)[-1]


def _drop_all(env: dict[str, str], workdir: str) -> None:
    from relay.trust import staged

    for run in staged.runs(env):
        if run.workdir == workdir:
            staged.remove_layer(run.layer.root)


def measure(runs: int = 15, quick: bool = False, env: dict[str, str] | None = None) -> dict:
    from relay.host.paths import PACKAGE_DIR
    from relay.trust import changes
    from relay.ui import changes_text

    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = str(PACKAGE_DIR.parent)
    runs = 5 if quick else runs
    root = tempfile.mkdtemp(prefix="hive-relay-bench-staged-")
    os.chmod(root, 0o755)
    env["HOME"] = os.path.join(root, "home")  # its own state dir: layers and memos of this run only
    env.pop("XDG_STATE_HOME", None)
    os.mkdir(env["HOME"], 0o700)
    out: dict = {"runs": runs, "edits": EDITS, "sizes": {}}
    edit = "; ".join(f"echo staged >> d{i:04d}/f00.txt" for i in range(EDITS))
    try:
        for files in SIZES[:1] if quick else SIZES:
            work = _checkout(root, files)
            row: dict = {}
            # Launch, paired rounds (order alternating), the same `true` with and without --staged.
            _box(env, work, "true", True)  # verify once for each policy (memoized), warm caches
            _box(env, work, "true", False)
            live, stg, tlive, tstg = [], [], [], []
            trace = os.path.join(root, "trace.json")
            for r in range(runs):
                for staged in ((False, True) if r % 2 == 0 else (True, False)):
                    start = time.perf_counter()
                    inside = _box(env, work, "true", staged, trace)
                    (stg if staged else live).append(time.perf_counter() - start)
                    if inside is not None:
                        (tstg if staged else tlive).append(inside)
            _drop_all(env, work)
            diffs = [s - v for s, v in zip(stg, live, strict=True)]
            row["launch_live_ms"] = statistics.median(live) * 1000
            row["launch_staged_ms"] = statistics.median(stg) * 1000
            row["launch_added_ms"] = statistics.median(diffs) * 1000
            if len(tstg) == len(tlive) == runs:  # the same, from the runner's own marks (less noise)
                row["launcher_live_ms"] = statistics.median(tlive) * 1000
                row["launcher_staged_ms"] = statistics.median(tstg) * 1000
                row["launcher_added_ms"] = statistics.median(a - b for a, b in zip(tstg, tlive, strict=True)) * 1000
            # Review of a real box's EDITS changes.
            _box(env, work, edit, True)
            run = _newest_run(env)
            row["changes_ms"] = _timed(lambda run=run: changes.review(run), runs) * 1000
            row["diff_ms"] = _timed(lambda run=run: changes_text.diff_text(run), runs) * 1000
            start = time.perf_counter()
            subprocess.run(_relay("changes", run.layer.run), env=env, capture_output=True, check=True)
            row["changes_cli_ms"] = (time.perf_counter() - start) * 1000
            applies = []
            for _ in range(max(3, runs // 3)):
                _box(env, work, edit, True)
                run = _newest_run(env)
                start = time.perf_counter()
                done, held = changes.apply(run)
                applies.append(time.perf_counter() - start)
                assert len(done) == EDITS and not held, (len(done), held)
            row["apply_ms"] = statistics.median(applies) * 1000
            _drop_all(env, work)
            # The peers' private copy of the same checkout.
            copies = []
            for i in range(3):
                dst = os.path.join(root, f"copy-{files}-{i}")
                start = time.perf_counter()
                subprocess.run(["cp", "-a", work, dst], check=True)
                copies.append(time.perf_counter() - start)
                shutil.rmtree(dst)
            row["cp_a_ms"] = statistics.median(copies) * 1000
            row["staged_vs_cp_a"] = row["cp_a_ms"] / max(row["launch_added_ms"], 0.5)
            out["sizes"][str(files)] = row
            shutil.rmtree(work)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["layers_dir"] = os.path.join(state_dir(env), "staged")
    return out


def rows(r: dict) -> tuple[list[str], dict[str, tuple[str, bool]]]:
    """Markdown rows and targets for bench.report."""
    lines, targets = [], {}
    for files, row in r["sizes"].items():
        n = f"{int(files) // 1000}k files"
        lines += [
            f"| staged launch ({n}): live / staged | {row['launch_live_ms']:.1f} / {row['launch_staged_ms']:.1f} ms | "
            f"+{row['launch_added_ms']:.1f} ms median of paired rounds (wall) |",
            *([f"| staged launch ({n}), launcher run → box released: live / staged | {row['launcher_live_ms']:.1f} / "
               f"{row['launcher_staged_ms']:.1f} ms | +{row['launcher_added_ms']:.1f} ms (trace marks, paired) |"]
              if "launcher_added_ms" in row else []),
            f"| staged review ({n}, {r['edits']} changed): changes / diff / apply | {row['changes_ms']:.1f} / "
            f"{row['diff_ms']:.1f} / {row['apply_ms']:.1f} ms | in-process; `hive-relay changes` wall "
            f"{row['changes_cli_ms']:.0f} ms |",
            f"| private copy ({n}): cp -a | {row['cp_a_ms']:.0f} ms | {row['staged_vs_cp_a']:.0f}× the staged launch's "
            "added time |",
        ]
        added = row.get("launcher_added_ms", row["launch_added_ms"])
        targets[f"staged launch +10 ms at the median ({n})"] = (f"+{added:.1f} ms", added <= 10)
        worst = max(row["changes_ms"], row["diff_ms"], row["apply_ms"])
        targets[f"changes/diff/apply of {r['edits']} files under 100 ms ({n})"] = (f"{worst:.1f} ms", worst < 100)
        if int(files) >= 100_000:
            targets[f"staged ≥ 20× faster than cp -a ({n})"] = (f"{row['staged_vs_cp_a']:.0f}×",
                                                              row["staged_vs_cp_a"] >= 20)
    return lines, targets


if __name__ == "__main__":
    result = measure(quick="--quick" in sys.argv)
    print(json.dumps(result, indent=2))
    for line in rows(result)[0]:
        print(line)
    for name, (value, met) in rows(result)[1].items():
        print(f"| {name} | {value} | {'yes' if met else 'NO'} |")
