"""kube mode's objects: every one validates against the Kubernetes API schema (kubernetes-validate,
strict), every required hardening is present, keys live only in the proxy's Secret, and the YAML
for a fixed plan is golden (regenerate with HIVE_RELAY_GOLDEN=1, then review the diff)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from relay.config.load import load_shipped
from relay.host.fs_view import HostFs
from relay.model.backend import Matrix
from relay.modes import kube_objects as kube_render
from relay.modes.kube_objects import KubeRun, render_objects, to_yaml
from relay.modes.kube_run import BoxResult, extract_result, progress_line, write_patches
from relay.plan.resolve import Request, resolve

from .fakefs import WORKDIR, fake_host
from .test_plan_golden import ENV, SUPERVISED
from .test_plan_golden import fake_checkout as fake_checkout  # noqa: F401 - a fixture, used by name

K8S = "1.34"  # the schema version the objects are validated against (kubernetes-validate 1.37.0 ships it)
GOLDEN = Path(__file__).parent / "golden" / "kube"
REPO = Path(__file__).resolve().parent.parent
RUN = KubeRun(run_id="4242-1-abc-0123abcd", image="localhost/hive-relay-contributor:0123456789ab-u1000",
              proxy_image="localhost/hive-relay-proxy:0123456789ab", count=3, parallel=2)
BASE_PROFILE = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
    {"names": ["read", "write", "socket", "ioctl", "clone", "ptrace"], "action": "SCMP_ACT_ALLOW"}]}


def kube_plan(backend: str, env: dict[str, str] | None = None, **request: object):  # noqa: ANN201
    backends = load_shipped()
    matrix = Matrix(backends=backends, profiles={}, allow_unsandboxed=frozenset(), sources=())
    req = Request(backend, mode="kube", workdir=WORKDIR, run_id="1-golden", prompt="fix the bug", **request)  # type: ignore[arg-type]
    return resolve(backends[backend], matrix, req, SUPERVISED, dict(env or ENV), fs=fake_host(), now=0)


@pytest.fixture
def fixed_seccomp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's default profile is the host's; the golden uses a small fixed one."""
    monkeypatch.setattr(kube_render, "default_profile", lambda: BASE_PROFILE)


def objects(backend: str = "claude", env: dict[str, str] | None = None, **kw: object) -> list[dict]:
    return render_objects(kube_plan(backend, env), replace(RUN, **kw), b"bundle-bytes")  # type: ignore[arg-type]


def kinds(objs: list[dict]) -> list[str]:
    return [o["kind"] for o in objs]


@pytest.mark.parametrize("backend", ["claude", "codex", "gemini", "opencode", "shell"])
def test_every_object_validates_against_the_kubernetes_schema(backend: str, fake_checkout: None) -> None:
    objs = objects(backend, runtime_class="gvisor", proxy_ip="10.96.0.12")
    assert kinds(objs)[0] == "Namespace" and kinds(objs)[-1] == "Job"
    for obj in yaml.safe_load_all(to_yaml(objs)):  # what kubectl would read, not the dicts
        kubernetes_validate.validate(obj, K8S, strict=True)


def test_the_validator_is_not_a_rubber_stamp(fake_checkout: None) -> None:
    """Twin of the above: a misspelt field and a wrong type are refused by the same validator."""
    job = objects()[-1]
    bad = json.loads(json.dumps(job))
    bad["spec"]["template"]["spec"]["automountServiceAcountToken"] = False
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S, strict=True)
    bad = json.loads(json.dumps(job))
    bad["spec"]["backoffLimit"] = "zero"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S, strict=True)


def test_the_job_carries_every_required_setting(fake_checkout: None) -> None:
    plan = kube_plan("claude")
    job = render_objects(plan, replace(RUN, runtime_class="gvisor"), b"x")[-1]
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == ("Indexed", 3, 2, 0)
    assert spec["activeDeadlineSeconds"] == plan.timeout and spec["ttlSecondsAfterFinished"] > 0
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False and pod["hostUsers"] is False and pod["runtimeClassName"] == "gvisor"
    assert pod["securityContext"]["seccompProfile"]["type"] == "Localhost"
    assert pod["securityContext"]["seccompProfile"]["localhostProfile"].startswith("hive-relay/box-")
    for c in pod["containers"] + pod["initContainers"]:
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert c["resources"]["limits"]["memory"] == f"{plan.limits.memory >> 20}Mi"
        assert c["image"] == RUN.image
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["/tmp"] == "tmp" and mounts[dict(plan.env_set)["HOME"]] == "home"
    assert vols["tmp"]["emptyDir"]["sizeLimit"] and vols["home"]["emptyDir"]["sizeLimit"]
    unpack = pod["initContainers"][0]
    assert unpack["command"][:2] == ["bash", "-c"] and "sha256sum -c" in unpack["command"][2]  # checked, then cloned
    sha = {e["name"]: e["value"] for e in unpack["env"]}["HIVE_RELAY_BUNDLE_SHA256"]
    assert sha == job["metadata"]["annotations"]["hive-relay/bundle-sha256"] == hashlib.sha256(b"x").hexdigest()


