"""kube mode's pod specs, run for real by `podman kube play` (there is no cluster here).

The Job's pod template becomes one pod per index on `--network none`; the proxy Deployment's pod
runs our proxy on the host network; the launcher's listener in each box pod's network namespace is
spliced to it (relay/modes/kube_podman.py). Attack + twin: the box reaches an allowed host only through
the proxy, a host not on the list is denied, a direct connection has no route; AF_UNIX sockets get
EPERM under the Localhost seccomp profile while socketpair works; each box has its own user
namespace (hostUsers: false) and its own workspace; N boxes bring back N patches and the checkout
is untouched.

Root and unprivileged alike (CI runs both). As root, `hostUsers: false` makes podman 4.3 pick an
automatic user namespace from the `containers` ranges in /etc/subuid and /etc/subgid (.ci/run adds
them); rootless, from the user's own range. Rootless on cgroup v1 the memory limit is a hard
rlimit instead of a cgroup (kube_podman.rlimit_resources); the test checks whichever applies.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from relay.config.load import get_backend, load_matrix
from relay.host.fs_view import HostFs
from relay.host.probe import probe
from relay.model.vocab import LimitsMethod
from relay.modes import kube_podman, kube_proxy_image
from relay.modes.image_tag import with_image
from relay.modes.kube_run import kube_run_for, make_bundle, stage_results, write_patches
from relay.plan.resolve import Request, resolve
from relay.trust import changes, staged
from relay.trust.kube_stage import bundle_head, stamp_ctime

from .conftest import _storage_conf, podman_env
from .servers import Handler, start_http

BOX = r"""
echo "changed by box $JOB_COMPLETION_INDEX" >> README.md
echo new > "new-$JOB_COMPLETION_INDEX.txt"
echo "uidmap $(awk '{print $1"-"$2"-"$3}' /proc/self/uid_map | head -1)"
echo "ifaces $(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\n' ,)"
echo "ids $(id -u):$(id -g)"
echo "caps $(awk '/^CapEff/ {print $2}' /proc/self/status) nnp $(awk '/^NoNewPrivs/ {print $2}' /proc/self/status)"
if touch /usr/hive-relay-probe 2>/dev/null; then echo "rootfs writable"; else echo "rootfs read-only"; fi
echo "rlimit-data $(ulimit -H -d) nproc $(ulimit -H -u)"
echo "cgroup-memory $(cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max 2>/dev/null)"
python3 - <<'PY'
import socket
try:
    socket.socket(socket.AF_UNIX)
    print("af_unix allowed")
except PermissionError:
    print("af_unix EPERM")
a, b = socket.socketpair()
print("socketpair ok")
PY
echo "via-proxy $(curl -sS -m 10 http://upstream.test:$PORT/hello 2>&1)"
echo "denied $(curl -sS -m 10 -o /dev/null -w '%{http_code}' http://other.test:$PORT/ 2>&1)"
echo "direct $(curl -sS -m 5 --noproxy '*' http://$HOSTIP:$PORT/ 2>&1 | head -c 80)"
"""


def _host_ip() -> str:
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return out[0] if out else "192.0.2.1"


def _podman_storage(home: Path) -> None:
    """Rootless podman finds its storage through $HOME: the real user's, where the image is."""
    conf = _storage_conf()
    if conf:
        (home / ".config" / "containers").mkdir(parents=True)
        (home / ".config" / "containers" / "storage.conf").write_text(conf)


def _play_with_secrets(plan, run_id: str, work: Path, env: dict, tmp_path: Path, ca: Path, server):  # noqa: ANN001, ANN202
    """One box pod and the proxy pod under podman kube play, the proxy's Secret read on the host from the
    plan's routes, the upstreams' throwaway CA trusted by the proxy; the fake upstream stops after."""
    from relay.modes.kube_secrets import secret_values

    run = kube_podman.local_run(kube_run_for(plan, run_id, 1, 1, env), env)
    kube_proxy_image.build_proxy_image(["podman"], run.image, env)
    try:
        return kube_podman.play(plan, run, make_bundle(str(work)), env, str(tmp_path / "play"), timeout=300,
                                secret_values=secret_values(plan, env), proxy_ca=str(ca))
    finally:
        server.shutdown()


