"""resolve(): a pure function from (backend, request, host facts) to a frozen Plan.

Everything the runner does is decided here, so `--dry-run --json` shows exactly what would
run and unit tests can assert on every backend × mode without launching anything.
"""

from __future__ import annotations

import json
import os
import time

from relay.box.nodeproxy import node_options
from relay.box.overlay_layer import unsafe_path
from relay.config.presets import expand as expand_presets
from relay.config.profiles import TOOLCHAIN_GRANTS, Profile, resolve_profile
from relay.host.paths import IN_CHECKOUT, PACKAGE_ROOT, config_home, gvisor_init_script, own_paths, state_dir, tool_dir
from relay.model import credential_files, token_shapes
from relay.model.allow_rules import HostRule, explain
from relay.model.backend import Backend, CredentialRoute, Matrix
from relay.model.errors import RefusedError, UsageError
from relay.model.fs_view import FsView
from relay.model.hashing import sha256
from relay.model.host_facts import HostFacts
from relay.model.limits import Limits, limit_method
from relay.model.mounts import Grant, Mount
from relay.model.record import asdict, field, record, replace
from relay.model.refusal import ENTRY
from relay.model.vocab import MODES, LoginHold, MountKind, Tier, WorkdirMode
from relay.plan.host_steps import host_steps
from relay.policy import inspection
from relay.policy.denylist import expand, nested_git_paths, protected_paths, secret_paths
from relay.policy.egress import CREDENTIAL_PLACEHOLDER, allowed_rules, as_entries, parse_entries
from relay.policy.fsplan import FsPlan, plan_filesystem
from relay.policy.sockets import (
    CONNECT_ENV,
    BoxSocket,
    connect_script,
    parse_ssh_hosts,
    resolve_sockets,
    socket_homes,
    ssh_command,
)
from relay.policy.tiers import ISOLATIONS, TierChoice, choose_engine, choose_tier  # noqa: F401 - re-exported (completion, tasks)
from relay.policy.workdir import own_checkout_in
from relay.policy.workdir import refusal as workdir_refusal
from relay.render import bwrap_argv, container_argv, gvisor_oci
from relay.render.container_argv import ContainerRun
from relay.render.gvisor_oci import GvisorRun
from relay.render.native_permissions import render as render_native
from relay.render.seccomp_bpf import SeccompPolicy, policy_for
from relay.render.vm_run import VmRun
from relay.trust import rundirs
from relay.trust.gitdir import EMPTY, OBJECT_REDIRECTS, GitPlan, plan_git
from relay.trust.staged import StagedLayer
from relay.trust.staged import for_run as staged_for_run

PROXY_LISTEN = "127.0.0.1:3128"
# The vm tier loads no seccomp filter: the agent's system calls reach only the guest's own kernel.
VM_SECCOMP = ("none in the guest: its own kernel answers the agent's system calls (the boundary is the VM)",)
GVISOR_RUNTIME_CLASS = "gvisor"  # kube mode: the RuntimeClass a gVisor node offers (GKE Sandbox, gVisor docs)
BOX_UID_FOR_ROOT = 1000
SECCOMP_FD = 3
INFO_FD = 4
BLOCK_FD = 5
# --allow-socket in the supervised tier: the i-th socket reaches bwrap as an O_PATH fd at SOCKET_FD + i
# (`--ro-bind-fd`), opened and checked by the runner, so nothing can swap the path between check and bind.
SOCKET_FD = 6
DEFAULT_TIMEOUT = 1800
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
BOX_GIT_EXCLUDES = "/run/hive-relay/git-excludes"



@record
class Request:
    """What the user asked for, straight from the command line."""

    backend: str
    mode: str = "local"
    profile: str | None = None
    isolation: str | None = None
    prompt: str | None = None
    workdir: str = "."
    allow_hosts: tuple[str, ...] = ()
    allow_presets: tuple[str, ...] = ()
    ask: bool = False
    timeout: int | None = None
    run_id: str = ""
    allow_sockets: tuple[str, ...] = ()  # --allow-socket: ssh-agent, gpg-agent or PATH (relay/policy/sockets.py)
    allow_ssh: tuple[str, ...] = ()  # --allow-ssh HOST[:PORT]
    no_grants: bool = False  # --no-grants: no `auth:` grant of the user config applies to this run
    staged: bool = False  # --staged: the box's workdir writes land in a private layer (relay/trust/staged.py)
    apply: bool = False  # --apply: at exit, apply what is not flagged; the flagged stay staged
    live: bool = False  # --live: the box writes the checkout itself (staged is the default)
    shared_live: bool = False  # --shared-live: a live box even while another live box runs on the checkout
    vm_accel: str | None = None  # --vm-accel kvm|tcg (or the user config's `vm: {accel: ...}`): the VM tier's CPU
    inspect: tuple[str, ...] = ()  # --inspect HOST[:PORT]: TLS to it terminated on the host (relay/policy/inspection.py)
    # Internal (selftest): run this argv in the backend's box instead of the agent.
    argv_override: tuple[str, ...] | None = None


@record
class LoginFileUse:
    """One credential file of the agent's state in this run: where it is, the JSON paths of the
    secrets it holds (names, never values), how the box gets it, and the routes that hold it."""

    file: str  # the host path
    held: LoginHold
    secrets: tuple[str, ...]  # concrete dotted paths, e.g. tokens.access_token
    paths: tuple[str, ...]  # the patterns the box's copy is masked at (secret_files, plus a route's token)
    routes: tuple[str, ...] = ()


@record
class Plan:
    """Everything one launch will do. Secrets appear by name only (env_pass), never by value."""

    backend: str
    mode: str
    tier: Tier
    profile: str
    profile_digest: str
    workdir: str
    interactive: bool
    timeout: int | None
    argv: tuple[str, ...]
    command: tuple[str, ...]
    env_set: tuple[tuple[str, str], ...]
    env_pass: tuple[str, ...]
    mounts: tuple[Mount, ...]
    denied: tuple[str, ...]
    protected: tuple[str, ...]
    placeholders: tuple[str, ...]
    egress: tuple[str, ...]
    proxy_listen: str | None
    limits: Limits
    seccomp: tuple[str, ...]
    box_uid: int | None
    sync_files: tuple[str, ...]
    log_path: str | None
    run_dir: str | None
    seccomp_policy: SeccompPolicy | None = None
    fs_rules: tuple[tuple[str, str], ...] = ()
    guarded_files: tuple[str, ...] = ()
    state_dirs: tuple[str, ...] = ()  # the backend's state dirs: private copies in the box's home (agentstate)
    home_keep: tuple[str, ...] = ()  # what of those copies comes back at exit
    state_exclude: tuple[str, ...] = ()  # denied paths inside them: never copied, never synced back
    git_excludes: tuple[str, ...] = ()
    unsandboxed: bool = False
    container: ContainerRun | None = None
    gvisor: GvisorRun | None = None  # the gvisor tier's runsc run (relay/render/gvisor_oci.py)
    vm: VmRun | None = None  # the vm tier's guest (relay/modes/vm_boot.py)
    # kube mode with --isolation gvisor: the box pods' runtimeClassName (the canary proves the cluster has it).
    runtime_class: str | None = None
    git: GitPlan | None = None  # the workdir's git dir by allowlist (relay/trust/gitdir.py)
    notes: tuple[str, ...] = field(default=())
    rules: tuple[HostRule, ...] = ()  # egress.allowed_rules: handed to the proxy as is; `egress` is their text
    # Keys injected by the proxy (config.CredentialRoute): names of the host variables, never values.
    credentials: tuple[CredentialRoute, ...] = ()
    # Egress presets on for this run (the backend's, then --allow-preset): name → the rules it added.
    presets: tuple[tuple[str, tuple[HostRule, ...]], ...] = ()
    ask: bool = False  # --ask: the proxy holds a denied request while `invoke ask` answers
    sockets: tuple[BoxSocket, ...] = ()  # --allow-socket: host sockets bound in; AF_UNIX socket() allowed
    ssh: tuple[str, ...] = ()  # --allow-ssh: HOST:PORT reached by ssh through the proxy
    # The user config's `auth:` grants: (name, "" when it applies to this run, else why it does not).
    auth_grants: tuple[tuple[str, str], ...] = ()
    # Where the workdir's writes go: `staged`'s layer (reviewed on the host), the checkout (live), or
    # kube's patch files. An unsandboxed run is live: the CLI runs on the host.
    workdir_mode: WorkdirMode = WorkdirMode.LIVE
    staged: StagedLayer | None = None
    shared_live: bool = False  # --shared-live: this live box may join another on the same checkout
    # Credential files of the agent's state the host has (config `secret_files:`): how each is held.
    login_files: tuple[LoginFileUse, ...] = ()
    # The launch's id (`PID-START-BOOT-RANDOM`, relay/host/liveness.py): names its run dir, cgroup,
    # staged layer and logs; "" for a plan made without one (a dry run of the pure planner).
    run_id: str = ""
    # The hosts whose TLS the proxy terminates with a leaf of the run's CA (`host:port`; relay/policy/inspection.py).
    inspected_hosts: tuple[str, ...] = ()
    # Where the host's real secrets are, for every backend, not this run's alone (relay/trust/state_scan.py:
    # no file of the box's state copy may hold one): the credential variables of every backend's routes
    # and of the user's grants, less those the box gets anyway, and every backend's credential and login
    # files with the JSON paths of their secrets. Names and paths only.
    scan_env: tuple[str, ...] = ()
    scan_files: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def to_json(self) -> dict:
        data = asdict(self)
        if self.staged is None:
            data.pop("staged")
        del data["rules"]  # shown as `egress` and `egress_rules`
        data["env_set"] = dict(self.env_set)
        data["mounts"] = [{k: v for k, v in asdict(m).items() if v is not None} for m in self.mounts]
        if self.gvisor is None:
            data.pop("gvisor")
        if self.vm is None:
            data.pop("vm")
        if self.runtime_class is None:
            data.pop("runtime_class")
        import shlex

        data["command_line"] = shlex.join(self.command)
        data["egress_rules"] = explain(self.rules)
        data["credentials"] = [route_json(r) for r in self.credentials]
        data["presets"] = {name: [r.render() for r in rules] for name, rules in self.presets}
        data["login_files"] = {u.file: {"held": u.held, "secrets": list(u.secrets), "routes": list(u.routes)}
                               for u in self.login_files}
        # What the launch makes on the host before the box starts, in order, each with its undo.
        data["host_steps"] = [{"step": s.step, "does": s.does, "undo": s.undo} for s in host_steps(self)]
        # The state search's sources are every backend's tables (config/backends.yaml), the same in every
        # plan: not repeated in each (docs/credentials.md says which they are).
        data.pop("scan_env")
        data.pop("scan_files")
        # Only with grants in the user config (the key is absent otherwise, as are the grants).
        data.pop("auth_grants")
        if self.auth_grants:
            data["auth_grants"] = {name: {"applies": not why, **({"skipped": why} if why else {})}
                                   for name, why in self.auth_grants}
        return data


