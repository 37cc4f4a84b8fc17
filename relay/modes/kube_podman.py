"""kube mode on one machine: the same pod specs, run by `podman kube play` (no cluster needed).

podman does not enforce NetworkPolicy, so the box pods are played with `--network none` (only
`lo`), exactly like container mode's `--network none`: the launcher opens the box's 127.0.0.1:3128
inside each pod's network namespace (relay/host/netns.py) and splices what arrives there to the proxy
pod's port. The pod's hostAliases entry names the proxy 127.0.0.1, so the same Job template
(HTTPS_PROXY=http://hive-relay-proxy:3128) works unchanged. A box has no route but that one.

The proxy pod runs on the host's network (rootless podman here cannot create a bridge: no
/dev/net/tun), on a free port in place of 3128; its JSON decision log is its stdout.

A plan with a runtime class (`kube --isolation gvisor`, or HIVE_RELAY_KUBE_RUNTIME_CLASS) is refused
here, never played on runc: podman 4.3's `kube play` reads no `runtimeClassName`, and its global
`--runtime runsc` does not get a pod running on this host (checked with runsc 20240729): runsc's gofer
cannot join the pod's shared user namespace (`hostUsers: false`: "error setting namespace of type
user": EINVAL), and without it podman's cri-o sandbox annotation makes each container a sub-container
of the infra's sandbox, whose set-up fails ("mounting submounts: mount cgroup /sys/fs/cgroup: file
exists"). A cluster's gVisor is proven by the canary (relay/modes/kube_canary.py) instead.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

from relay.model.hashing import sha256
from relay.model.record import field, record, replace
from relay.model.refusal import ENTRY
from relay.model.vocab import LimitsMethod
from relay.modes.kube_objects import (
    BUNDLE_PORT,
    PROXY_NAME,
    PROXY_PORT,
    KubeRun,
    render_objects,
    seccomp_name,
    seccomp_profile,
    to_yaml,
)
from relay.modes.kube_proxy_image import proxy_image_tag
from relay.modes.kube_run import BoxResult, extract_result
from relay.plan.resolve import Plan

CONTAINERS_CONF = '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n[engine]\nruntime = "runc"\n'


@record(frozen=False)
class Played:
    """One `podman kube play` run: where its files are and what it started."""

    work: str
    env: dict[str, str]
    podman: list[str]
    pods: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def down(self) -> None:
        self.stop.set()
        # With an automatic user namespace, podman 4.3's first `pod rm` sometimes fails on a busy
        # shm mount and leaves the pod; a second one removes it. Up to three rounds, then say so.
        left = list(self.pods)
        for _ in range(3):
            if not left:
                break
            subprocess.run([*self.podman, "pod", "rm", "-f", "-t", "0", *left], capture_output=True, env=self.env)
            left = [pod for pod in left if subprocess.run([*self.podman, "pod", "exists", pod], capture_output=True,
                                                          env=self.env).returncode == 0]
        if left:
            print(f"hive-relay: could not remove pods {' '.join(left)}; fix: podman pod rm -f {' '.join(left)}",
                  file=sys.stderr)
        if self.volumes:
            subprocess.run([*self.podman, "volume", "rm", "-f", *self.volumes], capture_output=True, env=self.env)


def podman_env(env: Mapping[str, str], work: str) -> dict[str, str]:
    """runc (this cgroup-v1 hybrid host: see DESIGN, Podman). The default_ulimits are for podman
    commands that read them; `kube play` 4.3 does not (checked: none in the container's inspect),
    which is why rlimit_resources sets its limits in the command."""
    os.makedirs(work, mode=0o700, exist_ok=True)
    conf = os.path.join(work, "containers.conf")
    with open(conf, "w") as fh:
        fh.write(CONTAINERS_CONF)
    return {**env, "CONTAINERS_CONF": conf}


def _bytes(quantity: str) -> int:
    """A memory quantity as kube_render writes it (`NMi` or a plain byte count)."""
    return int(quantity[:-2]) << 20 if quantity.endswith("Mi") else int(quantity)


def rlimit_resources(spec: dict, pids: int | None = None) -> None:
    """Rootless podman on cgroup v1 cannot create the pods' cgroups: `kube play` then fails to
    start a container with a memory limit (runc: "cannot set memory limit"), where `podman run`
    would warn and ignore it. So the played spec drops every container's `resources`, and its
    memory limit becomes an RLIMIT_DATA of the same size (with `pids`, an RLIMIT_NPROC), as container
    mode does (container_argv.uses_rlimits). `kube play` 4.3 has no --ulimit and ignores
    containers.conf's default_ulimits, so each container's command starts under `ulimit`, which sets
    the hard limit too: what runs after it (the agent, with no capabilities) cannot raise it."""
    for c in spec.get("initContainers", []) + spec["containers"]:
        limit = c.pop("resources", {}).get("limits", {}).get("memory")
        if not limit:
            continue
        lines = [f"ulimit -d {_bytes(limit) >> 10} || exit 70"]  # KiB
        if pids:
            lines.append(f"ulimit -p {pids} || exit 70")  # dash's -p: RLIMIT_NPROC
        c["command"] = ["/bin/sh", "-c", "\n".join([*lines, 'exec "$@"']), "hive-relay-rlimit", *c["command"]]


def private_volumes(spec: dict, pod: str) -> list[str]:
    """podman 4.3 plays an emptyDir or a configMap volume as a *named* volume, the name taken from
    the YAML: two pods with a volume `workspace` would share it. Each pod's volumes (and the
    ConfigMaps they show) get the pod's name in front; returns the volume names, to remove at the end."""
    names = []
    for v in spec["volumes"]:
        v["name"] = f"{pod}-{v['name']}"
        if "configMap" in v:
            v["configMap"]["name"] = f"{pod}-cm-{v['configMap']['name']}"  # not an emptyDir's name
            names.append(v["configMap"]["name"])
        else:
            names.append(v["name"])
    for c in spec.get("initContainers", []) + spec["containers"]:
        for m in c.get("volumeMounts", []):
            if not m["name"].startswith(f"{pod}-"):  # mounts may be one shared dict (the YAML's twins)
                m["name"] = f"{pod}-{m['name']}"
    return names