def test_the_seccomp_profile_is_container_modes(fake_checkout: None, fixed_seccomp: None) -> None:
    from relay.render.seccomp_oci import render

    plan = kube_plan("claude")
    assert kube_render.seccomp_profile(plan) == render(plan.seccomp_policy, BASE_PROFILE)
    other = kube_render.seccomp_name({"defaultAction": "SCMP_ACT_ALLOW"})
    assert kube_render.seccomp_name(kube_render.seccomp_profile(plan)) != other  # named by content


def test_keys_live_only_in_the_proxys_secret(fake_checkout: None) -> None:
    """Attack: the key in a box's env, volume or envFrom. Twin: the proxy gets it, on a real apply only."""
    plan = kube_plan("claude")
    assert plan.credentials, "the fixture's ANTHROPIC_API_KEY should make a credential route"
    from relay.modes.kube_secrets import carried

    key = next(c.key for c in carried(plan.credentials) if c.route.name == "anthropic")
    dry = render_objects(plan, RUN, b"x")
    real = render_objects(plan, RUN, b"x", {key: "sk-never-in-a-plan"})
    assert "sk-never-in-a-plan" not in to_yaml(dry)
    secret = next(o for o in real if o["kind"] == "Secret")
    assert secret["stringData"] == {key: "sk-never-in-a-plan"}
    conf = json.loads(next(o for o in real if o["kind"] == "ConfigMap")["data"]["proxy.json"])
    assert {r["name"]: r["secret_env"] for r in conf["routes"]}["anthropic"] == [key]  # the name, never the value
    for obj in real:
        text = json.dumps(obj)
        if obj["kind"] not in ("Secret",):
            assert "sk-never-in-a-plan" not in text
    box = real[-1]["spec"]["template"]["spec"]
    assert "proxy-credentials" not in json.dumps(box)
    env = {e["name"]: e["value"] for e in box["containers"][0]["env"]}
    assert env["ANTHROPIC_API_KEY"] == "hive-relay-placeholder"
    assert env["HTTPS_PROXY"] == "http://hive-relay-proxy:3128"
    proxy = next(o for o in real if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert proxy["containers"][0]["envFrom"] == [{"secretRef": {"name": "proxy-credentials"}}]


def test_network_policies_box_to_proxy_only_and_proxy_to_public(fake_checkout: None) -> None:
    objs = objects("claude")
    pols = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "NetworkPolicy"}
    box = pols["boxes-reach-only-the-proxy"]
    assert box["policyTypes"] == ["Ingress", "Egress"] and box["ingress"] == []
    assert box["egress"] == [{"to": [{"podSelector": {"matchLabels": kube_render._labels(RUN, "proxy")}}],
                              "ports": [{"protocol": "TCP", "port": 3128}, {"protocol": "TCP", "port": 3129}]}]
    # no port 53: no DNS; 3129 is the proxy pod's workspace server
    proxy = pols["proxy-reaches-public-allowed-ports"]
    public, dns = proxy["egress"]
    assert public["to"][0]["ipBlock"]["cidr"] == "0.0.0.0/0"
    assert {"10.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16"} <= set(
        public["to"][0]["ipBlock"]["except"])
    assert {p["port"] for p in public["ports"]} == {443}
    assert {p["port"] for p in dns["ports"]} == {53}
    # Twin: a profile without network has no proxy, only the workspace server, which reaches nothing;
    # its boxes reach that server's port and nothing else.
    plan = kube_plan("shell", profile="default")
    objs = render_objects(plan, RUN, b"x")
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    assert [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]] == ["bundle"]
    assert "proxy-config" not in json.dumps(objs)
    pols = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "NetworkPolicy"}
    assert set(pols) == {"boxes-reach-only-the-proxy", "bundle-server-reaches-nothing"}
    assert pols["boxes-reach-only-the-proxy"]["egress"][0]["ports"] == [{"protocol": "TCP", "port": 3129}]
    assert pols["bundle-server-reaches-nothing"]["egress"] == []


