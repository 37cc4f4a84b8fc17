"""kube mode: a resolved Plan rendered as Kubernetes objects (pure; nothing is applied here).

One namespace per run holds everything, so deleting it ends the run (Ctrl-C, timeout, done):

- an Indexed Job of `count` agent boxes (`parallel` at once), each pod hardened the way container
  mode's `podman run` is: non-root, read-only root, no capabilities, no privilege escalation, its
  own user namespace (`hostUsers: false`), the same merged seccomp profile (a `Localhost` profile
  the nodes must carry), sized emptyDirs for /tmp, $HOME and the workspace, the profile's limits;
- the egress proxy (relay/egress/proxy_main.py: our proxy, the same allowlist and JSON decision log) as
  its own Deployment and Service: not a sidecar, because NetworkPolicy selects whole pods;
- the workspace as a git bundle served by that pod (relay/modes/kube_bundle.py, port 3129): the launcher
  streams it in through `kubectl exec` once the pod is up, so no object in the API server carries
  it and its size has no 1 MiB limit; each box's init container fetches it, checks its sha256 (the
  Job's annotation) and clones it. With no egress at all, the pod serves the bundle alone;
- two NetworkPolicies: boxes may reach the proxy's port and nothing else (no DNS: the proxy's
  name comes from `hostAliases`); the proxy may reach public addresses on the allowed ports, and DNS;
- the credential routes' keys as a Secret mounted only into the proxy (never into a box).

The boxes find the proxy through a hostAliases entry (the Service's ClusterIP), so they need no
DNS. That address exists only once the Service is created: the runner applies the Service first
and renders the Job with it (`proxy_ip`); a dry run without it shows PROXY_IP_UNSET in its place.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from relay.model.backend import CredentialRoute
from relay.model.errors import RefusedError
from relay.model.hashing import sha256
from relay.model.record import record
from relay.plan.resolve import Plan
from relay.policy.egress import CREDENTIAL_PLACEHOLDER
from relay.render.seccomp_oci import default_profile, render

PROXY_NAME = "hive-relay-proxy"
PROXY_PORT = 3128
BOX_PROXY = f"{PROXY_NAME}:{PROXY_PORT}"
PROXY_IP_UNSET = "0.0.0.0"  # a dry run's stand-in: the Service's ClusterIP is known only once it exists
BOX_UID = 1000  # the image's contributor user (Dockerfile.contributor)
BUNDLE_KEY = "workspace.bundle"
BUNDLE_DIR = "/run/hive-relay/bundle"
BUNDLE_PORT = 3129  # relay/modes/kube_bundle.py's, in the proxy pod
SECCOMP_DIR = "hive-relay"  # under the kubelet's seccomp root (/var/lib/kubelet/seccomp)
PROXY_CONFIG = "/etc/hive-relay/proxy.json"
PROXY_PYTHONPATH = "/opt/hive-relay/python"
# Not public: what a box's proxy may not reach directly (RFC 1918, CGNAT, link-local, loopback, ...).
PRIVATE_V4 = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
              "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/3")
PRIVATE_V6 = ("::1/128", "fc00::/7", "fe80::/10", "ff00::/8")
RESULT_BEGIN = "hive-relay-patch-begin"
RESULT_END = "hive-relay-patch-end"
# The box's wrapper: run the agent in the workspace, then print the workspace's change since the
# cloned commit (its own commits included) as a base64 git diff between markers. The runner keeps it
# as RUN/box-N.patch and stages it (relay/trust/kube_stage.py); nothing is applied to the checkout.
BOX_SCRIPT = (
    'cd "$HIVE_RELAY_WORKSPACE" || exit 70\n'
    'base=${HIVE_RELAY_BASE:-$(git rev-parse HEAD)} || exit 70\n'
    '"$@"\n'
    'rc=$?\n'
    'git add -A >/dev/null 2>&1\n'
    f'echo {RESULT_BEGIN}\n'
    'git diff --cached --binary --full-index "$base" | base64\n'
    f'echo {RESULT_END} "$rc"\n'
    'exit "$rc"\n'
)
# The box's first init container: the bundle from the proxy pod (503 until the launcher has streamed
# it in), checked against the Job's sha256, then cloned. No proxy variable: a direct connection to
# the pod's bundle port, the one other port the boxes' NetworkPolicy opens.
FETCH_BUNDLE = (
    'i=0\n'
    f'until curl -sf --noproxy "*" -o {BUNDLE_DIR}/{BUNDLE_KEY} http://{PROXY_NAME}:{BUNDLE_PORT}/{BUNDLE_KEY}; do\n'
    '  i=$((i+1))\n'
    '  if [ "$i" -ge 600 ]; then echo "hive-relay: the workspace bundle did not arrive in 300 s" >&2; exit 69; fi\n'
    '  sleep 0.5\n'
    'done\n'
    f'echo "$HIVE_RELAY_BUNDLE_SHA256  {BUNDLE_DIR}/{BUNDLE_KEY}" | sha256sum -c --quiet - || {{\n'
    '  echo "hive-relay: the workspace bundle does not match the sha256 the launcher computed" >&2; exit 65; }\n'
    f'git clone --quiet {BUNDLE_DIR}/{BUNDLE_KEY} "$HIVE_RELAY_WORKSPACE" || exit 70\n'
    # The checkout's uncommitted changes (a snapshot commit on top of HEAD): in the worktree as
    # uncommitted changes again, HEAD and the index where the user's are.
    'cd "$HIVE_RELAY_WORKSPACE" || exit 70\n'
    'if [ "$HIVE_RELAY_BASE" != "$(git rev-parse HEAD)" ]; then\n'
    '  git read-tree -u --reset "$HIVE_RELAY_BASE" && git reset -q || exit 70\n'
    'fi\n'
)
WAIT_PROXY = (
    'i=0\n'
    'while [ "$i" -lt 600 ]; do\n'
    f'  (exec 3<>/dev/tcp/{PROXY_NAME}/{PROXY_PORT}) 2>/dev/null && exit 0\n'
    '  i=$((i+1)); sleep 0.5\n'
    'done\n'
    f'echo "hive-relay: the egress proxy {BOX_PROXY} did not answer in 300 s" >&2\n'
    'exit 69\n'
)


@record
class KubeRun:
    """What kube mode adds to a plan: the fan-out, the names and the cluster-side settings."""

    run_id: str
    image: str
    proxy_image: str
    count: int = 1
    parallel: int | None = None
    runtime_class: str | None = None
    proxy_ip: str | None = None
    ttl_seconds: int = 600  # after the Job ends, its objects (all owned by it) go; the launcher deletes sooner
    bundle_sha256: str = ""
    bundle_bytes: int = 0
    bundle_base: str = ""  # the commit the boxes start from (relay/kube_stage.bundle_head)


def namespace(run_id: str) -> str:
    """A DNS-1123 label from the run id: lower case, digits and '-', at most 63 characters."""
    clean = "".join(c if c.isalnum() else "-" for c in run_id.lower()).strip("-")
    return f"hive-relay-{clean}"[:63].rstrip("-")


def seccomp_profile(plan: Plan) -> dict:
    """The same merged profile container mode writes (the engine's default minus the box's denials)."""
    assert plan.seccomp_policy is not None
    return render(plan.seccomp_policy, default_profile())


def seccomp_name(profile: dict) -> str:
    """The profile's file name under the kubelet's seccomp root, named by content: a changed
    policy is a new file, never an old one silently reused."""
    digest = sha256(json.dumps(profile, sort_keys=True).encode()).hexdigest()[:12]
    return f"{SECCOMP_DIR}/box-{digest}.json"


def _labels(run: KubeRun, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "hive-relay", "app.kubernetes.io/component": role,
            "hive-relay/run": namespace(run.run_id)[len("hive-relay-"):]}


def _quantity(n: int) -> str:
    return f"{n // (1 << 20)}Mi" if n >= (1 << 20) else str(n)


def _box_env(plan: Plan) -> list[dict]:
    """The plan's variables, with the proxy's address (and a credential route's URL) pointing at
    the proxy Service. No caller variable is copied by value into a pod spec: keys stay with the proxy."""
    env = dict(plan.env_set)
    for name, value in env.items():
        env[name] = value.replace("127.0.0.1:3128", BOX_PROXY).replace(  # and bash's /dev/tcp form (ssh)
            "/dev/tcp/127.0.0.1/3128", "/dev/tcp/" + BOX_PROXY.replace(":", "/"))
    if plan.proxy_listen:
        env["NO_PROXY"] = env["no_proxy"] = "localhost,127.0.0.1,::1"
    env["HIVE_RELAY_WORKSPACE"] = plan.workdir
    env.pop("HIVE_RELAY_GO", None)
    for route in plan.credentials:
        if route.login is not None and (plan.backend, route.name) in LOGIN_BOX_ENV:
            env.setdefault(LOGIN_BOX_ENV[(plan.backend, route.name)], CREDENTIAL_PLACEHOLDER)
    return [{"name": k, "value": env[k]} for k in sorted(env)]


def _hardened(read_only: bool = True) -> dict:
    return {"runAsNonRoot": True, "runAsUser": BOX_UID, "runAsGroup": BOX_UID, "readOnlyRootFilesystem": read_only,
            "allowPrivilegeEscalation": False, "privileged": False, "capabilities": {"drop": ["ALL"]}}


def _bundle_size(run: KubeRun) -> str:
    """The bundle volume's size: the bundle and a MiB, in whole MiB."""
    return f"{(run.bundle_bytes >> 20) + 2}Mi"


def box_pod_spec(plan: Plan, run: KubeRun, seccomp_file: str) -> dict:
    """The agent box's pod spec: the Job's template, and what `podman kube play` runs per index."""
    home = dict(plan.env_set).get("HOME", "/home/contributor")
    tmp_size = _quantity(plan.limits.memory // 4)
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "home", "mountPath": home},
              {"name": "workspace", "mountPath": plan.workdir}]
    init = [{
        "name": "unpack", "image": run.image, "imagePullPolicy": "IfNotPresent",
        "command": ["bash", "-c", FETCH_BUNDLE],
        "env": [{"name": "HOME", "value": home}, {"name": "HIVE_RELAY_WORKSPACE", "value": plan.workdir},
                {"name": "HIVE_RELAY_BUNDLE_SHA256", "value": run.bundle_sha256},
                {"name": "HIVE_RELAY_BASE", "value": run.bundle_base}],
        "securityContext": _hardened(), "resources": _resources(plan),
        "volumeMounts": [{"name": "bundle", "mountPath": BUNDLE_DIR}] + mounts,
    }]
    if plan.proxy_listen:
        init.append({"name": "wait-proxy", "image": run.image, "imagePullPolicy": "IfNotPresent",
                     "command": ["bash", "-c", WAIT_PROXY], "securityContext": _hardened(),
                     "resources": _resources(plan)})
    spec: dict = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostUsers": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": BOX_UID, "runAsGroup": BOX_UID, "fsGroup": BOX_UID,
                            "seccompProfile": {"type": "Localhost", "localhostProfile": seccomp_file}},
        "initContainers": init,
        "containers": [{
            "name": "box", "image": run.image, "imagePullPolicy": "IfNotPresent",
            "command": ["/bin/sh", "-c", BOX_SCRIPT, "hive-relay-box", *plan.argv],
            "workingDir": plan.workdir,
            "env": [*_box_env(plan), {"name": "HIVE_RELAY_BASE", "value": run.bundle_base}],
            "securityContext": _hardened(),
            "resources": _resources(plan),
            "volumeMounts": mounts,
        }],
        "volumes": [
            {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": tmp_size}},
            {"name": "home", "emptyDir": {"medium": "Memory", "sizeLimit": tmp_size}},
            {"name": "workspace", "emptyDir": {"sizeLimit": "2Gi"}},
            {"name": "bundle", "emptyDir": {"sizeLimit": _bundle_size(run)}},
        ],
    }
    # The proxy pod's name: it serves the bundle even when the run has no egress at all.
    spec["hostAliases"] = [{"ip": run.proxy_ip or PROXY_IP_UNSET, "hostnames": [PROXY_NAME]}]
    if run.runtime_class:
        spec["runtimeClassName"] = run.runtime_class
    return spec