def local_run(run: KubeRun, env: Mapping[str, str], uid: int | None = None) -> KubeRun:
    """The run as this machine's podman plays it. Root plays the cluster's image (contributor uid
    1000). Rootless podman plays the image built for this user (contributor uid = the user's uid,
    as container mode runs it with --userns keep-id): the only image a new user has, the one
    `build-image` makes for them. A caller's HIVE_RELAY_KUBE_IMAGE still wins."""
    uid = os.getuid() if uid is None else uid
    if uid == 0 or env.get("HIVE_RELAY_KUBE_IMAGE"):
        return run
    from relay.config.load import load_matrix
    from relay.modes.image_tag import spec_from_env

    image = spec_from_env(load_matrix(dict(env), workdir=None).backends, uid, os.getgid(), env).tag
    return replace(run, image=image, proxy_image=env.get("HIVE_RELAY_KUBE_PROXY_IMAGE") or proxy_image_tag(image))


def _run_as(spec: dict, uid: int, gid: int) -> None:
    """Every runAsUser/runAsGroup/fsGroup of a pod spec set to the image's contributor ids."""
    contexts = [spec["securityContext"]] + [c["securityContext"] for c in spec.get("initContainers", []) +
                                            spec["containers"] if "securityContext" in c]
    for ctx in contexts:
        for key, value in (("runAsUser", uid), ("runAsGroup", gid), ("fsGroup", gid)):
            if key in ctx:
                ctx[key] = value


def flat_profile(name: str) -> str:
    return name.replace("/", "-")


