"""invoke tasks: the thin command layer. Parse, call `relay`, map errors to exit codes.

    invoke contribute-hive claude local
    invoke contribute-hive --backend codex --mode container
"""

from __future__ import annotations

import sys

from invoke import Context, Task, task
from invoke.exceptions import ParseError
from invoke.parser import Parser, ParserContext
from invoke.parser.parser import ParseMachine, is_flag

from relay.commands.cli import (
    ALLOW_DOC,
    ASK_DOC,
    CHANGE_HELP,
    CLEAN_DOC,
    CLEAN_HELP,
    COMMAND_HELP,
    DENY_DOC,
    DESCRIPTION,
    EPILOG,
    HELP,
    LOGS_DOC,
    LOGS_HELP,
    METAVARS,
    REPEATABLE,
    contribute,
    extra_argument,
    flag_name,
    guarded,
    missing_value,
    request_from,
    seconds,
    split_command,
    unknown_option,
    version_line,
)
from relay.commands.cli import count as count_arg
from relay.commands.options import SHORT_FLAGS
from relay.model.errors import UsageError


def _exit(code: int) -> None:
    from relay.commands.cli import exit_now

    exit_now(code)


def _seconds(value: str | None) -> int | None:
    return seconds(value)


# invoke has no optional positionals: it demands every positional at the end of parsing.
# `backend` and `mode` are positional *and* flags; this shim fills an omitted one just before
# that check, so `contribute-hive claude` means local and a missing backend is our exit-2 error.
_OPTIONAL_POSITIONALS = {"contribute-hive": {"backend": "", "mode": "local"}, "logs": {"run": ""}}
_complete_context = ParseMachine.complete_context


def _complete_with_optional_positionals(self: ParseMachine) -> None:
    defaults = _OPTIONAL_POSITIONALS.get(getattr(self.context, "name", None) or "", {})
    for arg in getattr(self.context, "positional_args", []):
        if arg.value is None and arg.name in defaults:
            arg.value = defaults[arg.name]
    _complete_context(self)


ParseMachine.complete_context = _complete_with_optional_positionals  # type: ignore[method-assign]

# While positionals are missing, invoke takes *any* word as one, so `--dryrun shell` became the
# backend '--dryrun'. A flag-like word that is no flag of ours is an unknown option; invoke's own
# flags (--help) keep working in the task's context.
_handle = ParseMachine.handle


def _handle_flags_first(self: ParseMachine, token: str) -> None:
    ctx = self.context
    if (self.current_state != "unknown" and ctx is not None and getattr(ctx, "name", None) in _OPTIONAL_POSITIONALS
            and is_flag(token) and token != "-" and token not in ctx.flags and token not in ctx.inverse_flags
            and not self.waiting_for_flag_value and ctx.missing_positional_args):
        if self.initial is not None and token in self.initial.flags:
            flag = self.initial.flags[token]
            if flag.name == "help":
                flag.value = ctx.name
            else:
                self.switch_to_flag(token)
            return
        self.error(f"No idea what {token!r} is!")
    _handle(self, token)


ParseMachine.handle = _handle_flags_first  # type: ignore[method-assign]

# invoke's parse errors become our one line and exit 2, like every other usage error.
_error = ParseMachine.error


def _error_with_flag(self: ParseMachine, msg: str) -> None:
    try:
        _error(self, msg)
    except ParseError as err:
        err.flag = self.flag  # type: ignore[attr-defined]
        raise


ParseMachine.error = _error_with_flag  # type: ignore[method-assign]

# invoke accepts a repeatable flag with no value at all (`-a --dry-run`, or `-a` last); ours need one.
_complete_flag = ParseMachine.complete_flag


def _complete_flag_needs_value(self: ParseMachine) -> None:
    flag = self.flag
    if (flag is not None and flag.kind is list and not self.flag_got_value
            and getattr(self.context, "name", None) in _OPTIONAL_POSITIONALS):
        self.error(f"Flag {flag!r} needed value and was not given one!")
    _complete_flag(self)