def _resources(plan: Plan) -> dict:
    mem = _quantity(plan.limits.memory)
    return {"limits": {"memory": mem, "cpu": "2"}, "requests": {"memory": "256Mi", "cpu": "250m"}}


def proxy_config(plan: Plan) -> dict:
    """What relay/egress/proxy_main.py serves: the plan's allowlist and credential routes (names, never keys)."""
    return {"backend": plan.backend, "listen": f"0.0.0.0:{PROXY_PORT}", "egress": list(plan.egress),
            "routes": [_route(r) for r in kube_routes(plan)]}


def kube_routes(plan: Plan) -> tuple:
    """The routes the cluster's proxy serves: every route of the plan (a backend's key from a
    variable, an `auth:` grant, a login's token), each under a key name of its own in the proxy's
    Secret (relay/modes/kube_secrets.py reads the values on the host)."""
    from relay.modes.kube_secrets import carried

    return tuple(c.route for c in carried(plan.credentials))


# A login route's token reaches the pod's proxy, but the CLI in the pod has no login file to send
# with (a pod gets no copy of the host's state): this variable, by backend and route, makes it send
# the placeholder as its key, which the proxy swaps for the real one on the pinned upstream.
LOGIN_BOX_ENV = {("claude", "anthropic-login"): "CLAUDE_CODE_OAUTH_TOKEN", ("claude", "anthropic-console"): "ANTHROPIC_API_KEY",
                 ("codex", "openai-login"): "CODEX_API_KEY",
                 ("opencode", "anthropic-login"): "ANTHROPIC_API_KEY",
                 ("opencode", "openai-login"): "OPENAI_API_KEY"}