def box_pods(objects: list[dict], prefix: str, count: int, ids: tuple[int, int] | None = None,
             host_port: int | None = None, bundle_port: int | None = None) -> list[tuple[dict, list[str]]]:
    """The Job's template as one Pod per index, as the Job controller would make them, each with
    its own volumes; (pod, its volume names). `ids`: the image's contributor uid and gid when
    they are not the cluster image's 1000 (rootless: local_run). `host_port` (and `bundle_port`,
    the workspace server's): the pods run on the
    host's network (doctor's leaky-CNI stand-in) and reach the proxy pod on that port directly."""
    job = next(o for o in objects if o["kind"] == "Job")
    text = json.dumps(job["spec"]["template"]["spec"])
    if host_port is not None:
        text = text.replace(f"{PROXY_NAME}:{PROXY_PORT}", f"{PROXY_NAME}:{host_port}").replace(
            f"{PROXY_NAME}/{PROXY_PORT}", f"{PROXY_NAME}/{host_port}")
    if bundle_port is not None:
        text = text.replace(f"{PROXY_NAME}:{BUNDLE_PORT}", f"{PROXY_NAME}:{bundle_port}")
    pods = []
    for i in range(count):
        # podman 4.3 ignores hostAliases under --network none, so the proxy's name is written as
        # the address hostAliases would give it here (127.0.0.1, where the launcher listens).
        spec = json.loads(text.replace(PROXY_NAME, "127.0.0.1"))
        spec.pop("hostAliases", None)
        if host_port is not None:
            spec.pop("hostUsers", None)  # on the host's network runc cannot mount /sys in a new user namespace
        name = f"{prefix}-{i}"
        for c in spec["containers"]:
            c["env"] = [*c.get("env", []), {"name": "JOB_COMPLETION_INDEX", "value": str(i)}]
        volumes = private_volumes(spec, name)
        if ids is not None:
            _run_as(spec, *ids)
        # podman 4.3 ignores securityContext.seccompProfile (checked: AF_UNIX sockets worked); it reads
        # the pre-1.25 annotation, resolved under --seccomp-profile-root, a file name without a
        # directory (it reads only the first path component). Same profile, flat name (flat_profile).
        profile = flat_profile(spec["securityContext"]["seccompProfile"]["localhostProfile"])
        pods.append(({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": name, "labels": job["spec"]["template"]["metadata"]["labels"],
                                   "annotations": {"batch.kubernetes.io/job-completion-index": str(i),
                                                   "seccomp.security.alpha.kubernetes.io/pod": f"localhost/{profile}"}},
                      "spec": spec}, volumes))
    return pods


