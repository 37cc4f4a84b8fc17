"""The command surface, through the real entries as a user types them, from a directory that is not
the checkout: `invoke contribute-hive` (invoke's own console script, --search-root), bin/contribute-hive,
`python -m relay` and the installed `hive-relay` console script.

Usage errors are one line and exit 2 on every entry; --version; `-- CMD ARGS`; the two help outputs
say the same things; shell completion; `pip install` of the checkout into a fresh venv.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from relay import __version__
from relay.commands.cli import COMMAND_HELP, EPILOG, HELP, OPTIONS, flag_name
from relay.commands.completion import script
from tests.conftest import REPO, Sandbox, require_box

BIN = str(REPO / "bin" / "contribute-hive")
_INVOKE_SCRIPT = Path(sys.executable).parent / "invoke"
INVOKE = ([str(_INVOKE_SCRIPT)] if _INVOKE_SCRIPT.exists() else [sys.executable, "-m", "invoke"])
ENTRIES = {
    "invoke": [*INVOKE, "--search-root", str(REPO), "contribute-hive"],
    "bin": [BIN],
    "python-m": [sys.executable, "-m", "relay"],
}


@pytest.fixture(scope="module", autouse=True)
def _bootstrapped() -> None:
    """bin/contribute-hive's first call may bootstrap the venv (and say so on stderr); do it once here,
    so that each test sees the entry as a user does on every later call."""
    env = {**os.environ, "HIVE_RELAY_TOOLS": os.environ.get("HIVE_RELAY_TOOLS", "")}
    subprocess.run([BIN, "--version"], env={k: v for k, v in env.items() if v}, capture_output=True, timeout=600)


def run(s: Sandbox, entry: list[str], *args: str, cwd: Path | None = None, timeout: float = 120,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {**s.env, **(env or {})}
    if os.environ.get("HIVE_RELAY_TOOLS"):
        full.setdefault("HIVE_RELAY_TOOLS", os.environ["HIVE_RELAY_TOOLS"])
    if os.environ.get("HIVE_RELAY_VENV"):
        full.setdefault("HIVE_RELAY_VENV", os.environ["HIVE_RELAY_VENV"])
    return subprocess.run([*entry, *args], cwd=cwd or s.workdir, env=full, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hive-relay: error: ") and "; fix: " in lines[0], lines[0]
    assert proc.stdout == ""
    return lines[0]


USAGE_CASES = {
    "unknown flag after the backend": (["shell", "--bogus"], "unknown option --bogus"),
    "misspelled flag before the backend": (["--backnd", "shell"], "unknown option --backnd; fix: did you mean --backend?"),
    "misspelled switch": (["shell", "--dryrun"], "did you mean --dry-run?"),
    "missing value": (["shell", "--prompt"], "--prompt needs a value; fix: --prompt PROMPT"),
    "missing value, repeatable flag": (["shell", "-a"], "--allow-host needs a value; fix: --allow-host HOST[:PORT]"),
    "missing value before a switch": (["shell", "--allow-host", "--dry-run"], "--allow-host needs a value"),
    "extra argument": (["shell", "local", "extra"], "unexpected argument 'extra'"),
    "-- without a command": (["shell", "--"], "`--` is not followed by a command"),
    "-- with --prompt": (["shell", "--prompt", "x", "--", "ls"], "both --prompt and `-- CMD ARGS` given"),
    "-- for an agent": (["codex", "--", "ls"], "runs a command in the shell backend only"),
    "bad timeout": (["shell", "--timeout", "soon"], "--timeout 'soon': expected whole seconds"),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("case", sorted(USAGE_CASES))
def test_usage_errors_are_one_line_with_exit_2(sandbox: Sandbox, entry: str, case: str) -> None:
    args, expected = USAGE_CASES[case]
    line = one_error_line(run(sandbox, ENTRIES[entry], *args))
    assert expected in line
    assert "unknown backend" not in line and "unknown mode" not in line


def test_both_entries_say_the_same_error(sandbox: Sandbox) -> None:
    for args, _ in USAGE_CASES.values():
        texts = {name: one_error_line(run(sandbox, ENTRIES[name], *args)).split("; fix:")[0] for name in ENTRIES}
        assert len(set(texts.values())) == 1, texts


def test_an_unknown_task_is_a_usage_error_too(sandbox: Sandbox) -> None:
    line = one_error_line(run(sandbox, [*INVOKE, "--search-root", str(REPO), "doctr"]))
    assert "no task named 'doctr'" in line and "invoke --list" in line


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_version(sandbox: Sandbox, entry: str) -> None:
    proc = run(sandbox, ENTRIES[entry], "--version")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"hive-relay {__version__}\n", "")
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_the_workdir_is_where_the_user_stands(sandbox: Sandbox, tmp_path: Path, entry: str) -> None:
    elsewhere = tmp_path / "some project"
    elsewhere.mkdir()
    proc = run(sandbox, ENTRIES[entry], "shell", "--dry-run", "--json", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["workdir"] == str(elsewhere.resolve())


def test_the_bin_entry_works_through_a_symlink_on_path(sandbox: Sandbox, tmp_path: Path) -> None:
    (tmp_path / "onpath").mkdir()
    link = tmp_path / "onpath" / "contribute-hive"
    link.symlink_to(BIN)
    proc = run(sandbox, [str(link)], "shell", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["workdir"] == str(sandbox.workdir.resolve())


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_double_dash_passes_the_argv_through_exactly(sandbox: Sandbox, entry: str) -> None:
    words = ["printf", "[%s]", "a b", "$HOME", "*", "", "--", "-x"]
    proc = run(sandbox, ENTRIES[entry], "shell", "--dry-run", "--json", "--", *words)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["argv"] == words


@pytest.mark.box
@pytest.mark.parametrize("entry", ["invoke", "bin"])
def test_double_dash_runs_the_command_and_its_exit_code_passes(box_sandbox: Sandbox, entry: str) -> None:
    require_box()
    proc = run(box_sandbox, ENTRIES[entry], "shell", "--quiet", "--",
               "sh", "-c", 'printf "[%s]" "$@"; exit 7', "sh", "a b", "$HOME", "*", "")
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "[a b][$HOME][*][]"


def _squash(text: str) -> str:
    """Help text without its wrapping (argparse and invoke wrap at different columns)."""
    return "".join(text.split())


def test_both_help_outputs_say_the_same_things(sandbox: Sandbox) -> None:
    bin_help = run(sandbox, ENTRIES["bin"], "--help")
    inv_help = run(sandbox, [*INVOKE, "--search-root", str(REPO), "--help", "contribute-hive"])
    assert bin_help.returncode == 0 and inv_help.returncode == 0, (bin_help.stderr, inv_help.stderr)
    outputs = {"bin": bin_help.stdout, "invoke": inv_help.stdout}
    for name, out in outputs.items():
        squashed = _squash(out)
        for dest, short, meta in OPTIONS:
            assert _squash(HELP[dest]) in squashed, (name, dest)
            long = flag_name(dest)
            if meta:
                assert (f"-{short} {meta}" in out), (name, dest)
                assert f"{long} {meta}" in out or f"{long}={meta}" in out, (name, dest)
            else:
                assert re.search(rf"-{short}, {long}\b", out), (name, dest)
        for text in (COMMAND_HELP, EPILOG):
            assert _squash(text) in squashed, (name, text)
    allow = HELP["allow_host"]
    assert "*.DOMAIN" in allow and "443" in allow and "NAME:80" in allow


def test_dry_run_text_states_the_default_port(sandbox: Sandbox) -> None:
    proc = run(sandbox, ENTRIES["bin"], "claude", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "without a port means 443" in proc.stdout and "NAME:80" in proc.stdout


# --- completion ------------------------------------------------------------------------------------

def complete(script_path: Path, *words: str) -> list[str]:
    """What bash's programmable completion offers for `words` (the last one is being typed)."""
    quoted = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    code = (f"source '{script_path}'; complete -p contribute-hive hive-relay >/dev/null || exit 9; "
            f"COMP_WORDS=({quoted}); COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 )); _hive_relay_complete; "
            'printf "%s\\n" "${COMPREPLY[@]}"')
    proc = subprocess.run(["bash", "--norc", "--noprofile", "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return [w for w in proc.stdout.splitlines() if w]


def test_the_shipped_completion_scripts_are_current(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "none")}
    assert (REPO / "completions" / "contribute-hive.bash").read_text() == script("bash", env)
    assert (REPO / "completions" / "_contribute-hive").read_text() == script("zsh", env)


def test_bash_completion_offers_backends_modes_and_options(sandbox: Sandbox, tmp_path: Path) -> None:
    proc = run(sandbox, ENTRIES["python-m"], "completion", "bash")
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "c.bash"
    path.write_text(proc.stdout)
    backends = ["claude", "codex", "gemini", "opencode", "shell"]
    assert complete(path, "contribute-hive", "") == backends + ["build-image", "completion", "logs", "clean", "allow",
                                                               "deny", "ask", "changes", "diff", "apply",
                                                               "discard"]
    assert complete(path, "hive-relay", "allow", "") == []
    assert complete(path, "contribute-hive", "c") == ["claude", "codex", "completion", "clean", "changes"]
    assert complete(path, "hive-relay", "apply", "") == []
    assert complete(path, "hive-relay", "logs", "") == []
    assert complete(path, "hive-relay", "shell", "") == ["local", "container", "kube"]
    assert complete(path, "contribute-hive", "--backend", "") == backends
    assert complete(path, "contribute-hive", "shell", "--mode", "c") == ["container"]
    assert complete(path, "contribute-hive", "shell", "--isolation", "s") == ["supervised"]
    assert complete(path, "contribute-hive", "--profile", "") == ["agent", "default", "tight"]  # the sandbox's
    assert complete(path, "contribute-hive", "shell", "--dr") == ["--dry-run"]
    assert complete(path, "contribute-hive", "--prompt", "x", "claude", "") == ["local", "container", "kube"]
    assert complete(path, "contribute-hive", "completion", "") == ["bash", "zsh"]
    assert "ls" in complete(path, "contribute-hive", "shell", "--", "l")
    zsh = run(sandbox, ENTRIES["python-m"], "completion", "zsh").stdout
    assert zsh.startswith("#compdef contribute-hive hive-relay\n") and "bashcompinit" in zsh


def test_completion_without_a_shell_is_a_usage_error(sandbox: Sandbox) -> None:
    """The fix names the entry as the user can type it from anywhere (not `hive-relay`, which may not be
    on PATH)."""
    from relay.model.refusal import ENTRY

    line = one_error_line(run(sandbox, ENTRIES["python-m"], "completion"))
    assert f"{ENTRY} completion bash" in line and "hive-relay completion" not in line


def test_invoke_completion_offers_backends_and_modes(sandbox: Sandbox) -> None:
    def cands(*words: str) -> list[str]:
        proc = run(sandbox, [*INVOKE, "--search-root", str(REPO), "--complete", "--", "invoke", *words])
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    assert {"claude", "shell", "local", "contribute-hive", "doctor"} <= set(cands("contribute-hive"))
    assert cands("contribute-hive", "--backend") == ["claude", "codex", "gemini", "opencode", "shell"]
    assert cands("contribute-hive", "shell", "--mode") == ["local", "container", "kube"]
    assert "--dry-run" in cands("contribute-hive", "--dr")
    script_text = run(sandbox, [*INVOKE, "--print-completion-script", "bash"]).stdout
    assert "complete -F" in script_text


# --- the installable entry point -------------------------------------------------------------------

def test_pip_install_puts_hive_relay_on_path(sandbox: Sandbox, tmp_path: Path) -> None:
    """`pip install .` of the checkout into a fresh venv (what `pipx install .` does), then the console
    script from another directory. The dependencies come from this test's own venv (a .pth file), so
    nothing but the build backend is fetched."""
    src = tmp_path / "src"
    src.mkdir()
    for part in ("pyproject.toml", "Dockerfile.contributor", "relay", "config", "bin", "completions"):
        (shutil.copytree if (REPO / part).is_dir() else shutil.copy2)(REPO / part, src / part)
    for cache in src.rglob("__pycache__"):
        shutil.rmtree(cache)
    venv = tmp_path / "venv"
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(src)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "hive-relay-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    share = venv / "share" / "hive-relay"
    assert (share / "config" / "backends.yaml").is_file() and os.access(share / "bin" / "container-entrypoint", os.X_OK)
    hive = str(venv / "bin" / "hive-relay")
    env = {k: v for k, v in sandbox.env.items() if k != "PYTHONPATH"}  # the installed package, not the checkout
    elsewhere = tmp_path / "project"
    elsewhere.mkdir()

    def go(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([hive, *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)

    version = go("--version")
    assert (version.returncode, version.stdout) == (0, f"hive-relay {__version__}\n"), version.stderr
    plan = go("shell", "--dry-run", "--json")
    assert plan.returncode == 0, plan.stderr
    data = json.loads(plan.stdout)
    assert data["workdir"] == str(elsewhere.resolve()) and data["backend"] == "shell"
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import relay.host.paths as p; print(p.PACKAGE_ROOT, p.IN_CHECKOUT)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert where == [str(share), "False"]
    assert "_hive_relay_complete" in go("completion", "bash").stdout
    assert "did you mean --dry-run?" in one_error_line(go("shell", "--dryrun"))


# The short flags are public surface: a letter once given never moves to another option. Appending an
# option adds a line here; changing one of these is a break.
SHORT_FLAGS_FROZEN = {
    "allow_host": "a", "backend": "b", "count": "c", "dry_run": "d", "allow_preset": "e", "isolation": "i",
    "json": "j", "parallel": "k", "allow_socket": "l", "mode": "m", "allow_ssh": "o", "profile": "p",
    "quiet": "q", "prompt": "r", "ask": "s", "timeout": "t", "version": "v", "workdir": "w",
    "no_grants": "g", "staged": "z", "apply": "y", "live": "L", "shared_live": "S",
    "vm_accel": "V",
    "inspect": "I",
}


def test_short_flags_are_frozen_and_the_same_in_both_entries() -> None:
    import tasks
    from relay.commands.options import SHORT_FLAGS

    assert SHORT_FLAGS == SHORT_FLAGS_FROZEN
    assert len(set(SHORT_FLAGS.values())) == len(SHORT_FLAGS)
    invoke_shorts = {a.attr_name or a.name: next((n for n in a.names if len(n) == 1), None)
                     for a in tasks.contribute_hive.get_arguments()}
    assert {d: s for d, s in invoke_shorts.items() if d in SHORT_FLAGS} == SHORT_FLAGS


def test_not_container_is_a_subset_that_never_needs_the_image() -> None:
    """`./bin/test -m "not container"`: no test left in it asks for the image (issue 27.3)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not container",
                           "-p", "no:cacheprovider"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert len(ids) > 1000
    assert not [i for i in ids if i.startswith("tests/test_container.py") or "container]" in i
                or "-container-" in i], ids


def test_the_venvs_invoke_works_from_any_directory_and_never_loads_the_projects_tasks(sandbox: Sandbox) -> None:
    """`.venv/bin/invoke doctor` typed in the user's project (issue 27): our tasks, not "Can't find any
    collection named 'tasks'!", and never a tasks.py (or invoke.py, yaml.py) a box left in that project."""
    s = sandbox
    invoke = REPO / ".venv" / "bin" / "invoke"
    subprocess.run([BIN, "--version"], env=s.env, capture_output=True, timeout=300, check=True)  # makes the venv
    planted = s.workdir / "PLANTED-RAN"
    for name in ("tasks.py", "invoke.py", "yaml.py"):
        (s.workdir / name).write_text(f"open({str(planted)!r}, 'w').write('{name}')\n"
                                      "from invoke import task\n@task\ndef doctor(c):\n    print('PLANTED')\n")
    listed = subprocess.run([str(invoke), "--list"], cwd=s.workdir, env=s.env, capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "contribute-hive" in listed.stdout and "accept-state" in listed.stdout
    doctor = subprocess.run([str(invoke), "doctor", "--json"], cwd=s.workdir, env=s.env, capture_output=True,
                            text=True, timeout=300)
    assert doctor.returncode in (0, 1), doctor.stderr[-2000:]
    assert "bwrap" in json.dumps(json.loads(doctor.stdout)) and "PLANTED" not in doctor.stdout
    assert not planted.exists(), planted.read_text()
    # Twin: an explicit -r still picks another collection, as invoke's own flag does.
    other = s.home / "other"
    other.mkdir()
    (other / "tasks.py").write_text("from invoke import task\n@task\ndef hello(c):\n    print('other collection')\n")
    hello = subprocess.run([str(invoke), "-r", str(other), "hello"], cwd=s.workdir, env=s.env, capture_output=True,
                           text=True, timeout=120)
    assert hello.returncode == 0 and "other collection" in hello.stdout, hello.stderr
    assert not planted.exists()