def _checkout(tmp_path: Path) -> Path:
    work = tmp_path / "checkout"
    work.mkdir()
    git = ["git", "-C", str(work), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    (work / "README.md").write_text("hello\n")
    subprocess.run([*git, "add", "README.md"], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    return work


def test_fan_out_of_shell_boxes_through_podman_kube_play(tmp_path: Path, image: str) -> None:
    server, port, _ = start_http()
    work = _checkout(tmp_path)
    env = {**podman_env(), "PORT": str(port)}
    host_ip = _host_ip()
    script = BOX.strip().replace("$PORT", str(port)).replace("$HOSTIP", host_ip)  # podman 4.3 misreads a leading newline
    req = Request("shell", mode="kube", workdir=str(work), run_id=f"kubetest-{os.getpid()}-{os.urandom(3).hex()}",
                  prompt="x", allow_hosts=(f"upstream.test:{port}=127.0.0.1:{port}",),
                  argv_override=("/bin/bash", "-c", script))
    matrix = load_matrix(env, workdir=None)
    facts = with_image(probe(env), matrix, req, env)
    plan = resolve(get_backend(matrix, "shell"), matrix, req, facts, env, fs=HostFs())
    run = kube_podman.local_run(kube_run_for(plan, req.run_id, 3, 2, env), env)
    assert run.image == image
    kube_proxy_image.build_proxy_image(["podman"], run.image, env)
    env = {**env, "XDG_STATE_HOME": str(tmp_path / "state")}
    base_ctime = stamp_ctime(env)
    bundle = make_bundle(str(work))
    try:
        played = kube_podman.play(plan, run, bundle, env, str(tmp_path / "play"), timeout=300)
    finally:
        server.shutdown()
    assert [r.index for r in played.results] == [0, 1, 2]
    uid = os.getuid() or 1000
    memory = plan.limits.memory

    def memory_limited(log: str) -> bool:
        if os.getuid() != 0 and plan.limits.method is not LimitsMethod.CGROUP_V2:
            return f"rlimit-data {memory >> 10} nproc {plan.limits.pids}\n" in log  # hard limits; -d counts KiB
        return f"cgroup-memory {memory}\n" in log

    for r in played.results:
        log = played.logs[r.index]
        assert r.exit_code == 0, log
        assert "af_unix EPERM" in log and "socketpair ok" in log, log  # attack refused, twin works
        assert "uidmap 0-" in log and "uidmap 0-0-" not in log, log  # its own user namespace (hostUsers: false)
        assert "ifaces lo," in log, log  # no interface but loopback
        assert f"ids {uid}:{uid}" in log, log  # the image's contributor, never root
        assert "caps 0000000000000000 nnp 1" in log, log  # no capabilities, no privilege escalation
        assert "rootfs read-only" in log, log
        assert memory_limited(log), log  # the profile's memory: a cgroup as root, an rlimit rootless on cgroup v1
        assert "via-proxy hello from the fake upstream" in log, log + played.proxy_log[-3000:]  # through the proxy
        assert "denied 403" in log, log  # a host not on the list
        assert "direct curl:" in log, log  # no route of its own
        patch = r.patch.decode()
        assert f"+changed by box {r.index}" in patch and f"new-{r.index}.txt" in patch
        assert all(f"box {i}" not in patch for i in range(3) if i != r.index)  # a workspace of its own
    assert sum("GET /hello" in line for line in Handler.requests) >= 3
    assert '"decision": "deny"' in played.proxy_log and "other.test" in played.proxy_log
    written = write_patches(str(tmp_path / "run"), played.results)
    assert len(written) == 3
    # Nothing came back into the checkout; each patch applies there for review.
    assert subprocess.run(["git", "-C", str(work), "status", "--porcelain"], capture_output=True,
                          text=True).stdout == ""
    subprocess.run(["git", "-C", str(work), "apply", "--check", written[1]], check=True)
    # Each box's patch is a staged run; apply box 0, then box 1: its README edit is a conflict, its new file lands.
    outcomes = stage_results(plan, run.run_id, bundle_head(bundle), base_ctime, played.results, env)
    assert [o.error for o in outcomes] == [None] * 3 and all(o.run for o in outcomes), outcomes
    first, second = (staged.find(env, o.run) for o in outcomes[:2])
    done, held = changes.apply(first)
    assert sorted(e.path for e in done) == ["README.md", "new-0.txt"] and not held
    done, held = changes.apply(second)
    assert [e.path for e in done] == ["new-1.txt"] and [e.path for e, _ in held] == ["README.md"]
    assert (work / "README.md").read_text() == "hello\nchanged by box 0\n"
    assert (work / "new-1.txt").read_text() == "new\n"
    leftovers = subprocess.run(["podman", "pod", "ls", "-q", "--filter", f"name={kube_podman.pod_prefix(run.run_id)}"],
                               capture_output=True, text=True, env=env).stdout
    assert leftovers.strip() == ""


def test_a_real_claude_turn_in_a_kube_pod_through_the_proxy_pod(tmp_path: Path, image: str) -> None:
    """The image's pinned claude, in the Job's pod spec under podman kube play, answers through the
    proxy pod (the fake API pinned with --allow-host); its own call elsewhere is denied there.
    The fake key is in the command only because the fake API is not a credential route's upstream;
    a real key stays in the proxy's Secret (tests/test_kube_render.py)."""
    from .fake_api import ANSWER, start

    server, port = start()
    work = _checkout(tmp_path)
    env = podman_env()
    script = (f"export ANTHROPIC_API_KEY=sk-ant-fake ANTHROPIC_BASE_URL=http://fake-api.test:{port}; "
              "claude -p 'say the answer'; echo \"other $(curl -sS -o /dev/null -w '%{http_code}' "
              "http://example.com/ 2>&1)\"")
    req = Request("shell", mode="kube", workdir=str(work), run_id=f"kubeclaude-{os.getpid()}-{os.urandom(3).hex()}",
                  prompt="x", allow_hosts=(f"fake-api.test:{port}=127.0.0.1:{port}",),
                  argv_override=("/bin/bash", "-c", script))
    matrix = load_matrix(env, workdir=None)
    plan = resolve(get_backend(matrix, "shell"), matrix, req, with_image(probe(env), matrix, req, env), env, fs=HostFs())
    run = kube_podman.local_run(kube_run_for(plan, req.run_id, 1, 1, env), env)
    kube_proxy_image.build_proxy_image(["podman"], run.image, env)
    try:
        played = kube_podman.play(plan, run, make_bundle(str(work)), env, str(tmp_path / "play"), timeout=300)
    finally:
        server.shutdown()
    log = played.logs[0]
    assert played.results[0].exit_code == 0, log
    assert ANSWER in log and "other 403" in log
    assert server.requests, "the fake API saw no request"
    assert '"host": "fake-api.test"' in played.proxy_log and '"decision": "allow"' in played.proxy_log


def test_a_box_past_its_time_is_removed_with_its_pods_and_volumes(tmp_path: Path, image: str) -> None:
    """The timeout path: the launcher gives up, and every pod and volume of the run is gone."""
    work = _checkout(tmp_path)
    env = podman_env()
    req = Request("shell", mode="kube", workdir=str(work), run_id=f"kubeslow-{os.getpid()}-{os.urandom(3).hex()}",
                  prompt="x", argv_override=("sleep", "300"))
    matrix = load_matrix(env, workdir=None)
    plan = resolve(get_backend(matrix, "shell"), matrix, req, with_image(probe(env), matrix, req, env), env, fs=HostFs())
    run = kube_podman.local_run(kube_run_for(plan, req.run_id, 2, 2, env), env)
    kube_proxy_image.build_proxy_image(["podman"], run.image, env)
    with pytest.raises(TimeoutError):
        kube_podman.play(plan, run, make_bundle(str(work)), env, str(tmp_path / "play"), timeout=20)
    prefix = kube_podman.pod_prefix(run.run_id)
    pods = subprocess.run(["podman", "pod", "ls", "-q", "--filter", f"name={prefix}"], capture_output=True, text=True,
                          env=env).stdout
    volumes = [v for v in subprocess.run(["podman", "volume", "ls", "-q"], capture_output=True, text=True,
                                         env=env).stdout.split() if v.startswith(prefix)]
    assert pods.strip() == "" and volumes == []
    containers = subprocess.run(["podman", "ps", "-a", "-q", "--filter", f"name={prefix}"], capture_output=True,
                                text=True, env=env).stdout
    assert containers.strip() == ""  # the sleeping boxes were stopped, not left running


def test_rootless_cgroup_v1_limits_become_hard_rlimits_in_the_command() -> None:
    """What rlimit_resources makes of a container really limits what it runs (the same /bin/sh,
    dash, as the image's), hard limits included, and the spec keeps no `resources` that rootless
    `kube play` would fail on."""
    spec = {"initContainers": [{"name": "i", "command": ["true"], "resources": {"limits": {"memory": "64Mi"}}}],
            "containers": [{"name": "c", "command": ["cat", "/proc/self/limits"],
                            "resources": {"limits": {"memory": "512Mi", "cpu": "2"}}}]}
    kube_podman.rlimit_resources(spec, pids=321)
    box = spec["containers"][0]
    assert "resources" not in box and "resources" not in spec["initContainers"][0]
    out = subprocess.run(box["command"], capture_output=True, text=True, check=True).stdout
    data = next(line for line in out.splitlines() if line.startswith("Max data size")).split()
    procs = next(line for line in out.splitlines() if line.startswith("Max processes")).split()
    assert data[3:5] == [str(512 << 20)] * 2 and procs[2:4] == ["321", "321"]  # soft and hard


def test_rootless_plays_the_users_own_image() -> None:
    """Root plays the cluster's image (uid 1000); a user plays the image build-image made for them."""
    from relay.modes.kube_objects import KubeRun

    run = KubeRun(run_id="r", image="localhost/hive-relay-contributor:x-u1000", proxy_image="p")
    assert kube_podman.local_run(run, {}, uid=0) == run
    mine = kube_podman.local_run(run, {}, uid=4242)
    assert mine.image.endswith("-u4242") and mine.proxy_image == kube_proxy_image.proxy_image_tag(mine.image)
    assert kube_podman.local_run(run, {"HIVE_RELAY_KUBE_IMAGE": "x"}, uid=4242) == run


def test_a_real_checkout_travels_with_its_uncommitted_work_and_comes_back_staged(tmp_path: Path, image: str) -> None:
    """The workspace outside the API server, at a size no ConfigMap holds (8 MiB of history and
    files), with the user's uncommitted edit and untracked file: the box sees the checkout as the
    user does (and not the ignored secret), its patch is staged against that snapshot, and applies
    on top of the user's uncommitted work without a conflict. The user's index and refs never move."""
    work = _checkout(tmp_path)
    git = ["git", "-C", str(work), "-c", "user.email=t@t", "-c", "user.name=t"]
    (work / "blobs").mkdir()
    for i in range(8):
        (work / "blobs" / f"b{i}.bin").write_bytes(os.urandom(1 << 20))  # incompressible: the bundle is > 8 MiB
    (work / ".gitignore").write_text(".env\n")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "blobs"], check=True)
    (work / "README.md").write_text("hello\nthe user's uncommitted line\n")
    (work / "notes.txt").write_text("untracked notes\n")
    (work / ".env").write_text("SECRET=ignored-stays-home\n")
    status = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout
    refs = subprocess.run([*git, "for-each-ref"], capture_output=True, text=True).stdout
    env = {**podman_env(), "XDG_STATE_HOME": str(tmp_path / "state")}
    script = ('cat README.md; cat notes.txt; test -e .env && echo ENV-SEEN; git status --porcelain | sed "s/^/st /"; '
              'echo "box line" >> README.md')
    req = Request("shell", mode="kube", workdir=str(work), run_id=f"kubebig-{os.getpid()}-{os.urandom(3).hex()}",
                  prompt="x", argv_override=("/bin/bash", "-c", script))
    matrix = load_matrix(env, workdir=None)
    plan = resolve(get_backend(matrix, "shell"), matrix, req, with_image(probe(env), matrix, req, env), env, fs=HostFs())
    run = kube_podman.local_run(kube_run_for(plan, req.run_id, 1, 1, env), env)
    kube_proxy_image.build_proxy_image(["podman"], run.image, env)
    base_ctime = stamp_ctime(env)
    bundle = make_bundle(str(work))
    assert len(bundle) > 8 << 20
    assert subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout == status
    assert subprocess.run([*git, "for-each-ref"], capture_output=True, text=True).stdout == refs
    played = kube_podman.play(plan, run, bundle, env, str(tmp_path / "play"), timeout=300)
    log = played.logs[0]
    assert played.results[0].exit_code == 0, log
    assert "the user's uncommitted line" in log and "untracked notes" in log and "ENV-SEEN" not in log, log
    assert "st  M README.md" in log and "st ?? notes.txt" in log, log  # uncommitted in the box too
    [out] = stage_results(plan, run.run_id, bundle_head(bundle), base_ctime, played.results, env)
    assert out.error is None and out.run, out
    r = staged.find(env, out.run)
    entries = changes.review(r).entries
    assert [(e.path, e.kind, e.conflict) for e in entries] == [("README.md", "modified", None)]
    done, held = changes.apply(r)
    assert [e.path for e in done] == ["README.md"] and not held
    assert (work / "README.md").read_text() == "hello\nthe user's uncommitted line\nbox line\n"


