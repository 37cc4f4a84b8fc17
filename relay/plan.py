"""resolve(): a pure function from (backend, request, host facts) to a frozen Plan.

Everything the runner does is decided here, so `--dry-run --json` shows exactly what would
run and unit tests can assert on every backend × mode without launching anything.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from dataclasses import asdict, dataclass, field, replace

from . import bwrap_argv, container_argv
from .config import Backend, Matrix
from .container_argv import ContainerRun
from .denylist import expand, nested_git_paths, protected_paths, secret_paths
from .digest import sha256
from .errors import RefusedError, UsageError
from .fsplan import FsView, Grant, Mount, plan_filesystem
from .gitdir import EMPTY, OBJECT_REDIRECTS, GitPlan, plan_git
from .hosts import HostRule, explain, parse_rule
from .native import render as render_native
from .paths import config_home, own_paths, state_dir, tool_dir
from .probe import HostFacts
from .profiles import TOOLCHAIN_GRANTS, Profile, resolve_profile
from .seccomp_policy import SeccompPolicy, policy_for
from .workdir import refusal as workdir_refusal

PROXY_LISTEN = "127.0.0.1:3128"
BOX_UID_FOR_ROOT = 1000
SECCOMP_FD = 3
INFO_FD = 4
BLOCK_FD = 5
DEFAULT_TIMEOUT = 1800
MODES = ("local", "container")
ISOLATIONS = ("auto", "process", "supervised", "container")
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
BOX_GIT_EXCLUDES = "/run/hive-relay/git-excludes"



@dataclass(frozen=True)
class Request:
    """What the user asked for, straight from the command line."""

    backend: str
    mode: str = "local"
    profile: str | None = None
    isolation: str | None = None
    prompt: str | None = None
    workdir: str = "."
    allow_hosts: tuple[str, ...] = ()
    timeout: int | None = None
    run_id: str = ""
    # Internal (selftest): run this argv in the backend's box instead of the agent.
    argv_override: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Limits:
    memory: int
    pids: int
    method: str


@dataclass(frozen=True)
class Plan:
    """Everything one launch will do. Secrets appear by name only (env_pass), never by value."""

    backend: str
    mode: str
    tier: str
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
    git_excludes: tuple[str, ...] = ()
    unsandboxed: bool = False
    container: ContainerRun | None = None
    git: GitPlan | None = None  # the workdir's git dir by allowlist (relay/gitdir.py)
    notes: tuple[str, ...] = field(default=())

    @property
    def rules(self) -> tuple[HostRule, ...]:
        return tuple(parse_rule(e) for e in self.egress)

    def to_json(self) -> dict:
        data = asdict(self)
        data["env_set"] = dict(self.env_set)
        data["mounts"] = [{k: v for k, v in asdict(m).items() if v is not None} for m in self.mounts]
        data["command_line"] = shlex.join(self.command)
        data["egress_rules"] = explain(self.rules)
        return data


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
        "NODE_USE_ENV_PROXY": "1",
    })
    return env


@dataclass(frozen=True)
class TierChoice:
    tier: str
    profile: str
    notes: tuple[str, ...] = ()


def choose_tier(
    request: Request, facts: HostFacts, backend: Backend, matrix: Matrix, caller_env: dict[str, str]
) -> TierChoice:
    """Pick the tier and profile. Explicit choices are fail-closed: they run as asked or refuse."""
    isolation = request.isolation or "auto"
    if isolation not in ISOLATIONS:
        raise UsageError(f"--isolation {isolation!r}: choose one of {', '.join(ISOLATIONS)}")
    if request.mode == "container" or isolation == "container":
        if request.mode == "local" and isolation == "container":
            raise UsageError("--isolation container needs --mode container")
        if isolation in ("process", "supervised"):
            raise UsageError(f"--isolation {isolation} is a local-mode tier; fix: drop it, or use --mode local")
        return TierChoice("container", request.profile or "agent")

    def needs_network(name: str) -> bool:
        return resolve_profile(name, matrix.profiles).network

    if isolation == "supervised" or (isolation == "auto" and facts.supervised_ok):
        if not facts.supervised_ok:
            raise RefusedError(f"--isolation supervised cannot be enforced: {_missing_supervised(facts)}")
        return TierChoice("supervised", request.profile or "agent")

    # No supervised box: either the user asked for the process tier, or auto fell through.
    missing = _missing_supervised(facts) if isolation == "auto" else "--isolation process was asked for"
    opt_in = _opted_in(backend, matrix, caller_env)
    if request.profile is not None and needs_network(request.profile):
        raise RefusedError(
            f"profile {request.profile!r} needs egress pinned to {backend.name}'s hosts, which only the supervised "
            f"tier enforces: {missing}"
        )
    if isolation == "auto" and request.profile is None and backend.egress and opt_in:
        return TierChoice("unsandboxed", "none", (f"{backend.opt_in} is set: {backend.name} runs without the box",))
    if isolation == "auto" and request.profile is None and backend.egress:
        # An agent needs its API hosts; at the process tier it would start with no network and fail.
        raise RefusedError(
            f"{backend.name} needs its API hosts, which only the supervised box can allow: {missing}. "
            f"To run {backend.name} without the box anyway, set {backend.opt_in}=1 (its own sandbox only)"
            + ("; --isolation process runs it with no network" if facts.process_ok else "")
        )
    if not facts.process_ok:
        raise RefusedError(
            f"no enforceable box on this host: {missing}; and {facts.process_error}"
            + (f". To run {backend.name} without the box anyway, set {backend.opt_in}=1" if backend.egress else "")
        )
    profile = request.profile or "default"
    notes: list[str] = []
    if request.profile is None:
        why = missing if isolation == "auto" else "the process tier cannot enforce egress"
        note = f"using the fail-closed default profile at the process tier: {why}"
        if backend.egress:
            note += (f"; {backend.name} needs its API hosts, which the default profile blocks; "
                     f"to run {backend.name} without the box set {backend.opt_in}=1")
        notes.append(note)
    notes.append("the process tier cannot write-protect .git/hooks and friends inside the workdir, and host "
                 "processes stay visible; install bubblewrap for the supervised box")
    return TierChoice("process", profile, tuple(notes))


def _opted_in(backend: Backend, matrix: Matrix, caller_env: dict[str, str]) -> bool:
    return caller_env.get(backend.opt_in) == "1" or backend.name in matrix.allow_unsandboxed


def _missing_supervised(facts: HostFacts) -> str:
    if facts.bwrap is None:
        return "bubblewrap is not installed; fix: apt-get install bubblewrap (or dnf install bubblewrap)"
    if facts.bwrap_error:
        fix = ("sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or add an AppArmor profile for bwrap"
               if facts.userns_restricted else "check that user namespaces are enabled (sysctl user.max_user_namespaces)")
        return f"{facts.bwrap_error}; fix: {fix}"
    return facts.seccomp_error or "seccomp is unavailable"


def resolve(
    backend: Backend,
    matrix: Matrix,
    request: Request,
    facts: HostFacts,
    caller_env: dict[str, str],
    fs: FsView | None = None,
    now: float | None = None,
) -> Plan:
    """Decide everything about one launch. Raises UsageError / RefusedError on bad requests."""
    fs = fs or FsView()
    if request.mode not in MODES:
        raise UsageError(f"unknown mode {request.mode!r}; choose one of: {', '.join(MODES)}")
    workdir = os.path.realpath(request.workdir)
    if fs.kind(workdir) != "dir":
        raise UsageError(f"--workdir {request.workdir}: not an existing directory; fix: create it or pass another")
    if request.timeout is not None and request.timeout <= 0:
        raise UsageError("--timeout must be a positive number of seconds")
    extra_rules = tuple(parse_rule(h) for h in request.allow_hosts)

    choice = choose_tier(request, facts, backend, matrix, caller_env)
    tier, notes = choice.tier, list(choice.notes)
    home, uid = facts.home, facts.uid
    shell = facts.shell if os.path.isabs(facts.shell) else "/bin/sh"
    if tier == "unsandboxed":
        return _unsandboxed_plan(backend, request, facts, caller_env, workdir, shell, notes)
    profile = resolve_profile(choice.profile, matrix.profiles)
    if os.path.realpath(home) == "/":
        raise RefusedError("HOME is '/', so the box cannot hide it; fix: set HOME to your home directory")
    reason = workdir_refusal(
        workdir, os.path.realpath(home), secret_paths(home, uid, backend.deny, caller_env.get("SSH_AUTH_SOCK")),
        own_paths(caller_env),
        os.path.realpath(config_home(caller_env)),
        [os.path.realpath(d) for d in (caller_env.get("PATH") or "").split(":") if d.startswith("/")])
    if reason:
        raise RefusedError(reason)

    grants: list[Grant] = []
    sync: list[str] = []
    guarded: list[str] = []
    if profile.backend_home:
        grants += [Grant(expand(p, home, uid), False) for p in backend.home_ro]
        grants += [Grant(expand(p, home, uid), True) for p in backend.home_rw]
        sync = [expand(p, home, uid) for p in backend.home_sync]
        guarded = [expand(p, home, uid) for p in backend.home_guard]
    if profile.toolchain:
        grants += [Grant(expand(p, home, uid), False) for p in TOOLCHAIN_GRANTS]
    grants += [Grant(expand(p, home, uid), False) for p in profile.home_ro]
    grants += [Grant(expand(p, home, uid), True) for p in profile.home_rw]
    # Read-only grants must land after a writable parent, so order ro after rw at equal depth.
    grants = sorted(dict.fromkeys(grants), key=lambda g: (g.path, not g.writable))

    tools = tool_dir(caller_env)
    box_path = caller_env.get("PATH") or SAFE_PATH
    box_path = f"{tools}/node_modules/.bin:{box_path}"
    native = render_native(backend.native_boxed, home=home, uid=uid, workdir=workdir, extra_deny=backend.deny,
                           unsandboxed=False)
    argv = list(request.argv_override or agent_argv(backend, request.prompt, shell, workdir, tuple(native)))
    cli = shutil.which(argv[0], path=box_path)
    extra_binds: list[Mount] = []

    if tier == "container":
        pass  # the CLIs come from the image, not from the host
    elif os.path.isdir(tools):
        extra_binds.append(Mount("ro-bind", tools, tools))
    if tier == "container":
        pass
    elif cli is None:
        notes.append(f"{argv[0]} is not installed yet; a real run installs it first (npm, into {tools})"
                     if backend.install_npm else f"{argv[0]} is not installed on this host")
    else:
        real_cli = os.path.realpath(cli)
        if (real_cli + "/").startswith(home.rstrip("/") + "/") and not real_cli.startswith(tools + "/"):
            install_dir = os.path.dirname(real_cli)
            extra_binds.append(Mount("ro-bind", install_dir, install_dir))

    run_dir = os.path.join(caller_env.get("XDG_RUNTIME_DIR") or "/tmp", f"hive-relay-{request.run_id}") if request.run_id else None
    protected = protected_paths(workdir) + nested_git_paths(workdir)
    git = plan_git(workdir, fs) if tier in ("supervised", "container") else None
    git_mounts: list[Mount] = []
    if git is not None:
        # The git dir is private and allowlisted; the deny-list entries under it are moot, and
        # resolving a linked one (`.git/hooks -> ..`) would freeze the workdir.
        protected = [p for p in protected if not safe_beneath(p, git.dotgit)] + list(git.protect)
        notes += git.notes
        if run_dir:
            git_mounts = [replace(m, src=os.path.join(run_dir, m.src or "")) if m.kind == "private-bind" else m
                          for m in git.mounts]
        else:
            git_mounts = [replace(m, src=os.path.join("/RUN-DIR", m.src or "")) if m.kind == "private-bind" else m
                          for m in git.mounts]
    fsplan = plan_filesystem(
        home=home,
        workdir=workdir,
        home_source=os.path.join(run_dir, "home") if (sync and run_dir) else None,
        grants=grants,
        secrets=secret_paths(home, uid, backend.deny, caller_env.get("SSH_AUTH_SOCK")),
        protected=protected + own_paths(caller_env),
        extra_binds=extra_binds,
        git_mounts=git_mounts,
        fs=fs,
        # Box-private tmpfs (/tmp, /var/tmp, /run, $HOME) is memory: cap each at a quarter of the limit.
        tmpfs_size=profile.memory // 4,
    )
    notes += fsplan.notes
    if git is not None and run_dir:
        # A missing objects/info/alternates reads as empty in the box, not as EACCES.
        redirects = {os.path.join(d.host, r) for d in git.dirs if d.kind == "common" for r in OBJECT_REDIRECTS}
        fsplan = replace(fsplan, mounts=tuple(
            Mount("ro-bind", m.dst, os.path.join(run_dir, EMPTY)) if m.kind == "mask-file" and m.dst in redirects else m
            for m in fsplan.mounts))
    # What the git plan binds read-only is protected too (reported with the rest).
    fsplan = replace(fsplan, protected=tuple(dict.fromkeys(
        fsplan.protected + tuple(m.dst for m in fsplan.mounts if m.kind == "ro-bind" and m in git_mounts))))
    # Placeholders would show up in the agent's `git status`; a box-only excludes file hides them.
    git_excludes = tuple(sorted("/" + os.path.relpath(p, workdir) for p in fsplan.placeholders
                                if p.startswith(workdir.rstrip("/") + "/")))
    if git_excludes and run_dir and tier in ("supervised", "container"):
        fsplan = replace(fsplan, mounts=fsplan.mounts + (
            Mount("ro-bind", BOX_GIT_EXCLUDES, os.path.join(run_dir, "git-excludes")),))
    else:
        git_excludes = ()

    egress: tuple[str, ...] = ()
    proxy_listen = None
    if profile.network:
        rules = tuple(parse_rule(e) for e in backend.egress) + extra_rules
        egress = tuple(dict.fromkeys(r.render() for r in rules))
        proxy_listen = PROXY_LISTEN
    elif extra_rules:
        raise RefusedError(
            f"profile {profile.name!r} has no network, so --allow-host cannot be honoured; "
            "fix: use --profile agent, or drop --allow-host"
        )

    env_set: dict[str, str] = {"HOME": home, "TMPDIR": "/tmp", "HIVE_RELAY": "1", "HIVE_RELAY_BACKEND": backend.name}
    env_pass = _env_names(profile, backend, caller_env)
    if tier == "container":
        caller_path = caller_env.get("PATH") if "PATH" in env_pass else None
        env_set["PATH"] = container_argv.IMAGE_PATH + (f":{caller_path}" if caller_path else "")
        env_pass = tuple(n for n in env_pass if n != "PATH")
    elif "PATH" in env_pass:
        env_set["PATH"] = box_path
        env_pass = tuple(n for n in env_pass if n != "PATH")
    else:
        env_set["PATH"] = SAFE_PATH
    if profile.backend_home:
        env_set.update(dict(backend.env_set))
    if git_excludes:
        env_set.update(GIT_CONFIG_COUNT="1", GIT_CONFIG_KEY_0="core.excludesFile", GIT_CONFIG_VALUE_0=BOX_GIT_EXCLUDES)
    if proxy_listen:
        env_set.update(proxy_env(proxy_listen))
    env_pass = tuple(n for n in env_pass if n not in env_set)

    limits = Limits(profile.memory, profile.pids, _limit_method(facts))
    seccomp = policy_for(nested_userns=backend.nested_userns, deny_network=tier == "process")
    box_uid = BOX_UID_FOR_ROOT if uid == 0 else None
    interactive = request.prompt is None
    timeout = None if interactive else (request.timeout or DEFAULT_TIMEOUT)
    if interactive and request.timeout:
        notes.append("--timeout applies to --prompt runs only; interactive sessions have no wall-clock kill")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    log_path = os.path.join(state_dir(caller_env), "logs", f"{stamp}-{backend.name}-{request.run_id or 'dry'}.jsonl")

    fs_rules: tuple[tuple[str, str], ...] = ()
    container: _ContainerChoice | None = None
    if tier == "process":
        if run_dir is None:
            raise UsageError("internal: the process tier needs a run id")
        command = list(argv)
        env_set["TMPDIR"] = os.path.join(run_dir, "tmp")
        rw = [workdir, env_set["TMPDIR"], "/dev/null", "/dev/zero", "/dev/full", "/dev/tty", "/dev/pts", "/dev/ptmx"]
        from .landlock import read_roots

        ro = read_roots(home) + ["/dev/urandom", "/dev/random"] + [g.path for g in grants if not g.writable]
        rw += [g.path for g in grants if g.writable]
        fs_rules = tuple((p, "ro") for p in ro) + tuple((p, "rw") for p in rw)
        fsplan = replace(fsplan, mounts=(), placeholders=(), protected=())
        if proxy_listen:
            raise RefusedError("the process tier cannot enforce egress; internal error in profile choice")
    elif tier == "container":
        container = _container_run(backend, matrix, request, facts, caller_env, limits, run_dir)
        limits = replace(limits, method=container.limit_method)
        if container.run.ctl_dir:
            env_set["HIVE_RELAY_GO"] = f"{container_argv.CTL_DIR}/go"
        command = container_argv.build(
            run=container.run, backend=backend.name, workdir=workdir, home=home, mounts=fsplan.mounts,
            env_set=env_set, env_pass=env_pass, interactive=interactive, tty=facts.tty, argv=argv,
        )
    else:
        command = bwrap_argv.build(
            bwrap=facts.bwrap or "bwrap",
            mounts=fsplan.mounts,
            workdir=workdir,
            box_uid=box_uid,
            seccomp_fd=SECCOMP_FD,
            info_fd=INFO_FD,
            block_fd=BLOCK_FD,
        ) + argv

    policy = {
        "tier": tier, "grants": [asdict(g) for g in grants], "sync": sync, "guard": guarded, "denied": fsplan.denied,
        "protected": fsplan.protected, "egress": egress, "env": sorted(env_pass), "limits": asdict(limits),
        "seccomp": seccomp.summary(), "fs_rules": fs_rules,
    }
    return Plan(
        backend=backend.name,
        mode=request.mode,
        tier=tier,
        profile=profile.name,
        profile_digest=_digest(policy),
        workdir=workdir,
        interactive=interactive,
        timeout=timeout,
        argv=tuple(argv),
        command=tuple(command),
        env_set=tuple(sorted(env_set.items())),
        env_pass=env_pass,
        mounts=fsplan.mounts,
        denied=fsplan.denied,
        protected=fsplan.protected,
        placeholders=fsplan.placeholders,
        egress=egress,
        proxy_listen=proxy_listen,
        limits=limits,
        seccomp=tuple(seccomp.summary()),
        seccomp_policy=seccomp,
        fs_rules=fs_rules,
        box_uid=box_uid,
        sync_files=tuple(sync) if tier != "process" else (),
        guarded_files=tuple(guarded),
        git_excludes=git_excludes,
        log_path=log_path if proxy_listen else None,
        run_dir=run_dir,
        container=container.run if container else None,
        git=git if tier in ("supervised", "container") else None,
        notes=tuple(notes),
    )


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
        backend=backend.name, mode=request.mode, tier="unsandboxed", profile="none",
        profile_digest=_digest({"unsandboxed": backend.name, "argv": argv}), workdir=workdir,
        interactive=interactive, timeout=None if interactive else (request.timeout or DEFAULT_TIMEOUT),
        argv=tuple(argv), command=tuple(argv), env_set=(), env_pass=tuple(sorted(caller_env)), mounts=(),
        denied=(), protected=(), placeholders=(), egress=(), proxy_listen=None,
        limits=Limits(0, 0, "none"), seccomp=(), box_uid=None, sync_files=(), log_path=None, run_dir=None,
        unsandboxed=True, notes=tuple(notes),
    )


@dataclass(frozen=True)
class _ContainerChoice:
    run: ContainerRun
    limit_method: str


def choose_engine(facts: HostFacts, caller_env: dict[str, str]) -> str:
    """podman first (rootless, daemonless), docker otherwise; $HIVE_RELAY_ENGINE picks one."""
    wanted = caller_env.get("HIVE_RELAY_ENGINE")
    if wanted:
        path = {"podman": facts.podman, "docker": facts.docker}.get(wanted) if "/" not in wanted else wanted
        if not path:
            raise RefusedError(f"HIVE_RELAY_ENGINE={wanted}: not installed; fix: install it or unset HIVE_RELAY_ENGINE")
        return path
    if facts.podman:
        return facts.podman
    if facts.docker:
        return facts.docker
    raise RefusedError("container mode needs podman or docker; fix: apt-get install podman (or use local mode)")


def _container_run(backend: Backend, matrix: Matrix, request: Request, facts: HostFacts, caller_env: dict[str, str],
                   limits: Limits, run_dir: str | None) -> _ContainerChoice:
    import resource

    from .image import spec_from_env

    engine = choose_engine(facts, caller_env)
    kind = container_argv.engine_kind(engine)
    rootless = kind == "podman" and facts.uid != 0
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 20)
    flags, method = container_argv.limit_flags(kind, rootless, facts.cgroup, limits, nofile)
    spec = spec_from_env(matrix.backends, facts.uid, facts.gid, caller_env)
    run = ContainerRun(
        engine=engine, kind=kind, rootless=rootless, name=f"hive-relay-{request.run_id or 'dry-run'}",
        image=spec.tag, user="0:0" if facts.uid == 0 else f"{facts.uid}:{facts.gid}",
        pidfile=os.path.join(run_dir, "pid") if run_dir and kind == "podman" else None,
        ctl_dir=os.path.join(run_dir, "ctl") if run_dir else None,
        seccomp_profile=os.path.join(run_dir, "seccomp.json") if run_dir else None,
        limit_flags=flags,
    )
    return _ContainerChoice(run, method)


def _limit_method(facts: HostFacts) -> str:
    if facts.cgroup == "v2":
        return "cgroup-v2"
    if facts.cgroup == "v1":
        return "cgroup-v1"
    return "rlimit"