# A login route whose CLI signs in only from its login file (codex's provider for a ChatGPT login reads
# auth.json's tokens and account id): a pod gets no copy of the host's state, so that CLI would start
# logged out. Refused, with the fixes, rather than a pod that fails inside.
LOGIN_NEEDS_FILE = {("codex", "chatgpt-login"): "set CODEX_API_KEY on the host (an API key the proxy carries)"}


def refuse_unreachable_logins(plan: Plan) -> None:
    """Stop a kube run whose CLI could not use its login in a pod (LOGIN_NEEDS_FILE), in one line."""
    for route in plan.credentials:
        fix = LOGIN_NEEDS_FILE.get((plan.backend, route.name))
        if route.login is not None and fix:
            raise RefusedError(f"{plan.backend}: kube mode cannot carry the login {route.login.file} into a pod "
                               f"(route {route.name}: the CLI signs in from that file, and a pod gets no copy of the "
                               f"host's state); fix: {fix}, or --mode local or --mode container")


def _route(route: CredentialRoute) -> dict:
    """Exactly what relay/egress/proxy_main.py's routes_from reads (a new field elsewhere never leaks in)."""
    return {"name": route.name, "secret_env": list(route.secret_env), "upstream_host": route.upstream_host,
            "upstream_port": route.upstream_port, "send": route.send,
            "box_env": [list(x) for x in route.box_env], "box_args": list(route.box_args),
            "methods": list(route.methods), "paths": list(route.paths), "push": route.push, "git": route.git,
            "basic_user": route.basic_user}


