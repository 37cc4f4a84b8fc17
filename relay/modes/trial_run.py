"""Enforceability is tested, not assumed: run the exact resolved plan once with `true` as the
agent, and memoize success per policy so later launches pay nothing.

A plan that fails here would fail (or worse, half-work) for the agent, so the launcher either
falls back to the fail-closed default profile (when the user named no profile) or refuses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from relay.box.stdio_redirect import redirected
from relay.host import safefs
from relay.host.paths import cache_dir
from relay.model.hashing import sha256
from relay.model.record import replace
from relay.model.vocab import Tier
from relay.plan.resolve import Plan

MEMO_LIMIT = 200
TRUE = "/bin/true" if os.path.exists("/bin/true") else "/usr/bin/true"


def policy_key(plan: Plan) -> str:
    """Everything that decides whether the box can start, minus what is unique to one run."""
    run_id = os.path.basename(plan.run_dir or "")
    command = [c.replace(run_id, "RUN") if run_id else c for c in plan.command[: len(plan.command) - len(plan.argv)]]
    data = [plan.tier, command, plan.limits.memory, plan.limits.pids, plan.limits.method, sorted(plan.fs_rules),
            list(plan.seccomp)] + (["staged"] if plan.staged else [])
    if plan.gvisor is not None:  # its mounts are in its spec, not its command line: they decide as much
        data.append([[m.kind, m.dst, (m.src or "").replace(run_id, "RUN") if run_id else m.src] for m in plan.mounts])
    return sha256(json.dumps(data).encode()).hexdigest()[:24]


def _memo_path(env: Mapping[str, str]) -> Path:
    return cache_dir(env) / "verified.json"


def _load(env: Mapping[str, str]) -> list[str]:
    """Verified policy keys. The cache dir is read-only in every box (paths.own_paths), and the file
    is read with no link followed and bounded; a bad memo only costs a verification run."""
    try:
        data = json.loads(safefs.read_owned_file(str(_memo_path(env)), 64 << 10) or b"[]")
        return [k for k in data if isinstance(k, str)] if isinstance(data, list) else []
    except (OSError, ValueError):
        return []


def _store(env: Mapping[str, str], key: str) -> None:
    keys = [k for k in _load(env) if k != key] + [key]
    path = _memo_path(env)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        safefs.write_file(str(path), json.dumps(keys[-MEMO_LIMIT:]).encode(), 0o600)
    except OSError:
        pass


def _moved(path: str | None, old: str, new: str) -> str | None:
    return new + path[len(old):] if path and (path == old or path.startswith(old + "/")) else path


def verify(plan: Plan, env: Mapping[str, str]) -> str | None:
    """None when the plan's box starts here (memoized); otherwise the reason it does not."""
    if plan.unsandboxed or plan.tier in (Tier.CONTAINER, Tier.VM):
        # The vm tier: a trial boot costs as much as the run (tens of seconds under TCG), and the guest
        # init fails closed itself: a mount it cannot make ends the guest with 70 before the command.
        return None
    key = policy_key(plan)
    if key in _load(env):
        return None
    from relay.modes.runner import run

    run_dir = (plan.run_dir + "-verify") if plan.run_dir else None
    head = plan.command[: len(plan.command) - len(plan.argv)]
    if plan.run_dir and run_dir:
        head = tuple(c.replace(plan.run_dir, run_dir) for c in head)
    probe_plan = replace(
        plan,
        argv=(TRUE,),
        command=head + (TRUE,),
        interactive=False,
        timeout=30,
        log_path=None,
        notes=(),
        run_dir=run_dir,
        run_id=(plan.run_id + "-verify") if plan.run_id else "",  # its own cgroup, logs and layer name
        # The gvisor tier's mounts are in its spec, not its command line: moved to the probe's run dir too.
        gvisor=plan.gvisor.moved(plan.run_dir, run_dir) if plan.gvisor and plan.run_dir and run_dir else plan.gvisor,
        mounts=tuple(replace(m, src=_moved(m.src, plan.run_dir, run_dir)) for m in plan.mounts)
        if plan.gvisor and plan.run_dir and run_dir else plan.mounts,
        credentials=(),  # `true` sends nothing: a grant's host command runs for the real run only
        shared_live=True,  # `true` writes nothing; the launcher holds the live lock across this probe
        # --staged: the probe mounts a layer of its own (the overlay is part of what must start), dropped after
        staged=replace(plan.staged, run=plan.staged.run + "-verify", root=plan.staged.root + "-verify")
        if plan.staged else None,
    )
    import tempfile  # only when a policy is verified (once per policy)

    with tempfile.TemporaryFile() as err, open(os.devnull, "wb") as devnull:
        try:
            with redirected({1: devnull.fileno(), 2: err.fileno()}):
                code = run(probe_plan, env, quiet=True)
        except Exception as exc:  # noqa: BLE001 - any failure means "not enforceable"
            code, reason = -1, str(exc)
        else:
            reason = ""
        if probe_plan.staged is not None:
            from relay.trust.staged import remove_layer

            try:
                remove_layer(probe_plan.staged.root)
            except OSError:
                pass
        err.seek(0)
        lines = [ln for ln in err.read().decode(errors="replace").splitlines() if ln.strip()]
    if code == 0:
        _store(env, key)
        return None
    return reason or (lines[-1] if lines else f"the box exited {code}")
