"""The relay's own entry (`python -m relay`), shared by tasks.py: request in, exit code out.

tasks.py (invoke) and this module both call `contribute()`, so the two surfaces cannot drift.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace

from .banner import emit, note_lines
from .config import get_backend, load_matrix
from .errors import RefusedError, RelayError, UsageError
from .plan import Request, resolve
from .probe import probe


def new_run_id() -> str:
    return f"{os.getpid()}-{os.urandom(4).hex()}"


def contribute(
    request: Request,
    *,
    dry_run: bool = False,
    as_json: bool = False,
    quiet: bool = False,
    env: Mapping[str, str] | None = None,
) -> int:
    """Resolve the request into a plan, then print it (dry run) or run it. Raises RelayError."""
    env = dict(os.environ if env is None else env)
    from .runner import mark

    mark("cli")
    if not os.path.isdir(request.workdir):
        raise UsageError(f"--workdir {request.workdir}: not an existing directory; fix: create it or pass another")
    from pathlib import Path

    matrix = load_matrix(env, workdir=Path(os.path.realpath(request.workdir)))
    mark("config_loaded")
    backend = get_backend(matrix, request.backend)
    if not dry_run and request.argv_override is None and request.mode == "local":
        from .install import ensure_cli

        template = backend.prompt_command if request.prompt is not None else backend.command
        ensure_cli(backend, env, template[0])
    facts = probe(env)
    mark("probed")
    plan = resolve(backend, matrix, request, facts, env)
    mark("resolved")
    if dry_run:
        if as_json:
            print(json.dumps(plan.to_json(), indent=2))
        else:
            print(render_plan(plan))
        return 0
    from .runner import run

    if plan.container is not None:
        from .engine import ensure_ready

        ensure_ready(plan.container, matrix, env)
        return run(plan, env, quiet=quiet)
    from .verify import verify

    problem = verify(plan, env)
    mark("verified")
    if problem and request.profile is None and plan.profile != "default":
        fallback = resolve(backend, matrix, replace(request, profile="default"), facts, env)
        plan = replace(fallback, notes=fallback.notes + (
            f"the {plan.profile} profile failed its probe here ({problem}); using the fail-closed default profile",))
        problem = verify(plan, env)
    if problem:
        raise RefusedError(f"the {plan.tier} box with profile {plan.profile} cannot start here: {problem}")
    return run(plan, env, quiet=quiet)


def build_image(*, base: str | None = None, rebuild: bool = False, base_only: bool = False,
                save_base: str | None = None, base_archive: str | None = None,
                env: Mapping[str, str] | None = None) -> int:
    """`invoke build-image`: the container-mode image for this user, built once and cached by content."""
    from . import image
    from .engine import info
    from .plan import choose_engine

    env = dict(os.environ if env is None else env)
    if base:
        env["HIVE_RELAY_BASE_IMAGE"] = base
    if base_archive:
        if not os.path.isfile(base_archive):
            raise UsageError(f"--base-archive {base_archive}: no such file; fix: make it with --save-base FILE")
        env["HIVE_RELAY_BASE_ARCHIVE"] = os.path.abspath(base_archive)
    engine = choose_engine(probe(env), env)
    found = info(engine)
    if found.error:
        raise RefusedError(f"cannot build the image: {found.error}; fix: `invoke doctor` shows the engine's state")
    image.say(f"engine: {found.kind} {found.version or ''} ({'rootless' if found.rootless else 'rootful'})")
    for line in found.notes():
        image.say(f"note: {line}")
    matrix = load_matrix(env, workdir=None)
    spec = image.spec_from_env(matrix.backends, os.getuid(), os.getgid(), env)
    image.ensure_base([engine], spec.base, env)
    if save_base:
        image.save_base([engine], spec.base, save_base)
        image.say(f"saved the base image {spec.base} to {save_base}")
    if not base_only:
        print(image.build([engine], spec, env, rebuild=rebuild))
    return 0


def render_plan(plan) -> str:  # noqa: ANN001 - Plan, avoided to keep import light
    data = plan.to_json()
    lines = [f"backend  {plan.backend}   mode {plan.mode}   tier {plan.tier}   profile {plan.profile} ({plan.profile_digest})",
             f"workdir  {plan.workdir}",
             f"argv     {' '.join(plan.argv)}",
             f"limits   {plan.limits.memory} bytes memory, {plan.limits.pids} processes via {plan.limits.method}",
             *([f"engine   {c.kind} {'rootless' if c.rootless else 'rootful'} ({c.engine}), image {c.image}, "
                f"user {c.user}, container {c.name}"] if (c := plan.container) else []),
             f"timeout  {plan.timeout if plan.timeout else 'none (interactive)'}",
             f"egress   {', '.join(plan.egress) if plan.proxy_listen else 'no network'}",
             f"log      {plan.log_path or '-'}",
             f"env      set: {', '.join(k for k, _ in plan.env_set)}",
             f"         passed by name: {', '.join(plan.env_pass) or '-'}",
             "denied   " + ("\n         ".join(plan.denied) or "-"),
             "protected " + ("\n          ".join(plan.protected) or "-"),
             "seccomp  " + "\n         ".join(plan.seccomp),
             f"command  {data['command_line']}"]
    lines += note_lines(plan.notes)
    return "\n".join(lines)


HELP = {
    "backend": "agent CLI: claude, codex, gemini, opencode or shell (also the first positional)",
    "mode": "local (bubblewrap box, default) or container (podman/docker) (also the second positional)",
    "profile": "policy profile: agent or default; unset picks agent when this host can enforce it",
    "isolation": "auto, process, supervised or container; an explicit choice is never downgraded",
    "prompt": "run non-interactively with this prompt (claude -p, codex exec, ...); exit code passes through",
    "workdir": "the checkout to work in (default: current dir); the only host dir the box can write",
    "allow_host": "extra egress host, repeatable: NAME[:PORT] or NAME[:PORT]=ADDR:PORT (pinned)",
    "timeout": "seconds before a --prompt run is killed (exit 124); interactive sessions have none",
    "dry_run": "print the resolved plan and launch nothing",
    "json": "with --dry-run: print the plan as JSON",
    "quiet": "no banner (notes and refusals are still printed)",
}
EPILOG = "exit codes: the agent's own; 2 usage/config; 3 refused (unenforceable or opt-in missing); 124 timeout; 128+N signal"


def build_parser():  # noqa: ANN201 - argparse is imported lazily
    import argparse


    parser = argparse.ArgumentParser(
        prog="contribute-hive",
        description="Run a coding agent inside the hive relay box (same surface as `invoke contribute-hive`).",
        epilog=EPILOG,
    )
    parser.add_argument("backend_pos", nargs="?", metavar="BACKEND", help=HELP["backend"])
    parser.add_argument("mode_pos", nargs="?", metavar="MODE", help=HELP["mode"])
    parser.add_argument("--backend", help=HELP["backend"])
    parser.add_argument("--mode", help=HELP["mode"])
    parser.add_argument("--profile", help=HELP["profile"])
    parser.add_argument("--isolation", help=HELP["isolation"])
    parser.add_argument("--prompt", help=HELP["prompt"])
    parser.add_argument("--workdir", default=".", help=HELP["workdir"])
    parser.add_argument("--allow-host", action="append", default=[], metavar="ENTRY", help=HELP["allow_host"])
    parser.add_argument("--timeout", type=int, metavar="SECONDS", help=HELP["timeout"])
    parser.add_argument("--dry-run", action="store_true", help=HELP["dry_run"])
    parser.add_argument("--json", action="store_true", help=HELP["json"])
    parser.add_argument("-q", "--quiet", action="store_true", help=HELP["quiet"])
    return parser


def request_from(
    backend_pos: str | None, mode_pos: str | None, backend: str | None, mode: str | None, **rest: object
) -> Request:
    """Merge positional and flag forms; the two may not disagree."""
    if backend_pos and backend and backend_pos != backend:
        raise UsageError(f"backend given twice: {backend_pos!r} and --backend {backend!r}")
    if mode_pos and mode and mode_pos != mode:
        raise UsageError(f"mode given twice: {mode_pos!r} and --mode {mode!r}")
    name = backend or backend_pos
    if not name:
        raise UsageError("no backend given; usage: invoke contribute-hive BACKEND [local|container]")
    return Request(backend=name, mode=mode or mode_pos or "local", run_id=new_run_id(), **rest)  # type: ignore[arg-type]


def guarded(fn, *args, **kwargs) -> int:  # noqa: ANN001
    """Run fn, turning RelayError into its one line and exit code."""
    try:
        return fn(*args, **kwargs)
    except RelayError as err:
        emit([f"hive-relay: error: {err.message}"])
        return err.exit_code
    except KeyboardInterrupt:
        emit(["hive-relay: interrupted"])
        return 130


def _build_image_main(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="contribute-hive build-image",
                                     description="Build the container-mode image for your uid (cached by content).")
    parser.add_argument("--base", help="base image with node 20+, npm and git (default: built offline with "
                                       "mmdebstrap + Node from npm)")
    parser.add_argument("--rebuild", action="store_true", help="ignore the layer cache")
    parser.add_argument("--base-only", action="store_true", help="only make sure the base image exists")
    parser.add_argument("--save-base", metavar="FILE", help="also save the base image to FILE")
    parser.add_argument("--base-archive", metavar="FILE", help="load a missing base image from FILE")
    ns = parser.parse_args(argv)
    return guarded(build_image, base=ns.base, rebuild=ns.rebuild, base_only=ns.base_only, save_base=ns.save_base,
                   base_archive=ns.base_archive)


ACCEPT_HELP = (
    "At exit, a box's changes to the agent's state that `home.keep` does not allow (plugins, extensions, "
    "commands, settings, MCP servers, new files, conflicts with the host) are kept aside in "
    "~/.local/state/hive-relay/kept/RUN/ with a kept.json manifest, and the exit line names RUN. Review those "
    "files, then accept them: each is copied to its place under ~ (all of the run's, or the PATHs named). A file "
    "that changed on the host since the run is refused (merge it by hand); nothing is half-accepted.")


def accept_state(run: str, paths: Sequence[str] = (), env: Mapping[str, str] | None = None) -> int:
    """`invoke accept-state RUN`: take kept-aside agent state into $HOME after review."""
    from .agentstate import accept
    from .paths import state_dir

    env = dict(os.environ if env is None else env)
    home = env.get("HOME") or os.path.expanduser("~")
    done = accept(state_dir(env), home, run, tuple(paths))
    print(f"hive-relay: accepted {len(done)} file(s) from run {run}: {', '.join(done)}")
    return 0


def _accept_state_main(argv: Sequence[str]) -> int:
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # type: ignore[override]
            raise UsageError(f"accept-state: {message}; fix: see `python -m relay accept-state --help`")

    parser = Parser(prog="contribute-hive accept-state", description=ACCEPT_HELP)
    parser.add_argument("run", metavar="RUN", help="the run id the exit line named (e.g. 12345-0a1b2c3d)")
    parser.add_argument("paths", nargs="*", metavar="PATH", help="only these kept files (~/.claude/x or .claude/x)")

    def go() -> int:
        ns = parser.parse_args(argv)
        return accept_state(ns.run, ns.paths)
    return guarded(go)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["build-image"]:
        return _build_image_main(argv[1:])
    if argv[:1] == ["accept-state"]:
        return _accept_state_main(argv[1:])
    ns = build_parser().parse_args(argv)
    def go() -> int:
        request = request_from(
            ns.backend_pos, ns.mode_pos, ns.backend, ns.mode, profile=ns.profile, isolation=ns.isolation,
            prompt=ns.prompt, workdir=ns.workdir, allow_hosts=tuple(ns.allow_host), timeout=ns.timeout,
        )
        return contribute(request, dry_run=ns.dry_run, as_json=ns.json, quiet=ns.quiet)
    return guarded(go)


if __name__ == "__main__":
    sys.exit(main())
