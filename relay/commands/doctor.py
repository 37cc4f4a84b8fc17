"""`invoke doctor`: one line per host component, then what is enforceable and how to fix the rest."""

from __future__ import annotations

import json
import os
import shutil

from relay.config.load import load_shipped
from relay.host.container_engine import EngineInfo, info
from relay.host.paths import tool_dir
from relay.host.probe import probe
from relay.model.errors import RelayError
from relay.model.host_facts import HostFacts
from relay.model.record import record, replace
from relay.model.refusal import ENTRY
from relay.render.container_argv import uses_rlimits


def with_fix(detail: str, fix: str) -> str:
    """A MISS detail always ends with its fix (some probe errors carry one already)."""
    return detail if "fix:" in detail else f"{detail}; fix: {fix}"


def components(facts: HostFacts, env: dict[str, str], survey: EngineSurvey) -> list[tuple[str, bool, str]]:
    """(component, ok, detail or fix) rows."""
    rows: list[tuple[str, bool, str]] = []
    rows.append(("bubblewrap", facts.bwrap is not None,
                 f"{facts.bwrap} {facts.bwrap_version or ''}".strip() if facts.bwrap else "missing; fix: apt-get install bubblewrap"))
    rows.append(("user namespaces", facts.bwrap_ok,
                 "a real box started" if facts.bwrap_ok else with_fix(
                     facts.bwrap_error or "no box was started (bubblewrap is missing)",
                     "apt-get install bubblewrap" if facts.bwrap is None else
                     "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0" if facts.userns_restricted else
                     "sysctl -w user.max_user_namespaces=15000 (and kernel.unprivileged_userns_clone=1 where it "
                     "exists)")))
    rows.append(("apparmor userns restriction", not facts.userns_restricted,
                 "not restricted" if not facts.userns_restricted else "restricted; fix: sysctl -w kernel.apparmor_restrict_unprivileged_userns=0"))
    rows.append(("seccomp", facts.seccomp, "libseccomp loaded" if facts.seccomp else with_fix(
        facts.seccomp_error or "libseccomp is missing",
        "apt-get install libseccomp2, then pip install -r requirements.txt in the venv (pyseccomp)")))
    rows.append(("landlock", facts.landlock_abi > 0,
                 f"ABI {facts.landlock_abi}" if facts.landlock_abi else with_fix(
                     "unavailable (only the process tier uses it)",
                     "boot a kernel 5.13+ with landlock in the lsm= list (e.g. lsm=landlock,lockdown,yama,apparmor)")))
    rows.append(("cgroup limits", facts.cgroup is not None,
                 f"cgroup {facts.cgroup} writable" if facts.cgroup else with_fix(
                     "no writable cgroup; rlimits are used instead",
                     "run as root, or on a cgroup v2 host with a delegated subtree (systemd-run --user --scope)")))
    rows.append(("tty injection sysctl", True,
                 {True: "legacy_tiocsti=1: TIOCSTI is live, seccomp blocks it in the box",
                  False: "legacy_tiocsti=0: the kernel blocks TIOCSTI", None: "unknown"}[facts.legacy_tiocsti]))
    rows.append(("selftest python", facts.box_python is not None,
                 facts.box_python or f"no python3 outside $HOME (only `{ENTRY} selftest` needs one); fix: apt-get install python3"))
    rows += engine_rows(facts, survey)
    from relay.host import vm_host

    rows += vm_host.rows(env)
    from relay.host import runsc_host

    rows += runsc_host.rows({k: getattr(facts, k) for k in ("runsc", "runsc_version", "runsc_platform", "runsc_error",
                                                              "gvisor_init", "gvisor_init_note")})
    rows.append(vm_image_row(facts, env))
    path = f"{tool_dir(env)}/node_modules/.bin:{env.get('PATH', '')}"
    for name, backend in sorted(load_shipped().items()):
        if backend.install_bin:
            found = shutil.which(backend.install_bin, path=path)
            rows.append((f"cli {name}", found is not None,
                         found or f"not installed; fix: npm install --prefix {tool_dir(env)} {backend.install_npm}"))
    return rows


def vm_image_row(facts: HostFacts, env: dict[str, str]) -> tuple[str, bool, str]:
    """The guest's root comes from container mode's content-addressed image (the same tag)."""
    from relay.modes.image_tag import spec_from_env

    try:
        tag = spec_from_env(load_shipped(), facts.uid, facts.gid, env).tag
    except (OSError, RelayError) as err:
        return ("vm: root image", False, f"cannot name the image: {err}")
    return ("vm: root image", True, f"{tag} (container mode's image; `{ENTRY} build-image` builds it)")


@record
class EngineSurvey:
    """Each installed engine asked once (`info` costs ~450 ms), and the one container mode would use."""

    chosen: str | None
    refusal: str | None
    infos: dict[str, EngineInfo]


def survey_engines(facts: HostFacts, env: dict[str, str]) -> EngineSurvey:
    from relay.policy.tiers import choose_engine

    try:
        chosen, refusal = choose_engine(facts, env), None
    except RelayError as err:
        chosen, refusal = None, err.message
    return EngineSurvey(chosen, refusal, {p: info(p) for p in (facts.podman, facts.docker) if p})