def route_json(route: CredentialRoute) -> dict:
    """A route as the plan shows it: where the key goes and how, and which variables (or login file) it
    comes from. A grant also says where its secret is read (a command's argv, a file and JSON path),
    never its value."""
    shown = {"route": route.name, "upstream": f"{route.upstream_host}:{route.upstream_port}", "send": route.send,
             "from": [route.login.file] if route.login else list(route.secret_env),
             "box_url": f"http://{PROXY_LISTEN}/{route.name}",
             "allows": {**route.http_rules().as_json(), "summary": route.http_rules().describe()}}
    if route.inspect:
        shown["inspect"] = True
    if route.grant:
        shown["grant"] = True
        shown["secret"] = ({"env": list(route.secret_env)} if route.secret_env else
                           {"command": list(route.secret_command)} if route.secret_command else
                           {"file": route.secret_file, **({"json": route.secret_json} if route.secret_json else {})})
        shown["git_insteadof"] = grant_origin(route)
        if route.backends:
            shown["backends"] = list(route.backends)
    return shown


def grant_origin(route: CredentialRoute) -> str:
    """The https origin a grant serves; the box's git rewrites it to the grant's route."""
    port = "" if route.upstream_port == 443 else f":{route.upstream_port}"
    return f"https://{route.upstream_host}{port}/"


def _expand_argv(template: tuple[str, ...], *, prompt: str | None, shell: str, workdir: str) -> list[str]:
    out = []
    for arg in template:
        arg = arg.replace("{shell}", shell).replace("{workdir}", workdir)
        if "{prompt}" in arg:
            arg = arg.replace("{prompt}", prompt or "")
        out.append(arg)
    return out


def agent_argv(backend: Backend, prompt: str | None, shell: str, workdir: str, native: tuple[str, ...]) -> list[str]:
    template = backend.prompt_command if prompt is not None else backend.command
    argv = _expand_argv(template, prompt=prompt, shell=shell, workdir=workdir)
    return argv[:1] + list(native) + argv[1:]


def _digest(obj: object) -> str:
    return sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _env_names(profile: Profile, backend: Backend, caller_env: dict[str, str]) -> tuple[str, ...]:
    """The caller's variables the box gets, by exact name only. No pattern is expanded: `LC_*`
    would also match LC_TOKEN. Config refuses patterns; one that slipped in passes nothing."""
    # Backend variables (API keys, base URLs) come only with the backend's own grants.
    names = profile.env + (backend.env_pass if profile.backend_home else ())
    return tuple(dict.fromkeys(n for n in names if n != "HOME" and _plain_name(n)))


def _plain_name(name: str) -> bool:
    return name.isascii() and name.replace("_", "a").isalnum() and not name[0].isdigit()


def proxy_env(listen: str) -> dict[str, str]:
    url = f"http://{listen}"
    env = {}
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = url
    env.update({
        "NO_PROXY": "localhost,127.0.0.1,::1",
        "no_proxy": "localhost,127.0.0.1,::1",
        "npm_config_proxy": url,
        "npm_config_https_proxy": url,
        "PIP_PROXY": url,
        "YARN_HTTP_PROXY": url,
        "YARN_HTTPS_PROXY": url,
        "GLOBAL_AGENT_HTTP_PROXY": url,
        # Node's built-in fetch ignores HTTPS_PROXY unless told: NODE_USE_ENV_PROXY on Node >= 24 (and
        # 22.21+), a preload on older Node (relay/box/nodeproxy.py; it stands aside on the newer ones).
        "NODE_USE_ENV_PROXY": "1",
        "NODE_OPTIONS": node_options(),
        # Java reads no proxy variable; the JVM options do it (every JVM prints "Picked up ..." once).
        # Go's net/http honours HTTPS_PROXY as it is; git and curl read the lowercase forms.
        "JAVA_TOOL_OPTIONS": java_proxy_options(listen),
    })
    return env


def java_proxy_options(listen: str) -> str:
    """The JVM's proxy properties for the box's proxy, with the box's own loopback (NO_PROXY) direct."""
    host, _, port = listen.rpartition(":")
    return " ".join(f"-D{scheme}.proxy{k}={v}" for scheme in ("http", "https") for k, v in (("Host", host), ("Port", port))
                    ) + " -Dhttp.nonProxyHosts=localhost|127.*|[::1]"


@record(frozen=False)
class _Draft:
    """One plan while resolve() builds it: the inputs, then what each step adds. Steps run in a
    fixed order and only append (notes keep the order in which the user reads them)."""

    backend: Backend
    matrix: Matrix
    request: Request
    facts: HostFacts
    env: dict[str, str]
    fs: FsView
    workdir: str
    tier: Tier
    profile: Profile
    shell: str
    notes: list[str]
    rules: tuple[HostRule, ...]
    now: float | None
    presets: tuple[tuple[str, tuple[HostRule, ...]], ...] = ()
    own: list[str] = field(default_factory=list)
    run_dir: str | None = None
    grants: list[Grant] = field(default_factory=list)
    sync: list[str] = field(default_factory=list)
    guarded: list[str] = field(default_factory=list)
    state_dirs: list[str] = field(default_factory=list)
    argv: list[str] = field(default_factory=list)
    box_path: str = ""
    extra_binds: list[Mount] = field(default_factory=list)
    protected: list[str] = field(default_factory=list)
    git: GitPlan | None = None
    git_mounts: list[Mount] = field(default_factory=list)
    fsplan: FsPlan | None = None
    git_excludes: tuple[str, ...] = ()
    env_set: dict[str, str] = field(default_factory=dict)
    env_pass: tuple[str, ...] = ()
    routes: list[CredentialRoute] = field(default_factory=list)
    login_files: list[LoginFileUse] = field(default_factory=list)
    route_env: dict[str, str] = field(default_factory=dict)
    git_config: list[tuple[str, str]] = field(default_factory=list)
    withheld: set[str] = field(default_factory=set)
    pointed: list[str] = field(default_factory=list)  # base-URL variables the caller set (a route then steps aside)
    auth_grants: tuple[tuple[str, str], ...] = ()
    limits: Limits | None = None
    command: list[str] = field(default_factory=list)
    fs_rules: tuple[tuple[str, str], ...] = ()
    container: ContainerRun | None = None
    gvisor: GvisorRun | None = None
    vm: VmRun | None = None
    runtime_class: str | None = None
    sockets: tuple[BoxSocket, ...] = ()
    staged: StagedLayer | None = None
    workdir_mode: WorkdirMode = WorkdirMode.LIVE
    inspected: tuple[tuple[str, int], ...] = ()

    @property
    def home(self) -> str:
        return self.facts.home

    @property
    def uid(self) -> int:
        return self.facts.uid

    @property
    def interactive(self) -> bool:
        return self.request.prompt is None


def resolve(
    backend: Backend,
    matrix: Matrix,
    request: Request,
    facts: HostFacts,
    caller_env: dict[str, str],
    fs: FsView,
    now: float | None = None,
) -> Plan:
    """Decide everything about one launch. Raises UsageError / RefusedError on bad requests.

    Pure: the host is read only through `fs` and `facts` (gathered before; see relay/modes/image_tag.py with_image), so
    tests/test_plan_golden.py resolves every case against an in-memory host. There is no default view:
    a caller hands in the real host (`relay.host.fs_view.HostFs()`) by name, or a fake. A shared core,
    then one small function per tier (_TIERS)."""
    workdir = _checked_request(request, fs)
    extra_rules = parse_entries(request.allow_hosts) + parse_ssh_hosts(request.allow_ssh)
    presets = expand_presets(backend.presets + request.allow_presets, matrix.presets)
    extra_rules += tuple(r for _, rules in presets for r in rules)
    choice = choose_tier(request, facts, backend, matrix, caller_env)
    shell = facts.shell if os.path.isabs(facts.shell) else "/bin/sh"
    if choice.tier == Tier.UNSANDBOXED:
        return _unsandboxed_plan(backend, request, facts, caller_env, workdir, shell, list(choice.notes))
    profile = resolve_profile(choice.profile, matrix.profiles)
    _check_socket_requests(request, choice.tier, profile)
    if presets and not profile.network:
        raise RefusedError(f"profile {profile.name!r} has no network, so the egress presets "
                           f"{', '.join(n for n, _ in presets)} cannot be honoured; fix: use --profile agent, "
                           "or drop them")
    d = _Draft(backend, matrix, request, facts, caller_env, fs, workdir, choice.tier, profile, shell,
               list(choice.notes), allowed_rules(backend, profile, extra_rules), now, presets=presets)
    _refuse_workdir(d)
    _workdir_mode(d)
    _home_grants(d)
    _agent(d)
    _credentials(d)
    _grants(d)
    _inspection(d)
    _git(d)
    _filesystem(d)
    _environment(d)
    _agent_sockets(d)
    _TIERS[d.tier](d)
    return _plan(d)


