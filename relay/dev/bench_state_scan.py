"""`invoke bench` rows for the agent state's secret search (relay/trust/state_scan.py, issue 29): the
host step that copies the agent's state into the box, with the search and without, paired round by
round in the same run on the same synthetic state dir.

- the copy alone: `agentstate.copy_in` with no host secret (what every launch paid before);
- the copy with the search, cold: the same with the host's secrets (a route's key, a login's JWT) and
  no memo, as a first launch or the first after a token was refreshed: every file is read;
- the copy with the search, warm: the memo of files found clean in place, as every later launch.

The state dir is shaped like a months-old `~/.claude`: JSONL transcripts (text, paths, UUIDs), one
holding a base64 screenshot, logs and small JSON files, SIZE_MB in all (32 with --quick). No target is
set by the issue; the rows are ratios against the copy alone, so a reader sees what the search costs.
Run alone: `python -m relay.dev.bench_state_scan [--quick]`.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import uuid

from relay.egress.secret_scan import secret_forms
from relay.trust import agentstate


def _make_state(home: str, size_mb: int) -> int:
    """The synthetic state dir under HOME/.claude; returns its size in bytes."""
    root = os.path.join(home, ".claude")
    projects = os.path.join(root, "projects", "-home-dev-src-app")
    os.makedirs(projects)
    os.makedirs(os.path.join(root, "logs"))
    total, n = 0, 0
    line = json.dumps({"type": "assistant", "cwd": "/home/dev/src/app", "uuid": str(uuid.uuid4()), "message": {
        "content": "Let me read src/app/handlers.py and fix the retry loop in fetch_all() so it backs off. " * 4}})
    while total < size_mb << 20:
        path = os.path.join(projects, f"{uuid.uuid4()}.jsonl")
        with open(path, "w") as fh:
            body = (line + "\n") * 2000
            if n == 3:  # a pasted screenshot
                body += json.dumps({"type": "user", "image": base64.b64encode(os.urandom(3 << 20)).decode()}) + "\n"
            fh.write(body)
        total += os.path.getsize(path)
        n += 1
    for i in range(40):
        with open(os.path.join(root, "logs", f"mcp-{i}.json"), "w") as fh:
            json.dump({"server": f"s{i}", "events": ["connected", "listed tools"] * 20}, fh)
    return total


def _copy(home: str, run: str, secrets_: tuple, cache: str) -> tuple[float, agentstate.AgentState]:
    box = os.path.join(run, "home")
    os.makedirs(box)
    state = agentstate.new(home, (os.path.join(home, ".claude"),), (), (), os.path.join(run, "state"), "1-deadbeef")
    state.secrets, state.memo_env = secrets_, {"HOME": home, "XDG_CACHE_HOME": cache}
    start = time.perf_counter()
    agentstate.copy_in(state, box)
    took = time.perf_counter() - start
    shutil.rmtree(run)
    return took, state


def measure(runs: int, quick: bool) -> dict:
    """Paired rounds of the three copies (see the module's docstring)."""
    size_mb = 32 if quick else 200
    base = tempfile.mkdtemp(prefix="hive-relay-bench-scan-")
    try:
        home = os.path.join(base, "home")
        os.makedirs(home)
        size = _make_state(home, size_mb)
        sought = (secret_forms("the anthropic route's key", "sk-ant-api03-" + secrets.token_urlsafe(70)),
                  secret_forms("~/.codex/auth.json tokens.access_token",
                               "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0." + secrets.token_urlsafe(256)))
        warm_cache = os.path.join(base, "warm-cache")
        _copy(home, os.path.join(base, "warmup"), sought, warm_cache)  # the memo, and the page cache
        times: dict[str, list[float]] = {"copy alone": [], "copy + search, cold": [], "copy + search, warm": []}
        scanned = 0
        kinds = [("copy alone", (), None), ("copy + search, cold", sought, "cold"), ("copy + search, warm", sought, "")]
        for i in range(runs):
            for name, with_secrets, cache in kinds[i % 3:] + kinds[:i % 3]:  # each its turn first
                took, state = _copy(home, os.path.join(base, f"r{i}-{len(times[name])}-{cache}"), with_secrets,
                                    os.path.join(base, f"cold{i}") if cache == "cold" else warm_cache)
                times[name].append(took)
                scanned = max(scanned, state.scanned_bytes)
        alone = times["copy alone"]
        return {
            "size_mb": size / (1 << 20), "scanned_mb": scanned / (1 << 20),
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "ratio": {k: statistics.median(a / b for a, b in zip(v, alone, strict=True)) for k, v in times.items()},
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)


def rows(r: dict) -> tuple[list[str], dict[str, tuple[str, bool]]]:
    """Markdown rows for bench.report (a figure: the issue sets no target for it)."""
    lines = []
    for name, median in r["median_s"].items():
        note = "baseline" if name == "copy alone" else f"{r['ratio'][name]:.2f}× the copy alone (paired rounds)"
        lines.append(f"| agent state ({r['size_mb']:.0f} MB): {name} | {median * 1000:.0f} ms | {note} |")
    cold = r["median_s"]["copy + search, cold"] - r["median_s"]["copy alone"]
    if cold > 0:
        lines.append(f"| agent state search, cold | {r['scanned_mb'] / cold:.0f} MB/s | {r['scanned_mb']:.0f} MB read |")
    return lines, {}


if __name__ == "__main__":
    result = measure(3 if "--quick" in sys.argv else 7, "--quick" in sys.argv)
    print(json.dumps(result, indent=2))
    for row in rows(result)[0]:
        print(row)