def engine_rows(facts: HostFacts, survey: EngineSurvey) -> list[tuple[str, bool, str]]:
    """podman and docker: whether each answers, and whether it runs rootless."""
    rows: list[tuple[str, bool, str]] = []
    chosen = survey.chosen
    for name, path, fix in (("podman", facts.podman, "apt-get install podman (container mode)"),
                            ("docker", facts.docker, "apt-get install podman (preferred), or docker")):
        if path is None:
            other = facts.podman if name == "docker" else None
            rows.append((name, other is not None, "missing; podman is used instead" if other else
                         f"missing; fix: {fix}"))
            continue
        found = survey.infos[path]
        if found.error:
            # Never ok: an engine that does not answer is broken, even when container mode uses the other.
            unused = "" if path == chosen else f"; container mode uses {chosen} instead" if chosen else ""
            daemon = "start its daemon (systemctl start docker)" if found.kind == "docker" else \
                f"`{path} info` shows why"
            engine_fix = (f"{daemon}, or uninstall it: container mode does not need it" if path != chosen else
                          f"{daemon}; or apt-get install podman (it needs no daemon)")
            rows.append((name, False, f"{path}: {found.error}{unused}; fix: {engine_fix}"))
            continue
        detail = (f"{path} {found.version or ''}: {'rootless' if found.rootless else 'rootful'}, "
                  f"storage {found.storage_driver}{'; used for container mode' if path == chosen else ''}")
        rows.append((name, True, "; ".join([detail, *found.notes()])))
    return rows


def enforceable(facts: HostFacts, survey: EngineSurvey) -> dict[str, str]:
    """Which tier/profile pairs this host can enforce, each with the fix when it cannot."""
    from relay.policy.tiers import auto_pick, gvisor_error, missing_supervised, process_error, supervised_ok

    supervised = "enforceable" if supervised_ok(facts) else f"NOT enforceable: {missing_supervised(facts)}"
    process = "enforceable" if process_error(facts) is None else f"NOT enforceable: {process_error(facts)}"
    return {
        "supervised/agent": supervised,
        "supervised/default": supervised,
        "process/default": process,
        "process/agent": "never: the process tier cannot enforce egress",
        "container": _container_state(facts, survey),
        "gvisor": (f"enforceable with runsc ({facts.runsc_platform}{', rootless' if facts.uid else ''}), only when "
                   "asked: --isolation gvisor" if gvisor_error(facts) is None else f"NOT enforceable: {gvisor_error(facts)}"),
        "vm": (f"NOT enforceable: {facts.vm_error}" if facts.vm_error
               else "enforceable with KVM, only when asked: --isolation vm"),
        "auto pick": auto_pick(facts),
    }


def _container_state(facts: HostFacts, survey: EngineSurvey) -> str:
    if survey.chosen is None:
        return f"NOT enforceable: {survey.refusal}"
    found = survey.infos[survey.chosen]
    if found.error:
        return f"NOT enforceable: {found.error}"
    limits = ("rlimits (rootless podman on cgroup v1)" if uses_rlimits(found.kind, found.rootless, facts.cgroup)
              else f"cgroup limits ({found.kind})")
    return f"enforceable with {found.kind} ({'rootless' if found.rootless else 'rootful'}), {limits}"


def doctor(as_json: bool = False, mode: str | None = None, isolation: str | None = None) -> int:
    """`isolation`: kube mode's canary with `gvisor` also proves the cluster runs the boxes on gVisor."""
    if mode == "kube":
        from relay.commands.guarded import guarded
        from relay.modes.kube_run import kube_doctor

        return guarded(kube_doctor, dict(os.environ), isolation=isolation)
    if isolation not in (None, ""):
        from relay.commands.guarded import guarded
        from relay.model.errors import UsageError

        def bad_isolation() -> int:
            raise UsageError(f"doctor --isolation {isolation}: only with --mode kube (gvisor); local and container "
                             "doctor report every tier")
        return guarded(bad_isolation)
    if mode not in (None, "", "local", "container"):
        from relay.commands.guarded import guarded
        from relay.model.errors import UsageError

        def bad() -> int:
            raise UsageError(f"doctor --mode {mode}: choose local, container or kube")
        return guarded(bad)
    env = dict(os.environ)
    from relay.host import runsc_host, vm_host

    facts = replace(probe(env), vm_error=vm_host.vm_error(env), **runsc_host.facts(env, build_init=False))
    from relay.host.engine_query import untouched

    with untouched(env):  # no pause process, no ~/.config/cni or storage dirs left by asking podman
        survey = survey_engines(facts, env)
    rows = components(facts, env, survey)
    tiers = enforceable(facts, survey)
    tcg = vm_host.vm_error(env, "tcg")  # the VM tier emulated: no /dev/kvm needed, only asked for by name
    tiers["vm/tcg"] = (f"NOT enforceable: {tcg}" if tcg else "enforceable emulated (qemu TCG: the same boundary, "
                       "tens of seconds a boot), only when asked: --isolation vm --vm-accel tcg")
    if as_json:
        print(json.dumps({
            "components": [{"name": n, "ok": ok, "detail": d} for n, ok, d in rows],
            "enforceable": tiers,
            "facts": facts.to_json(),
        }, indent=2))
    else:
        width = max(len(n) for n, _, _ in rows)
        for name, ok, detail in rows:
            print(f"{'ok  ' if ok else 'MISS'} {name:<{width}}  {detail}")
        print()
        for tier, state in tiers.items():
            print(f"{tier:<20} {state}")
    return 0