def _checked_request(request: Request, fs: FsView) -> str:
    """The request's own checks (before any tier is chosen); returns the real workdir."""
    if request.mode not in MODES:
        raise UsageError(f"unknown mode {request.mode!r}; choose one of: {', '.join(MODES)}")
    workdir = fs.realpath(request.workdir)
    if fs.kind(workdir) != "dir":
        raise UsageError(f"--workdir {request.workdir}: not an existing directory; fix: create it or pass another")
    if request.timeout is not None and request.timeout <= 0:
        raise UsageError("--timeout must be a positive number of seconds")
    return workdir


def _refuse_workdir(d: _Draft) -> None:
    """A HOME the box cannot hide, or a workdir whose writes would run on the host later, refuses."""
    fs, env = d.fs, d.env
    if fs.realpath(d.home) == "/":
        raise RefusedError("HOME is '/', so the box cannot hide it; fix: set HOME to your home directory")
    d.own = own_paths(env, fs.realpath)
    reason = workdir_refusal(
        d.workdir, fs.realpath(d.home), secret_paths(d.home, d.uid, d.backend.deny, env.get("SSH_AUTH_SOCK")),
        d.own,
        fs.realpath(config_home(env)),
        [fs.realpath(p) for p in (env.get("PATH") or "").split(":") if p.startswith("/")])
    if reason:
        raise RefusedError(reason)
    request = d.request
    d.run_dir = rundirs.path_for(env, request.run_id) if request.run_id else None


def _workdir_mode(d: _Draft) -> None:
    """Staged is the default: the box writes into a copy-on-write layer of its own (relay/box/overlay.py),
    reviewed and applied from the host. `--live` (or `workdir: live` in the user config) lets it write
    the checkout itself; a repo's `workdir: staged` forces staged, and --live then stops the run.
    Where this host cannot stage, the run stops (exit 3) rather than quietly going live: the fix is
    `--live`, said in the same line."""
    request, matrix = d.request, d.matrix
    if request.live and request.staged:
        raise UsageError("--live and --staged contradict each other; fix: pick one (staged is the default)")
    if request.shared_live and not (request.live or matrix.workdir_mode == WorkdirMode.LIVE):
        raise UsageError("--shared-live is for a live box beside another live box; fix: add --live, or drop it "
                         "(staged boxes share a checkout without it)")
    if request.mode == "kube":  # the checkout is never written: each box's changes come back as a patch
        if request.live or request.apply:
            raise UsageError(f"{'--live' if request.live else '--apply'} has no meaning in kube mode: its boxes run "
                             "on the cluster and each one's changes come back as a patch file; fix: drop it")
        d.workdir_mode = WorkdirMode.PATCHES
        return
    if request.live and matrix.workdir_forced:
        raise RefusedError(f"--live: the repo's {matrix.workdir_forced} forces `workdir: staged`, so the box may not "
                           "write this checkout directly; fix: drop --live (review and apply the box's changes)")
    live = request.live or (matrix.workdir_mode == WorkdirMode.LIVE and not request.staged)
    if live:
        if request.apply:
            raise UsageError("--apply applies a staged run's changes at exit; fix: drop --live (or drop --apply)")
        d.workdir_mode = WorkdirMode.LIVE
        return
    asked = "--staged" if request.staged else "staged (the default)"
    live_fix = "" if request.staged else ", or --live to let the box write the checkout directly"
    why = None
    if d.tier not in (Tier.SUPERVISED, Tier.GVISOR, Tier.VM, Tier.CONTAINER):  # container mode: podman's overlay volumes
        why = (f"the {d.tier} tier has no mount namespace to stage the workdir in; fix: install bubblewrap "
               f"(the supervised tier){live_fix}")
    elif unsafe_path(d.workdir):
        why = (f"the workdir {d.workdir} holds {unsafe_path(d.workdir)!r}, which an overlay mount cannot name; "
               f"fix: rename the directory{live_fix}")
    if why:
        raise RefusedError(f"{asked}: {why}")
    d.workdir_mode = WorkdirMode.STAGED
    d.staged = replace(staged_for_run(d.env, request.run_id or "dry"), apply_at_exit=request.apply)


def _home_grants(d: _Draft) -> None:
    """The backend's and the profile's grants under $HOME, its state dirs (private copies), and
    what is synced back or guarded at exit."""
    backend, home, uid, profile = d.backend, d.home, d.uid, d.profile
    grants: list[Grant] = []
    if profile.backend_home:
        grants += [Grant(expand(p, home, uid), False) for p in backend.home_ro]
        if d.tier == Tier.PROCESS:  # no mount namespace for a private copy: the state dirs stay read-only
            grants += [Grant(expand(p, home, uid), False) for p in backend.home_rw]
            if backend.home_rw:
                d.notes.append("the process tier cannot give the agent a private copy of its state dirs, so they "
                               "are read-only (logins and sessions are not saved); install bubblewrap for the "
                               "supervised box")
        else:
            grants += _state_dirs(d)
        d.sync = [expand(p, home, uid) for p in backend.home_sync]
        d.guarded = [expand(p, home, uid) for p in backend.home_guard]
    if profile.toolchain:
        grants += [Grant(expand(p, home, uid), False) for p in TOOLCHAIN_GRANTS]
    grants += [Grant(expand(p, home, uid), False) for p in profile.home_ro]
    grants += [Grant(expand(p, home, uid), True) for p in profile.home_rw]
    # Read-only grants must land after a writable parent, so order ro after rw at equal depth.
    d.grants = sorted(dict.fromkeys(grants), key=lambda g: (g.path, not g.writable))


def _state_dirs(d: _Draft) -> list[Grant]:
    """Under $HOME: a private copy in the box's home (d.state_dirs). Elsewhere (an absolute path):
    bound as before, returned as writable grants. A symbolic link is never followed."""
    home, grants = d.home, []
    for path in (expand(p, home, d.uid) for p in d.backend.home_rw):
        if path.startswith(home.rstrip("/") + "/") and d.fs.is_symlink(path):
            real = d.fs.realpath(path)
            leak = next((s for s in secret_paths(home, d.uid, d.backend.deny, None)
                         if real == s or real.startswith(s.rstrip("/") + "/")), None)
            d.notes.append(f"grant {path} skipped: it resolves into denied {leak}" if leak else
                           f"{path} is a symbolic link, which is never followed: the box starts with an empty "
                           "private one and nothing of it is synced back")
        elif path.startswith(home.rstrip("/") + "/"):
            d.state_dirs.append(path)
        else:
            grants.append(Grant(path, True))
    return grants


def _agent(d: _Draft) -> None:
    """The agent's argv, the box's PATH, and the CLI's install dirs bound read-only (local tiers:
    a container's CLIs come from its image)."""
    tools = tool_dir(d.env, d.fs.realpath)
    d.box_path = f"{tools}/node_modules/.bin:{d.env.get('PATH') or SAFE_PATH}"
    native = render_native(d.backend.native_boxed, home=d.home, uid=d.uid, workdir=d.workdir,
                           extra_deny=d.backend.deny, unsandboxed=False)
    d.argv = list(d.request.argv_override or agent_argv(d.backend, d.request.prompt, d.shell, d.workdir,
                                                        tuple(native)))
    if d.tier == Tier.CONTAINER:
        return
    if d.fs.kind(tools) == "dir":
        d.extra_binds.append(Mount(MountKind.RO_BIND, tools, tools))
    cli = d.fs.which(d.argv[0], d.box_path)
    if cli is None:
        d.notes.append(f"{d.argv[0]} is not installed yet; a real run installs it first (npm, into {tools})"
                       if d.backend.install_npm else f"{d.argv[0]} is not installed on this host")
        return
    real_cli = d.fs.realpath(cli)
    if (real_cli + "/").startswith(d.home.rstrip("/") + "/") and not real_cli.startswith(tools + "/"):
        install_dir = os.path.dirname(real_cli)
        d.extra_binds.append(Mount(MountKind.RO_BIND, install_dir, install_dir))