def test_golden_yaml(fake_checkout: None, fixed_seccomp: None) -> None:
    text = to_yaml(objects("claude", proxy_ip="10.96.0.12"))
    path = GOLDEN / "claude.yaml"
    if os.environ.get("HIVE_RELAY_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs: review, then regenerate with HIVE_RELAY_GOLDEN=1"


def test_a_bundle_of_any_size_is_in_no_object(fake_checkout: None) -> None:
    """A real checkout's bundle (here 5 MiB, five times a ConfigMap's limit) travels outside the API
    server: no object carries its bytes, only its sha256 and size, and the volumes fit it."""
    bundle = os.urandom(5 << 20)
    objs = render_objects(kube_plan("shell"), RUN, bundle)
    text = to_yaml(objs)
    assert len(text) < 200_000 and base64.b64encode(bundle[:64]).decode()[:40] not in text
    job = objs[-1]
    assert job["metadata"]["annotations"]["hive-relay/bundle-bytes"] == str(5 << 20)
    vols = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert vols["bundle"]["emptyDir"]["sizeLimit"] == "7Mi"


def test_the_bundle_server_serves_only_a_complete_checked_bundle(tmp_path: Path) -> None:
    """relay/modes/kube_bundle.py: 503 before the bundle is in, a wrong sha256 or size is refused and
    serves nothing, any other path is 404; the twin: the right bundle is served byte for byte."""
    import io
    import threading
    import urllib.error
    import urllib.request

    from relay.modes import kube_bundle

    data = os.urandom(3 << 20)
    good = hashlib.sha256(data).hexdigest()
    assert kube_bundle.receive(str(tmp_path), "0" * 64, len(data), io.BytesIO(data)) == 65
    assert kube_bundle.receive(str(tmp_path), good, len(data) - 1, io.BytesIO(data)) == 65
    assert list(tmp_path.iterdir()) == []  # nothing half-written stays
    import http.server

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), kube_bundle.handler_for(str(tmp_path)))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{url}/workspace.bundle", timeout=10)
        assert err.value.code == 503
        assert kube_bundle.receive(str(tmp_path), good, len(data), io.BytesIO(data)) == 0
        for path in ("/", "/../etc/passwd", "/workspace.bundle/x", "/.incoming-1"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(url + path, timeout=10)
            assert err.value.code == 404
        assert urllib.request.urlopen(f"{url}/workspace.bundle", timeout=10).read() == data
    finally:
        server.shutdown()


def test_the_patch_comes_back_from_the_log_and_garbage_is_no_patch(tmp_path: Path) -> None:
    patch = b"diff --git a/f b/f\n+x\n"
    b64 = base64.b64encode(patch).decode()
    log = f"agent says hi\nhive-relay-patch-begin\n{b64[:10]}\n{b64[10:]}\nhive-relay-patch-end 7\n"
    assert extract_result(2, log) == BoxResult(2, patch, 7)
    assert extract_result(0, "no markers at all\n") == BoxResult(0, None, None)
    assert extract_result(0, "\nhive-relay-patch-begin\n!!notbase64\nhive-relay-patch-end 0\n").patch is None
    written = write_patches(str(tmp_path / "run"), [extract_result(2, log), BoxResult(3, None, 1)])
    assert written == [str(tmp_path / "run" / "box-2.patch")] and Path(written[0]).read_bytes() == patch
    with pytest.raises(FileExistsError):  # never over an existing file
        write_patches(str(tmp_path / "run"), [extract_result(2, log)])
    assert progress_line(3, "Running") == "box 3   running"
    assert progress_line(3, "Succeeded", 0, "/r/box-3.patch") == "box 3   succeeded  exit 0  patch /r/box-3.patch"


def test_cli_dry_run_prints_yaml_and_json_and_refuses_without_a_cluster(tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    env = {**os.environ, "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}
    git = ["git", "-C", str(work), "-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    (work / "f").write_text("x\n")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "i"], check=True)
    base = [sys.executable, "-m", "relay", "shell", "kube", "--prompt", "true", "--workdir", str(work), "--count", "2"]
    out = subprocess.run([*base, "--dry-run"], capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    assert [d["kind"] for d in docs][-1] == "Job" and docs[-1]["spec"]["completions"] == 2
    js = subprocess.run([*base, "--dry-run", "--json"], capture_output=True, text=True, env=env, cwd=REPO)
    data = json.loads(js.stdout)
    assert data["mode"] == "kube" and data["kube"]["count"] == 2 and data["kube"]["objects"][-1]["kind"] == "Job"
    real = subprocess.run(base, capture_output=True, text=True, env=env, cwd=REPO)
    assert real.returncode == 3, real.stderr
    assert real.stderr.count("\n") == 1 and "--dry-run" in real.stderr and "context" in real.stderr
    bad = subprocess.run([sys.executable, "-m", "relay", "shell", "local", "--count", "2", "--dry-run"],
                         capture_output=True, text=True, env=env, cwd=REPO)
    assert bad.returncode == 2 and "kube mode's" in bad.stderr
    tty = subprocess.run([sys.executable, "-m", "relay", "shell", "kube", "--workdir", str(work), "--dry-run"],
                         capture_output=True, text=True, env=env, cwd=REPO)
    assert tty.returncode == 2 and "--prompt" in tty.stderr and tty.stdout == ""


def pod_list(ns: str, count: int, phase: str = "Succeeded") -> dict:
    """A PodList as the API server answers `get pods -l ... -o json` for the Job's pods (names with
    the controller's random suffix, the completion index annotation, container statuses), checked
    against the Kubernetes schema: the scripted kubectl speaks real API responses."""
    items = []
    for i in range(count):
        name = f"boxes-{i}-{os.urandom(3).hex()[:5]}"
        items.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": f"00000000-0000-4000-8000-00000000000{i}",
                         "labels": {"app.kubernetes.io/component": "box", "batch.kubernetes.io/job-name": "boxes",
                                    "batch.kubernetes.io/job-completion-index": str(i)},
                         "annotations": {"batch.kubernetes.io/job-completion-index": str(i)},
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "boxes",
                                              "uid": "0b6c5a9e-1111-4222-8333-444455556666", "controller": True}]},
            "spec": {"restartPolicy": "Never", "containers": [{"name": "box", "image": "hive-relay-contributor"}]},
            "status": {"phase": phase, "containerStatuses": [{
                "name": "box", "image": "hive-relay-contributor", "imageID": "", "ready": False, "restartCount": 0,
                "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]},
        })
    out = {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "4242"}, "items": items}
    kubernetes_validate.validate(out, K8S, strict=True)
    return out


def scripted_cluster(tmp_path: Path, pods: int, **extra: str) -> tuple[Path, dict[str, str]]:
    """A checkout with one commit, the scripted kubectl first on PATH answering `pods` box pods, and
    the environment that runs the real CLI against it (MODE=ok unless `extra` says otherwise)."""
    work = _checkout(tmp_path)
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "kubectl").write_text(STUB_KUBECTL)
    (stub / "kubectl").chmod(0o755)
    (tmp_path / "pods.json").write_text(json.dumps(pod_list("hive-relay-run", pods)))
    env = {**os.environ, "HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state"), "STUB_DIR": str(tmp_path),
           "MODE": "ok", "PATH": f"{stub}:{os.environ['PATH']}", **extra}
    return work, env