ParseMachine.complete_flag = _complete_flag_needs_value  # type: ignore[method-assign]
_parse_argv = Parser.parse_argv
_COMPLETING: list[bool] = []


def _usage_error(err: ParseError) -> UsageError:
    msg, ctx = str(err), err.context
    name = getattr(ctx, "name", None)
    fix = f"`invoke --help {name}` lists the options" if name else "`invoke --list` lists the tasks"
    if name == "contribute-hive":
        fix = "`invoke --help contribute-hive` (or `contribute-hive --help`) lists the options"
    if msg.startswith("No idea what ") and msg.endswith(" is!"):
        token = msg[len("No idea what "):-len(" is!")].strip("'\"")
        if is_flag(token):
            return unknown_option(token, list(getattr(ctx, "flags", {})), fix)
        if name == "contribute-hive":
            return extra_argument(token)
        if name:
            return UsageError(f"unexpected argument {token!r} for {name}; fix: {fix}")
        return UsageError(f"no task named {token!r}; fix: {fix}")
    flag = getattr(err, "flag", None)
    if flag is not None and "needed value" in msg:
        return missing_value(flag_name(flag.name))
    if flag is not None and "doesn't take any value" in msg:
        return UsageError(f"{flag_name(flag.name)} takes no value; fix: {flag_name(flag.name)} alone")
    return UsageError(f"{msg}; fix: {fix}")


def _parse_argv_usage_errors(self: Parser, argv: list[str]):  # noqa: ANN202
    try:
        return _parse_argv(self, argv)
    except ParseError as err:
        if _COMPLETING or "contribute-hive" not in self.contexts:
            raise  # completion wants the error itself; the core parse is invoke's own
        print(f"hive-relay: error: {_usage_error(err).message}", file=sys.stderr)
        _exit(2)


Parser.parse_argv = _parse_argv_usage_errors  # type: ignore[method-assign]

# `invoke --help contribute-hive` shows the same placeholders as `contribute-hive --help`.
_help_for = ParserContext.help_for


def _help_for_with_placeholders(self: ParserContext, flag: str):  # noqa: ANN202
    names, text = _help_for(self, flag)
    meta = METAVARS.get(self.flags[flag].name) if self.name == "contribute-hive" else None
    if meta:
        parts = [n.split("=")[0].split(" ")[0] for n in names.split(", ")]
        names = ", ".join(f"{n} {meta}" if len(n) == 2 else f"{n}={meta}" for n in parts)
    return names, text


ParserContext.help_for = _help_for_with_placeholders  # type: ignore[method-assign]


def _patch_completion() -> None:
    """invoke's own `--complete` offers task names and flags; for contribute-hive it also offers the
    backends, modes, profiles and isolation levels (what `invoke --print-completion-script bash` calls)."""
    import invoke.program

    original = invoke.program.complete

    def complete(names, core, initial_context, collection, parser):  # noqa: ANN001, ANN202
        import shlex

        _COMPLETING.append(True)
        try:
            tokens = shlex.split(core.remainder)
        except ValueError:
            tokens = []
        if "contribute-hive" in tokens and "--" not in tokens:
            import os

            from relay.commands.completion import names as config_names
            from relay.model.vocab import MODES
            from relay.plan.resolve import ISOLATIONS

            found = config_names(dict(os.environ))
            words = tokens[tokens.index("contribute-hive") + 1:]
            prev = words[-1] if words else ""
            values = {"-b": found["backends"], "--backend": found["backends"], "-m": MODES, "--mode": MODES,
                      "-p": found["profiles"], "--profile": found["profiles"], "-i": ISOLATIONS,
                      "--isolation": ISOLATIONS}
            prev2 = words[-2] if len(words) > 1 else ""
            if prev in values or prev2 in values:
                print("\n".join(values.get(prev) or values[prev2]))
            elif not prev.startswith("-"):
                positionals = [w for w in words if not w.startswith("-")]
                print("\n".join(found["backends"] + MODES if len(positionals) <= 1 else MODES))
        return original(names, core, initial_context, collection, parser)

    invoke.program.complete = complete


_patch_completion()


