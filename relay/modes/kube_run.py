"""kube mode's runner: print the objects (dry run), or apply them to the current kubectl context,
follow the boxes, bring back one patch per box, and delete the run's namespace.

Thin on purpose: relay/modes/kube_objects.py decides every object; what is left here is I/O. The pure
parts (the patch carried in a box's log, the progress line, the paths) are functions of their own
so tests cover them without a cluster.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from relay.host.fs_view import HostFs
from relay.host.paths import state_dir
from relay.model.errors import EXIT_TIMEOUT, RefusedError, RelayError, UsageError
from relay.model.hashing import sha256
from relay.model.record import record, replace
from relay.modes.kube_objects import (
    RESULT_BEGIN,
    RESULT_END,
    KubeRun,
    describe,
    namespace,
    render_objects,
    to_yaml,
    with_bundle,
)
from relay.plan.resolve import Plan
from relay.trust.kube_stage import Outcome, bundle_head, stage_box, stamp_ctime

MAX_PATCH = 64 << 20  # a box's patch larger than this is not written (its log is kept instead)
NO_CLUSTER = ("kube mode needs a Kubernetes cluster: kubectl has no current context; fix: `kubectl config "
              "use-context NAME`, or print the objects with --dry-run")


@record
class Kubectl:
    """kubectl pinned to the context the run began on: every call names it, so a `kubectl config
    use-context` in another terminal mid-run cannot send the follow, the logs or the namespace
    delete (the launcher's or the reaper's) to another cluster, nor leave this run's namespace."""

    path: str
    context: str | None = None

    def argv(self, *args: str) -> list[str]:
        pin = [f"--context={self.context}"] if self.context else []
        if "--" in args:  # what follows `--` is the container's command, not kubectl's
            i = args.index("--")
            return [self.path, *args[:i], *pin, *args[i:]]
        return [self.path, *args, *pin]


class KubeTimeout(RelayError):
    """--timeout passed before every box finished: exit 124, as in the other modes."""

    exit_code = EXIT_TIMEOUT


@record
class BoxResult:
    """What one box's log carried back: its patch (None when the box never reached the end) and exit code."""

    index: int
    patch: bytes | None
    exit_code: int | None


def extract_result(index: int, log: str) -> BoxResult:
    """The last marked patch in a box's log. The box wrote it, so it is data for review only:
    decoded strictly, bounded, never applied. A missing or garbled block is no patch."""
    begin = log.rfind(f"\n{RESULT_BEGIN}\n")
    if begin < 0 and log.startswith(f"{RESULT_BEGIN}\n"):
        begin = -1
    elif begin < 0:
        return BoxResult(index, None, None)
    body_start = begin + len(RESULT_BEGIN) + 2
    end = log.find(f"\n{RESULT_END} ", body_start - 1)
    if end < 0:
        return BoxResult(index, None, None)
    tail = log[end + len(RESULT_END) + 2:].split("\n", 1)[0].strip()
    code = int(tail) if tail.isdigit() else None
    b64 = "".join(log[body_start:end].split())
    if len(b64) > MAX_PATCH * 4 // 3 + 4:
        return BoxResult(index, None, code)
    try:
        patch = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        return BoxResult(index, None, code)
    return BoxResult(index, patch, code)


def patch_path(run_dir: str, index: int) -> str:
    return os.path.join(run_dir, f"box-{index}.patch")


def write_patches(run_dir: str, results: list[BoxResult]) -> list[str]:
    """One file per box with a patch, created new (O_EXCL) in the run's own dir; an empty patch is
    written too (the box changed nothing). Returns the paths written."""
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    written = []
    for r in results:
        if r.patch is None:
            continue
        path = patch_path(run_dir, r.index)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(r.patch)
        written.append(path)
    return written


def progress_line(index: int, phase: str, exit_code: int | None = None, patch: str | None = None) -> str:
    """One box's state, as the runner prints it: `box 3  running`, `box 3  exit 0  patch PATH`."""
    line = f"box {index:<3} {phase.lower()}"
    if exit_code is not None:
        line += f"  exit {exit_code}"
    if patch:
        line += f"  patch {patch}"
    return line


