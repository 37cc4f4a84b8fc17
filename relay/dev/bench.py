"""`invoke bench`: what users feel, each figure a median over repeated runs and a ratio against a
baseline measured in the same run (absolute times on shared machines are not stable).

Writes bench/results/<stamp>.{json,md} and bench/results/latest.{json,md}.
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
from pathlib import Path

from relay.dev.measure import container_image, median_time, one_core_busy, paired, ratio
from relay.host.fs_view import HostFs
from relay.host.paths import PACKAGE_ROOT, cache_dir
from relay.model.errors import RelayError

BENCH = PACKAGE_ROOT / "bench"
RESULTS = BENCH / "results"
PEERS_PKG = "@anthropic-ai/sandbox-runtime"
MB = 1 << 20


def peers_dir(env: dict[str, str]) -> Path:
    return cache_dir(env) / "peers"


def srt_path(env: dict[str, str]) -> str | None:
    pkg = peers_dir(env) / "node_modules" / PEERS_PKG / "package.json"
    if not pkg.exists():
        return shutil.which("srt")
    bins = json.loads(pkg.read_text()).get("bin", {})
    rel = bins.get("srt") if isinstance(bins, dict) else bins
    return str(pkg.parent / rel) if rel else None


def install_peers(env: dict[str, str]) -> str | None:
    """npm install srt into the peers dir; returns why it failed, or None."""
    from relay.modes.install import NPM_BOUNDS, Progress, run_npm

    npm = shutil.which("npm", path=env.get("PATH"))
    if npm is None:
        return "npm is missing; fix: apt-get install nodejs npm"
    target = peers_dir(env)
    target.mkdir(parents=True, exist_ok=True)
    print(f"bench: installing {PEERS_PKG} into {target} (npm)", file=sys.stderr, flush=True)
    progress = Progress(PEERS_PKG, sys.stderr)
    rc = run_npm([npm, "install", "--no-audit", "--no-fund", "--progress=false", "--loglevel=silly", "--prefix",
                  str(target), PEERS_PKG], {**NPM_BOUNDS, **env}, progress)
    progress.close(None if rc else f"installed {PEERS_PKG} in {progress.elapsed():.1f} s")
    return f"npm install {PEERS_PKG} failed (exit {rc}: {progress.reason or 'see above'})" if rc else None


def ensure_ripgrep(env: dict[str, str]) -> str | None:
    """srt refuses to start without ripgrep: install it as root (apt), else say why the peer is out."""
    if shutil.which("rg", path=env.get("PATH")):
        return None
    if os.getuid() == 0 and shutil.which("apt-get", path=env.get("PATH")):
        print("bench: srt needs ripgrep (rg): installing ripgrep (apt-get)", file=sys.stderr, flush=True)
        apt = {**env, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "-q", "ripgrep"]
        if subprocess.run(cmd, env=apt, stdout=sys.stderr, stdin=subprocess.DEVNULL).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=apt, stdout=sys.stderr, stdin=subprocess.DEVNULL)
            subprocess.run(cmd, env=apt, stdout=sys.stderr, stdin=subprocess.DEVNULL)
        if shutil.which("rg", path=env.get("PATH")):
            return None
    return "srt needs ripgrep (rg), which is not installed; fix: sudo apt-get install ripgrep"


def srt_settings(work: str, host: str) -> str:
    """srt's policy for the comparison: one allowed host, writes to the workdir only."""
    path = os.path.join(work, "srt-settings.json")
    with open(path, "w") as fh:
        json.dump({"network": {"allowedDomains": [host], "deniedDomains": []},
                   "filesystem": {"denyRead": [], "allowWrite": [work], "denyWrite": []}}, fh)
    return path


def ready_peer(env: dict[str, str], work: str, host: str) -> tuple[list[str] | None, str | None]:
    """(argv prefix for `srt ... CMD`, None) when srt installs and runs `true` with exit 0 here;
    (None, why) otherwise: a peer that cannot run is refused, never timed."""
    if not srt_path(env):
        why = install_peers(env)
        if why:
            return None, why
    srt = srt_path(env)
    if not srt:
        return None, f"{PEERS_PKG} installed no srt binary"
    why = ensure_ripgrep(env)
    if why:
        return None, why
    argv = [srt, "--settings", srt_settings(work, host)]
    proc = subprocess.run([*argv, "true"], env=env, cwd=work, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])[:300]
        return None, f"`srt true` exits {proc.returncode} here: {tail}"
    return argv, None


def _relay(*args: str) -> list[str]:
    return [sys.executable, "-m", "relay", *args]