def _contribute_hive(
    c: Context,
    backend: str | None = None,
    mode: str | None = None,
    profile: str | None = None,
    isolation: str | None = None,
    prompt: str | None = None,
    workdir: str = ".",
    allow_host: list[str] | None = None,
    timeout: str | None = None,
    dry_run: bool = False,
    json: bool = False,
    quiet: bool = False,
    version: bool = False,
    allow_socket: list[str] | None = None,
    allow_ssh: list[str] | None = None,
    allow_preset: list[str] | None = None,
    ask: bool = False,
    count: str | None = None,
    parallel: str | None = None,
    no_grants: bool = False,
    staged: bool = False,
    apply: bool = False,
    live: bool = False,
    shared_live: bool = False,
    vm_accel: str | None = None,
    inspect: list[str] | None = None,
) -> None:
    if version:
        print(version_line())
        _exit(0)
    # invoke keeps what follows `--` only as one joined string; the words themselves come from argv,
    # split where invoke splits it (the first `--`).
    _, command = split_command(sys.argv[1:])

    def go() -> int:
        request = request_from(
            None, None, backend or None, mode or "local", profile=profile, isolation=isolation, prompt=prompt,
            workdir=workdir, allow_hosts=tuple(allow_host or ()), timeout=seconds(timeout), command=command,
            allow_sockets=tuple(allow_socket or ()), allow_ssh=tuple(allow_ssh or ()),
            allow_presets=tuple(allow_preset or ()), ask=ask, no_grants=no_grants, staged=staged,
            apply=apply, live=live, shared_live=shared_live, vm_accel=vm_accel, inspect=tuple(inspect or ()),
        )
        return contribute(request, dry_run=dry_run, as_json=json, quiet=quiet, count=count_arg(count, "--count"),
                          parallel=count_arg(parallel, "--parallel"))

    _exit(guarded(go))


_contribute_hive.__doc__ = f"{DESCRIPTION}.\n\n{COMMAND_HELP}.\n\n{EPILOG}."


class _Task(Task):
    """invoke derives each short flag from the first free character of the name, so a new option could
    shift, or lose, the letter of one after it. Take them from options.OPTIONS instead, the one table the
    `hive-relay` parser also reads: the short flags are part of the public surface and never move."""

    def arg_opts(self, name: str, default: str, taken_names: set[str]) -> dict:
        opts = super().arg_opts(name, default, taken_names)
        short = SHORT_FLAGS.get(name)
        if short is not None:
            opts["names"][1:] = [short]
        return opts


contribute_hive = task(klass=_Task, positional=["backend", "mode"], iterable=list(REPEATABLE), help=HELP,
                       name="contribute-hive")(_contribute_hive)


@task(help={"json": "print the report as JSON",
            "mode": "kube: run a canary box on the current kubectl context and refuse (exit 3) what it cannot enforce",
            "isolation": "with --mode kube: gvisor also proves the canary box runs on gVisor (runtimeClassName gvisor)"})
def doctor(c: Context, json: bool = False, mode: str | None = None, isolation: str | None = None) -> None:
    """Check what this host can enforce: bubblewrap, namespaces, seccomp, cgroups, tty, CLIs."""
    from relay.commands.doctor import doctor as run_doctor

    _exit(guarded(run_doctor, as_json=json, mode=mode, isolation=isolation))


@task(help={
    "base": "base image (default: localhost/hive-relay-base:SUITE-RECIPE, built offline with mmdebstrap from your "
            "Debian mirror + Node from npm; any image with node 20+, npm and git works)",
    "rebuild": "rebuild without the engine's layer cache even if the image is up to date",
    "base_only": "only make sure the base image exists",
    "save_base": "also save the base image to FILE (load it elsewhere with --base-archive)",
    "base_archive": "load a missing base image from FILE (made by --save-base) instead of building it",
})
def build_image(c: Context, base: str | None = None, rebuild: bool = False, base_only: bool = False,
                save_base: str | None = None, base_archive: str | None = None) -> None:
    """Build the container-mode image (Dockerfile.contributor) for your uid; cached by content."""
    from relay.commands.cli import build_image as run_build_image

    _exit(guarded(run_build_image, base=base, rebuild=rebuild, base_only=base_only, save_base=save_base,
                  base_archive=base_archive))