def _credentials(d: _Draft) -> None:
    """The backend's credential routes this run uses: those whose key is set in the caller's
    environment (under a name the box would get), or whose login file the host has (in a state dir
    the box gets a private copy of). A used route's key variables are withheld from the box, which
    gets the placeholder and the proxy's URL instead; the proxy adds the key. A login file's copy
    holds placeholders (agentstate masks it). The first route used sets a shared variable (the
    base URL). A key the caller pointed elsewhere (its base-URL variable set) stays in the box, and
    says so; so does every key no route can hold (`_SECRET_SUFFIXES`). A login file no route can hold
    refuses the run unless its backend's opt-in is set (_login_files)."""
    if not (d.profile.network and d.profile.backend_home) or d.tier == Tier.PROCESS:
        _login_files(d)
        return
    passable = set(_env_names(d.profile, d.backend, d.env))
    unusable: list[CredentialRoute] = []  # login routes a kube pod could not use (each has a login)
    for route in d.backend.credentials:
        login = _login_file(d, route)
        if login is None and not any(d.env.get(n) for n in route.secret_env if n in passable):
            continue
        if login is not None and not route.login.refresh_url and any(
                r.upstream_host == route.upstream_host for r in d.routes):
            continue  # a key in a login file beside a key a route already holds: the file is masked, that route carries
        if login is not None and route.box_args and any(r.box_args for r in d.routes):
            continue  # the CLI takes one provider (codex: an API key before its ChatGPT login); the file is masked
        if login is not None and route.inspect and d.request.mode == "kube":
            unusable.append(route)  # a pod has no copy of the login file, and kube's proxy has no run CA
            continue
        url = f"http://{PROXY_LISTEN}/{route.name}"
        own = [n for n, _ in route.box_env if n not in route.secret_env and d.env.get(n) and n in passable]
        if own:
            d.pointed.append(own[0])
            what = f"~/{os.path.relpath(login, d.home)} (the login) stays in the box, and" if login else "the key"
            d.notes.append(f"credentials: in box for route {route.name}: {own[0]} is set, so {what} goes where it "
                           f"points, not through the proxy; fix: unset {own[0]} to keep it on the host")
            continue
        if login is not None:
            route = replace(route, login=replace(route.login, file=login))
        d.routes.append(replace(route, secret_env=tuple(n for n in route.secret_env if n in passable)))
        d.withheld.update(route.secret_env)
        render = {"{url}": url, "{placeholder}": CREDENTIAL_PLACEHOLDER}
        for name, template in route.box_env:
            d.route_env.setdefault(name, _render(template, render))
        # The route's flags are the CLI's own: a command that is not the CLI (a user's `command:` of
        # /bin/sh, say) would run them; it gets the variables only.
        if d.request.argv_override is None and route.box_args and _runs_the_cli(d):
            d.argv[1:1] = [_render(a, render) for a in route.box_args]
    if unusable and not d.routes:
        route = unusable[0]
        raise RefusedError(f"{d.backend.name}: kube mode cannot use the login {route.login.file} "
                           f"(route {route.name} inspects {route.upstream_host}, the CLI's fixed endpoint; a pod gets "
                           "no copy of the login and kube's proxy pod has no run CA yet); fix: an API key by env for "
                           f"{d.backend.name}, or --mode local or --mode container")
    in_box = _login_files(d)
    loose = [n for n in sorted(passable) if d.env.get(n) and n not in d.withheld and n.endswith(_SECRET_SUFFIXES)]
    if loose:
        d.notes.append(f"credentials: in box for {d.backend.name}: {', '.join(loose)} passed into the box as set "
                       "(no credential route holds it on the host)")
    if d.backend.credentials and not d.routes and not in_box and not loose and d.state_dirs:
        d.notes.append(_no_credential(d.backend))


def _no_credential(backend: Backend) -> str:
    """One line for a run that finds no key and no login on the host: what to set, or the login to run."""
    names = sorted(dict.fromkeys(n for r in backend.credentials for n in r.secret_env),
                   key=lambda n: not n.endswith("_API_KEY"))  # the plain API key first, else routes' order
    ways = [f"set {names[0]} on the host (the proxy adds it; the box gets a placeholder)"] if names else []
    if backend.login_command and any(r.login and r.login.refresh_url for r in backend.credentials):  # an OAuth login the proxy holds
        ways.append(f"log in on the host first: {ENTRY} login {backend.name}")
    tail = (" (a /login inside this box keeps its token in the box for the session; its token exchange is "
            "end-to-end TLS the proxy does not open)") if backend.name == "claude" else ""
    return f"credentials: none for {backend.name} on this host; {', or '.join(ways)}{tail}"


def _runs_the_cli(d: _Draft) -> bool:
    return d.backend.install_bin is None or os.path.basename(d.argv[0]) == d.backend.install_bin


def login_opt_in(backend: str) -> str:
    """The per-backend opt-in that lets a login no route holds into the box as it is."""
    return "HIVE_RELAY_LOGIN_IN_BOX_" + backend.upper().replace("-", "_")


def _login_files(d: _Draft) -> bool:
    """Each credential file of the backend's state (`secret_files:`, and every login route's file) the
    host has, inside a state dir the box gets a private copy of, and how the box gets it. Masked
    (placeholders of the same shape, relay/model/credential_files.py) when a route of this run holds the backend's
    credential, so the CLI's API traffic carries the real key only on the route's pinned upstream, or
    when the box has no network (nothing could use it). Otherwise the real login would be in the box:
    that refuses (exit 3) unless the per-backend opt-in is set; then it is copied as it is, and said.
    Returns whether a file is in the box by opt-in. A credential file that is a symbolic link refuses
    too (nothing masks a link, and the copy would hold its target as it is). kube mode's boxes get no
    copy of the host's state at all (their $HOME is an empty volume), so no login file of the host is ever in one."""
    if d.request.mode == "kube":
        return False
    specs: dict[str, list[str]] = {}
    for path, paths in d.backend.secret_files:
        specs.setdefault(expand(path, d.home, d.uid), []).extend(paths)
    for route in d.routes:
        if route.login is not None:
            specs.setdefault(route.login.file, []).append(route.login.token)
    in_box = _unmaskable(d)
    opt = login_opt_in(d.backend.name)
    # What the box gets as it is anyway (a key the caller pointed at its own base URL): a value in a file
    # that is one of these (claude's customApiKeyResponses keeps that key's last 20 characters) adds nothing.
    # Not a value any grant reads (grants withhold theirs later, in _grants), nor one a route or the backend sets.
    kept_out = set(d.withheld) | {n for g in d.matrix.grants for n in g.secret_env} | set(d.route_env) | \
        {n for n, _ in d.backend.env_set}
    in_box_values = {d.env[n] for n in _env_names(d.profile, d.backend, d.env) if d.env.get(n) and n not in kept_out}
    for host_path, paths in specs.items():
        shown = "~/" + os.path.relpath(host_path, d.home)
        if d.fs.lkind(host_path) == "link" and _in_state_dirs(d, host_path) and d.env.get(opt) != "1":
            # No route reads a login through a link, and the box's copy of the state dir would hold the
            # link and, beside it, the file it points to as it is (a dotfile manager's layout).
            raise RefusedError(f"{d.backend.name}: {shown} is a symbolic link, so its login cannot be masked in the "
                               f"box's copy; fix: replace the link with the file itself (cp --remove-destination "
                               f"\"$(readlink -f {shown})\" {shown}), or {opt}=1 to take it into the box as it is")
        if d.fs.lkind(host_path) != "file" or not _in_state_dirs(d, host_path):
            continue
        try:
            pairs = credential_files.values(d.fs.read_bounded(host_path, credential_files.MAX_FILE + 1),
                                            tuple(paths), credential_files.is_dotenv(host_path))
            found = tuple(dict.fromkeys(at for at, value in pairs if not _in_box_anyway(value, in_box_values)))
        except ValueError:
            # masked means: no copy at all (agentstate cannot mask it; an encrypted token store, say)
            found = ("(a file it cannot read)",) if credential_files.is_dotenv(host_path) else ("(not JSON)",)
        if not found:
            continue
        holders = tuple(r.name for r in d.routes)
        if holders or not d.profile.network:
            d.login_files.append(LoginFileUse(host_path, LoginHold.MASKED, found, tuple(dict.fromkeys(paths)), holders))
            continue
        if d.env.get(opt) != "1":
            keys = sorted(dict.fromkeys(n for r in d.backend.credentials for n in r.secret_env),
                          key=lambda n: not n.endswith("_API_KEY"))
            fixes = ([f"unset {n} (the route steps aside for a base URL you set)" for n in dict.fromkeys(d.pointed)]
                     or [f"set {keys[0]} on the host (the proxy adds it)"] if keys or d.pointed else []) + \
                ([f"log in on the host ({ENTRY} login {d.backend.name})"]
                 if d.backend.login_command and not d.pointed
                 and any(r.login and r.login.refresh_url for r in d.backend.credentials) else [])
            raise RefusedError(f"{d.backend.name}: {shown} holds a login ({', '.join(found[:3])}) no credential route "
                               f"can hold, so its real token would be readable in the box; fix: "
                               f"{', or '.join(fixes + [f'{opt}=1 to take it into the box as it is'])}")
        in_box = True
        d.login_files.append(LoginFileUse(host_path, LoginHold.IN_BOX, found, tuple(dict.fromkeys(paths))))
        d.notes.append(f"credentials: in box for {d.backend.name}: {shown} is copied into the box as it is "
                       f"({opt}=1): its real token is readable there")
    return in_box


def _in_box_anyway(value: str, in_box_values: set[str]) -> bool:
    """A secret of a file that the box holds anyway: one of `in_box_values`, or the end of one (8+ characters)."""
    return any(v == value or (len(value) >= 8 and v.endswith(value)) for v in in_box_values)