def _allowed_ports(plan: Plan) -> list[int]:
    """Where the proxy connects: a pinned rule's pin port, else the rule's port (443 when unset)."""
    ports = {rule.pin_port or rule.port or 443 for rule in plan.rules}
    ports |= {r.upstream_port for r in plan.credentials}
    return sorted(ports) or [443]


def with_bundle(run: KubeRun, bundle: bytes) -> KubeRun:
    """The run with its bundle's sha256 and size: what the Job checks and the volumes are sized by."""
    from relay.model.record import replace
    from relay.trust.kube_stage import bundle_head

    return replace(run, bundle_sha256=sha256(bundle).hexdigest(), bundle_bytes=len(bundle),
                   bundle_base=bundle_head(bundle) or "")


def render_objects(plan: Plan, run: KubeRun, bundle: bytes, secret_values: Mapping[str, str] | None = None) -> list[dict]:
    """Every object of one run, in apply order. `secret_values` (the routes' keys, by variable name)
    is given only on a real apply; a dry run shows the Secret's key names without values. The
    bundle itself is in no object: only its sha256 and size (the runner streams it to the proxy pod)."""
    if plan.container is not None or plan.mode != "kube":
        raise ValueError("render_objects needs a kube-mode plan")
    refuse_unreachable_logins(plan)
    run = with_bundle(run, bundle)
    ns = namespace(run.run_id)
    profile = seccomp_profile(plan)
    seccomp_file = seccomp_name(profile)
    objects: list[dict] = [{
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": ns, "labels": {**_labels(run, "run"),
                                            "pod-security.kubernetes.io/enforce": "restricted"}},
    }]
    objects += _proxy_objects(plan, run, ns, secret_values)
    objects += _network_policies(plan, run, ns)
    parallel = min(run.parallel or run.count, run.count)
    objects.append({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "boxes", "namespace": ns, "labels": _labels(run, "box"),
                     "annotations": {"hive-relay/profile": f"{plan.profile} ({plan.profile_digest})",
                                     "hive-relay/seccomp": seccomp_file,
                                     "hive-relay/bundle-sha256": run.bundle_sha256,
                                     "hive-relay/bundle-bytes": str(run.bundle_bytes)}},
        "spec": {
            "completionMode": "Indexed", "completions": run.count, "parallelism": parallel,
            "backoffLimit": 0, "activeDeadlineSeconds": plan.timeout or 1800,
            "ttlSecondsAfterFinished": run.ttl_seconds,
            "template": {"metadata": {"labels": _labels(run, "box")},
                         "spec": box_pod_spec(plan, run, seccomp_file)},
        },
    })
    return objects