STUB_KUBECTL = r"""#!/bin/bash
# A stand-in for kubectl (no cluster runs on this machine): records each call, answers the few the
# runner asks. MODE=fail makes `get pods` fail, as a cluster that goes away mid-run.
echo "$*" >> "$STUB_DIR/calls"
case "$*" in
  "config current-context") echo stub-context ;;
  *" --context=stub-context --context="*) echo "pinned twice: $*" >&2; exit 1 ;;
  "apply -f - --context=stub-context"|"create -f - --context=stub-context") { cat; echo ---; } >> "$STUB_DIR/applied" ;;
  *) [[ "$*" == *" --context=stub-context"* ]] || { echo "not pinned to the run's context: $*" >&2; exit 1; } ;;&
  *"get service hive-relay-proxy"*) printf 10.96.0.9 ;;
  *"rollout status deployment/hive-relay-proxy"*) ;;
  *"get job boxes -o jsonpath={.metadata.uid}"*) printf 0b6c5a9e-1111-4222-8333-444455556666 ;;
  *"get pods"*) [ -n "$HANG" ] && { echo "$$" > "$STUB_DIR/hung"; sleep 300; } ;;&
  *" exec -i deployment/hive-relay-proxy -c bundle --context=stub-context -- python3 -m relay.modes.kube_bundle receive "*) cat > "$STUB_DIR/bundle" ;;
  *"get pods"*)
    [ "$MODE" = fail ] && { echo "the server is gone" >&2; exit 1; }
    cat "$STUB_DIR/pods.json" ;;
  *" logs boxes-"*)
    a="$*"; n=${a#*logs boxes-}; n=${n%%-*}
    echo "agent output"; echo hive-relay-patch-begin; printf 'diff --git a/f b/f\nnew file mode 100644\n--- /dev/null\n+++ b/f\n@@ -0,0 +1 @@\n+box %s\n' "$n" | base64; echo "hive-relay-patch-end 0" ;;
  *"delete namespace"*) ;;
  *) echo "unexpected: $*" >&2; exit 1 ;;
esac
"""


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_the_cluster_path_applies_collects_and_always_deletes_the_namespace(tmp_path: Path, mode: str) -> None:
    """The thin apply/follow/collect path against a scripted kubectl (there is no cluster here): the
    Job goes in with the Service's ClusterIP in hostAliases, everything after it is owned by it (so
    its TTL removes them), the bundle goes in last of all, each box's patch lands in the run's state
    dir and nothing in the checkout, and the namespace is deleted on success and on failure."""
    work, env = scripted_cluster(tmp_path, 2, MODE=mode)
    proc = subprocess.run([sys.executable, "-m", "relay", "shell", "kube", "--prompt", "true", "--workdir", str(work),
                           "--count", "2"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    time.sleep(1)  # a reaper that wrongly deleted again would have done so by now
    calls = (tmp_path / "calls").read_text().splitlines()
    deleted = [c for c in calls if c.startswith("delete namespace hive-relay-")]
    assert len(deleted) == 1, calls  # by the launcher; its reaper was told and did nothing
    applied = [d for d in yaml.safe_load_all((tmp_path / "applied").read_text()) if d]
    kinds = [d["kind"] for d in applied]
    assert proc.returncode == (70 if mode == "fail" else 0), proc.stderr
    assert kinds[:3] == ["Namespace", "Service", "Job"] and kinds.count("Job") == 1
    job = applied[2]
    assert job["spec"]["template"]["spec"]["hostAliases"] == [{"ip": "10.96.0.9", "hostnames": ["hive-relay-proxy"]}]
    owners = [d["metadata"].get("ownerReferences") for d in applied[3:]]
    assert {"Deployment", "NetworkPolicy", "Service"} <= set(kinds[3:])
    assert all(o == [{"apiVersion": "batch/v1", "kind": "Job", "name": "boxes",
                      "uid": "0b6c5a9e-1111-4222-8333-444455556666"}] for o in owners), owners
    for d in applied[3:]:
        kubernetes_validate.validate(d, K8S, strict=True)
    # The workspace went to the proxy pod's server after the policies and the proxy; no object carries it.
    bundle = (tmp_path / "bundle").read_bytes()
    assert bundle.startswith(b"# v2 git bundle\n")
    assert job["metadata"]["annotations"]["hive-relay/bundle-sha256"] == hashlib.sha256(bundle).hexdigest()
    order = [c.split()[0] if not c.startswith("-n ") else c.split()[2] for c in calls]
    assert order.index("rollout") < order.index("exec") and "binaryData" not in (tmp_path / "applied").read_text()
    assert max(i for i, c in enumerate(order) if c == "apply") < order.index("exec")
    if mode == "fail":
        assert "the server is gone" in proc.stderr
        return
    ns = deleted[0].split()[2]
    patches = sorted((tmp_path / "state" / "hive-relay" / "kube" / ns).iterdir())
    assert [p.name for p in patches] == ["box-0.log", "box-0.patch", "box-1.log", "box-1.patch"]
    assert "agent output" in patches[0].read_text()
    patches = [p for p in patches if p.suffix == ".patch"]
    assert patches[0].read_text().endswith("+++ b/f\n@@ -0,0 +1 @@\n+box 0\n")
    assert "box 0   succeeded" in proc.stdout and "box 1   done  exit 0  patch" in proc.stdout
    assert "nothing was applied to your checkout" in proc.stderr
    assert subprocess.run(["git", "-C", str(work), "status", "--porcelain"], capture_output=True, text=True).stdout == ""
    # Each box's patch is a staged run RUN-INDEX, listed and applied like a local run's.
    runs = [ln.split()[3] for ln in proc.stdout.splitlines() if " staged " in ln]
    assert len(runs) == 2 and runs[0].endswith("-0") and runs[1].endswith("-1"), proc.stdout
    assert f"apply {runs[0]}" in proc.stderr
    listed = json.loads(subprocess.run([sys.executable, "-m", "relay", "changes", "--json"], capture_output=True,
                                       text=True, env=env, cwd=REPO, check=True).stdout)
    assert sorted(r["run"] for r in listed) == sorted(runs)
    first = subprocess.run([sys.executable, "-m", "relay", "apply", runs[0]], capture_output=True, text=True, env=env,
                           cwd=REPO)
    assert first.returncode == 0 and (work / "f").read_text() == "box 0\n", first.stdout + first.stderr
    second = subprocess.run([sys.executable, "-m", "relay", "apply", runs[1]], capture_output=True, text=True, env=env,
                            cwd=REPO)
    assert second.returncode == 1 and "conflict" in second.stdout, second.stdout  # the same path, another box
    assert (work / "f").read_text() == "box 0\n"


def test_a_kill_9_of_the_launcher_still_deletes_the_namespace(tmp_path: Path) -> None:
    """Attack on cleanup: the launcher is killed with SIGKILL mid-run (its finally never runs). Its
    reaper, in a session of its own, sees the pipe close and deletes the namespace. The twin is the
    test above: a launcher that ends normally tells its reaper, and only one delete is made."""
    work, env = scripted_cluster(tmp_path, 1, HANG="1")
    proc = subprocess.Popen([sys.executable, "-m", "relay", "shell", "kube", "--prompt", "true", "--workdir",
                             str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "hung").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the launcher never reached its follow loop"
            time.sleep(0.05)
        calls = (tmp_path / "calls").read_text()
        assert "delete namespace" not in calls
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 120
        while "delete namespace hive-relay-" not in (tmp_path / "calls").read_text():
            assert time.monotonic() < deadline, "no reaper deleted the namespace after the launcher's kill -9"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        hung = tmp_path / "hung"
        if hung.exists():
            try:
                os.kill(int(hung.read_text()), signal.SIGKILL)  # the stub's sleeping `get pods`
            except (ProcessLookupError, ValueError):
                pass


def _checkout(tmp_path: Path) -> Path:
    """A git checkout with one empty commit, at tmp_path/w."""
    work = tmp_path / "w"
    work.mkdir()
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run(["git", "-C", str(work), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q",
                    "--allow-empty", "-m", "i"], check=True)
    return work


def _kube_dry_run(tmp_path: Path, backend: str, work: Path, strip: tuple[str, ...]):  # noqa: ANN202
    """(env, run): HOME at tmp_path with none of the caller's variables named `strip*`, and a function
    that runs `BACKEND kube --dry-run --json` there, with extra variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(strip)}
    env.update({"HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")})
    cmd = [sys.executable, "-m", "relay", backend, "kube", "--prompt", "hi", "--workdir", str(work), "--dry-run", "--json"]

    def run(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, env={**env, **extra}, cwd=REPO, timeout=120)

    return env, run


def _login(home: Path, access: str, expires_ms: int, refresh: str | None = "sk-ant-ort01-REAL-REFRESH") -> None:
    path = home / ".claude" / ".credentials.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    oauth = {"accessToken": access, "expiresAt": expires_ms, "scopes": ["user:inference"]}
    if refresh:
        oauth["refreshToken"] = refresh
    path.write_text(json.dumps({"claudeAiOauth": oauth}))
    path.chmod(0o600)


def test_grants_and_logins_reach_only_the_clusters_proxy(tmp_path: Path) -> None:
    """The whole credential policy on the cluster: an `auth:` grant read from a host file and claude's
    login token travel only in the proxy's Secret, each under a key of its own; the box pod gets
    the placeholder (and claude a bearer placeholder to send); the dry run names what is carried and
    from where, never a value. Attack twin: a login that would expire before the run's deadline and
    cannot be refreshed refuses the run (exit 3, one line) before anything is applied."""
    (tmp_path / "k.json").write_text(json.dumps({"a": {"b": "ghp-REAL-GRANT-SECRET"}}))
    cfg = tmp_path / "config.yaml"
    cfg.write_text("auth:\n  gh:\n    host: github.com\n    secret: {file: ~/k.json, json: a.b}\n"
                   "    send: authorization-basic\n")
    access = "sk-ant-oat01-REAL-ACCESS-TOKEN"
    _login(tmp_path, access, int((time.time() + 10 * 3600) * 1000))
    work, env = scripted_cluster(tmp_path, 1, HIVE_RELAY_CONFIG=str(cfg))
    env = {k: v for k, v in env.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    cmd = [sys.executable, "-m", "relay", "claude", "kube", "--prompt", "hi", "--workdir", str(work)]
    dry = subprocess.run([*cmd, "--dry-run", "--json"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert dry.returncode == 0, dry.stderr
    carried = {c["route"]: c for c in json.loads(dry.stdout)["kube"]["credentials_carried"]}
    assert carried["gh"]["from"] == "grant" and carried["anthropic-login"]["from"] == "login", carried
    assert access not in dry.stdout and "ghp-REAL-GRANT-SECRET" not in dry.stdout
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    applied = [d for d in yaml.safe_load_all((tmp_path / "applied").read_text()) if d]
    (secret,) = [d for d in applied if d["kind"] == "Secret"]
    values = secret["stringData"]
    assert values[carried["gh"]["key"]] == "ghp-REAL-GRANT-SECRET" and values[carried["anthropic-login"]["key"]] == access
    for d in applied:
        if d["kind"] != "Secret":
            text = json.dumps(d)
            assert access not in text and "ghp-REAL-GRANT-SECRET" not in text and "REAL-REFRESH" not in text, d["kind"]
    assert "REAL-REFRESH" not in json.dumps(values)  # the pod never holds a refresh token
    job = next(d for d in applied if d["kind"] == "Job")
    box_env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert box_env["CLAUDE_CODE_OAUTH_TOKEN"] == "hive-relay-placeholder"
    # The twin's attack: an expired login with no refresh token stops the run before any object.
    _login(tmp_path, access, int((time.time() + 60) * 1000), refresh=None)
    (tmp_path / "calls").unlink()
    refused = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert refused.returncode == 3, refused.stderr
    assert "cannot carry the login" in refused.stderr and "fix:" in refused.stderr and access not in refused.stderr
    assert "apply" not in (tmp_path / "calls").read_text()


def test_a_codex_api_key_login_file_reaches_only_the_clusters_proxy(tmp_path: Path) -> None:
    """codex's `auth.json` holding an API key: the pod gets no copy of it (nothing of the host's
    state goes to a pod, so the plan does not refuse), the route carries the key from the host file
    to the proxy's Secret, and codex in the pod sends the placeholder (CODEX_API_KEY) to the route."""
    work = _checkout(tmp_path)
    (tmp_path / ".codex").mkdir()
    real = "sk-proj-REALKEY" + "x" * 40
    (tmp_path / ".codex" / "auth.json").write_text(json.dumps({"OPENAI_API_KEY": real}))
    env, run = _kube_dry_run(tmp_path, "codex", work, ("OPENAI_", "CODEX_"))
    dry = run()
    assert dry.returncode == 0, dry.stderr
    assert real not in dry.stdout
    data = json.loads(dry.stdout)
    assert data["kube"]["credentials_carried"] == [{"route": "openai-login", "key": "HIVE_RELAY_KEY_0", "from": "login"}]
    job = data["kube"]["objects"][-1]
    box_env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert box_env["CODEX_API_KEY"] == "hive-relay-placeholder"
    from relay.config.load import get_backend, load_matrix
    from relay.host.probe import probe
    from relay.modes.kube_secrets import secret_values

    matrix = load_matrix(env, workdir=None)
    plan = resolve(get_backend(matrix, "codex"), matrix,
                   Request("codex", mode="kube", workdir=str(work), run_id="1-x", prompt="hi"), probe(env), env, fs=HostFs())
    assert secret_values(plan, env) == {"HIVE_RELAY_KEY_0": real}  # read from the host file, for the Secret only


def test_a_claude_console_key_reaches_only_the_clusters_proxy(tmp_path: Path) -> None:
    """claude's Console `/login` (the key in ~/.claude.json): the pod gets no copy of the file, the route
    carries the key from the host file to the proxy's Secret, and claude in the pod sends the placeholder
    (ANTHROPIC_API_KEY) to the route."""
    work = _checkout(tmp_path)
    real = "sk-ant-api03-REALCONSOLE" + "x" * 60
    (tmp_path / ".claude.json").write_text(json.dumps({"primaryApiKey": real, "numStartups": 1}))
    _, run = _kube_dry_run(tmp_path, "claude", work, ("ANTHROPIC_", "CLAUDE_"))
    dry = run()
    assert dry.returncode == 0, dry.stderr
    assert real not in dry.stdout
    data = json.loads(dry.stdout)
    assert data["kube"]["credentials_carried"] == [{"route": "anthropic-console", "key": "HIVE_RELAY_KEY_0", "from": "login"}]
    job = data["kube"]["objects"][-1]
    box_env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert box_env["ANTHROPIC_API_KEY"] == "hive-relay-placeholder" and box_env["ANTHROPIC_BASE_URL"].endswith("/anthropic-console")


def test_a_codex_chatgpt_login_is_refused_in_kube_and_an_api_key_runs(tmp_path: Path) -> None:
    """codex's ChatGPT login signs in from auth.json's tokens, and a pod gets no copy of the host's
    state: the run stops before any object (exit 3, one line naming the fixes) instead of a pod that
    starts logged out. Twin: CODEX_API_KEY on the host is carried as before."""
    work = _checkout(tmp_path)
    (tmp_path / ".codex").mkdir()
    (tmp_path / ".codex" / "auth.json").write_text(json.dumps({
        "auth_mode": "chatgpt", "OPENAI_API_KEY": None,
        "tokens": {"access_token": "eyJhbGciOiJub25lIn0.eyJleHAiOjQxMDI0NDQ4MDB9.REALSIG", "refresh_token": "rt-REAL",
                   "id_token": "eyJhbGciOiJub25lIn0.eyJleHAiOjQxMDI0NDQ4MDB9.REALSIG", "account_id": "acc"}}))
    _, run = _kube_dry_run(tmp_path, "codex", work, ("OPENAI_", "CODEX_"))
    refused = run()
    lines = [x for x in refused.stderr.splitlines() if x.strip()]
    assert refused.returncode == 3 and len(lines) == 1 and "route chatgpt-login" in refused.stderr, refused.stderr
    assert "fix: set CODEX_API_KEY" in refused.stderr and "REAL" not in refused.stdout + refused.stderr
    ran = run(CODEX_API_KEY="sk-test-not-real")
    assert ran.returncode == 0 and json.loads(ran.stdout)["kube"]["credentials_carried"][0]["route"] == "openai", ran.stderr


def test_opencode_chatgpt_login_in_kube_refuses_alone_and_yields_to_a_key(tmp_path: Path) -> None:
    """opencode's ChatGPT login is a route that inspects chatgpt.com: a pod has no copy of the login and
    kube's proxy has no run CA, so alone it refuses (exit 3, one line with the fixes); with an API key on
    the host the key's route carries and nothing is inspected."""
    work = _checkout(tmp_path)
    auth = tmp_path / ".local" / "share" / "opencode" / "auth.json"
    auth.parent.mkdir(parents=True)
    auth.write_text(json.dumps({"openai": {"type": "oauth", "access": "eyJhbGciOiJub25lIn0.eyJleHAiOjQxMDI0NDQ4MDB9.REALSIG",
                                           "refresh": "rt-REAL", "expires": 4_102_444_800_000}}))
    _, run = _kube_dry_run(tmp_path, "opencode", work, ("OPENAI_", "ANTHROPIC_"))
    refused = run()
    lines = [x for x in refused.stderr.splitlines() if x.strip()]
    assert refused.returncode == 3 and len(lines) == 1 and "route openai-chatgpt inspects chatgpt.com" in refused.stderr
    assert "REAL" not in refused.stdout + refused.stderr
    ran = run(OPENAI_API_KEY="sk-test-not-real")
    data = json.loads(ran.stdout)
    assert ran.returncode == 0 and [c["route"] for c in data["kube"]["credentials_carried"]] == ["openai"], ran.stderr
    assert data["inspected_hosts"] == []


def test_isolation_gvisor_asks_for_the_gvisor_runtime_class_on_the_box_pods_only(fake_checkout: None,
                                                                                  fixed_seccomp: None) -> None:
    """`kube --isolation gvisor`: the plan names the class, the Job's pods ask for it (golden), the proxy
    pod does not (it is ours, not the agent's); HIVE_RELAY_KUBE_RUNTIME_CLASS may rename it. The twin:
    without it, no runtimeClassName anywhere."""
    from relay.modes.kube_run import kube_run_for

    plan = kube_plan("claude", isolation="gvisor")
    assert plan.runtime_class == "gvisor" and plan.to_json()["runtime_class"] == "gvisor"
    run = replace(kube_run_for(plan, RUN.run_id, 3, 2, {"HIVE_RELAY_KUBE_IMAGE": RUN.image,
                                                        "HIVE_RELAY_KUBE_PROXY_IMAGE": RUN.proxy_image}),
                  proxy_ip="10.96.0.12")
    assert run.runtime_class == "gvisor"
    objs = render_objects(plan, run, b"bundle-bytes")
    job = next(o for o in objs if o["kind"] == "Job")
    box_spec = job["spec"]["template"]["spec"]
    assert box_spec["runtimeClassName"] == "gvisor"
    golden = GOLDEN / "claude-gvisor-box-pod.yaml"
    text = to_yaml([box_spec])
    if os.environ.get("HIVE_RELAY_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden} differs: review, then regenerate with HIVE_RELAY_GOLDEN=1"
    proxy = next(o for o in objs if o["kind"] == "Deployment")
    assert "runtimeClassName" not in proxy["spec"]["template"]["spec"]
    renamed = kube_run_for(plan, RUN.run_id, 1, 1, {"HIVE_RELAY_KUBE_IMAGE": RUN.image, "HIVE_RELAY_KUBE_PROXY_IMAGE":
                                                    RUN.proxy_image, "HIVE_RELAY_KUBE_RUNTIME_CLASS": "runsc-sandbox"})
    assert renamed.runtime_class == "runsc-sandbox"
    plain = kube_plan("claude")
    assert plain.runtime_class is None and "runtime_class" not in plain.to_json()
    assert kube_run_for(plain, RUN.run_id, 1, 1, {"HIVE_RELAY_KUBE_IMAGE": RUN.image,
                                                  "HIVE_RELAY_KUBE_PROXY_IMAGE": RUN.proxy_image}).runtime_class is None


def test_kube_isolation_gvisor_needs_no_local_runsc(fake_checkout: None) -> None:
    """The cluster runs runsc, not this host: a kube plan with --isolation gvisor resolves on a host without
    runsc (SUPERVISED's runsc_error is "not probed"), while container mode refuses there."""
    from relay.model.errors import RefusedError

    assert kube_plan("shell", isolation="gvisor").runtime_class == "gvisor"
    with pytest.raises(RefusedError, match="--isolation gvisor cannot be enforced in container mode"):
        backends = load_shipped()
        matrix = Matrix(backends=backends, profiles={}, allow_unsandboxed=frozenset(), sources=())
        req = Request("shell", mode="container", workdir=WORKDIR, run_id="1-golden", prompt="x", isolation="gvisor")
        resolve(backends["shell"], matrix, req, SUPERVISED, dict(ENV), fs=fake_host(), now=0)