def proxy_pod(objects: list[dict], prefix: str, port: int, bundle_port: int) -> tuple[list[dict], list[str]]:
    """The proxy Deployment's template as a Pod (and its ConfigMap, when the run has egress), the
    proxy listening on `port` of the host and the workspace server on `bundle_port`."""
    dep = next(o for o in objects if o["kind"] == "Deployment")
    docs: list[dict] = []
    found = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "proxy-config"]
    if found:
        conf = copy.deepcopy(found[0])
        data = json.loads(conf["data"]["proxy.json"])
        data["listen"] = f"127.0.0.1:{port}"
        conf["data"]["proxy.json"] = json.dumps(data)
        conf["metadata"] = {"name": f"{prefix}-proxy-cm-proxy-config"}
        docs.append(conf)
    spec = copy.deepcopy(dep["spec"]["template"]["spec"])
    volumes = private_volumes(spec, f"{prefix}-proxy")
    for c in spec["containers"]:
        c.pop("readinessProbe", None)
        c.pop("ports", None)  # host network: podman maps no ports there
        if c["name"] == "bundle":
            c["command"] = [f"127.0.0.1:{bundle_port}" if a == f"0.0.0.0:{BUNDLE_PORT}" else a for a in c["command"]]
    # On the host's network a fresh user namespace cannot mount /sys (runc: EPERM); the cluster's
    # proxy pod keeps hostUsers: false. Still non-root, read-only, no capabilities.
    spec.pop("hostUsers", None)
    return [*docs, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{prefix}-proxy"}, "spec": spec}], volumes


def _proxy_secrets_and_trust(spec: dict, objects: list[dict], ca: str | None) -> None:
    """podman 4.3 plays no Secret: the proxy container's envFrom becomes its values as env (the
    pod's own spec, never a box's). A CA file is mounted read-only and named by SSL_CERT_FILE."""
    secret = next((o for o in objects if o["kind"] == "Secret"), None)
    for c in spec["containers"]:
        if c.pop("envFrom", None) and secret is not None:
            c["env"] = [*c.get("env", []), *({"name": k, "value": v} for k, v in secret.get("stringData", {}).items())]
        if ca and c["name"] == "proxy":
            c["env"] = [*c.get("env", []), {"name": "SSL_CERT_FILE", "value": "/etc/hive-relay-ca/ca.pem"}]
            c.setdefault("volumeMounts", []).append({"name": "hive-relay-ca", "mountPath": "/etc/hive-relay-ca/ca.pem",
                                                    "readOnly": True})
    if ca:
        spec["volumes"].append({"name": "hive-relay-ca", "hostPath": {"path": ca, "type": "File"}})


def pod_prefix(run_id: str) -> str:
    """Short pod names (podman names a container POD-CONTAINER): `hr-` and a digest of the run id."""
    return "hr-" + sha256(run_id.encode()).hexdigest()[:8]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _infra_pidfile(p: Played, pod: str) -> str:
    """Where the runtime will write the pod's infra process id (known before the pod starts: a
    started pod's `podman pod inspect` waits for its init containers, which wait for our listener)."""
    infra = subprocess.run([*p.podman, "pod", "inspect", pod, "--format", "{{.InfraContainerID}}"],
                           capture_output=True, text=True, env=p.env).stdout.strip()
    path = subprocess.run([*p.podman, "inspect", infra, "--format", "{{.PidFile}}"], capture_output=True, text=True,
                          env=p.env).stdout.strip()
    if not infra or not path:
        raise RuntimeError(f"pod {pod} has no infra container")
    return path


def _infra_pid(pidfile: str, pod: str, deadline: float, proc: subprocess.Popen) -> int:
    while time.monotonic() < deadline:
        try:
            with open(pidfile) as fh:
                text = fh.read().strip()
            if text.isdigit() and int(text) > 0:
                return int(text)
        except OSError:
            pass
        if proc.poll() not in (None, 0):
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"podman pod start {pod} failed: {err[-500:]}")
        time.sleep(0.02)
    raise RuntimeError(f"pod {pod} did not start")


def _splice(a: socket.socket, b: socket.socket) -> None:
    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    t = threading.Thread(target=pump, args=(b, a), daemon=True)
    t.start()
    pump(a, b)
    t.join()
    a.close()
    b.close()


def _forward(p: Played, listener: socket.socket, port: int) -> None:
    """Accept in the box's namespace, connect to the proxy pod: the box's one way out."""
    listener.settimeout(0.2)
    while not p.stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError as err:
            # A client gone before its accept (ECONNABORTED, as the init container's probe does) or a
            # transient shortage is not the end of the box's only way out; a closed listener is.
            if err.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
                return
            time.sleep(0.01)
            continue
        conn.settimeout(None)
        try:  # the connect on the connection's own thread: a slow one must not hold up the others
            threading.Thread(target=_relay_to_proxy, args=(conn, port), daemon=True).start()
        except RuntimeError as err:  # no thread to be had
            _unanswered(conn, f"the box's forwarder could not serve the connection: {err}", wait=False)
    listener.close()


def _relay_to_proxy(conn: socket.socket, port: int) -> None:
    try:
        up = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError as err:
        _unanswered(conn, f"the egress proxy pod does not answer on port {port}: {err.strerror or err}")
        return
    up.settimeout(None)  # the connect had a limit; a slow stream must not
    _splice(conn, up)


