"""invoke tasks: the thin command layer. Parse, call `relay`, map errors to exit codes.

    invoke contribute-hive claude local
    invoke contribute-hive --backend codex --mode container
"""

from __future__ import annotations

import sys

from invoke import Context, task
from invoke.parser.parser import ParseMachine

from relay.cli import HELP, contribute, guarded, request_from
from relay.errors import UsageError


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.exit(code)


def _seconds(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"--timeout {value!r}: expected whole seconds, e.g. --timeout 600") from None


# invoke has no optional positionals: it demands every positional at the end of parsing.
# `backend` and `mode` are positional *and* flags; this shim fills an omitted one just before
# that check, so `contribute-hive claude` means local and a missing backend is our exit-2 error.
_OPTIONAL_POSITIONALS = {"contribute-hive": {"backend": "", "mode": "local"}}
_complete_context = ParseMachine.complete_context


def _complete_with_optional_positionals(self: ParseMachine) -> None:
    defaults = _OPTIONAL_POSITIONALS.get(getattr(self.context, "name", None) or "", {})
    for arg in getattr(self.context, "positional_args", []):
        if arg.value is None and arg.name in defaults:
            arg.value = defaults[arg.name]
    _complete_context(self)


ParseMachine.complete_context = _complete_with_optional_positionals  # type: ignore[method-assign]


@task(positional=["backend", "mode"], iterable=["allow_host"], help=HELP)
def contribute_hive(
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
) -> None:
    """Run a coding agent inside the hive relay box: BACKEND [local|container]."""

    def go() -> int:
        request = request_from(
            None, None, backend or None, mode or "local", profile=profile, isolation=isolation, prompt=prompt,
            workdir=workdir, allow_hosts=tuple(allow_host or ()), timeout=_seconds(timeout),
        )
        return contribute(request, dry_run=dry_run, as_json=json, quiet=quiet)

    _exit(guarded(go))


@task(help={"json": "print the report as JSON"})
def doctor(c: Context, json: bool = False) -> None:
    """Check what this host can enforce: bubblewrap, namespaces, seccomp, cgroups, tty, CLIs."""
    from relay.doctor import doctor as run_doctor

    _exit(guarded(run_doctor, as_json=json))


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
    from relay.cli import build_image as run_build_image

    _exit(guarded(run_build_image, base=base, rebuild=rebuild, base_only=base_only, save_base=save_base,
                  base_archive=base_archive))


@task(positional=["run"], iterable=["path"], help={
    "run": "the run id the exit line named (its kept-aside files are in ~/.local/state/hive-relay/kept/RUN/)",
    "path": "only this kept file (~/.claude/x), repeatable; default: all of the run's",
})
def accept_state(c: Context, run: str, path: list[str] | None = None) -> None:
    """Accept an agent's kept-aside state (plugins, settings, new files...) into ~ after you reviewed it."""
    from relay.cli import accept_state as run_accept_state

    _exit(guarded(run_accept_state, run, tuple(path or ())))


@task(help={"args": "extra arguments for pytest, e.g. '-k proxy -x'"})
def test(c: Context, args: str = "") -> None:
    """Run the whole test suite (pytest, then the bats shell tests)."""
    import shlex
    import subprocess

    _exit(subprocess.call(["./bin/test", *shlex.split(args)]))


@task(help={"backend": "only this backend (default: all)", "json": "print the results as JSON",
            "mode": "local (bubblewrap box, default) or container (podman/docker)"}, iterable=["backend"])
def selftest(c: Context, backend: list[str] | None = None, json: bool = False, mode: str = "local") -> None:
    """Run real escape probes inside a real box per backend; exit 1 if the box is weaker than its plan."""
    from relay.selftest import selftest as run_selftest

    _exit(guarded(run_selftest, list(backend or []) or None, as_json=json, mode=mode))


@task(help={"runs": "repetitions per timing (median is reported)", "with_peers": "install and compare srt (npm)",
            "quick": "fewer runs and a 32 MB download (for CI)"})
def bench(c: Context, runs: int = 15, with_peers: bool = False, quick: bool = False) -> None:
    """Benchmark launch overhead, proxy throughput/latency, memory and scale against same-run baselines."""
    from relay.bench import bench as run_bench

    _exit(guarded(run_bench, runs=runs, with_peers=with_peers, quick=quick))