def _unmaskable(d: _Draft) -> bool:
    """The backend's `unmaskable:` files (guarded settings: ~/.claude/settings.json's `env`, an MCP server's
    env and headers in gemini's and opencode's settings) in the box's copy of its state: their sync-back
    and review compare the box's file with the host's, so a placeholder there could come back over the
    real value. A secret found in one refuses the run (exit 3) unless the opt-in, and so does one that
    is not JSON even with comments (it cannot be checked). Returns whether one is in the box by opt-in."""
    opt = login_opt_in(d.backend.name)
    in_box = False
    for path, paths in d.backend.unmaskable:
        host_path = expand(path, d.home, d.uid)
        if not _in_state_dirs(d, host_path):
            continue
        if d.fs.lkind(host_path) == "link":
            # The copy holds the link as a link: what the box reads through it is the file it points to,
            # when that is in the copy too (a settings file linked within its state dir).
            host_path = d.fs.realpath(host_path)
            if not _in_state_dirs(d, host_path):
                continue
        if d.fs.lkind(host_path) != "file":
            continue
        shown = "~/" + os.path.relpath(host_path, d.home)
        try:
            data = credential_files.parse_settings(d.fs.read_bounded(host_path, credential_files.MAX_FILE + 1), host_path)
            found = [".".join(map(str, at)) for at, value in credential_files.found(data, paths)
                     if token_shapes.secret_entry(at[-1], value, credential_files.before(data, at))]
        except ValueError as e:
            if d.env.get(opt) != "1":
                raise RefusedError(f"{d.backend.name}: {shown} cannot be checked for credentials ({e}), and the box "
                                   "would get it as it is; fix: repair it (the CLI cannot read it either), or "
                                   f"{opt}=1 to take it into the box as it is") from None
            found = ["(unchecked)"]
        if not found:
            continue
        if d.env.get(opt) != "1":
            raise RefusedError(f"{d.backend.name}: {shown} holds credentials ({', '.join(found[:3])}) in a settings "
                               "file the box's copy cannot mask, so they would be readable in the box; fix: move them "
                               f"to the host's environment (or an `auth:` grant), or {opt}=1 to take them into the box as they are")
        in_box = True
        d.login_files.append(LoginFileUse(host_path, LoginHold.IN_BOX, tuple(found), paths))
        d.notes.append(f"credentials: in box for {d.backend.name}: {shown} holds credentials ({opt}=1): "
                       "they are readable there")
    return in_box


def _in_state_dirs(d: _Draft, path: str) -> bool:
    """Whether the box gets a private copy of `path`: inside a state dir, or a synced file (~/.claude.json)."""
    return any(path.startswith(s.rstrip("/") + "/") for s in d.state_dirs) or (path in d.sync and d.tier != Tier.PROCESS)


# Names of variables that hold a secret, for the `credentials: in box` note of a key no route holds.
_SECRET_SUFFIXES = ("_API_KEY", "_AUTH_TOKEN", "_OAUTH_TOKEN", "_ACCESS_TOKEN")


def _login_file(d: _Draft, route: CredentialRoute) -> str | None:
    """The host path of a login route's file when the host has it (a regular file, seen without
    following a link) inside a state dir the box gets a private copy of; else None."""
    if route.login is None:
        return None
    path = expand(route.login.file, d.home, d.uid)
    if d.fs.lkind(path) != "file" or not _in_state_dirs(d, path):
        return None
    # A route only when the file holds its token: codex's auth.json holds an API key or a ChatGPT login,
    # and each is its own route with its own flags.
    try:
        raw = d.fs.read_bounded(path, credential_files.MAX_FILE + 1)
        if not credential_files.secret_paths(raw, (route.login.token,)):
            return None
        if any(value == wanted for at, wanted in route.login.unless
               for _, value in credential_files.found(credential_files.parse(raw), (at,))):
            return None  # the CLI uses another login of this file (e.g. codex's auth_mode: chatgpt)
    except ValueError:
        return None
    return path


def _grants(d: _Draft) -> None:
    """The user config's `auth:` grants: each that applies is a route of this run (the plan lists it),
    and the box's git rewrites the grant's https origin to it, so `git clone/fetch/push
    https://HOST/...` reaches the proxy in plain HTTP on the box's loopback and the proxy adds the
    credential. The box holds no token and no credential helper. A grant applies to a run with network,
    of one of its `backends:` (every backend without the key), without --no-grants; one that does not is
    no route, so its secret is never read (hostsecrets reads only the plan's routes), and the plan says why."""
    uses = []
    for grant in d.matrix.grants:
        d.withheld.update(grant.secret_env)  # a grant's variables never reach the box, whatever passes them
        why = _grant_skipped(d, grant)
        uses.append((grant.name, why))
        if why:
            d.notes.append(f"auth grant {grant.name}: {why}")
            continue
        d.routes.append(grant)
        d.git_config.append((f"url.http://{PROXY_LISTEN}/{grant.name}/.insteadOf", grant_origin(grant)))
        d.notes.append(f"auth grant {grant.name}: requests to {grant_origin(grant)} through "
                       f"http://{PROXY_LISTEN}/{grant.name}/ get your credential, added on the host")
    d.auth_grants = tuple(uses)


def _grant_skipped(d: _Draft, grant: CredentialRoute) -> str:
    """Why the grant does not apply to this run ("" when it does)."""
    if d.request.no_grants:
        return "off for this run (--no-grants)"
    if grant.backends and d.backend.name not in grant.backends:
        return f"not for backend {d.backend.name} (backends: {', '.join(grant.backends)})"
    if not d.profile.network or d.tier == Tier.PROCESS:
        return "this run has no network"
    return ""