def summary(results: list[BoxResult], run_dir: str, staged_runs: Sequence[str] = ()) -> str:
    """The run's last line. With staged runs, it names the commands that review and apply them."""
    from relay.model.refusal import ENTRY

    failed = sum(1 for r in results if r.exit_code != 0)
    with_patch = sum(1 for r in results if r.patch)
    line = f"hive-relay: {len(results)} box(es), {failed} failed, {with_patch} with changes; "
    if staged_runs:
        return line + (f"staged as {', '.join(staged_runs)}; nothing was applied to your checkout; review: {ENTRY} "
                       f"changes {staged_runs[0]}; apply: {ENTRY} apply {staged_runs[0]} (patches and logs in {run_dir})")
    return line + f"patches in {run_dir} (nothing was applied to your checkout)"


def stage_results(plan: Plan, run_id: str, base: str | None, base_ctime_ns: int, results: Sequence[BoxResult],
                  env: Mapping[str, str]) -> list[Outcome]:
    """Each box's patch as the staged run `RUN-INDEX` (relay/trust/kube_stage.py), reviewed and applied with
    the same commands as a local run's. A patch that does not apply to the base is left as a file."""
    from relay.trust.staged import launch_meta

    meta = {**launch_meta(plan), "mode": "kube", "fanout": run_id, "placeholders": [], "git": []}
    out = []
    for r in results:
        if not r.patch:
            out.append(Outcome(r.index))
        elif base is None:
            out.append(Outcome(r.index, error="the bundle named no commit"))
        else:
            out.append(stage_box(plan.workdir, base, r.patch, f"{run_id}-{r.index}", meta, base_ctime_ns, env,
                                 MAX_PATCH))
    return out


def outcome_line(o: Outcome) -> str:
    if o.error:
        return f"box {o.index:<3} not staged: {o.error}"
    return f"box {o.index:<3} staged {o.run} ({o.files} file(s))" if o.run else f"box {o.index:<3} no changes"


SNAPSHOT_REF = "refs/hive-relay/snapshot"
_IDENT = {"GIT_AUTHOR_NAME": "hive relay", "GIT_AUTHOR_EMAIL": "hive-relay@localhost",
          "GIT_COMMITTER_NAME": "hive relay", "GIT_COMMITTER_EMAIL": "hive-relay@localhost"}
_FIX = "run in a git checkout with at least one commit"


def _git(args: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> str:
    proc = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", *args], capture_output=True, text=True,
                          env=env, stdin=subprocess.DEVNULL, timeout=timeout)
    if proc.returncode != 0:
        raise UsageError(f"kube mode ships the workdir as a git bundle, and `git {' '.join(args[2:3])}` failed: "
                         f"{proc.stderr.strip()[-200:]}; fix: {_FIX}")
    return proc.stdout.strip()


def _snapshot(workdir: str, env: dict[str, str]) -> str | None:
    """A commit of the checkout as it is now (HEAD plus uncommitted and untracked, not ignored,
    files), made through a private index (`env`), so the user's index and refs are untouched; None
    when it equals HEAD."""
    _git(["-C", workdir, "read-tree", "HEAD"], env)
    _git(["-C", workdir, "add", "-A", "--", "."], env)
    tree = _git(["-C", workdir, "write-tree"], env)
    if tree == _git(["-C", workdir, "rev-parse", "HEAD^{tree}"], env):
        return None
    return _git(["-C", workdir, "commit-tree", tree, "-p", "HEAD", "-m",
                 "hive relay: the checkout's uncommitted changes at launch"], env)


