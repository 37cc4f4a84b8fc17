"""`invoke selftest`: real escape probes inside a real box, per backend, as a pass/fail table.

It runs each backend's own resolved plan (same profile, grants, deny list and egress) with the
agent replaced by `boxprobes.py`, in a throwaway workdir, against a local upstream that is
pinned into the allowlist. Any probe showing the box weaker than its plan claims fails the run.
"""

from __future__ import annotations

import http.server
import json
import os
import secrets
import shutil
import socketserver
import stat
import sys
import tempfile
import threading
from pathlib import Path

from relay.box.stdio_redirect import redirected
from relay.config.load import get_backend, load_matrix
from relay.host import safefs
from relay.host.fs_view import HostFs
from relay.host.liveness import new_run_id
from relay.host.paths import cache_dir
from relay.host.probe import probe
from relay.model.errors import RefusedError, RelayError, UsageError
from relay.model.record import record
from relay.modes.image_tag import with_image
from relay.modes.runner import run
from relay.plan.resolve import PROXY_LISTEN, Plan, Request, resolve
from relay.policy.denylist import expand

PROBES = Path(__file__).resolve().parents[1] / "box" / "escape_probes.py"
ALLOWED_NAME = "selftest.hive-relay.test"


@record(frozen=False)
class Row:
    """One escape probe's result in one tier and profile: the table row selftest prints and --json gives."""

    backend: str
    tier: str
    profile: str
    probe: str
    kind: str
    ok: bool
    detail: str


class _Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def _upstream() -> tuple[socketserver.TCPServer, int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Quiet)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, server.server_address[1]


@record(frozen=False)
class PlantedKey:
    """A fake private key in the host's ~/.ssh for the "read ~/.ssh" probe to attack (the dir is made,
    0700, when the user has none, and removed again with the key). Reached with no link followed."""

    home: str
    name: str
    made_dir: bool

    def remove(self) -> None:
        try:
            with safefs.base_dir(self.home) as hfd:
                safefs.unlink_beneath(hfd, f".ssh/{self.name}", only_if=lambda st: stat.S_ISREG(st.st_mode))
                if self.made_dir:
                    safefs.unlink_beneath(hfd, ".ssh", only_if=lambda st: stat.S_ISDIR(st.st_mode))
        except OSError:
            pass


def plant_ssh_key(home: str) -> PlantedKey:
    name = f"id_hive_relay_selftest_{secrets.token_hex(6)}"  # clean.SELFTEST_KEY_PREFIX
    with safefs.base_dir(home) as hfd:
        try:
            os.mkdir(".ssh", 0o700, dir_fd=hfd)
            made = True
        except FileExistsError:
            made = False
        sfd = safefs.open_beneath(hfd, ".ssh", os.O_RDONLY | os.O_DIRECTORY)
        try:
            safefs.create_new(sfd, name, b"-----BEGIN OPENSSH PRIVATE KEY-----\nhive relay selftest: must not be "
                                         b"readable in a box\n-----END OPENSSH PRIVATE KEY-----\n", 0o600)
        except BaseException:
            os.close(sfd)
            if made:
                os.rmdir(".ssh", dir_fd=hfd)
            raise
        os.close(sfd)
    return PlantedKey(home, name, made)


def _plan(backend: str, env: dict[str, str], workdir: str, port: int, facts, matrix,  # noqa: ANN001
          mode: str = "local", planted: str | None = None, isolation: str | None = None,
          vm_accel: str | None = None) -> Plan:
    b = get_backend(matrix, backend)
    # The vm tier shares the workdir as it is (it cannot stage yet): a scratch workdir, so live is harmless.
    vm = {"vm_accel": vm_accel, "live": True} if isolation == "vm" else {}
    base = Request(backend=backend, mode=mode, prompt="selftest", workdir=workdir, run_id=new_run_id(),
                   argv_override=("true",), isolation=isolation, **vm)
    facts = with_image(facts, matrix, base, env)
    first = resolve(b, matrix, base, facts, env, fs=HostFs())
    allow = (f"{ALLOWED_NAME}:{port}=127.0.0.1:{port}",) if first.proxy_listen else ()
    grants = [expand(p, facts.home, facts.uid) for p in b.home_rw + b.home_ro] if first.profile != "default" else []
    grants = [g for g in grants if os.path.exists(g)]
    probe_args = [f"launcher={os.getpid()}", f"grants={','.join(grants)}"]
    if planted:
        probe_args.append(f"planted={planted}")
    if isolation == "vm":
        probe_args.append("tier=vm")
    if first.proxy_listen:
        probe_args += [f"proxy={PROXY_LISTEN}", f"allowed={ALLOWED_NAME}:{port}", "denied=example.com:443"]
    # Container mode's image, and the vm tier's root (the same image), have their own python3.
    python = "/usr/bin/python3" if mode == "container" or isolation == "vm" else (facts.box_python or "/usr/bin/python3")
    argv = (python, "-I", "-S", "-c", PROBES.read_text(), *probe_args)
    request = Request(backend=backend, mode=mode, prompt="selftest", workdir=workdir, run_id=new_run_id(),
                      allow_hosts=allow, argv_override=argv, isolation=isolation, **vm)
    return resolve(b, matrix, request, facts, env, fs=HostFs())