def _render(template: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        template = template.replace(key, value)
    return template


def _git(d: _Draft) -> None:
    """Write protections inside the workdir, and its git dir by allowlist (bwrap and container)."""
    d.protected = protected_paths(d.workdir) + nested_git_paths(d.workdir, d.fs)
    d.git = plan_git(d.workdir, d.fs) if d.tier in (Tier.SUPERVISED, Tier.GVISOR, Tier.VM, Tier.CONTAINER) else None
    if d.git is None:
        return
    # The git dir is private and allowlisted; the deny-list entries under it are moot, and
    # resolving a linked one (`.git/hooks -> ..`) would freeze the workdir.
    d.protected = [p for p in d.protected if not safe_beneath(p, d.git.dotgit)] + list(d.git.protect)
    d.notes += d.git.notes
    base = d.run_dir or "/RUN-DIR"
    d.git_mounts = [replace(m, src=os.path.join(base, m.src or "")) if m.kind == MountKind.PRIVATE_BIND else m
                    for m in d.git.mounts]


def _own_checkout(d: _Draft) -> str | None:
    """hive relay's own checkout, when the workdir holds it (relay/policy/workdir.py own_checkout_in)."""
    return own_checkout_in(d.workdir, d.fs.realpath(str(PACKAGE_ROOT)) if IN_CHECKOUT else None)


def _read_only_checkout(d: _Draft, fsplan: FsPlan) -> FsPlan:
    """Our checkout in the workdir is read-only as a whole: the workdir's bind (and every writable
    bind below it that is not the git plan's) becomes read-only; a checkout below the workdir is
    bound read-only onto itself (right after the workdir's bind, masks and protections on top)."""
    own = _own_checkout(d)
    if own is None:
        return fsplan
    d.notes.append(f"the workdir holds hive relay's own checkout ({own}): it is read-only in the box, since "
                   "invoke, pytest and python -m relay there load whatever lies at its top; fix: give the box a "
                   "clone (git worktree add ../hive-relay-work) and run hive relay from this checkout")
    ours = set(d.git_mounts)
    # A missing path in a read-only tree cannot be created: its mask (and the placeholder it needs) goes.
    moot = {p for p in fsplan.placeholders if _lies_in(p, own)}
    mounts = [replace(m, kind=MountKind.RO_BIND, src=m.src or m.dst)
              if m.kind == MountKind.BIND and m not in ours and _lies_in(m.dst, own) else m for m in fsplan.mounts
              if not (m.dst in moot and m.kind in (MountKind.MASK_FILE, MountKind.MASK_DIR))]
    if own != d.workdir:  # right after the workdir's bind, so that the masks and protections still go on top
        at = next(i for i, m in enumerate(mounts) if m.kind == MountKind.BIND and m.dst == d.workdir) + 1
        mounts.insert(at, Mount(MountKind.RO_BIND, own, own))
    return replace(fsplan, mounts=tuple(mounts), protected=(own,) + tuple(p for p in fsplan.protected if p not in moot),
                   placeholders=tuple(p for p in fsplan.placeholders if p not in moot))


def _lies_in(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _inspection(d: _Draft) -> None:
    """The hosts this run inspects (relay/policy/inspection.py): `--inspect`, `,inspect=true` rules and
    routes or grants with `inspect: true` (whose upstream the box may then reach directly)."""
    d.rules = d.rules + inspection.route_rules(d.routes, d.rules)
    d.inspected = inspection.inspected_targets(d.request.inspect, d.rules, d.routes,
                                               d.profile.network and d.tier != Tier.PROCESS, d.request.mode)
    if d.inspected and d.tier not in (Tier.SUPERVISED, Tier.CONTAINER, Tier.GVISOR):
        raise RefusedError(f"TLS inspection needs a box with the host-side proxy, not the {d.tier} tier; fix: "
                           "--isolation supervised (or container), or drop --inspect")


def _filesystem(d: _Draft) -> None:
    """The box's mounts (relay/policy/fsplan.py), then what the git plan adds to them."""
    secrets = secret_paths(d.home, d.uid, d.backend.deny, d.env.get("SSH_AUTH_SOCK"))
    fsplan = plan_filesystem(
        home=d.home,
        workdir=d.workdir,
        home_source=os.path.join(d.run_dir, "home") if ((d.sync or d.state_dirs) and d.run_dir) else None,
        grants=d.grants,
        secrets=secrets,
        protected=d.protected + d.own,
        extra_binds=d.extra_binds,
        git_mounts=d.git_mounts,
        fs=d.fs,
        # Box-private tmpfs (/tmp, /var/tmp, /run, $HOME) is memory: cap each at a quarter of the limit.
        tmpfs_size=d.profile.memory // 4,
    )
    d.notes += fsplan.notes
    fsplan = _read_only_checkout(d, fsplan)
    if d.git is not None and d.run_dir:
        # A missing objects/info/alternates reads as empty in the box, not as EACCES.
        redirects = {os.path.join(g.host, r) for g in d.git.dirs if g.kind == "common" for r in OBJECT_REDIRECTS}
        fsplan = replace(fsplan, mounts=tuple(
            Mount(MountKind.RO_BIND, m.dst, os.path.join(d.run_dir, EMPTY)) if m.kind == MountKind.MASK_FILE and m.dst in redirects
            else m for m in fsplan.mounts))
    # What the git plan binds read-only is protected too (reported with the rest).
    fsplan = replace(fsplan, protected=tuple(dict.fromkeys(
        fsplan.protected + tuple(m.dst for m in fsplan.mounts if m.kind == MountKind.RO_BIND and m in d.git_mounts))))
    # Placeholders would show up in the agent's `git status`; a box-only excludes file hides them.
    excludes = tuple(sorted("/" + os.path.relpath(p, d.workdir) for p in fsplan.placeholders
                            if p.startswith(d.workdir.rstrip("/") + "/")))
    if excludes and d.run_dir and d.tier in (Tier.SUPERVISED, Tier.GVISOR, Tier.VM, Tier.CONTAINER):
        fsplan = replace(fsplan, mounts=fsplan.mounts + (
            Mount(MountKind.RO_BIND, BOX_GIT_EXCLUDES, os.path.join(d.run_dir, "git-excludes")),))
        d.git_excludes = excludes
    if d.inspected and d.run_dir:  # the run CA's certificate with the system roots; its key stays in the run dir
        fsplan = replace(fsplan, mounts=fsplan.mounts + (
            Mount(MountKind.RO_BIND, inspection.BOX_CA_BUNDLE, os.path.join(d.run_dir, inspection.BUNDLE_NAME)),))
    if d.facts.uid == 0 and d.run_dir and d.tier == Tier.SUPERVISED:  # the box user of a root caller gets a sane name
        from relay.policy import passwd

        fsplan = replace(fsplan, mounts=fsplan.mounts + passwd.mounts(d.run_dir))
    d.fsplan = fsplan


def _environment(d: _Draft) -> None:
    """What the box's environment sets, and which caller variables pass by name; the limits."""
    profile, env = d.profile, d.env
    env_set: dict[str, str] = {"HOME": d.home, "TMPDIR": "/tmp", "HIVE_RELAY": "1", "HIVE_RELAY_BACKEND": d.backend.name}
    env_pass = tuple(n for n in _env_names(profile, d.backend, env) if n not in d.withheld)
    if d.tier == Tier.CONTAINER:
        caller_path = env.get("PATH") if "PATH" in env_pass else None
        env_set["PATH"] = container_argv.IMAGE_PATH + (f":{caller_path}" if caller_path else "")
    else:
        env_set["PATH"] = d.box_path if "PATH" in env_pass else SAFE_PATH
    env_pass = tuple(n for n in env_pass if n != "PATH")
    if profile.backend_home:
        env_set.update(dict(d.backend.env_set))
    env_set.update(d.route_env)
    git_config = ([("core.excludesFile", BOX_GIT_EXCLUDES)] if d.git_excludes else []) + d.git_config
    for i, (key, value) in enumerate(git_config):  # git's env-provided config: box-only, no file
        env_set.update({"GIT_CONFIG_COUNT": str(len(git_config)), f"GIT_CONFIG_KEY_{i}": key, f"GIT_CONFIG_VALUE_{i}": value})
    if profile.network:
        env_set.update(proxy_env(PROXY_LISTEN))
    if d.inspected:  # every TLS client in the box trusts the bundle: the system roots and the run CA
        env_set.update(inspection.trust_env())
    d.env_set = env_set
    d.env_pass = tuple(n for n in env_pass if n not in env_set)
    d.limits = Limits(profile.memory, profile.pids, limit_method(d.facts.cgroup))
    if d.interactive and d.request.timeout and d.request.argv_override is None:
        d.notes.append("--timeout applies to --prompt and `-- CMD` runs only; interactive sessions have no "
                       "wall-clock kill")


def _check_socket_requests(request: Request, tier: Tier, profile: Profile) -> None:
    """--allow-socket/--allow-ssh where they cannot be kept narrow: refused before anything else."""
    if not (request.allow_sockets or request.allow_ssh):
        return
    if tier == Tier.GVISOR and request.allow_sockets:
        raise RefusedError("--allow-socket cannot be enforced in the gvisor tier yet (its agent gets no AF_UNIX "
                           "socket at all); fix: use --isolation supervised, or drop --allow-socket")
    if tier == Tier.PROCESS:
        raise RefusedError("--allow-socket and --allow-ssh need the supervised box or a container: the process tier "
                           "has no mount namespace to show one socket alone, and no network; fix: install "
                           "bubblewrap, or use --mode container")
    if request.allow_ssh and not profile.network:
        raise RefusedError(f"profile {profile.name!r} has no network, so --allow-ssh cannot be honoured; "
                           "fix: use --profile agent, or drop --allow-ssh")


def _agent_sockets(d: _Draft) -> None:
    """--allow-socket and --allow-ssh (relay/policy/sockets.py): each named host socket, alone, bound at a
    box-private path (AF_UNIX socket() is then allowed in this box only, see _plan); ssh through the
    proxy by GIT_SSH_COMMAND. Loud in the notes; refused where they cannot be kept that narrow."""
    request = d.request
    if d.profile.network and d.tier != Tier.PROCESS:
        # Always: ssh in the box goes to the proxy, which allows the --allow-ssh hosts and answers any
        # other with a refusal that names the fix (rather than the box's "cannot resolve").
        d.env_set.update({"GIT_SSH_COMMAND": ssh_command(), CONNECT_ENV: connect_script(PROXY_LISTEN)})
    if not (request.allow_sockets or request.allow_ssh):
        return
    assert d.fsplan is not None
    d.sockets = resolve_sockets(request.allow_sockets, d.env, d.home, d.uid, d.fs)
    mounts = list(d.fsplan.mounts)
    for sock in d.sockets:
        cover = next((m for m in reversed(mounts) if safe_beneath(sock.box, m.dst)), None)
        if cover is not None and cover.kind in (MountKind.MASK_DIR, MountKind.MASK_FILE):
            raise RefusedError(f"--allow-socket {sock.name}: {sock.box} lies in {cover.dst}, which the box hides; "
                               "fix: move the socket elsewhere")
        mounts.append(Mount(MountKind.RO_BIND, sock.box, sock.host))
        d.notes.append(f"HOST SOCKET IN THE BOX: {sock.name} ({sock.host}) at {sock.box}; AF_UNIX sockets are allowed "
                       "in this box; every other host socket stays hidden")
    if d.sockets and d.tier == Tier.SUPERVISED:
        # The host's root is read-only, but connect() to a socket in it still works: hide the dirs
        # that hold host daemons' sockets (right after the root, so the workdir and grants are bound
        # back on top).
        hidden = socket_homes(d.fs)
        mounts[1:1] = [Mount(MountKind.TMPFS, h, size=bwrap_argv.MASK_SIZE) for h in hidden]
        d.notes.append(f"with AF_UNIX allowed the box does not see {', '.join(hidden)} (where host daemons keep "
                       "their sockets)")
    d.fsplan = replace(d.fsplan, mounts=tuple(mounts))
    agent = next((s for s in d.sockets if s.name == "ssh-agent"), None)
    if agent is not None:
        if d.tier == Tier.CONTAINER:
            # The image's entrypoint refuses to start when $SSH_AUTH_SOCK is a socket it can see (its
            # deny-list check); the agent gets the variable after that check instead.
            d.argv[:0] = ["env", f"SSH_AUTH_SOCK={agent.box}"]
        else:
            d.env_set["SSH_AUTH_SOCK"] = agent.box
        d.env_pass = tuple(n for n in d.env_pass if n != "SSH_AUTH_SOCK")
    if request.allow_ssh:
        hosts = ", ".join(r.render().removesuffix(r.options()) for r in parse_ssh_hosts(request.allow_ssh))
        d.notes.append(f"ssh through the egress proxy to {hosts} (git uses GIT_SSH_COMMAND, plain ssh: "
                       "$GIT_SSH_COMMAND HOST; a host key is accepted on first use in the box)" + ("" if agent else "; the box has no ssh key: add --allow-socket "
                                                      "ssh-agent"))


def _process_tier(d: _Draft) -> None:
    """Landlock rules instead of mounts: read the host's system dirs, write the workdir and a tmp."""
    if d.run_dir is None:
        raise UsageError("internal: the process tier needs a run id")
    from relay.box.landlock import read_roots

    d.command = list(d.argv)
    d.env_set["TMPDIR"] = os.path.join(d.run_dir, "tmp")
    own = _own_checkout(d)
    if own is not None and own != d.workdir:
        raise RefusedError(f"the workdir {d.workdir} holds hive relay's own checkout ({own}), which the process tier "
                           "cannot keep read-only; fix: install bubblewrap, or pick a workdir that does not hold it")
    _refuse_own_paths_under_writes(d, [] if own is not None else [d.workdir])
    rw = [d.workdir, d.env_set["TMPDIR"], "/dev/null", "/dev/zero", "/dev/full", "/dev/tty", "/dev/pts", "/dev/ptmx"]
    if own is not None:
        rw.remove(d.workdir)  # our own checkout: read-only (see _read_only_checkout)
    ro = read_roots(d.home, d.fs.listdir("/")) + ["/dev/urandom", "/dev/random"] + ([own] if own else [])
    ro += [g.path for g in d.grants if not g.writable]
    rw += [g.path for g in d.grants if g.writable]
    d.fs_rules = tuple((p, "ro") for p in ro) + tuple((p, "rw") for p in rw)
    assert d.fsplan is not None
    d.fsplan = replace(d.fsplan, mounts=(), placeholders=(), protected=())
    if d.profile.network:
        raise RefusedError("the process tier cannot enforce egress; internal error in profile choice")


def _refuse_own_paths_under_writes(d: _Draft, workdirs: list[str]) -> None:
    """Landlock cannot carve a read-only hole in a writable tree, so at the process tier a workdir
    or writable grant that holds one of hive relay's own paths (its config, state, cache: the memos
    the next launch trusts, `relay.host.memo`) would let this box steer the next one. Refused, for
    every tier's sake; the supervised box binds them read-only instead."""
    for root in workdirs + [g.path for g in d.grants if g.writable]:
        held = next((p for p in d.own if _lies_in(p, root)), None)
        if held is not None:
            what = "the workdir" if root in workdirs else "the writable grant"
            raise RefusedError(f"{what} {root} holds hive relay's own {held}, which the process tier cannot keep "
                               "read-only (the next launch trusts what is there); fix: install bubblewrap, or pick "
                               f"a {'workdir' if root in workdirs else 'grant'} that does not hold it")


def _refuse_unpinned_links(d: _Draft) -> None:
    """An engine cannot pin a link (its mounts follow it; relay/box/linkpin.py runs before bwrap only)."""
    assert d.fsplan is not None
    if d.fsplan.pinned_links:
        link = d.fsplan.pinned_links[0]
        raise RefusedError(f"{link} is a symbolic link the box could replace (with its own hooks or settings), and "
                           f"--mode {d.request.mode} cannot pin a link; fix: --mode local, or replace the link with "
                           "the directory or file it points to")


def _container_tier(d: _Draft) -> None:
    """podman/docker run: the same mounts as engine flags, limits as the engine enforces them."""
    assert d.fsplan is not None and d.limits is not None
    _refuse_unpinned_links(d)
    if d.request.mode == "kube":  # rendered as Kubernetes objects by relay/modes/kube_objects.py, not run here
        d.limits = replace(d.limits, method="kubernetes (pod resources.limits)")
        d.command = list(d.argv)
        if d.request.isolation == "gvisor":
            d.runtime_class = GVISOR_RUNTIME_CLASS
            d.notes.append(f"gvisor: the box pods ask for runtimeClassName {GVISOR_RUNTIME_CLASS} (GKE Sandbox's name; "
                           f"`{ENTRY} doctor --mode kube --isolation gvisor` proves the cluster runs them on gVisor)")
        return
    choice = _container_run(d.backend, d.matrix, d.request, d.facts, d.env, d.limits, d.run_dir,
                            network=d.profile.network)
    d.container, d.limits = choice.run, replace(d.limits, method=choice.limit_method)
    if d.staged is not None:
        _refuse_staged_container(d, choice.run, d.staged)
    if choice.run.ctl_dir and not choice.run.runtime:  # gvisor: the proxy serves before the box starts
        d.env_set["HIVE_RELAY_GO"] = f"{container_argv.CTL_DIR}/go"
    if choice.run.runtime:
        if d.sockets:
            raise RefusedError("--allow-socket cannot be enforced with --isolation gvisor yet (its agent gets no "
                               "AF_UNIX socket()); fix: drop --isolation gvisor, or drop --allow-socket")
        d.notes.append(f"gvisor: the container runs on runsc ({d.facts.runsc_version or d.facts.runsc}, platform "
                       f"{d.facts.runsc_platform}): the agent's kernel is gVisor's Sentry, not the host's")
    d.command = container_argv.build(
        run=choice.run, backend=d.backend.name, workdir=d.workdir, home=d.home, mounts=d.fsplan.mounts,
        env_set=d.env_set, env_pass=d.env_pass, interactive=d.interactive, tty=d.facts.tty, argv=d.argv,
        staged=(d.staged.upper, d.staged.work) if d.staged else None,
        listen=PROXY_LISTEN if d.profile.network else None,
    )


def _refuse_staged_container(d: _Draft, run: ContainerRun, layer: StagedLayer) -> None:
    """Staged in a container: podman's overlay volume with our upper dir (`:O,upperdir=`); docker's
    volumes have no such thing, and the volume's option string cannot name every path."""
    asked = "--staged" if d.request.staged else "staged (the default)"
    live_fix = "" if d.request.staged else ", or --live to let the box write the checkout directly"
    if run.kind != "podman":
        raise RefusedError(f"{asked}: {run.kind} has no overlay volume with an upper dir of our own; fix: use podman "
                           f"(HIVE_RELAY_ENGINE=podman) or --mode local{live_fix}")
    if run.runtime:
        # podman hands an overlay volume to the runtime as an OCI `overlay` mount, which runsc 20240729
        # does not implement: the box would see no workdir at all (checked), and its writes would go nowhere.
        raise RefusedError(f"{asked}: with --isolation gvisor, podman hands its overlay volume to runsc, which cannot "
                           "mount it; fix: --live to let the box write the checkout directly, or --mode local "
                           "--isolation gvisor (which stages)")
    if unsafe_path(layer.root):
        raise RefusedError(f"{asked}: the staged layer's path {layer.root} holds {unsafe_path(layer.root)!r}, which "
                           f"a podman volume cannot name; fix: set XDG_STATE_HOME to a plain path{live_fix}")


def _supervised_tier(d: _Draft) -> None:
    """The bwrap box: its argv, then the agent's."""
    assert d.fsplan is not None
    d.command = bwrap_argv.build(
        bwrap=d.facts.bwrap or "bwrap",
        mounts=d.fsplan.mounts,
        workdir=d.workdir,
        box_uid=_box_uid(d),
        seccomp_fd=SECCOMP_FD,
        info_fd=INFO_FD,
        block_fd=BLOCK_FD,
        fd_binds={(sock.box, sock.host): SOCKET_FD + i for i, sock in enumerate(d.sockets)},
    ) + d.argv
    if d.fsplan.pinned_links:  # links the box must not replace: pinned by a pre-stage that then execs bwrap
        import sys

        from relay.box import linkpin

        pairs = [x for link in d.fsplan.pinned_links for x in (link, d.fs.readlink(link) or "")]
        d.command = [sys.executable, "-I", "-S", os.path.abspath(linkpin.__file__), *pairs, "--", *d.command]


def _gvisor_tier(d: _Draft) -> None:
    """The runsc box (relay/render/gvisor_oci.py): runsc's argv, the in-box init's, then the agent's.
    The spec itself is rendered by the runner (it holds the environment's values, which the plan names
    only); everything it is rendered from is in the plan."""
    assert d.fsplan is not None
    if d.fsplan.pinned_links:
        link = d.fsplan.pinned_links[0]
        raise RefusedError(f"{link} is a symbolic link the box could replace (with its own hooks or settings), and "
                           "the gvisor tier cannot pin a link yet; fix: --isolation supervised, or replace the link "
                           "with the directory or file it points to")
    if d.facts.box_python is None and d.facts.gvisor_init is None:
        raise RefusedError("--isolation gvisor needs a python3 the box can see (outside $HOME) for its init, or a C "
                           "compiler to build the compiled one; fix: apt-get install python3 (or gcc libc6-dev)")
    base = os.path.join(d.run_dir or "/RUN-DIR", "gvisor")
    rootless = d.uid != 0
    d.gvisor = GvisorRun(
        runsc=d.facts.runsc or "runsc", platform=d.facts.runsc_platform or "systrap", rootless=rootless,
        container_id=f"hive-relay-{d.request.run_id or 'dry-run'}", bundle=base, state_root=os.path.join(base, "state"),
        init_script=d.facts.gvisor_init or gvisor_init_script(), python=d.facts.box_python,
        seccomp_file=os.path.join(base, "seccomp.bpf"),
        socket=os.path.join(base, "proxy.sock") if d.profile.network else None,
        box_uid=gvisor_oci.BOX_UID,
    )
    d.command = d.gvisor.argv() + d.gvisor.init_argv(PROXY_LISTEN if d.profile.network else None) + d.argv


def _vm_tier(d: _Draft) -> None:
    """The microVM (relay/modes/vm_boot.py, run by relay/modes/vm_runner.py): qemu's argv as far as the
    plan decides it (the shares and the control dir's contents follow from the mounts at launch),
    then the agent's argv, which the guest init runs as the caller's uid with no capabilities."""
    from relay.host.paths import cache_dir
    from relay.policy.tiers import vm_accel

    assert d.facts.vm_qemu and d.facts.vm_kernel, "a vm plan without its probed qemu and kernel"
    if not d.facts.image:
        raise RefusedError("--isolation vm needs container mode's image as the guest's root, and its tag is unknown; "
                           f"fix: `{ENTRY} build-image`")
    _refuse_unpinned_links(d)
    accel = vm_accel(d.request)
    base = os.path.join(d.run_dir or "/RUN-DIR", "vm")
    d.vm = VmRun(qemu=d.facts.vm_qemu, kernel=d.facts.vm_kernel, accel=accel, emulated=accel == "tcg",
                 image=d.facts.image, cache=str(cache_dir(d.env) / "vm"), dir=base,
                 socket=os.path.join(base, "proxy.sock") if d.profile.network else None, uid=d.uid)
    if accel == "tcg":
        d.notes.append("the VM is emulated (qemu TCG, no KVM): the same guest and boundary, a boot of tens of "
                       "seconds, and every instruction slower")
    d.command = [d.vm.qemu, "-M", f"microvm,accel={accel}", "-kernel", d.vm.kernel, "-drive",
                 f"file={d.vm.root_image()},readonly=on", "--"] + d.argv


_TIERS = {Tier.PROCESS: _process_tier, Tier.CONTAINER: _container_tier, Tier.SUPERVISED: _supervised_tier,
          Tier.GVISOR: _gvisor_tier, Tier.VM: _vm_tier}


def _box_uid(d: _Draft) -> int | None:
    """A root caller's box user (bwrap's and the engines'); the gvisor box is the caller itself, as the
    Sentry's capability-less root (relay/render/gvisor_oci.py)."""
    return BOX_UID_FOR_ROOT if d.uid == 0 and d.tier not in (Tier.GVISOR, Tier.VM) else None


def _timeout(request: Request) -> int | None:
    """--prompt runs: the given timeout or the default. A `-- CMD` run keeps its terminal like a session
    but honours an explicit --timeout. A session has none."""
    if request.prompt is not None:
        return request.timeout or DEFAULT_TIMEOUT
    return request.timeout if request.argv_override is not None else None


def _plan(d: _Draft) -> Plan:
    """The frozen Plan from a finished draft, with the digest of its policy."""
    assert d.fsplan is not None and d.limits is not None
    fsplan, tier = d.fsplan, d.tier
    egress = as_entries(d.rules)
    proxy_listen = PROXY_LISTEN if d.profile.network else None
    seccomp = policy_for(nested_userns=d.backend.nested_userns, deny_network=tier == Tier.PROCESS,
                         unix_sockets=bool(d.sockets))
    policy = {
        "tier": tier, "grants": [asdict(g) for g in d.grants], "sync": d.sync, "guard": d.guarded,
        "state": d.state_dirs, "keep": d.backend.home_keep if d.state_dirs else (), "denied": fsplan.denied,
        "protected": fsplan.protected, "egress": egress, "env": sorted(d.env_pass), "limits": asdict(d.limits),
        "seccomp": seccomp.summary(), "fs_rules": d.fs_rules,
    }
    if d.routes:
        policy["credentials"] = [route_json(r) for r in d.routes]
    if d.sockets:
        policy["sockets"] = [asdict(s) for s in d.sockets]
    if (d.container is not None and d.container.runtime) or d.runtime_class:
        policy["runtime"] = "runsc"  # --isolation gvisor in container or kube mode
    if d.inspected:
        policy["inspected"] = inspection.shown(d.inspected)
    if d.staged:
        policy["workdir"] = "staged"
        # Staged: bwrap makes the mount targets of the workdir's masks inside the overlay, so they land
        # in the layer (and review skips them), never in the checkout, where other boxes would see them.
        inside = tuple(p for p in fsplan.placeholders if _lies_in(p, d.workdir))
        fsplan = replace(fsplan, placeholders=tuple(p for p in fsplan.placeholders if p not in inside))
        d.staged = replace(d.staged, placeholders=inside)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(d.now))
    log_path = os.path.join(state_dir(d.env), "logs", f"{stamp}-{d.backend.name}-{d.request.run_id or 'dry'}.jsonl")
    return Plan(
        backend=d.backend.name, mode=d.request.mode, tier=tier, profile=d.profile.name,
        profile_digest=_digest(policy), workdir=d.workdir, interactive=d.interactive,
        timeout=_timeout(d.request),
        argv=tuple(d.argv), command=tuple(d.command), env_set=tuple(sorted(d.env_set.items())),
        env_pass=d.env_pass, mounts=fsplan.mounts, denied=fsplan.denied, protected=fsplan.protected,
        placeholders=fsplan.placeholders, egress=egress, rules=d.rules, proxy_listen=proxy_listen,
        limits=d.limits, seccomp=tuple(seccomp.summary()) if tier != Tier.VM else VM_SECCOMP,
        seccomp_policy=seccomp if tier != Tier.VM else None, fs_rules=d.fs_rules,
        box_uid=_box_uid(d), sync_files=tuple(d.sync) if tier != Tier.PROCESS else (),
        guarded_files=tuple(d.guarded), state_dirs=tuple(d.state_dirs),
        home_keep=tuple(expand(p, d.home, d.uid) for p in d.backend.home_keep) if d.state_dirs else (),
        state_exclude=_state_exclude(d), git_excludes=d.git_excludes,
        log_path=log_path if proxy_listen else None, run_dir=d.run_dir, container=d.container, gvisor=d.gvisor, vm=d.vm, git=d.git,
        runtime_class=d.runtime_class,
        notes=tuple(d.notes), credentials=tuple(d.routes), sockets=d.sockets,
        ssh=tuple(r.render().removesuffix(r.options()) for r in parse_ssh_hosts(d.request.allow_ssh)),
        presets=d.presets if proxy_listen else (), ask=d.request.ask and proxy_listen is not None,
        auth_grants=d.auth_grants, workdir_mode=d.workdir_mode, staged=d.staged,
        shared_live=d.request.shared_live, login_files=tuple(d.login_files), run_id=d.request.run_id,
        inspected_hosts=inspection.shown(d.inspected), **_scan_sources(d),
    )


def _scan_sources(d: _Draft) -> dict:
    """Plan.scan_env and Plan.scan_files (see there): a codex box's state must not carry the claude login
    or the Anthropic key a codex session on the host once printed, though this run routes neither."""
    given = set(d.env_pass) | {n for n, _ in d.env_set.items()}
    names = {n for b in d.matrix.backends.values() for r in b.credentials for n in r.secret_env}
    names |= {n for g in d.matrix.grants for n in g.secret_env}
    files: dict[str, list[str]] = {}
    for b in d.matrix.backends.values():
        for path, paths in b.secret_files:
            files.setdefault(expand(path, d.home, d.uid), []).extend(paths)
        for r in b.credentials:
            if r.login is not None:
                files.setdefault(expand(r.login.file, d.home, d.uid), []).extend(
                    p for p in (r.login.token, r.login.refresh_token, r.login.id_token) if p)
    return {"scan_env": tuple(sorted(names - given)),
            "scan_files": tuple((f, tuple(dict.fromkeys(p))) for f, p in sorted(files.items()))}


def _state_exclude(d: _Draft) -> tuple[str, ...]:
    """Denied and hive relay's own paths inside a state dir: never copied in nor synced back."""
    return tuple(sorted({p for p in secret_paths(d.home, d.uid, d.backend.deny, None) + d.own
                         if any(p == s or p.startswith(s + "/") for s in d.state_dirs)}))


def safe_beneath(path: str, base: str) -> bool:
    return os.path.normpath(path) == os.path.normpath(base) or path.startswith(base.rstrip("/") + "/")


def _unsandboxed_plan(
    backend: Backend, request: Request, facts: HostFacts, caller_env: dict[str, str], workdir: str, shell: str,
    notes: list[str],
) -> Plan:
    """The opt-in path: the CLI alone, with its own strictest native sandbox and the caller's environment."""
    native = render_native(backend.native_unsandboxed, home=facts.home, uid=facts.uid, workdir=workdir,
                           extra_deny=backend.deny, unsandboxed=True)
    argv = list(request.argv_override or agent_argv(backend, request.prompt, shell, workdir, tuple(native)))
    interactive = request.prompt is None
    return Plan(
        backend=backend.name, mode=request.mode, tier=Tier.UNSANDBOXED, profile="none",
        profile_digest=_digest({"unsandboxed": backend.name, "argv": argv}), workdir=workdir,
        interactive=interactive, timeout=_timeout(request),
        argv=tuple(argv), command=tuple(argv), env_set=(), env_pass=tuple(sorted(caller_env)), mounts=(),
        denied=(), protected=(), placeholders=(), egress=(), proxy_listen=None,
        limits=Limits(0, 0, "none"), seccomp=(), box_uid=None, sync_files=(), log_path=None, run_dir=None,
        unsandboxed=True, notes=tuple(notes), run_id=request.run_id,
    )


@record
class _ContainerChoice:
    """The container run rendered for this plan and how its limits are enforced (the engine's or none)."""

    run: ContainerRun
    limit_method: str


def _container_run(backend: Backend, matrix: Matrix, request: Request, facts: HostFacts, caller_env: dict[str, str],
                   limits: Limits, run_dir: str | None, network: bool = True) -> _ContainerChoice:
    from relay.host.container_engine import engine_kind

    engine = choose_engine(facts, caller_env)
    kind = engine_kind(engine)
    rootless = kind == "podman" and facts.uid != 0
    if facts.image is None:
        raise UsageError("internal: container mode needs the image identity in the host facts (relay.modes.image_tag.with_image)")
    gvisor = request.isolation == "gvisor"
    if gvisor and kind != "podman":
        raise RefusedError(f"--isolation gvisor in container mode runs on podman (`podman --runtime runsc`), and "
                           f"{engine} is {kind}; fix: HIVE_RELAY_ENGINE=podman, or --mode local")
    flags, method = container_argv.limit_flags(kind, rootless, facts.cgroup, limits, facts.nofile, gvisor)
    ctl_dir = os.path.join(run_dir, "ctl") if run_dir else None
    extra: dict = {}
    if gvisor:
        # The init's files: the filter and the proxy's socket in the control dir (owner-only: bound in one
        # by one, never the dir), the init from our package; the OCI profile is not used (see container_argv).
        box = ctl_dir or "/RUN-DIR/ctl"
        extra = {"runtime": facts.runsc or "runsc",
                 "runtime_flags": container_argv.runsc_flags(facts.runsc_platform or "systrap", rootless),
                 "init_script": facts.gvisor_init or gvisor_init_script(),
                 "seccomp_bpf": os.path.join(box, "seccomp.bpf"),
                 "proxy_socket": os.path.join(box, "proxy.sock") if network else None}
    run = ContainerRun(
        engine=engine, kind=kind, rootless=rootless, name=f"hive-relay-{request.run_id or 'dry-run'}",
        image=facts.image, user="0:0" if facts.uid == 0 else f"{facts.uid}:{facts.gid}",
        pidfile=os.path.join(run_dir, "pid") if run_dir and kind == "podman" else None,
        ctl_dir=ctl_dir,
        seccomp_profile=os.path.join(run_dir, "seccomp.json") if run_dir and not gvisor else None,
        limit_flags=flags, **extra,
    )
    return _ContainerChoice(run, method)