def _box_json(args: list[str], env: dict[str, str], cwd: str) -> object:
    proc = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"bench step failed ({proc.returncode}): {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tree_rss(pid: int, skip: Callable[[str], bool]) -> int:
    """PSS (bytes) of pid and its descendants, skipping processes whose cmdline `skip` matches.
    PSS, not RSS: the forked janitor shares its pages with the launcher, and RSS would count them twice."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = Path(f"/proc/{p}/smaps_rollup").read_text()
            children = []
            for task in os.listdir(f"/proc/{p}/task"):
                children += Path(f"/proc/{p}/task/{task}/children").read_text().split()
        except OSError:
            continue
        if skip(cmd):
            continue
        for line in status.splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1]) * 1024
        stack += [int(c) for c in children]
    return total


def _peak_rss(argv: list[str], env: dict[str, str], cwd: str, skip: Callable[[str], bool]) -> tuple[int, int]:
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid, skip))
        time.sleep(0.01)
    return peak, proc.returncode


LAUNCH_ORDER = ("sh -c true", "bare bwrap", "relay entry (python -m relay)", "bin/contribute-hive",
                "invoke contribute-hive", "srt true (peer)")
SCENARIOS = ("idle", "one core busy")
# Targets against the peer, in both scenarios: (entry, at most this many times srt's launch).
PEER_TARGETS = (("bin/contribute-hive", 0.35), ("invoke contribute-hive", 0.6))  # issue 26: 0.35×


def launch_commands(box: list[str], srt: list[str] | None) -> dict[str, list[str]]:
    bwrap = shutil.which("bwrap") or "bwrap"
    cmds = {
        "sh -c true": ["sh", "-c", "true"],
        "bare bwrap": [bwrap, "--unshare-all", "--ro-bind", "/", "/", "true"],
        "relay entry (python -m relay)": _relay(*box, "true"),
        "bin/contribute-hive": [str(PACKAGE_ROOT / "bin" / "contribute-hive"), *box, "true"],
        "invoke contribute-hive": [sys.executable, "-m", "invoke", "--search-root", str(PACKAGE_ROOT),
                                   "contribute-hive", *box, "true"],
    }
    if srt:
        cmds["srt true (peer)"] = [*srt, "true"]
    return cmds


def measure_launch(box: list[str], srt: list[str] | None, runs: int, env: dict[str, str], work: str) -> dict:
    """Paired launch timings, idle and with one core kept busy."""
    cmds = launch_commands(box, srt)
    # Steady state: the bytecode a first launch writes (absent where PYTHONDONTWRITEBYTECODE is set,
    # which would time compiling every module on every launch instead).
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(PACKAGE_ROOT / "relay"), str(PACKAGE_ROOT / "tasks.py")],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    for name, argv in cmds.items():  # warm caches (memoized probes, page cache); a failure here is fatal
        proc = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise RelayError(f"bench: {name} exits {proc.returncode}: {proc.stderr.strip()[-300:]}")
    out = {"idle": paired(cmds, runs, env, work)}
    with one_core_busy():
        out["one core busy"] = paired(cmds, runs, env, work)
    return out


def bench(runs: int = 15, with_peers: bool = False, quick: bool = False, launch_only: bool = False,
          new_user: bool = False) -> int:
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(PACKAGE_ROOT))
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    blob_mb = 32 if quick else 200
    runs = 5 if quick else runs
    work = tempfile.mkdtemp(prefix="hive-relay-bench-")
    server = None
    results: dict = {"runs": runs, "blob_mb": blob_mb, "machine": {"cores": os.cpu_count()}}
    try:
        os.chmod(work, 0o755)
        shutil.copy(BENCH / "client.py", work)
        big, mid = os.path.join(work, "big.bin"), os.path.join(work, "mid.bin")
        with open(big, "wb") as fh:
            fh.truncate(blob_mb * MB)
        with open(mid, "wb") as fh:
            fh.truncate(4 * MB)
        server = subprocess.Popen([sys.executable, str(BENCH / "blobserver.py"), big, mid], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        port = int(server.stdout.readline())
        # tls=false: the blob server speaks plain HTTP inside the CONNECT tunnel (the SNI check's own
        # cost is measured with TLS, in relay/dev/bench_tunnels.py).
        allow = f"bench.test:{port}=127.0.0.1:{port},tls=false"
        box = ["shell", "local", "-q", "--workdir", work, "--allow-host", allow, "--prompt"]

        # 1. Launch overhead against the baselines and the peer (one allowed host each), paired runs.
        srt = None
        if with_peers:
            srt, why = ready_peer(env, work, "bench.test")
            if why:
                print(f"bench: srt is not compared: {why}", file=sys.stderr, flush=True)
                results["peer_refused"] = why
        scenarios = measure_launch(box, srt, runs, env, work)
        results["launch_scenarios"] = scenarios
        results["launch"] = scenarios["idle"]
        launch = {k: (v["median_s"], v["failures"]) for k, v in scenarios["idle"].items()}
        if launch_only:
            if new_user:  # the container rows too, the new user's with them
                results["container"] = _bench_container(env, work, runs, port, blob_mb, throughput=False)
                results["container_new_user"] = _new_user(env)
            return report(results)

        # Phases of one launch, from the runner's trace marks.
        trace_file = os.path.join(work, "trace.json")
        phases: dict[str, list[float]] = {}
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run(_relay(*box, "true"), env={**env, "HIVE_RELAY_TRACE": trace_file}, cwd=work, check=True)
            total = time.perf_counter() - start
            marks = json.loads(Path(trace_file).read_text())
            order = ["cli", "config_loaded", "probed", "resolved", "verified", "run", "seccomp_compiled", "spawned",
                     "box_ready", "proxy_started", "agent_exited", "torn_down"]
            present = [m for m in order if m in marks]
            for a, b in zip(present, present[1:], strict=False):
                phases.setdefault(f"{a} → {b}", []).append(marks[b] - marks[a])
            phases.setdefault("total (wall)", []).append(total)
        py_start = median_time([sys.executable, "-c", "pass"], runs, env, work)[0]
        py_imports = median_time([sys.executable, "-c", "import relay.commands.cli, relay.modes.runner, relay.plan.resolve"], runs, env, work)[0]
        results["phases_s"] = {"python start": py_start, "python start + relay imports": py_imports,
                               **{k: statistics.median(v) for k, v in phases.items()}}

        # 2. Proxy throughput: the same download direct on loopback and through the proxy.
        # Interleaved rounds (direct, plain, CONNECT) so that drift on a shared machine hits all three alike;
        # the direct baseline is the same Python client on the host, straight to the server on loopback.
        client = [sys.executable, os.path.join(work, "client.py")]
        direct, plain, tunnel = [], [], []
        for _ in range(2 if quick else 5):
            direct += _box_json([*client, "get", "bench.test", str(port), "1"], env, work)
            plain += _box_json(_relay(*box, f"/usr/bin/python3 client.py get bench.test {port} 1 127.0.0.1:3128"), env, work)
            tunnel += _box_json(_relay(*box, f"/usr/bin/python3 client.py connect bench.test {port} 1 127.0.0.1:3128"), env, work)

        def mbps(samples: list) -> float:
            return statistics.median(b / s for b, s in samples) / MB

        results["throughput_MBps"] = {"direct": mbps(direct), "proxy plain HTTP": mbps(plain), "proxy CONNECT": mbps(tunnel)}

        # 2a. The tunnel checks (a TLS ClientHello read and judged) against TLS direct / unchecked.
        from relay.dev import bench_tunnels

        results["tunnel_checks"] = bench_tunnels.measure(quick)
        # 2a'. TLS inspection (relay/egress/inspect.py) against TLS straight to the same upstream.
        results["inspection"] = bench_tunnels.measure_inspection(quick)

        # 2b. A credential route (plain HTTP -> proxy adds the key -> TLS upstream) against direct TLS.
        results["credential_route"] = measure_credential_route(work, env, blob_mb, quick)

        # Small-request latency, p50 and p99.
        n = 100 if quick else 300
        lat_direct = _box_json([*client, "latency", "bench.test", str(port), str(n)], env, work)
        lat_proxy = _box_json(_relay(*box, f"/usr/bin/python3 client.py latency bench.test {port} {n} 127.0.0.1:3128"), env, work)

        def pct(xs: list, q: float) -> float:
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000

        results["latency_ms"] = {"direct p50": pct(lat_direct, 0.5), "direct p99": pct(lat_direct, 0.99),
                                 "proxy p50": pct(lat_proxy, 0.5), "proxy p99": pct(lat_proxy, 0.99)}

        # 3/4. Concurrent tunnels from 1 to 200: aggregate throughput, errors, launcher+proxy peak RSS.
        scale = {}
        for count in ((1, 10, 50) if quick else (1, 10, 50, 100, 200)):
            out = _box_json(_relay(*box, f"/usr/bin/python3 client.py tunnels bench.test {port} {count} 127.0.0.1:3128"), env, work)
            scale[str(count)] = {"aggregate_MBps": out["bytes"] / out["seconds"] / MB, "errors": out["errors"],
                                 "seconds": out["seconds"]}
        results["tunnels"] = scale

        def not_box(cmd: str) -> bool:
            return "bwrap" in cmd.split(" ")[0] or cmd.startswith("/usr/bin/python3 client.py")

        count = 50 if quick else 200
        rss_busy, _ = _peak_rss(_relay(*box, f"/usr/bin/python3 client.py tunnels bench.test {port} {count} 127.0.0.1:3128"),
                                env, work, not_box)
        rss_idle, _ = _peak_rss(_relay(*box, "sleep 0.5"), env, work, not_box)
        memory = {"launcher+proxy idle MiB": rss_idle / MB, f"launcher+proxy with {count} tunnels MiB": rss_busy / MB}
        if srt:
            rss_srt, _ = _peak_rss([*srt, "sleep 0.5"], env, work, lambda c: c.startswith("bwrap") or c.startswith("sleep"))
            memory["srt idle MiB (peer)"] = rss_srt / MB
        results["memory"] = memory

        # 5. Container mode, when the engine answers and this user's image is built (bench never builds it).
        results["container"] = _bench_container(env, work, runs, port, blob_mb)
        if new_user:
            results["container_new_user"] = _new_user(env)

        # 4. Ten boxes at once.
        start = time.perf_counter()
        procs = [subprocess.Popen(_relay(*box, "echo started"), env=env, cwd=work, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True) for _ in range(10)]
        started, failures = [], 0
        for p in procs:
            out, _ = p.communicate()
            failures += p.returncode != 0 or "started" not in out
            started.append(time.perf_counter() - start)
        results["ten_boxes"] = {"all_done_s": max(started), "single_box_s": launch["relay entry (python -m relay)"][0],
                                "failures": failures}

        # 6. The staged workdir: launch against live, review and apply, and the peers' cp -a (relay/dev/bench_staged.py).
        from relay.dev import bench_staged

        results["staged"] = bench_staged.measure(runs, quick, env)

        # 6b. The agent state's secret search: the copy with and without it, cold and warm (relay/dev/bench_state_scan.py).
        from relay.dev import bench_state_scan

        results["state_scan"] = bench_state_scan.measure(3 if quick else 7, quick)

        # 7. The gvisor tier: our launch against bare `runsc do true` and our supervised launch (relay/dev/bench_gvisor.py).
        from relay.dev import bench_gvisor

        results["gvisor"] = bench_gvisor.measure(runs, env)
        if "skipped" not in results["gvisor"]:
            results["gvisor"]["throughput"] = bench_gvisor.measure_throughput(2 if quick else 5, blob_mb, env)
            # Container mode on runsc against a bare `podman --runtime runsc run` of the same image.
            results["gvisor"]["container"] = bench_gvisor.measure_container(runs, env)

        # 8. The vm tier under TCG: boot-to-prompt, a figure (relay/dev/bench_vm.py; one boot in --quick).
        from relay.dev import bench_vm

        results["vm"] = bench_vm.measure(quick, env)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        shutil.rmtree(work, ignore_errors=True)
    return report(results)


def _first_event_and_rest(sock, request: bytes, start: float) -> tuple[float, int]:  # noqa: ANN001 - a socket
    """Send `request`, then (seconds from `start` until the first SSE `data:` arrived, bytes read to EOF)."""
    sock.sendall(request)
    buf, got, first, total = bytearray(1 << 16), b"", 0.0, 0
    view = memoryview(buf)
    while True:
        n = sock.recv_into(buf)
        if not n:
            break
        total += n
        if not first and len(got) < (1 << 16):  # an SSE answer's first event is in its first bytes
            got += bytes(view[:n])
            if b"\r\n\r\n" in got and b"data:" in got.partition(b"\r\n\r\n")[2]:
                first = time.perf_counter() - start
    return first, total


def measure_credential_route(work: str, env: dict[str, str], blob_mb: int, quick: bool) -> dict:
    """A credential route as a box's CLI uses it (plain HTTP to the proxy, which adds the key and
    re-originates TLS to the pinned upstream) against the same request made directly over TLS from
    the host to the same local TLS server: time to the first SSE event, and throughput of a large
    response. Rounds alternate direct and route, and ratios are taken round by round. The server and
    the proxy each run in a process of their own (bench/tlsserver.py, bench/credproxy.py). The outbound
    secret scan's cost: a second proxy without it (`noscan`: no request scan, a 2xx body searched for
    the key's ends only), the same route through both in alternating rounds, on a one-byte blob and on
    SSE text, as throughput and as the proxy's CPU per MiB (the steadier of the two when the machine
    is shared)."""
    import socket
    import ssl

    ca_key, ca, key, csr, cert, ext = (os.path.join(work, n) for n in
                                       ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem", "srv.ext"))
    Path(ext).write_text("subjectAltName=DNS:bench.test\nextendedKeyUsage=serverAuth\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for args in (["req", "-x509", *ec, "-days", "1", "-subj", "/CN=hive relay bench CA", "-keyout", ca_key, "-out", ca],
                 ["req", *ec, "-subj", "/CN=bench.test", "-keyout", key, "-out", csr],
                 ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1",
                  "-extfile", ext, "-out", cert]):
        subprocess.run(["openssl", *args], check=True, capture_output=True)
    procs: list[subprocess.Popen] = []

    def start(*argv: str) -> int:
        proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, text=True, env=env)
        procs.append(proc)
        assert proc.stdout is not None
        return int(proc.stdout.readline())

    try:
        tls_port = start(str(BENCH / "tlsserver.py"), cert, key, str(blob_mb))
        proxy_port = start(str(BENCH / "credproxy.py"), ca, str(tls_port))
        clocks = {proxy_port: int(procs[-1].stdout.readline())}  # type: ignore[union-attr]
        noscan_port = start(str(BENCH / "credproxy.py"), ca, str(tls_port), "noscan")
        clocks[noscan_port] = int(procs[-1].stdout.readline())  # type: ignore[union-attr]

        def cpu_of(port: int) -> float:  # the proxy's process CPU time, every thread, to the nanosecond
            with socket.create_connection(("127.0.0.1", clocks[port])) as s:
                return float(s.makefile().read())
        ctx = ssl.create_default_context(cafile=ca)

        def direct(path: str) -> tuple[float, int, float]:
            start_t = time.perf_counter()
            with ctx.wrap_socket(socket.create_connection(("127.0.0.1", tls_port)), server_hostname="bench.test") as s:
                first, n = _first_event_and_rest(s, f"GET {path} HTTP/1.1\r\nHost: bench.test\r\n"
                                                    f"x-api-key: sk-bench\r\nConnection: close\r\n\r\n".encode(), start_t)
            return first, n, time.perf_counter() - start_t

        def route(path: str, port: int = proxy_port) -> tuple[float, int, float]:
            start_t = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port)) as s:
                first, n = _first_event_and_rest(s, f"GET /bench{path} HTTP/1.1\r\nHost: 127.0.0.1:3128\r\n"
                                                    f"x-api-key: hive-relay-placeholder\r\n\r\n".encode(), start_t)
            return first, n, time.perf_counter() - start_t

        # Time to first event counts from before connect, as the CLI sees it (its TLS handshake, or the proxy's).
        sse: dict[str, list[float]] = {"direct": [], "route": []}
        for i in range(20 if quick else 60):
            for name, fetch in ((("direct", direct), ("route", route)) if i % 2 else (("route", route), ("direct", direct))):
                sse[name].append(fetch("/sse")[0])
        tp: dict[str, list[float]] = {"direct": [], "route": []}
        for i in range(3 if quick else 5):
            for name, fetch in ((("direct", direct), ("route", route)) if i % 2 else (("route", route), ("direct", direct))):
                _, n, took = fetch("/big")
                tp[name].append(n / took / MB)
        # The outbound secret scan's cost (relay/egress/secret_scan.py): the same route with and without it,
        # on the one-byte blob and on SSE text, rounds alternating.
        # Wall-clock rounds swing by ±10% on a shared machine, so the proxy's own CPU time per MiB (from
        # /proc, summed over all rounds) is taken too: the route is bound by the proxy's CPU.
        scan: dict[str, list[float]] = {f"{kind} {w}": [] for kind in ("blob", "text") for w in ("scan", "no scan")}
        cpu: dict[str, list[float]] = {k: [0.0, 0.0] for k in scan}  # [CPU seconds, MiB]
        for i in range(6 if quick else 16):
            for kind, path in (("blob", "/big"), ("text", "/text")):
                pair = (("scan", proxy_port), ("no scan", noscan_port))
                for w, port in pair if i % 2 else pair[::-1]:
                    before = cpu_of(port)
                    _, n, took = route(path, port)
                    cpu[f"{kind} {w}"][0] += cpu_of(port) - before
                    cpu[f"{kind} {w}"][1] += n / MB
                    scan[f"{kind} {w}"].append(n / took / MB)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000

    return {
        "sse_first_event_ms": {"direct TLS p50": pct(sse["direct"], 0.5), "route p50": pct(sse["route"], 0.5),
                               "direct TLS p99": pct(sse["direct"], 0.99), "route p99": pct(sse["route"], 0.99)},
        "sse_ratio": statistics.median(r / d for r, d in zip(sse["route"], sse["direct"], strict=True)),
        "throughput_MBps": {"direct TLS": statistics.median(tp["direct"]), "route": statistics.median(tp["route"])},
        "throughput_ratio": statistics.median(r / d for r, d in zip(tp["route"], tp["direct"], strict=True)),
        "scan_MBps": {k: statistics.median(v) for k, v in scan.items()},
        "scan_cpu_ms_per_MiB": {k: c / m * 1000 for k, (c, m) in cpu.items()},
        "scan_cpu_ratio": {kind: (cpu[f"{kind} scan"][0] / cpu[f"{kind} scan"][1])
                           / (cpu[f"{kind} no scan"][0] / cpu[f"{kind} no scan"][1]) for kind in ("blob", "text")},
        "scan_ratio": {kind: statistics.median(a / b for a, b in zip(scan[f"{kind} scan"], scan[f"{kind} no scan"], strict=True))
                       for kind in ("blob", "text")},
        "blob_mb": blob_mb,
    }


def _new_user(env: dict[str, str]) -> dict:
    """Opt-in (`--new-user`): a fresh storage builds the image, which takes minutes."""
    from relay.dev.bench_container import new_user

    found = container_image(env)
    return new_user(found[0], env) if isinstance(found, tuple) else {"skipped": found}


def _curl_mbps(argv: list[str], env: dict[str, str], cwd: str) -> float:
    out = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True).stdout
    size, seconds = out.split()[-2:]
    return float(size) / float(seconds) / MB


def _bench_container(env: dict[str, str], work: str, runs: int, port: int, blob_mb: int,
                     throughput: bool = True) -> dict:
    found = container_image(env)
    if isinstance(found, str):
        return {"skipped": found}
    engine, tag = found
    box = ["shell", "container", "-q", "--workdir", work, "--allow-host", f"bench.test:{port}=127.0.0.1:{port}",
           "--prompt"]
    from relay.dev import bench_container

    # Warm launches (staged, --live, a bare engine run), paired rounds: relay/dev/bench_container.py.
    warm = bench_container.measure(engine, tag, env, work, runs, f"bench.test:{port}=127.0.0.1:{port}")
    if "skipped" in warm or not throughput:
        return warm
    # The same curl download direct, through the local box's proxy and through the container's
    # (interleaved rounds): the proxy is the same code, so the two proxied figures should match.
    curl = "curl -s -o /dev/null -w '%{size_download} %{time_total}'"
    local_box = ["shell", "local", *box[2:]]
    direct, local, proxied = [], [], []
    for _ in range(3):
        direct.append(_curl_mbps(["sh", "-c", f"{curl} http://127.0.0.1:{port}/big"], env, work))
        local.append(_curl_mbps(_relay(*local_box, f"{curl} http://bench.test:{port}/big"), env, work))
        proxied.append(_curl_mbps(_relay(*box, f"{curl} http://bench.test:{port}/big"), env, work))
    return {**warm,
            "throughput_MBps": {"direct curl": statistics.median(direct),
                                "local box curl via proxy": statistics.median(local),
                                "container curl via proxy": statistics.median(proxied)},
            "blob_mb": blob_mb}


def _fmt_ratio(value: float | None, launch: dict[str, dict], a: str, b: str) -> str:
    if value is not None:
        return f"{value:.2f}×"
    failed = [n for n in (a, b) if n in launch and launch[n]["failures"]]
    if failed:
        return "no ratio: " + ", ".join(f"{n} failed {launch[n]['failures']} of {len(launch[n]['exit_codes'])} runs "
                                        f"(exit {sorted(set(c for c in launch[n]['exit_codes'] if c))})" for n in failed)
    return "not measured"


def launch_report(r: dict) -> tuple[list[str], dict[str, tuple[str, bool]]]:
    """The launch table (every scenario, ratios against baselines and the peer from paired rounds)
    and the launch targets. A ratio is never computed against a run that failed."""
    lines: list[str] = []
    targets: dict[str, tuple[str, bool]] = {}
    peer = "srt true (peer)"
    for scenario, launch in r["launch_scenarios"].items():
        for name in [n for n in LAUNCH_ORDER if n in launch]:
            m = launch[name]
            status = f"FAILED {m['failures']} of {len(m['exit_codes'])} runs" if m["failures"] else f"{m['median_s'] * 1000:.1f} ms"
            notes = [f"{_fmt_ratio(ratio(launch, name, base), launch, name, base)} {label}"
                     for base, label in (("bare bwrap", "bare bwrap"), (peer, "srt")) if base != name and base in launch]
            lines.append(f"| launch ({scenario}): {name} | {status} | {', '.join(notes)} |")
        for entry, limit in PEER_TARGETS:
            key = f"{entry} ≤ {limit}× srt true ({scenario})"
            if peer not in launch:
                targets[key] = (f"not measured: {r.get('peer_refused') or 'srt not installed (--with-peers)'}", False)
                continue
            value = ratio(launch, entry, peer)
            targets[key] = (_fmt_ratio(value, launch, entry, peer), value is not None and value <= limit)
    return lines, targets


def report(r: dict) -> int:
    lines, targets = launch_report(r)
    if "throughput_MBps" not in r:  # --launch-only (with --new-user: the container launch rows too)
        if r.get("container"):
            from relay.dev.bench_container import rows as container_rows

            more, more_targets = container_rows(r["container"], r.get("container_new_user"))
            lines += more
            targets.update(more_targets)
        return _write(r, ["| measure | value | ratio / note |", "|---|---|---|", *lines], targets)
    launch = {k: v["median_s"] for k, v in r["launch"].items()}
    entry = launch["relay entry (python -m relay)"]
    tp = r["throughput_MBps"]
    lat = r["latency_ms"]
    mem = r["memory"]
    busy_key = next(k for k in mem if "tunnels" in k)
    targets.update({
        "relay entry within 60 ms of bare bwrap": (f"+{(entry - launch['bare bwrap']) * 1000:.0f} ms",
                                                   entry - launch["bare bwrap"] <= 0.060),
        "proxy throughput ≥ 0.8× direct": (f"{min(tp['proxy plain HTTP'], tp['proxy CONNECT']) / tp['direct']:.2f}×",
                                           min(tp["proxy plain HTTP"], tp["proxy CONNECT"]) >= 0.8 * tp["direct"]),
        "added p50 latency < 2 ms": (f"{lat['proxy p50'] - lat['direct p50']:.2f} ms", lat["proxy p50"] - lat["direct p50"] < 2),
        "launcher+proxy PSS ≤ 40 MiB": (f"{mem[busy_key]:.1f} MiB", mem[busy_key] <= 40),
    })
    cr = r.get("credential_route")
    if cr:
        sse, ctp = cr["sse_first_event_ms"], cr["throughput_MBps"]
        added = sse["route p50"] - sse["direct TLS p50"]
        targets["credential route: added SSE first-event p50 < 2 ms"] = (f"{added:.2f} ms", added < 2)
        targets["credential route throughput ≥ 0.8× direct TLS"] = (f"{cr['throughput_ratio']:.2f}×",
                                                                   cr["throughput_ratio"] >= 0.8)
        if "scan_cpu_ratio" in cr:  # the proxy's CPU per MiB: steadier than wall-clock rounds on a shared machine
            worst = max(cr["scan_cpu_ratio"].values())
            targets["secret scan adds < 5% to the route's proxy CPU per MiB"] = (f"{(worst - 1) * 100:+.1f}%", worst < 1.05)
    lines = ["| measure | value | ratio / note |", "|---|---|---|", *lines]
    if r.get("tunnel_checks"):
        from relay.dev import bench_tunnels

        more, checks = bench_tunnels.rows(r["tunnel_checks"])
        lines += more
        targets.update(checks)
    if r.get("inspection"):
        from relay.dev import bench_tunnels

        more, checks = bench_tunnels.inspection_rows(r["inspection"])
        lines += more
        targets.update(checks)
    for name, t in r["phases_s"].items():
        lines.append(f"| phase: {name} | {t * 1000:.1f} ms | |")
    for name, v in tp.items():
        lines.append(f"| throughput ({r['blob_mb']} MB): {name} | {v:.0f} MB/s | {v / tp['direct']:.2f}× direct |")
    for name, v in lat.items():
        lines.append(f"| latency {name} | {v:.2f} ms | |")
    if cr:
        for name, v in cr["sse_first_event_ms"].items():
            lines.append(f"| credential route: SSE first event, {name} | {v:.2f} ms | |")
        lines.append(f"| credential route: SSE first event, route / direct TLS | {cr['sse_ratio']:.2f}× | "
                     "median of paired rounds, from before connect |")
        for name, v in cr["throughput_MBps"].items():
            note = "baseline" if name == "direct TLS" else f"{cr['throughput_ratio']:.2f}× direct TLS (paired rounds)"
            lines.append(f"| credential route throughput ({cr['blob_mb']} MB): {name} | {v:.0f} MB/s | {note} |")
        for kind, v in cr.get("scan_ratio", {}).items():
            got, ms = cr["scan_MBps"], cr["scan_cpu_ms_per_MiB"]
            lines.append(f"| credential route with the secret scan ({kind}) | {got[f'{kind} scan']:.0f} MB/s against "
                         f"{got[f'{kind} no scan']:.0f} MB/s without | {v:.3f}× (paired rounds) |")
            lines.append(f"| credential route with the secret scan ({kind}): proxy CPU | {ms[f'{kind} scan']:.2f} ms/MiB "
                         f"against {ms[f'{kind} no scan']:.2f} ms/MiB without | {cr['scan_cpu_ratio'][kind]:.3f}× |")
    one = r["tunnels"]["1"]["aggregate_MBps"]
    for n, v in r["tunnels"].items():
        lines.append(f"| {n} concurrent tunnels | {v['aggregate_MBps']:.0f} MB/s aggregate | {v['aggregate_MBps'] / one:.2f}× one tunnel, {v['errors']} errors |")
    for name, v in mem.items():
        lines.append(f"| memory: {name} | {v:.1f} MiB | |")
    tb = r["ten_boxes"]
    lines.append(f"| 10 boxes at once | {tb['all_done_s'] * 1000:.0f} ms until all done | {tb['all_done_s'] / tb['single_box_s']:.1f}× one box, {tb['failures']} failures |")
    c = r.get("container", {})
    if "skipped" in c:
        lines.append(f"| container mode | not measured | {c['skipped']} |")
    elif c:
        from relay.dev.bench_container import rows as container_rows

        more, more_targets = container_rows(c, r.get("container_new_user"))
        lines += more
        targets.update(more_targets)
        ctp = c["throughput_MBps"]
        for name, v in ctp.items():
            lines.append(f"| container throughput ({c['blob_mb']} MB): {name} | {v:.0f} MB/s | "
                         f"{v / ctp['direct curl']:.2f}× direct curl |")
    if r.get("staged"):
        from relay.dev.bench_staged import rows as staged_rows

        more, more_targets = staged_rows(r["staged"])
        lines += more
        targets.update(more_targets)
    if r.get("state_scan"):
        from relay.dev.bench_state_scan import rows as scan_rows

        lines += scan_rows(r["state_scan"])[0]
    if r.get("gvisor"):
        from relay.dev.bench_gvisor import rows as gvisor_rows

        more, more_targets = gvisor_rows(r["gvisor"])
        lines += more
        targets.update(more_targets)
    if r.get("vm"):
        from relay.dev.bench_vm import rows as vm_rows

        more, more_targets = vm_rows(r["vm"])
        lines += more
        targets.update(more_targets)
    return _write(r, lines, targets)


def _write(r: dict, lines: list[str], targets: dict[str, tuple[str, bool]]) -> int:
    r["targets"] = {k: {"value": v, "met": bool(m)} for k, (v, m) in targets.items()}
    lines = [*lines, "", "| target | value | met |", "|---|---|---|"]
    for name, t in r["targets"].items():
        lines.append(f"| {name} | {t['value']} | {'yes' if t['met'] else 'NO'} |")
    md = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in (stamp, "latest"):
        (RESULTS / f"{name}.json").write_text(json.dumps(r, indent=2) + "\n")
        (RESULTS / f"{name}.md").write_text(md)
    print(md)
    print(f"bench: results in {RESULTS}/{stamp}.md and .json")
    return 0


def _pods_pss(prefix: str, env: dict[str, str]) -> int:
    """PSS (bytes) of every process in the pods named PREFIX-* (found by the pod id in their cgroup
    path), plus this launcher (its proxy forwarder threads). The pods are not our children."""
    ids = subprocess.run(["podman", "pod", "ls", "-q", "--no-trunc", "--filter", f"name={prefix}"], capture_output=True,
                         text=True, env=env).stdout.split()
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cgroup = Path(f"/proc/{pid}/cgroup").read_text()
            if not (int(pid) == os.getpid() or any(i in cgroup for i in ids)):
                continue
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def bench_kube(count: int = 10, env: dict[str, str] | None = None) -> dict:
    """kube mode's fan-out on this machine: `count` shell boxes through podman kube play (all at
    once, proxy pod included) against `count` sequential container-mode runs of the same command;
    peak host memory in use above the idle baseline during the fan-out (the machine is shared, so
    this is an upper bound). Every box must bring back its patch."""
    import tempfile
    import threading

    from relay.config.load import get_backend, load_matrix
    from relay.host.probe import probe
    from relay.modes import kube_podman, kube_proxy_image
    from relay.modes.image_tag import with_image
    from relay.modes.kube_run import kube_run_for, make_bundle
    from relay.plan.resolve import Request, resolve

    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    work = tempfile.mkdtemp(prefix="hive-relay-bench-kube-")
    try:
        repo = os.path.join(work, "checkout")
        os.makedirs(repo)
        git = ["git", "-C", repo, "-c", "user.email=b@b", "-c", "user.name=b"]
        subprocess.run(["git", "init", "-q", repo], check=True)
        with open(os.path.join(repo, "README.md"), "w") as fh:
            fh.write("bench\n")
        subprocess.run([*git, "add", "README.md"], check=True)
        subprocess.run([*git, "commit", "-qm", "bench"], check=True)
        command = "echo changed >> README.md"
        req = Request("shell", mode="kube", workdir=repo, run_id=f"bench-{os.getpid()}-{os.urandom(3).hex()}",
                      prompt=command)
        matrix = load_matrix(env, workdir=None)
        plan = resolve(get_backend(matrix, "shell"), matrix, req, with_image(probe(env), matrix, req, env), env, fs=HostFs())
        run = kube_podman.local_run(kube_run_for(plan, req.run_id, count, count, env), env)
        kube_proxy_image.build_proxy_image(["podman"], run.image, env)
        bundle = make_bundle(repo)
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.2):
                peak[0] = max(peak[0], _pods_pss(kube_podman.pod_prefix(run.run_id), env))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.perf_counter()
        played = kube_podman.play(plan, run, bundle, env, os.path.join(work, "play"), timeout=900)
        fan_out = time.perf_counter() - start
        done.set()
        sampler.join()
        failures = sum(1 for r in played.results if r.exit_code != 0 or not r.patch or b"+changed" not in r.patch)
        failures += count - len(played.results)
        start = time.perf_counter()
        seq_failures = 0
        for _ in range(count):
            proc = subprocess.run(_relay("shell", "container", "-q", "--workdir", repo, "--prompt", command), env=env,
                                  cwd=repo, stdin=subprocess.DEVNULL, capture_output=True)
            seq_failures += proc.returncode != 0
        sequential = time.perf_counter() - start
        return {"boxes": count, "kube_fan_out_all_done_s": round(fan_out, 2),
                f"{count}_sequential_container_runs_s": round(sequential, 2),
                "ratio_sequential_over_fan_out": round(sequential / fan_out, 2),
                "peak_pods_and_launcher_pss_MiB": round(peak[0] / MB, 1),
                "fan_out_failures": failures, "sequential_failures": seq_failures}
    finally:
        shutil.rmtree(work, ignore_errors=True)