def run_backend(backend: str, env: dict[str, str], port: int, facts, matrix,  # noqa: ANN001
                mode: str = "local", isolation: str | None = None, vm_accel: str | None = None) -> list[Row]:
    # Beside the cache dir (not /tmp) so that the workdir's parent is a real host directory; not in
    # it, since hive relay's own dirs are never a workdir.
    try:
        planted = plant_ssh_key(env.get("HOME", "/"))
    except OSError as err:
        return [Row(backend, "-", "-", "read ~/.ssh", "attack", False,
                    f"could not plant a key in ~/.ssh to attack: {err.strerror or err}")]
    base = Path(cache_dir(env)).parent / "hive-relay-selftest"
    rows: list[Row] = []
    errors: list[str] = []
    scratch = None
    try:
        base.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix="selftest-", dir=base)
        workdir = os.path.join(scratch, "work")
        os.mkdir(workdir)
        plan = _plan(backend, env, workdir, port, facts, matrix, mode, planted.name, isolation, vm_accel)
        if plan.container is not None:
            from relay.modes.image import ensure_ready

            ensure_ready(plan.container, matrix, env)
        if plan.unsandboxed:
            return [Row(backend, plan.tier, plan.profile, "box enforced", "attack", False, "runs unsandboxed (opt-in)")]
        # The box's own stderr and the runner's notes and exit summary (the probes' refused connection,
        # for one) are captured too: the table is all selftest prints.
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            with redirected({1: out.fileno(), 2: err.fileno()}):
                code = run(plan, env, quiet=True)
            out.seek(0)
            lines = out.read().decode(errors="replace").splitlines()
            err.seek(0)
            errors = [ln for ln in err.read().decode(errors="replace").splitlines() if ln.strip()]
        for line in lines:
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if data["kind"] == "attack-host":
                # The box reported where its writes succeeded; only the host can say if any arrived.
                arrived = [p for p in data["detail"].split(",") if p and os.path.exists(p)]
                for path in arrived:
                    os.unlink(path)
                detail = f"reached the host: {arrived}" if arrived else "nothing reached the host"
                rows.append(Row(backend, plan.tier, plan.profile, data["probe"], "attack", not arrived, detail))
                continue
            rows.append(Row(backend, plan.tier, plan.profile, data["probe"], data["kind"], data["ok"], data["detail"]))
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        planted.remove()
    if not rows:
        why = f": {errors[-1]}" if errors else ""
        rows.append(Row(backend, plan.tier, plan.profile, "probes ran", "legit", False,
                        f"box exited {code} with no output{why}"))
    return rows


def selftest(backends: list[str] | None = None, as_json: bool = False, mode: str = "local",
             isolation: str | None = None, vm_accel: str | None = None) -> int:
    """`isolation`: the local tier to probe (gvisor: the same probes in the runsc box, with the same
    expected results; vm: the same probes in the guest, where AF_UNIX and TIOCSTI are the guest
    kernel's own, so their attacks are "reaches a host socket" and "injects into the caller's
    terminal"; an explicit tier that cannot run here refuses, exit 3, as a launch would)."""
    env = dict(os.environ)
    if mode not in ("local", "container"):
        raise UsageError(f"unknown mode {mode!r}; choose one of: local, container")
    if isolation not in (None, "supervised", "gvisor", "vm"):
        raise UsageError(f"selftest --isolation {isolation}: choose supervised, gvisor or vm")
    if vm_accel is not None and isolation != "vm":
        raise UsageError("selftest --vm-accel applies to --isolation vm only; fix: add --isolation vm")
    matrix = load_matrix(env, workdir=None)
    facts = probe(env)
    if isolation == "gvisor":
        from relay.host import runsc_host
        from relay.model.record import replace

        facts = replace(facts, **runsc_host.facts(env))
    if isolation == "vm":
        from relay.host import vm_host
        from relay.model.record import replace
        from relay.modes.image_tag import spec_from_env
        from relay.policy.tiers import VM_ACCELS

        vm_accel = vm_accel or matrix.vm_accel
        if vm_accel is not None and vm_accel not in VM_ACCELS:
            raise UsageError(f"selftest --vm-accel {vm_accel!r}: choose one of {', '.join(VM_ACCELS)}")
        error = vm_host.vm_error(env, vm_accel or "kvm")
        if error:
            raise RefusedError(f"--isolation vm cannot be enforced: {error}")
        facts = replace(facts, vm_error=None, vm_qemu=vm_host.qemu_path(env), vm_kernel=vm_host.guest_kernel(env),
                        image=spec_from_env(matrix.backends, facts.uid, facts.gid, env).tag)
    names = backends or sorted(matrix.backends)
    for name in names:
        get_backend(matrix, name)
    server, port = _upstream()
    rows: list[Row] = []
    try:
        for name in names:
            try:
                rows += run_backend(name, env, port, facts, matrix, mode, isolation, vm_accel)
            except RelayError as err:
                rows.append(Row(name, "-", "-", "box starts", "legit", False, err.message))
    finally:
        server.shutdown()
    failed = [r for r in rows if not r.ok]
    if as_json:
        print(json.dumps([r.__dict__ for r in rows], indent=2))
    else:
        print(f"{'backend':<9} {'tier':<11} {'profile':<8} {'probe':<34} {'kind':<7} result  detail")
        for r in rows:
            print(f"{r.backend:<9} {r.tier:<11} {r.profile:<8} {r.probe:<34} {r.kind:<7} {'PASS' if r.ok else 'FAIL'}    {r.detail}")
        attacks = [r for r in rows if r.kind == "attack"]
        legit = [r for r in rows if r.kind == "legit"]
        print(f"\n{sum(r.ok for r in attacks)}/{len(attacks)} attacks refused, "
              f"{sum(r.ok for r in legit)}/{len(legit)} legitimate uses working")
    sys.stdout.flush()
    return 1 if failed else 0