def _unanswered(conn: socket.socket, reason: str, wait: bool = True) -> None:
    """The box's client gets a 502/503 with the reason, never a connection closed unanswered (curl's
    "Empty reply from server"), and the play's stderr a line. `wait`: drain what the client sends
    (briefly) before closing, so the answer is not lost to a reset; not on the accept loop itself."""
    from relay.egress.answers import refuse, response

    print(f"hive-relay: {reason}", file=sys.stderr, flush=True)
    status = "502 Bad Gateway" if wait else "503 Service Unavailable"
    try:
        refuse(conn, response(status, "-", 0, reason, "A failure, not a denial: retrying may work.", header="Error"),
               wait=wait)
    except OSError:
        pass
    finally:
        conn.close()


@record(frozen=False)
class PlayResult:
    """Each box's result and log (by index), and the proxy's decision log (its stdout)."""

    results: list[BoxResult]
    logs: dict[int, str]
    proxy_log: str


def play(plan: Plan, run: KubeRun, bundle: bytes, env: Mapping[str, str], work: str,
         timeout: float = 600.0, box_network: str = "none", secret_values: Mapping[str, str] | None = None,
         proxy_ca: str | None = None) -> PlayResult:
    """Play the run's pods (at most `run.parallel` at once), wait for every box, collect.
    `secret_values`: the proxy Secret's values (relay/modes/kube_secrets.py), given to the proxy pod as
    its envFrom would; `proxy_ca`: a CA file the proxy pod trusts (SSL_CERT_FILE), as a cluster's
    proxy image would carry a corporate CA; the tests' TLS upstreams use one.
    `box_network` other than none is for doctor's tests only: a cluster whose CNI ignores
    NetworkPolicy, simulated by a box pod with a network of its own; `host` works rootless too
    (a rootless bridge needs slirp4netns, which needs /dev/net/tun)."""
    from relay.host.netns import listen_in

    if run.runtime_class:
        from relay.model.errors import RefusedError

        raise RefusedError(f"runtimeClassName {run.runtime_class}: podman kube play cannot run a pod on runsc here "
                           "(see relay/modes/kube_podman.py), and playing it on runc would be weaker than asked; fix: "
                           f"a cluster with gVisor (check it: {ENTRY} doctor --mode kube --isolation gvisor), or drop "
                           "--isolation gvisor")
    podman = ["podman", "--log-level=error"]
    prefix = pod_prefix(run.run_id)
    run = replace(run, proxy_ip="127.0.0.1")
    objects = render_objects(plan, run, bundle, secret_values)
    rootless = os.getuid() != 0
    # Rootless on cgroup v1 (no delegated v2 cgroup): limits as rlimits (rlimit_resources).
    rlimits = rootless and plan.limits.method is not LimitsMethod.CGROUP_V2
    ids = (os.getuid(), os.getgid()) if rootless and not env.get("HIVE_RELAY_KUBE_IMAGE") else None
    port = _free_port() if plan.proxy_listen else 0
    bport = _free_port()
    host_port = port if box_network == "host" and plan.proxy_listen else None
    pods, box_volumes = [], []
    for pod, volumes in box_pods(objects, prefix, run.count, ids, host_port,
                                 bport if box_network == "host" else None):
        if rlimits:
            rlimit_resources(pod["spec"], plan.limits.pids)
        pods.append(pod)
        box_volumes += volumes
    p = Played(work=work, env=podman_env(env, work), podman=podman)
    profile = seccomp_profile(plan)
    root = os.path.join(work, "seccomp")
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, flat_profile(seccomp_name(profile))), "w") as fh:
        json.dump(profile, fh)
    proxy_log = ""
    try:
        docs, volumes = proxy_pod(objects, prefix, port, bport)
        _proxy_secrets_and_trust(docs[-1]["spec"], objects, proxy_ca)
        if ids is not None:
            _run_as(docs[-1]["spec"], *ids)
        if rlimits:
            rlimit_resources(docs[-1]["spec"])
        p.pods.append(docs[-1]["metadata"]["name"])
        p.volumes += volumes
        _play(p, docs, "proxy.yaml", ["--network", "host"])
        for wait in ([port] if plan.proxy_listen else []) + [bport]:
            _wait_port(wait, time.monotonic() + 60)
        _upload_bundle(p, f"{prefix}-proxy-bundle", run, bundle)
        p.pods += [pod["metadata"]["name"] for pod in pods]
        p.volumes += box_volumes
        # One play per pod, so that `parallel` bounds how many run at once, as the Job controller does.
        pending = list(pods)
        running: list[tuple[dict, subprocess.Popen]] = []
        results: list[BoxResult] = []
        logs: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while pending or running:
            while pending and len(running) < (run.parallel or run.count):
                pod = pending.pop(0)
                name = pod["metadata"]["name"]
                file = os.path.join(work, f"{name}.yaml")
                with open(file, "w") as fh:
                    fh.write(to_yaml([pod]))
                created = subprocess.run([*podman, "kube", "play", "--start=false", "--network", box_network,
                                          "--seccomp-profile-root", root, file], capture_output=True, text=True, env=p.env)
                if created.returncode != 0:
                    raise RuntimeError(f"podman kube play {name} failed: {created.stderr[-500:]}")
                pidfile = _infra_pidfile(p, name)
                proc = subprocess.Popen([*podman, "pod", "start", name], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, env=p.env)
                if box_network != "host":
                    pid = _infra_pid(pidfile, name, deadline, proc)
                    # The box's ways out, each spliced to the proxy pod's port on the host: the
                    # proxy's (when the run has egress) and the workspace server's.
                    for inside, to in ([(PROXY_PORT, port)] if plan.proxy_listen else []) + [(BUNDLE_PORT, bport)]:
                        listener = listen_in(pid, f"127.0.0.1:{inside}", join_userns=rootless)
                        t = threading.Thread(target=_forward, args=(p, listener, to), daemon=True)
                        t.start()
                        p.threads.append(t)
                running.append((pod, proc))
            for pod, proc in list(running):
                name = pod["metadata"]["name"]
                if proc.poll() is None:
                    continue
                box = f"{name}-box"
                state = subprocess.run([*podman, "inspect", box, "--format", "{{.State.Status}}"], capture_output=True,
                                       text=True, env=p.env).stdout.strip()
                if proc.returncode != 0 and state in ("", "created", "configured"):  # it never ran: say why now
                    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                    raise RuntimeError(f"podman pod start {name} failed: {err[-500:]}")
                if state in ("running", "created", "configured"):
                    continue
                text = subprocess.run([*podman, "logs", box], capture_output=True, text=True, encoding="utf-8",
                                      errors="replace", env=p.env).stdout
                index = int(name.rsplit("-", 1)[1])
                logs[index] = text
                results.append(extract_result(index, text))
                running.remove((pod, proc))
            if time.monotonic() > deadline:
                raise TimeoutError("the boxes did not finish in time")
            time.sleep(0.1)
        if plan.proxy_listen:
            proxy_log = subprocess.run([*podman, "logs", f"{prefix}-proxy-proxy"], capture_output=True, text=True,
                                       env=p.env).stdout
        return PlayResult(sorted(results, key=lambda r: r.index), logs, proxy_log)
    finally:
        p.down()


def _upload_bundle(p: Played, container: str, run: KubeRun, bundle: bytes) -> None:
    """The bundle into the proxy pod's workspace server, as `kubectl exec -i` does on a cluster."""
    from relay.modes.kube_run import bundle_upload_argv

    proc = subprocess.run([*p.podman, "exec", "-i", container, *bundle_upload_argv(run, bundle)], input=bundle,
                          capture_output=True, env=p.env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"streaming the bundle into {container} failed: {proc.stderr.decode(errors='replace')[-500:]}")


def _play(p: Played, docs: list[dict], name: str, extra: list[str]) -> None:
    file = os.path.join(p.work, name)
    with open(file, "w") as fh:
        fh.write(to_yaml(docs))
    proc = subprocess.run([*p.podman, "kube", "play", *extra, file], capture_output=True, text=True, env=p.env)
    if proc.returncode != 0:
        raise RuntimeError(f"podman kube play {name} failed: {proc.stderr[-500:]}")


def _wait_port(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the proxy pod did not listen on 127.0.0.1:{port}")