@task(positional=["run"], iterable=["path"], help={
    "run": "the run id the exit line named (its kept-aside files are in ~/.local/state/hive-relay/kept/RUN/)",
    "path": "only this kept file (~/.claude/x, or a workdir file's absolute path), repeatable; default: all of the run's",
})
def accept_state(c: Context, run: str, path: list[str] | None = None) -> None:
    """Accept an agent's kept-aside state (plugins, settings, new files...) into ~ after you reviewed it."""
    from relay.commands.cli import accept_state as run_accept_state

    _exit(guarded(run_accept_state, run, tuple(path or ())))


def _logs(c: Context, run: str | None = None, denied: bool = False) -> None:
    from relay.commands.logs import show

    _exit(guarded(show, run or None, denied=denied))


_logs.__doc__ = LOGS_DOC
logs = task(positional=["run"], help={"run": LOGS_HELP["run"], "denied": LOGS_HELP["denied"]}, name="logs")(_logs)


def _clean(c: Context, dry_run: bool = False, all: bool = False,  # noqa: A002 - the flag is --all
           staged_older_than: str | None = None) -> None:
    from relay.commands.clean import clean as run_clean
    from relay.commands.cli import staged_days

    _exit(guarded(lambda: run_clean(dry_run=dry_run, everything=all, staged_older_than=staged_days(staged_older_than))))


_clean.__doc__ = CLEAN_DOC
clean = task(help={"dry_run": CLEAN_HELP["dry_run"], "all": CLEAN_HELP["all"],
                   "staged_older_than": CLEAN_HELP["staged_older_than"]}, name="clean")(_clean)


# The staged workdir's review (relay/trust/changes.py): the same texts as `hive-relay changes|diff|apply|discard`.
def _staged_help(op: str) -> dict[str, str]:
    from relay.commands.cli import STAGED_HELP as H

    out = {"run": H["list_run"] if op == "changes" else H["run"]}
    if op != "changes":
        out["path"] = H["path"] + ", repeatable"
    if op == "apply":
        out["skip_flagged"] = H["skip_flagged"]
    if op != "diff":
        out["json"] = H["json"]
    return out


def _changes(c: Context, run: str | None = None, json: bool = False) -> None:
    from relay.ui.changes_text import changes_main

    _exit(guarded(changes_main, run or None, json))


def _diff(c: Context, run: str, path: list[str] | None = None) -> None:
    from relay.ui.changes_text import diff_main

    _exit(guarded(diff_main, run, tuple(path or ())))


def _apply(c: Context, run: str, path: list[str] | None = None, skip_flagged: bool = False, json: bool = False) -> None:
    from relay.ui.changes_text import apply_main

    _exit(guarded(apply_main, run, tuple(path or ()), skip_flagged, json))


def _discard(c: Context, run: str, path: list[str] | None = None, json: bool = False) -> None:
    from relay.ui.changes_text import discard_main

    _exit(guarded(discard_main, run, tuple(path or ()), json))


def _staged_docs() -> None:
    from relay.commands.cli import APPLY_DOC, CHANGES_DOC, DIFF_DOC, DISCARD_DOC

    _changes.__doc__, _diff.__doc__, _apply.__doc__, _discard.__doc__ = CHANGES_DOC, DIFF_DOC, APPLY_DOC, DISCARD_DOC


_staged_docs()
changes = task(positional=["run"], help=_staged_help("changes"), name="changes")(_changes)
diff = task(positional=["run"], iterable=["path"], help=_staged_help("diff"), name="diff")(_diff)
apply = task(positional=["run"], iterable=["path"], help=_staged_help("apply"), name="apply")(_apply)
discard = task(positional=["run"], iterable=["path"], help=_staged_help("discard"), name="discard")(_discard)


@task(positional=["host"], help=CHANGE_HELP, name="allow")
def allow(c: Context, host: str, run: str | None = None) -> None:
    from relay.commands.live_rules import change

    _exit(guarded(change, "allow", host, run or None))