def make_bundle(workdir: str) -> bytes:
    """The workdir as a git bundle: what the boxes clone. HEAD with its history (and the current
    branch, so the clone is on it), plus, when the checkout has uncommitted or untracked files
    (ignored ones stay home), a snapshot commit of them on top under refs/hive-relay/snapshot:
    the box's init container puts those files in its worktree as uncommitted changes, so the box
    starts from the checkout as the user sees it, and its patch is taken against that snapshot.

    No ref or index of the user's is written, not even for a moment: the bundle's refs live in a
    scratch bare repository that borrows the user's objects (alternates), gone after. Only the
    snapshot's objects go to the user's object store (inert; `git gc` drops them in time)."""
    with tempfile.TemporaryDirectory(prefix="hive-relay-bundle-") as tmp:
        head = _git(["-C", workdir, "rev-parse", "--verify", "HEAD^{commit}"])
        objects = os.path.join(workdir, _git(["-C", workdir, "rev-parse", "--git-path", "objects"]))
        branch = subprocess.run(["git", "-C", workdir, "symbolic-ref", "-q", "HEAD"], capture_output=True, text=True,
                                stdin=subprocess.DEVNULL).stdout.strip()
        scratch = os.path.join(tmp, "git")
        _git(["init", "-q", "--bare", scratch])
        with open(os.path.join(scratch, "objects", "info", "alternates"), "w") as fh:
            fh.write(os.path.abspath(objects) + "\n")
        # The snapshot's objects go to the user's object store (inert data, which staging the boxes'
        # patches reads back: relay/trust/kube_stage.py); its ref only ever exists in the scratch repository.
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index"), "LC_ALL": "C", **_IDENT}
        try:
            snap = _snapshot(workdir, env)
        except subprocess.TimeoutExpired as err:
            raise UsageError("kube mode could not snapshot the checkout in 600 s; fix: commit or ignore large "
                             "untracked files") from err
        bare = ["--git-dir", scratch]
        refs = ["HEAD"]
        if branch.startswith("refs/heads/"):
            _git([*bare, "update-ref", branch, head])
            _git([*bare, "symbolic-ref", "HEAD", branch])
            refs.append(branch)
        else:
            _git([*bare, "update-ref", "--no-deref", "HEAD", head])
        if snap:
            _git([*bare, "update-ref", SNAPSHOT_REF, snap])
            refs.append(SNAPSHOT_REF)
        out = os.path.join(tmp, "workspace.bundle")
        _git([*bare, "bundle", "create", "-q", out, *refs])
        with open(out, "rb") as fh:
            return fh.read()


def proxy_image(image: str) -> str:
    """The proxy's image: the box image plus the relay package (relay/modes/kube_proxy_image.py builds it)."""
    from relay.modes.kube_proxy_image import proxy_image_tag

    return proxy_image_tag(image)


def kube_run_for(plan: Plan, run_id: str, count: int, parallel: int | None, env: Mapping[str, str]) -> KubeRun:
    if count < 1 or (parallel is not None and parallel < 1):
        raise UsageError("--count and --parallel must be at least 1")
    image = env.get("HIVE_RELAY_KUBE_IMAGE") or _plan_image(plan, env)
    # --isolation gvisor asks for the `gvisor` class; HIVE_RELAY_KUBE_RUNTIME_CLASS may name the cluster's own
    # (the canary then checks that its box really runs on gVisor, whatever the class is called).
    runtime_class = env.get("HIVE_RELAY_KUBE_RUNTIME_CLASS") or plan.runtime_class
    return KubeRun(run_id=run_id, image=image, proxy_image=env.get("HIVE_RELAY_KUBE_PROXY_IMAGE") or proxy_image(image),
                   count=count, parallel=parallel, runtime_class=runtime_class)


def _plan_image(plan: Plan, env: Mapping[str, str]) -> str:
    from relay.config.load import load_matrix
    from relay.modes.image_tag import spec_from_env

    matrix = load_matrix(dict(env), workdir=None)
    return spec_from_env(matrix.backends, 1000, 1000, env).tag


def kube_main(plan: Plan, env: Mapping[str, str], *, dry_run: bool, as_json: bool, count: int,
              parallel: int | None, run_id: str) -> int:
    """`contribute-hive BACKEND kube`: the objects on stdout (dry run), or a run on the cluster."""
    if plan.interactive:
        raise UsageError("kube mode runs --prompt boxes only (a Job has no terminal); fix: add --prompt TEXT, or use "
                         "local or container mode for an interactive session")
    run = kube_run_for(plan, run_id, count, parallel, env)
    if dry_run:
        bundle = make_bundle(plan.workdir)
        objects = render_objects(plan, run, bundle)
        if as_json:
            data = plan.to_json()
            data["kube"] = {**describe(plan, with_bundle(run, bundle)), "objects": objects}
            print(json.dumps(data, indent=2))
        else:
            sys.stdout.write(to_yaml(objects))
        return 0
    kubectl = shutil.which("kubectl", path=env.get("PATH"))
    if kubectl is None:
        raise RefusedError("kube mode needs kubectl; fix: install kubectl, or print the objects with --dry-run")
    context = current_context(kubectl, env)
    if context is None:
        raise RefusedError(NO_CLUSTER)
    return apply_and_follow(Kubectl(kubectl, context), plan, run, env)