def _bundle_container(run: KubeRun) -> dict:
    """The workspace server (relay/modes/kube_bundle.py) beside the proxy: stdlib only, its own port."""
    return {
        "name": "bundle", "image": run.proxy_image, "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-m", "relay.modes.kube_bundle", "serve", "--dir", BUNDLE_DIR,
                    "--listen", f"0.0.0.0:{BUNDLE_PORT}"],
        "env": [{"name": "PYTHONPATH", "value": PROXY_PYTHONPATH}],
        "ports": [{"name": "bundle", "containerPort": BUNDLE_PORT, "protocol": "TCP"}],
        "securityContext": _hardened(),
        "resources": {"limits": {"memory": "128Mi", "cpu": "1"}, "requests": {"memory": "32Mi", "cpu": "50m"}},
        "readinessProbe": {"tcpSocket": {"port": BUNDLE_PORT}, "periodSeconds": 2},
        "volumeMounts": [{"name": "bundle", "mountPath": BUNDLE_DIR}],
    }


def _server_ports(plan: Plan) -> list[int]:
    """The proxy pod's ports the boxes may reach: the proxy's (when the run has egress) and the bundle's."""
    return ([PROXY_PORT] if plan.proxy_listen else []) + [BUNDLE_PORT]


def _proxy_objects(plan: Plan, run: KubeRun, ns: str, secret_values: Mapping[str, str] | None) -> list[dict]:
    names = sorted({n for r in kube_routes(plan) for n in r.secret_env})
    labels = _labels(run, "proxy")
    bundle = {"name": "bundle", "emptyDir": {"sizeLimit": _bundle_size(run)}}
    if not plan.proxy_listen:  # no egress at all: the pod only serves the workspace
        return _server_objects(run, ns, labels, [_bundle_container(run)], [bundle], [BUNDLE_PORT])
    volumes = [{"name": "config", "configMap": {"name": "proxy-config", "defaultMode": 0o444}},
               {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}}, bundle]
    container: dict = {
        "name": "proxy", "image": run.proxy_image, "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-m", "relay.egress.proxy_main", "--config", PROXY_CONFIG],
        "env": [{"name": "PYTHONPATH", "value": PROXY_PYTHONPATH}],
        "ports": [{"name": "proxy", "containerPort": PROXY_PORT, "protocol": "TCP"}],
        "securityContext": _hardened(),
        "resources": {"limits": {"memory": "256Mi", "cpu": "1"}, "requests": {"memory": "64Mi", "cpu": "100m"}},
        "readinessProbe": {"tcpSocket": {"port": PROXY_PORT}, "periodSeconds": 2},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/hive-relay", "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    objects: list[dict] = [{
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "proxy-config", "namespace": ns, "labels": labels},
        "data": {"proxy.json": json.dumps(proxy_config(plan), indent=1, sort_keys=True)},
    }]
    if names:
        # The keys: only the proxy's container reads them (envFrom), no box pod mounts this Secret.
        secret: dict = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                        "metadata": {"name": "proxy-credentials", "namespace": ns, "labels": labels,
                                     "annotations": {"hive-relay/keys": ",".join(
                                         f"{r.secret_env[0]}={r.name}" for r in kube_routes(plan))}}}
        if secret_values is not None:
            secret["stringData"] = {n: secret_values[n] for n in names if n in secret_values}
        objects.append(secret)
        container["envFrom"] = [{"secretRef": {"name": "proxy-credentials"}}]
    return objects + _server_objects(run, ns, labels, [container, _bundle_container(run)], volumes,
                                     [PROXY_PORT, BUNDLE_PORT])


