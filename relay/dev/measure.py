"""How the bench times things: commands paired round by round (so that drift on a shared machine hits all alike), ratios taken per round, the loaded scenario, and which container image a run would use."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


def median_time(argv: list[str], runs: int, env: dict[str, str], cwd: str) -> tuple[float, int]:
    times, failures = [], 0
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
        failures += proc.returncode != 0
    return statistics.median(times), failures


def paired(cmds: dict[str, list[str]], runs: int, env: dict[str, str], cwd: str) -> dict[str, dict]:
    """Every command once per round, the order rotated each round, so that drift on a shared machine
    hits all of them alike; ratios are then taken round by round. A command that exits non-zero
    is a failed measure (a failing peer would time as "fast"), kept with its exit codes."""
    names = list(cmds)
    out = {name: {"times": [], "exit_codes": []} for name in names}
    for r in range(runs):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            proc = subprocess.run(cmds[name], env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE)
            out[name]["times"].append(time.perf_counter() - start)
            out[name]["exit_codes"].append(proc.returncode)
            if proc.returncode:
                out[name]["last_error"] = proc.stderr.decode(errors="replace").strip()[-600:]
                print(f"bench: {name} exited {proc.returncode}: {out[name]['last_error'][-300:]}", file=sys.stderr)
    for name in names:
        m = out[name]
        m["median_s"] = statistics.median(m["times"])
        m["failures"] = sum(rc != 0 for rc in m["exit_codes"])
    return out


def ratio(launch: dict[str, dict], a: str, b: str) -> float | None:
    """Median over rounds of a/b; None when either side is missing or failed in any round."""
    if a not in launch or b not in launch or launch[a]["failures"] or launch[b]["failures"]:
        return None
    return statistics.median(x / y for x, y in zip(launch[a]["times"], launch[b]["times"], strict=True))


@contextmanager
def one_core_busy(limit_s: float = 900.0) -> Iterator[None]:
    """The loaded scenario: one process spinning on one core, bounded in time even if we die."""
    code = f"import time\nend = time.monotonic() + {limit_s}\nwhile time.monotonic() < end:\n    pass\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
    try:
        time.sleep(0.2)  # spinning before the first timed run
        yield
    finally:
        proc.kill()
        proc.wait()


def container_image(env: dict[str, str]) -> tuple[str, str] | str:
    """(engine, image tag) for this user's container runs, or why container mode is not measured."""
    from relay.config.load import load_matrix
    from relay.host.container_engine import info
    from relay.host.probe import probe
    from relay.modes.image import exists
    from relay.modes.image_tag import spec_from_env
    from relay.plan.resolve import choose_engine

    try:
        engine = choose_engine(probe(env), env)
    except Exception as err:  # noqa: BLE001 - any reason is a note in the report
        return str(err)
    if info(engine).error:
        return f"{engine} does not answer"
    tag = spec_from_env(load_matrix(env, workdir=None).backends, os.getuid(), os.getgid(), env).tag
    return (engine, tag) if exists([engine], tag) else f"image {tag} not built (invoke build-image)"