def current_context(kubectl: str, env: Mapping[str, str]) -> str | None:
    proc = subprocess.run([kubectl, "config", "current-context"], capture_output=True, text=True, env=dict(env),
                          stdin=subprocess.DEVNULL)
    name = proc.stdout.strip()
    return name if proc.returncode == 0 and name else None


CALL_TIMEOUT = 360.0  # one kubectl call; a hung API server must not hang the launcher (its finally deletes)


def _kubectl(kubectl: Kubectl, env: Mapping[str, str], *args: str, stdin: str | None = None) -> str:
    # errors="replace": a box's log is the box's bytes; one that is not UTF-8 must not crash the
    # launcher and lose every other box's patch with it (the patch block itself is base64).
    try:
        proc = subprocess.run(kubectl.argv(*args), input=stdin, capture_output=True, text=True, encoding="utf-8",
                              errors="replace", env=dict(env), timeout=CALL_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise RelayError(f"kubectl {' '.join(a for a in args if not a.startswith('-'))[:60]} did not answer in "
                         f"{CALL_TIMEOUT:.0f} s; fix: check the cluster (kubectl get --raw /readyz)") from None
    if proc.returncode != 0:
        raise RelayError(f"kubectl {args[0]} failed: {proc.stderr.strip()[-300:]}")
    return proc.stdout


def bundle_upload_argv(run: KubeRun, bundle: bytes) -> list[str]:
    """Pure: what the proxy pod's bundle container runs to take the bundle from its stdin."""
    from relay.modes.kube_objects import BUNDLE_DIR

    return ["python3", "-m", "relay.modes.kube_bundle", "receive", "--dir", BUNDLE_DIR,
            "--sha256", sha256(bundle).hexdigest(), "--bytes", str(len(bundle))]


def _serve_bundle(kubectl: Kubectl, env: Mapping[str, str], ns: str, run: KubeRun, bundle: bytes) -> None:
    """Wait for the proxy pod and stream the bundle into it (`kubectl exec -i`: the API server
    relays the stream, etcd stores nothing)."""
    _kubectl(kubectl, env, "-n", ns, "rollout", "status", "deployment/hive-relay-proxy", "--timeout=300s")
    proc = subprocess.run(kubectl.argv("-n", ns, "exec", "-i", "deployment/hive-relay-proxy", "-c", "bundle", "--",
                                       *bundle_upload_argv(run, bundle)), input=bundle, capture_output=True, env=dict(env),
                          timeout=1800)
    if proc.returncode != 0:
        raise RelayError("kube mode could not stream the workspace to the proxy pod: "
                         f"{proc.stderr.decode(errors='replace').strip()[-300:]}")


def owned_by_job(obj: dict, uid: str) -> dict:
    """Pure: the object with the run's Job as its owner, so the cluster's garbage collector removes it
    when the Job's TTL does (after `ttlSecondsAfterFinished`, or `activeDeadlineSeconds` at the most),
    even if no launcher is left to delete the namespace."""
    meta = {**obj["metadata"], "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "boxes",
                                                    "uid": uid}]}
    return {**obj, "metadata": meta}