def test_the_kube_repo_bench_runs_and_every_box_brings_its_patch(image: str) -> None:
    """`invoke bench --kube-repo`, scaled down (300 files, 3 MB, 2 boxes): the rows are there, the
    baseline was timed, and every box came back with its patch."""
    from relay.dev.bench_kube_repo import bench_kube_repo

    r = bench_kube_repo(files=300, total_mb=3, count=2, env=podman_env())
    assert r["failures"] == 0, r
    assert isinstance(r["podman_run_baseline_s"], float) and r["first_box_running_s"] is not None, r
    assert r["bundle_MB"] >= 2.5 and r["first_box_over_podman_run"] is not None, r
    # Each box's patch staged, the checkout untouched until then, each applied (one file per box).
    assert r["checkout_untouched_before_apply"] and r["staged_runs"] == 2 and r["applied"] == 2, r
    assert r["held"] == 0 and r["files_changed_in_checkout_after_apply"] == 2, r



def test_a_grant_and_a_login_route_work_from_a_pod_with_the_secret_only_in_the_proxy_pod(
        tmp_path: Path, image: str) -> None:
    """The whole credential policy on the cluster, for real under podman kube play: a box pod calls
    an `auth:` grant's route and claude's login route; the TLS upstreams (a throwaway CA, the real
    names pinned to 127.0.0.1) receive the real grant secret and the real login token, which only
    the proxy pod got (relay/modes/kube_secrets.py); the box's probe of its env, /proc and files finds
    only the placeholder, and must find that. Attack twin: the placeholder sent to an allowed host
    that is no route's upstream arrives there as the placeholder."""
    import json as _json
    import time as _time

    from . import fake_api
    from .servers import make_ca

    ca, tls = make_ca(tmp_path, ("api.anthropic.com", "grant.test", "other.test"))
    ca.chmod(0o644)
    server, port = fake_api.start(tls=tls)
    work = _checkout(tmp_path)
    home = tmp_path / "home"
    (home / ".claude").mkdir(parents=True)
    access = "sk-ant-oat01-REAL-LOGIN-" + os.urandom(8).hex()
    (home / ".claude" / ".credentials.json").write_text(_json.dumps({"claudeAiOauth": {
        "accessToken": access, "refreshToken": "sk-ant-ort01-REAL-REFRESH", "scopes": ["user:inference"],
        "expiresAt": int((_time.time() + 10 * 3600) * 1000)}}))
    _podman_storage(home)
    grant = "ghp_REALGRANT" + os.urandom(8).hex()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"auth:\n  gr:\n    host: grant.test:{port}\n    secret: {{env: [TEST_GRANT]}}\n"
                   "    send: authorization-bearer\n")
    env = {k: v for k, v in podman_env().items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update({"HOME": str(home), "HIVE_RELAY_CONFIG": str(cfg), "TEST_GRANT": grant})
    probe_script = (
        'echo "grant $(curl -s -o /dev/null -w %{http_code} http://127.0.0.1:3128/gr/v1/hello)"; '
        'echo "login $(curl -s -o /dev/null -w %{http_code} -H "Authorization: Bearer $CLAUDE_CODE_OAUTH_TOKEN" '
        '-H "content-type: application/json" -d "{}" "$ANTHROPIC_BASE_URL/v1/messages")"; '
        f'echo "other $(curl -sk -o /dev/null -w %{{http_code}} -H "Authorization: Bearer $CLAUDE_CODE_OAUTH_TOKEN" '
        f'https://other.test:{port}/x)"; '
        'found=$( (env; cat /proc/*/environ 2>/dev/null | tr "\\0" "\\n"; '
        'find "$HOME" /tmp -type f -exec cat {} + 2>/dev/null) | grep -c hive-relay-placeholder); '
        'echo "placeholder-seen $found"; '
        f'(env; cat /proc/*/environ 2>/dev/null; find "$HOME" /tmp -type f -exec cat {{}} + 2>/dev/null) '
        f'| grep -q -e REAL-LOGIN -e ghp_REALGRANT -e REAL-REFRESH && echo REAL-FOUND; true')
    req = Request("claude", mode="kube", workdir=str(work), run_id=f"kubecred-{os.getpid()}-{os.urandom(3).hex()}",
                  prompt="x", argv_override=("/bin/bash", "-c", probe_script),
                  allow_hosts=(f"api.anthropic.com:443=127.0.0.1:{port}", f"grant.test:{port}=127.0.0.1:{port}",
                               f"other.test:{port}=127.0.0.1:{port}"))
    matrix = load_matrix(env, workdir=None)
    plan = resolve(get_backend(matrix, "claude"), matrix, req, with_image(probe(env), matrix, req, env), env, fs=HostFs())
    assert {r.name for r in plan.credentials} >= {"gr", "anthropic-login"}, plan.credentials
    played = _play_with_secrets(plan, req.run_id, work, env, tmp_path, ca, server)
    log = played.logs[0]
    assert "grant 200" in log and "login 200" in log, log + played.proxy_log[-3000:]
    assert "REAL-FOUND" not in log and access not in log and grant not in log, log
    assert int(log.split("placeholder-seen ")[1].split()[0]) > 0, log  # a blind probe cannot pass
    seen = [h.get("authorization", "") for h in server.headers_seen]
    assert f"Bearer {grant}" in seen and f"Bearer {access}" in seen, seen
    assert "Bearer hive-relay-placeholder" in seen  # other.test is no route's upstream: no swap there
    assert access not in played.proxy_log and grant not in played.proxy_log



def test_a_gvisor_plan_is_refused_by_the_kube_play_proof_never_played_on_runc(tmp_path: Path) -> None:
    """podman kube play cannot run a pod on runsc here (relay/modes/kube_podman.py says why): a plan whose
    box pods ask for runtimeClassName gvisor is refused before any pod exists, never played on runc. The
    twin: the same plan without --isolation gvisor has no runtime class (the fan-out test plays those)."""
    from relay.model.errors import RefusedError

    work = _checkout(tmp_path)
    env = podman_env()
    req = Request("shell", mode="kube", workdir=str(work), run_id=f"kubegv-{os.getpid()}-{os.urandom(3).hex()}",
                  prompt="x", argv_override=("/bin/bash", "-c", "echo RAN"), isolation="gvisor")
    matrix = load_matrix(env, workdir=None)
    image = "localhost/hive-relay-contributor:0123456789ab-u1000"  # never pulled nor run: refused before
    facts = replace(probe(env), image=image)
    plan = resolve(get_backend(matrix, "shell"), matrix, req, facts, env, fs=HostFs())
    run = kube_run_for(plan, req.run_id, 1, 1, {**env, "HIVE_RELAY_KUBE_IMAGE": image,
                                                 "HIVE_RELAY_KUBE_PROXY_IMAGE": image})
    assert run.runtime_class == "gvisor"
    with pytest.raises(RefusedError, match="runtimeClassName gvisor: podman kube play cannot run a pod on runsc"):
        kube_podman.play(plan, run, make_bundle(str(work)), env, str(tmp_path / "play"), timeout=60)
    assert not (tmp_path / "play").exists()
    plain = resolve(get_backend(matrix, "shell"), matrix, replace(req, isolation=None), facts, env, fs=HostFs())
    assert kube_run_for(plain, req.run_id, 1, 1, {**env, "HIVE_RELAY_KUBE_IMAGE": image,
                                                   "HIVE_RELAY_KUBE_PROXY_IMAGE": image}).runtime_class is None


def test_a_real_gemini_turn_with_a_google_login_in_a_kube_pod(tmp_path: Path, image: str) -> None:
    """gemini's Google login on the cluster, for real under podman kube play: the pod gets no copy of
    oauth_creds.json (nothing of the host's state goes to a pod), only GOOGLE_GENAI_USE_GCA and the
    placeholder as GOOGLE_CLOUD_ACCESS_TOKEN, which gemini uses without a file; the proxy pod's Secret
    holds the real token and sends it to the pinned Code Assist upstream. The pod's probe finds no real
    value."""
    import json as _json
    import time as _time

    from . import fake_api
    from .servers import make_ca

    names = ("cloudcode-pa.googleapis.com", "oauth2.googleapis.com", "generativelanguage.googleapis.com")
    ca, tls = make_ca(tmp_path, names)
    ca.chmod(0o644)
    server, port = fake_api.start(tls=tls)
    work = _checkout(tmp_path)
    home = tmp_path / "home"
    (home / ".gemini").mkdir(parents=True)
    access = "ya29.a0REAL-GOOGLE-" + os.urandom(12).hex()
    (home / ".gemini" / "oauth_creds.json").write_text(_json.dumps({
        "access_token": access, "refresh_token": "1//0gREAL-REFRESH", "token_type": "Bearer",
        "scope": "https://www.googleapis.com/auth/cloud-platform", "expiry_date": int((_time.time() + 10 * 3600) * 1000)}))
    _podman_storage(home)
    env = {k: v for k, v in podman_env().items() if not k.startswith(("GEMINI_", "GOOGLE_"))}
    env.update({"HOME": str(home)})
    script = ("gemini --skip-trust -p 'say the answer'; "
              "(env; cat /proc/*/environ 2>/dev/null; find \"$HOME\" /tmp -type f -exec cat {} + 2>/dev/null) "
              "| grep -q -e REAL-GOOGLE -e REAL-REFRESH && echo REAL-FOUND; true")
    req = Request("gemini", mode="kube", workdir=str(work), run_id=f"kubegem-{os.getpid()}-{os.urandom(3).hex()}",
                  prompt="x", argv_override=("/bin/bash", "-c", script),
                  allow_hosts=tuple(f"{n}:443=127.0.0.1:{port}" for n in names))
    matrix = load_matrix(env, workdir=None)
    plan = resolve(get_backend(matrix, "gemini"), matrix, req, with_image(probe(env), matrix, req, env), env, fs=HostFs())
    assert [r.name for r in plan.credentials] == ["google-login"], plan.credentials
    played = _play_with_secrets(plan, req.run_id, work, env, tmp_path, ca, server)
    log = played.logs[0]
    assert fake_api.ANSWER in log and "REAL-FOUND" not in log and access not in log, log + played.proxy_log[-3000:]
    seen = {h.get("authorization", "") for h in server.headers_seen if h.get("host") == names[0]}
    assert seen == {f"Bearer {access}"}, seen
    assert access not in played.proxy_log