def _server_objects(run: KubeRun, ns: str, labels: dict, containers: list[dict], volumes: list[dict],
                    ports: list[int]) -> list[dict]:
    """The proxy pod's Deployment and its Service."""
    names = {PROXY_PORT: "proxy", BUNDLE_PORT: "bundle"}
    return [{
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": PROXY_NAME, "namespace": ns, "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {
                     "automountServiceAccountToken": False, "enableServiceLinks": False, "hostUsers": False,
                     "securityContext": {"runAsNonRoot": True, "runAsUser": BOX_UID, "runAsGroup": BOX_UID,
                                         "fsGroup": BOX_UID, "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": containers, "volumes": volumes}}},
    }, {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": PROXY_NAME, "namespace": ns, "labels": labels},
        "spec": {"selector": labels, "ports": [{"name": names[p], "port": p, "targetPort": p, "protocol": "TCP"}
                                               for p in ports]},
    }]


def _network_policies(plan: Plan, run: KubeRun, ns: str) -> list[dict]:
    box, proxy = _labels(run, "box"), _labels(run, "proxy")
    reach = [{"protocol": "TCP", "port": p} for p in _server_ports(plan)]
    box_egress = [{"to": [{"podSelector": {"matchLabels": proxy}}], "ports": reach}]
    objects = [{
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "boxes-reach-only-the-proxy", "namespace": ns, "labels": box},
        # No DNS and no other pod: the proxy pod's ports (egress, the bundle) are the one way out.
        "spec": {"podSelector": {"matchLabels": box}, "policyTypes": ["Ingress", "Egress"], "ingress": [],
                 "egress": box_egress},
    }]
    if not plan.proxy_listen:
        objects.append({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "bundle-server-reaches-nothing", "namespace": ns, "labels": proxy},
            "spec": {"podSelector": {"matchLabels": proxy}, "policyTypes": ["Ingress", "Egress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": box}}], "ports": reach}], "egress": []},
        })
    if plan.proxy_listen:
        ports = [{"protocol": "TCP", "port": p} for p in _allowed_ports(plan)]
        objects.append({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "proxy-reaches-public-allowed-ports", "namespace": ns, "labels": proxy},
            "spec": {
                "podSelector": {"matchLabels": proxy}, "policyTypes": ["Ingress", "Egress"],
                "ingress": [{"from": [{"podSelector": {"matchLabels": box}}], "ports": reach}],
                "egress": [
                    {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": list(PRIVATE_V4)}},
                            {"ipBlock": {"cidr": "::/0", "except": list(PRIVATE_V6)}}], "ports": ports},
                    # DNS for the proxy itself (the cluster resolver, wherever it lives).
                    {"to": [{"namespaceSelector": {}}],
                     "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
                ],
            },
        })
    return objects


def to_yaml(objects: Sequence[dict]) -> str:
    """Multi-document YAML, keys in the order written (what `kubectl apply -f -` reads)."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:  # no &id001 anchors: plain, diffable YAML
            return True

    def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
        # A literal block only where every YAML reader agrees on it: no leading blank (that needs an
        # indentation indicator, which go-yaml, podman's reader, reads differently) and no trailing spaces.
        plain_block = "\n" in data and not data[:1].isspace() and " \n" not in data and "\t" not in data
        style = "|" if plain_block else ('"' if "\n" in data else None)
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    _Dumper.add_representer(str, _str)
    return yaml.dump_all(list(objects), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1 << 30)  # no folded lines: go-yaml misreads some


def describe(plan: Plan, run: KubeRun) -> dict:
    """The `--dry-run --json` key `kube`: the names the run would create, and which credential
    routes reach the cluster's proxy (each under its Secret key; values never shown)."""
    from relay.modes.kube_secrets import carried

    return {"namespace": namespace(run.run_id), "count": run.count, "parallel": min(run.parallel or run.count, run.count),
            "image": run.image, "proxy_image": run.proxy_image, "runtime_class": run.runtime_class,
            "seccomp_profile": seccomp_name(seccomp_profile(plan)),
            "credentials": [r.name for r in plan.credentials],
            "credentials_carried": [{"route": c.route.name, "key": c.key, "from": c.source}
                                    for c in carried(plan.credentials)],
            "workspace": {"bundle_bytes": run.bundle_bytes, "bundle_sha256": run.bundle_sha256,
                          "served_by": f"{PROXY_NAME}:{BUNDLE_PORT}"}}