def apply_and_follow(kubectl: Kubectl, plan: Plan, run: KubeRun, env: Mapping[str, str]) -> int:
    """Apply the run's objects, print a line per box as it changes, collect the patches, and delete
    the namespace however the run ends (relay/modes/kube_reaper.py: even after a kill -9 of this process).

    Order: the Namespace and the proxy Service (the boxes' hostAliases need its address), the Job,
    then everything else owned by the Job, then the bundle. The bundle is the gate: a box's agent
    runs only after its init container has fetched it, so never before the NetworkPolicies exist."""
    from relay.modes import kube_reaper
    from relay.modes.kube_secrets import secret_values

    ns = namespace(run.run_id)
    keys = secret_values(plan, env)  # every route's value, read on the host (a login's refreshed to last the run)
    base_ctime = stamp_ctime(env)  # before the bundle: a host edit from here on is a conflict at apply
    bundle = make_bundle(plan.workdir)
    base = bundle_head(bundle)
    objects = render_objects(plan, run, bundle, keys)
    run_dir = os.path.join(state_dir(dict(env)), "kube", ns)
    deadline = time.monotonic() + (plan.timeout or 1800) + 60
    reaper = kube_reaper.start(kubectl.argv("delete", "namespace", ns, "--wait=false"), env)
    try:
        first = [o for o in objects if o["kind"] in ("Namespace", "Service")]
        _kubectl(kubectl, env, "apply", "-f", "-", stdin=to_yaml(first))
        ip = _kubectl(kubectl, env, "-n", ns, "get", "service", "hive-relay-proxy", "-o",
                      "jsonpath={.spec.clusterIP}").strip()
        objects = render_objects(plan, replace(run, proxy_ip=ip), bundle, keys)
        _kubectl(kubectl, env, "apply", "-f", "-", stdin=to_yaml([o for o in objects if o["kind"] == "Job"]))
        uid = _kubectl(kubectl, env, "-n", ns, "get", "job", "boxes", "-o", "jsonpath={.metadata.uid}").strip()
        if not uid:
            raise RelayError("kube mode: the cluster gave the Job no uid")
        rest = [owned_by_job(o, uid) for o in objects if o["kind"] not in ("Namespace", "Job")]
        secrets = [o for o in rest if o["kind"] == "Secret"]
        if secrets:
            # create, not apply: a client-side apply copies the whole object, stringData included, into
            # its kubectl.kubernetes.io/last-applied-configuration annotation, which `kubectl describe`
            # prints (kubernetes/kubernetes#23564). The namespace is new, so nothing is there to update.
            _kubectl(kubectl, env, "create", "-f", "-", stdin=to_yaml(secrets))
        _kubectl(kubectl, env, "apply", "-f", "-", stdin=to_yaml([o for o in rest if o["kind"] != "Secret"]))
        _serve_bundle(kubectl, env, ns, run, bundle)
        results, logs = _follow(kubectl, env, ns, run.count, deadline)
        write_patches(run_dir, results)
        write_logs(run_dir, logs)
        for r in results:
            print(progress_line(r.index, "done", r.exit_code, patch_path(run_dir, r.index) if r.patch else None))
        outcomes = stage_results(plan, run.run_id, base, base_ctime, results, env)
        for o in outcomes:
            print(outcome_line(o))
        print(summary(results, run_dir, [o.run for o in outcomes if o.run]), file=sys.stderr)
        return 0 if all(r.exit_code == 0 for r in results) else 1
    finally:
        _delete_namespace(kubectl, env, ns, reaper)