@task(positional=["host"], help=CHANGE_HELP, name="deny")
def deny(c: Context, host: str, run: str | None = None) -> None:
    from relay.commands.live_rules import change

    _exit(guarded(change, "deny", host, run or None))


@task(help={"run": CHANGE_HELP["run"]}, name="ask")
def ask(c: Context, run: str | None = None) -> None:
    from relay.commands.live_rules import ask as run_ask

    _exit(guarded(run_ask, run or None))


allow.__doc__, deny.__doc__, ask.__doc__ = ALLOW_DOC, DENY_DOC, ASK_DOC


@task(positional=["backend"], help={"backend": "the agent to log in: claude, codex or opencode"})
def login(c: Context, backend: str) -> None:
    """Run BACKEND's own login on this host, outside any box (the credential stays on the host)."""
    import os

    from relay.commands.login import login as run_login

    _exit(guarded(lambda: run_login(backend, dict(os.environ))))  # the env as guarded() cleaned it


@task(help={"args": "extra arguments for pytest, e.g. '-k proxy -x'"})
def test(c: Context, args: str = "") -> None:
    """Run the whole test suite (pytest, then the bats shell tests)."""
    import os
    import shlex
    import subprocess

    # By our own path, from our own root: `./bin/test` from the caller's directory (a project, a box's
    # workdir) would run whatever is there.
    root = os.path.dirname(os.path.abspath(__file__))
    _exit(subprocess.call([os.path.join(root, "bin", "test"), *shlex.split(args)], cwd=root))


@task(help={"backend": "only this backend (default: all)", "json": "print the results as JSON",
            "mode": "local (bubblewrap box, default) or container (podman/docker)",
            "isolation": "local mode's tier to probe: supervised (default, as auto picks), gvisor (runsc) or vm",
            "vm_accel": "with --isolation vm: kvm (the default) or tcg (qemu's emulated CPU)"},
      iterable=["backend"])
def selftest(c: Context, backend: list[str] | None = None, json: bool = False, mode: str = "local",
             isolation: str | None = None, vm_accel: str | None = None) -> None:
    """Run real escape probes inside a real box per backend; exit 1 if the box is weaker than its plan."""
    from relay.commands.selftest import selftest as run_selftest

    _exit(guarded(run_selftest, list(backend or []) or None, as_json=json, mode=mode, isolation=isolation,
                   vm_accel=vm_accel))


@task(help={"runs": "repetitions per timing (median is reported)",
            "with_peers": "install and compare srt (npm; ripgrep via apt as root) with one allowed host; "
                          "a peer that cannot run is refused, never timed",
            "quick": "fewer runs and a 32 MB download (for CI)",
            "launch_only": "only the launch figures (paired runs, idle and with one core busy)",
            "new_user": "also the first and second container launch of a new rootless user (fresh podman storage "
                        "and relay state in a HOME of its own; it builds the image, so minutes; with "
                        "--launch-only, the container launch rows too)",
            "kube": "only kube mode's fan-out: 10 shell boxes through podman kube play against 10 sequential "
                    "container runs (root: hostUsers needs automatic user namespaces)"})
def bench(c: Context, runs: int = 15, with_peers: bool = False, quick: bool = False, launch_only: bool = False,
          kube: bool = False, kube_repo: bool = False, new_user: bool = False) -> None:
    """Benchmark launch overhead (idle and one core busy), proxy throughput/latency, memory and scale
    against same-run baselines. --kube: a 10-box fan-out; --kube-repo: a 200 MB, 50,000-file
    checkout fanned out to 3 boxes (minutes), against a bare `podman run`."""
    from relay.dev.bench import bench as run_bench

    if kube_repo:
        import json as _json

        from relay.dev.bench_kube_repo import bench_kube_repo

        print(_json.dumps(bench_kube_repo(), indent=1))
        return
    if kube:
        import json as _json

        from relay.dev.bench import bench_kube

        print(_json.dumps(bench_kube(), indent=1))
        return

    _exit(guarded(run_bench, runs=runs, with_peers=with_peers, quick=quick, launch_only=launch_only,
                  new_user=new_user))