def _delete_namespace(kubectl: Kubectl, env: Mapping[str, str], ns: str, reaper: int) -> None:
    """The run's end: delete its namespace, bounded in time; if that failed, the reaper (told
    nothing) tries once more when this process is gone."""
    from relay.modes import kube_reaper

    try:
        deleted = subprocess.run(kubectl.argv("delete", "namespace", ns, "--wait=false"), capture_output=True,
                                 env=dict(env), timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        deleted = False
    if deleted:
        kube_reaper.done(reaper)
    else:
        os.close(reaper)


def write_logs(run_dir: str, logs: Mapping[int, str]) -> None:
    """Each box's log (the agent's output) next to its patch, bounded, created new."""
    for index, text in logs.items():
        fd = os.open(os.path.join(run_dir, f"box-{index}.log"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     0o600)
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as fh:
            fh.write(text[-MAX_PATCH:])


def _follow(kubectl: Kubectl, env: Mapping[str, str], ns: str, count: int,
            deadline: float) -> tuple[list[BoxResult], dict[int, str]]:
    seen: dict[int, str] = {}
    while time.monotonic() < deadline:
        pods = json.loads(_kubectl(kubectl, env, "-n", ns, "get", "pods", "-l",
                                   "app.kubernetes.io/component=box", "-o", "json"))["items"]
        done: dict[int, str] = {}
        for pod in pods:
            index = int(pod["metadata"].get("annotations", {}).get("batch.kubernetes.io/job-completion-index", "-1"))
            phase = pod.get("status", {}).get("phase", "Pending")
            if seen.get(index) != phase:
                seen[index] = phase
                print(progress_line(index, phase), flush=True)
            if phase in ("Succeeded", "Failed"):
                done[index] = pod["metadata"]["name"]
        if len(done) >= count:
            logs = {i: _kubectl(kubectl, env, "-n", ns, "logs", name, "-c", "box") for i, name in sorted(done.items())}
            return [extract_result(i, text) for i, text in logs.items()], logs
        time.sleep(2)
    raise KubeTimeout("kube mode: the boxes did not finish before --timeout; the namespace is deleted")



def kube_doctor(env: Mapping[str, str], backend_name: str = "claude", isolation: str | None = None) -> int:
    """`invoke doctor --mode kube`: a canary box under the boxes' NetworkPolicy on the current
    context; relay/modes/kube_canary.py decides. Its namespace is deleted whatever happens."""
    from relay.config.load import get_backend, load_matrix
    from relay.host.liveness import new_run_id
    from relay.host.probe import probe
    from relay.modes.image_tag import with_image
    from relay.modes.kube_canary import canary_script, decide, parse
    from relay.plan.resolve import Request, resolve
    from relay.policy.tiers import opted_in

    path = shutil.which("kubectl", path=env.get("PATH"))
    if path is None:
        raise RefusedError("kube mode needs kubectl; fix: install kubectl and select a context")
    context = current_context(path, env)
    if context is None:
        raise RefusedError(NO_CLUSTER.replace("print the objects with --dry-run", "see docs/kube.md"))
    matrix = load_matrix(dict(env), workdir=None)
    backend = get_backend(matrix, backend_name)
    here = tempfile.mkdtemp(prefix="hive-relay-canary-")  # an empty checkout: the canary needs no workspace
    subprocess.run(["git", "init", "-q", here], check=True, capture_output=True)
    subprocess.run(["git", "-C", here, "-c", "user.email=canary@hive-relay", "-c", "user.name=canary", "commit", "-q",
                    "--allow-empty", "-m", "canary"], check=True, capture_output=True)
    request = Request(backend_name, mode="kube", workdir=here, run_id=f"canary-{new_run_id()}", prompt="canary",
                      argv_override=("/bin/bash", "-c", canary_script()), isolation=isolation)
    plan = resolve(backend, matrix, request, with_image(probe(dict(env)), matrix, request, env), dict(env), fs=HostFs())
    run = kube_run_for(plan, request.run_id, 1, 1, env)
    ns = namespace(run.run_id)
    kubectl = Kubectl(path, context)
    runtime_ok = None
    if run.runtime_class:
        runtime_ok = subprocess.run(kubectl.argv("get", "runtimeclass", run.runtime_class), capture_output=True,
                                    env=dict(env)).returncode == 0
    from relay.modes import kube_reaper

    reaper = kube_reaper.start(kubectl.argv("delete", "namespace", ns, "--wait=false"), env)  # a kill -9 of doctor must not leave the canary's namespace
    try:
        bundle = make_bundle(here)
        objects = render_objects(plan, run, bundle)
        _kubectl(kubectl, env, "apply", "-f", "-", stdin=to_yaml([o for o in objects if o["kind"] != "Job"]))
        ip = _kubectl(kubectl, env, "-n", ns, "get", "service", "hive-relay-proxy", "-o",
                      "jsonpath={.spec.clusterIP}").strip()
        _serve_bundle(kubectl, env, ns, run, bundle)
        objects = render_objects(plan, replace(run, proxy_ip=ip), bundle)
        _kubectl(kubectl, env, "apply", "-f", "-", stdin=to_yaml([o for o in objects if o["kind"] == "Job"]))
        try:
            _, logs = _follow(kubectl, env, ns, 1, time.monotonic() + 180)
            log = next(iter(logs.values()), "")
        except RelayError:
            log = ""
        events = subprocess.run(kubectl.argv("-n", ns, "get", "events", "-o", "json"), capture_output=True, text=True,
                                env=dict(env)).stdout
        seccomp_ok = "seccomp" not in events.lower()  # a missing Localhost profile is a pod event naming it
        verdict = decide(parse(log, seccomp_ok, runtime_ok, gvisor=plan.runtime_class is not None and
                               isolation == "gvisor"), backend.name, backend.opt_in,
                         opted_in(backend, matrix, env))
    finally:
        _delete_namespace(kubectl, env, ns, reaper)
        shutil.rmtree(here, ignore_errors=True)
    for line in verdict.lines:
        print(line)
    if verdict.exit_code:
        raise RefusedError("kube mode cannot be enforced on this cluster (see the MISS lines above)")
    return 0
