"""The end of a staged run (issue 25, items 2 and 9): the interactive exit prompt through a real
terminal (pexpect), the --prompt run's line, and housekeeping (`clean`, `logs`, the launch sweep).

The prompt's promise: nothing is lost unless the user says `d` and then `y`. Enter, `k`, Ctrl-C and
end of input keep the run staged and the checkout untouched; `a` applies what is not flagged; and
the caller's terminal is sane afterwards (echo and canonical mode back, the shell still reads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

from relay.commands import clean
from relay.host import liveness
from relay.model.refusal import ENTRY
from relay.model.vocab import ExitChoice
from relay.trust import rundirs, staged
from relay.trust.changes import Review
from relay.ui import staged_counts, staged_exit

from .conftest import Sandbox
from .test_housekeeping import dead_pid, invoke, one_error_line, plant_log

PROMPT_RE = r"\[a\]pply all · \[r\]eview · \[k\]eep staged · \[d\]iscard \(Enter: keep\) "


# ---- the pure parts ----------------------------------------------------------------------------

@pytest.mark.parametrize(("typed", "choice"), [
    ("\n", ExitChoice.KEEP), ("", ExitChoice.KEEP), ("  \r\n", ExitChoice.KEEP), ("k\n", ExitChoice.KEEP),
    ("keep", ExitChoice.KEEP), ("A\n", ExitChoice.APPLY), ("apply all\n", ExitChoice.APPLY),
    ("apply", ExitChoice.APPLY), ("r", ExitChoice.REVIEW), ("review\n", ExitChoice.REVIEW),
    ("d\n", ExitChoice.DISCARD), ("Discard", ExitChoice.DISCARD), ("x\n", None), ("yes", None), ("ak", None),
])
def test_the_answer_is_parsed_and_enter_keeps(typed: str, choice: ExitChoice | None) -> None:
    assert staged_exit.parse_answer(typed) == choice


def test_only_an_explicit_yes_confirms_a_discard() -> None:
    assert staged_exit.parse_yes("y\n") and staged_exit.parse_yes(" YES ")
    assert not any(staged_exit.parse_yes(t) for t in ("", "\n", "n", "no", "yy", "d"))


class _E:
    def __init__(self, flags: bool = False, conflict: str | None = None, refused: str | None = None) -> None:
        self.flagged, self.conflict, self.refused = flags, conflict, refused


def test_the_lines_say_the_counts_and_the_exact_commands() -> None:
    rv = Review(None, [_E(), _E(flags=True), _E(conflict="host edit"), _E()], git=0)  # type: ignore[arg-type]
    c = staged_counts.counts_of(rv)
    assert c == staged_counts.Counts(4, 1, 1, 0, 0) and not c.empty
    assert staged_counts.summary_line(c, "R1") == "staged: 4 changed, 1 flagged, 1 conflict (run R1; nothing applied yet)"
    assert staged_counts.prompt_run_line(c, "R1", "/x/bin/contribute-hive") == (
        "staged: 4 changed, 1 flagged, 1 conflict, not applied; apply: /x/bin/contribute-hive apply R1 "
        "--skip-flagged; review: /x/bin/contribute-hive changes R1")
    plain = staged_counts.Counts(2)
    assert staged_counts.prompt_run_line(plain, "R2", "E") == (
        "staged: 2 changed, 0 flagged, 0 conflicts, not applied; apply: E apply R2; review: E changes R2")
    assert staged_counts.counts_text(staged_counts.Counts(0, git=3, refused=1)) == (
        "0 changed, 0 flagged, 0 conflicts, 1 refused, 3 git files")
    assert staged_counts.Counts().empty and not staged_counts.Counts(git=1).empty
    assert ENTRY.endswith("/bin/contribute-hive") and os.path.isabs(ENTRY)


# ---- the layer without a box ------------------------------------------------------------------

def _layer(tmp_path: Path, run: str | None = None, started: float | None = None) -> tuple[staged.Run, dict]:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    # No container engine: `clean --all` below is about layers, and as root podman's one store does
    # not follow $HOME, so it would remove the machine's images (CI, stop 35).
    env = {"HOME": str(tmp_path / "home"), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "HIVE_RELAY_ENGINE": str(tmp_path / "no-engine")}
    layer = staged.for_run(env, run or liveness.new_run_id())  # default: owned by this process
    staged.create(layer, str(work), {"backend": "shell", "profile_digest": "d"})
    if started is not None:
        meta = staged.read_json(layer.root, staged.META) or {}
        staged.write_json(layer.root, staged.META, {**meta, "started": started})
    return staged.find(env, layer.run), env


def test_an_empty_layer_goes_quietly_and_a_changed_one_gets_the_line(tmp_path: Path) -> None:
    run, env = _layer(tmp_path)
    assert staged_exit.finish(run.layer, interactive=True, env=env) == ["staged: the box changed nothing in the workdir"]
    assert not os.path.exists(run.layer.root)
    run, env = _layer(tmp_path)
    Path(run.layer.upper, "new.txt").write_text("x\n")
    # Not a terminal (pytest's stdin): no question, the line.
    assert staged_exit.finish(run.layer, interactive=True, env=env) == [
        f"staged: 1 changed, 0 flagged, 0 conflicts, not applied; apply: {ENTRY} apply {run.layer.run}; "
        f"review: {ENTRY} changes {run.layer.run}"]
    assert os.path.isdir(run.layer.upper)


def test_the_prompt_loop_keeps_on_enter_eof_and_a_refused_discard(tmp_path: Path) -> None:
    run, env = _layer(tmp_path)
    Path(run.layer.upper, "new.txt").write_text("x\n")
    c = staged_counts.counts(run.layer)[1]
    for answers in (["\n"], [None], ["what\n", "k\n"], ["d\n", "n\n", "\n"], ["d\n", None]):
        feed = iter(answers)
        lines = staged_exit.ask(-1, run.layer, c, env, ask_line=lambda _q, feed=feed: next(feed))
        assert lines[0].startswith("staged: kept; review: ") and os.path.isdir(run.layer.upper), answers
    feed = iter(["d\n", "y\n"])
    lines = staged_exit.ask(-1, run.layer, c, env, ask_line=lambda _q: next(feed))
    assert lines == [f"staged: discarded run {run.layer.run}; the checkout is as it was"]
    assert not os.path.exists(run.layer.root) and not (tmp_path / "work" / "new.txt").exists()


def test_the_sweep_and_clean_never_delete_an_unapplied_layer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A dead launcher's layer (kill -9, power cut) survives every launch's sweep and a plain
    `clean`; `--staged-older-than` removes ended runs older than the age, naming each, and never a
    running one."""
    from relay.commands.cli import _sweep_stale_state

    old, env = _layer(tmp_path, f"{dead_pid()}-1-deadbeef-{os.urandom(4).hex()}", started=time.time() - 10 * 86400)
    Path(old.layer.upper, "work.txt").write_text("unapplied\n")
    young, _ = _layer(tmp_path, f"{dead_pid()}-2-deadbeef-{os.urandom(4).hex()}")
    Path(young.layer.upper, "y.txt").write_text("y\n")
    mine, _ = _layer(tmp_path, started=time.time() - 30 * 86400)  # this process owns it: running
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "home" / ".local" / "state" / "hive-relay")  # even if they shared a dir
    for base in (env["XDG_RUNTIME_DIR"], staged.staged_root(env)):
        rundirs.run_dirs(base)
    _sweep_stale_state(env)
    assert all(os.path.isdir(r.layer.upper) for r in (old, young, mine))
    assert clean.clean(env=env) == 0
    out = capsys.readouterr().out
    assert all(os.path.isdir(r.layer.upper) for r in (old, young, mine))
    line = next(ln for ln in out.splitlines() if old.layer.root in ln)
    assert line.startswith("kept") and "1 changed" in line and f"changes {old.layer.run}" in line, out
    assert clean.clean(env=env, everything=True) == 0 and os.path.isdir(old.layer.upper)  # --all: still kept
    capsys.readouterr()
    assert clean.clean(env=env, dry_run=True, staged_older_than=7) == 0 and os.path.isdir(old.layer.upper)
    assert "would remove  staged run" in capsys.readouterr().out
    assert clean.clean(env=env, staged_older_than=7) == 0
    out = capsys.readouterr().out
    removed = next(ln for ln in out.splitlines() if old.layer.root in ln)
    assert removed.startswith("removed") and f"run {old.layer.run}: 10.0 days old, 1 changed" in removed, out
    assert not os.path.exists(old.layer.root) and os.path.isdir(young.layer.upper) and os.path.isdir(mine.layer.upper)
    assert "younger than 7 days" in next(ln for ln in out.splitlines() if young.layer.root in ln)
    assert "running" in next(ln for ln in out.splitlines() if mine.layer.root in ln)
    assert clean.clean(env=env, staged_older_than=0) == 0
    assert not os.path.exists(young.layer.root) and os.path.isdir(mine.layer.upper)


def test_clean_and_logs_on_the_command_line(sandbox: Sandbox) -> None:
    s = sandbox
    run, _ = _layer(s.root, f"{dead_pid()}-3-deadbeef-0000abcd")
    Path(run.layer.upper, "a.txt").write_text("a\n")
    plant_log(s.home / ".local" / "state" / "hive-relay" / "logs", "20260101-000000", run.layer.run)
    listing = s.relay("logs")
    row = next(ln for ln in listing.stdout.splitlines() if run.layer.run in ln and "B" in ln)
    assert row.rstrip().endswith(f"changes {run.layer.run}"), listing.stdout
    assert f"{ENTRY} changes RUN" in listing.stdout
    shown = s.relay("logs", run.layer.run)
    assert f"`{ENTRY} changes {run.layer.run}`" in shown.stdout, shown.stdout
    assert "--staged-older-than" in s.relay("clean", "--help").stdout
    assert "staged-older-than" in invoke(s, "--help", "clean").stdout
    assert "number of days" in one_error_line(s.relay("clean", "--staged-older-than", "soon"))
    kept = invoke(s, "clean", "--dry-run", "--staged-older-than", "1")
    assert kept.returncode == 0 and "younger than 1 days" in kept.stdout, kept.stdout + kept.stderr
    gone = s.relay("clean", "--staged-older-than", "0")
    assert gone.returncode == 0 and not os.path.exists(run.layer.root), gone.stdout


# ---- real boxes, a real terminal ----------------------------------------------------------------

def _runs(s: Sandbox) -> dict[str, dict]:
    r = s.relay("changes", "--json")
    assert r.returncode == 0, r.stderr
    return {x["run"]: x for x in json.loads(r.stdout)}


def _session(s: Sandbox, script: str = "echo box > made.txt") -> pexpect.spawn:
    """An interactive staged shell session that runs `script`, exits, and reaches the prompt."""
    child = pexpect.spawn(sys.executable, ["-m", "relay", "shell", "local", "--quiet", "--staged"], cwd=str(s.workdir),
                          env=s.env, encoding="utf-8", timeout=90, dimensions=(24, 80))
    child.sendline("echo READY$((40+2))")
    child.expect("READY42")
    child.sendline(f"{script}; exit 0")
    child.expect(r"staged: (\d+) changed, (\d+) flagged, (\d+ conflicts?) \(run (\S+);")
    return child


def _run_of(child: pexpect.spawn) -> str:
    return child.match.group(4)


def _end(child: pexpect.spawn) -> int:
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


@pytest.mark.box
@pytest.mark.tty
@pytest.mark.parametrize("answer", ["k", "enter", "ctrl-d"])
def test_keep_leaves_the_run_staged_and_the_host_untouched(box_sandbox: Sandbox, answer: str) -> None:
    s = box_sandbox
    child = _session(s)
    run = _run_of(child)
    assert child.match.group(1) == "1" and child.match.group(2) == "0"
    child.expect(PROMPT_RE)
    if answer == "ctrl-d":
        child.sendeof()
    else:
        child.send("k\r" if answer == "k" else "\r")
    child.expect(f"staged: kept; review: {ENTRY} changes {run}; apply: {ENTRY} apply {run}")
    assert _end(child) == 0
    assert not (s.workdir / "made.txt").exists()
    assert _runs(s)[run]["files"] == 1


@pytest.mark.box
@pytest.mark.tty
def test_apply_all_lands_the_unflagged_and_keeps_the_flagged_staged(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    (s.workdir / "Makefile").write_text("all:\n\t@echo ok\n")
    child = _session(s, "echo box > made.txt; printf 'all:\\n\\ttouch /tmp/never\\n' > Makefile")
    run = _run_of(child)
    assert child.match.group(1) == "2" and child.match.group(2) == "1"
    child.expect(PROMPT_RE)
    child.send("a\r")
    child.expect(r"applied 1 change\(s\); kept staged: Makefile")
    child.expect(f"still staged: 1 changed, 1 flagged, 0 conflicts; review: {ENTRY} changes {run}")
    assert _end(child) == 0
    assert (s.workdir / "made.txt").read_text() == "box\n"
    assert (s.workdir / "Makefile").read_text() == "all:\n\t@echo ok\n"
    assert _runs(s)[run]["files"] == 1


@pytest.mark.box
@pytest.mark.tty
def test_review_shows_the_diff_then_asks_again_and_discard_needs_a_yes(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    child = _session(s)
    run = _run_of(child)
    child.expect(PROMPT_RE)
    child.send("r\r")
    child.expect(r"A made\.txt")  # the summary
    child.expect(r"\+box")  # the diff (through the pager: less -F quits on a short one)
    child.expect(PROMPT_RE)
    child.send("d\r")
    child.expect(r"discard run \S+ \(1 changed, 0 flagged, 0 conflicts\) for good\? \[y/N\] ")
    child.send("\r")  # no: asked again, nothing dropped
    child.expect(PROMPT_RE)
    assert os.path.isdir(s.home / ".local" / "state" / "hive-relay" / "staged" / run / "upper")
    child.send("d\r")
    child.expect(r"\[y/N\] ")
    child.send("y\r")
    child.expect(f"discarded run {run}")
    assert _end(child) == 0
    assert run not in _runs(s) and not (s.workdir / "made.txt").exists()


@pytest.mark.box
@pytest.mark.tty
def test_ctrl_c_at_the_prompt_keeps_everything_and_the_terminal_is_sane(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    env = {**s.env, "PS1": "$ "}
    shell = pexpect.spawn("bash", ["--norc", "--noprofile", "-i"], cwd=str(s.workdir), env=env, encoding="utf-8",
                          timeout=90, dimensions=(24, 80))
    shell.sendline(f"{sys.executable} -m relay shell local --quiet --staged")
    shell.sendline("echo READY$((40+2))")
    shell.expect("READY42")
    shell.sendline("stty raw -echo; echo box > made.txt; exit 0")  # the box leaves the terminal raw
    shell.expect(r"\(run (\S+);")
    run = shell.match.group(1)
    shell.expect(PROMPT_RE)
    shell.sendintr()
    shell.expect(f"staged: kept; review: {ENTRY} changes {run}")
    shell.sendline("echo rc=$?")
    shell.expect(r"rc=(\d+)")
    assert shell.match.group(1) == "0"
    shell.sendline("stty -a | tr ' ' '\\n' | grep -x -e echo -e icanon | sort | tr '\\n' + ; echo")
    shell.expect(r"echo\+icanon\+")
    shell.sendline("exit")
    shell.expect(pexpect.EOF)
    assert not (s.workdir / "made.txt").exists() and _runs(s)[run]["files"] == 1


@pytest.mark.box
@pytest.mark.tty
def test_no_change_means_no_prompt_and_no_layer_left(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    before = set(_runs(s))
    child = pexpect.spawn(sys.executable, ["-m", "relay", "shell", "local", "--quiet", "--staged"], cwd=str(s.workdir),
                          env=s.env, encoding="utf-8", timeout=90, dimensions=(24, 80))
    child.sendline("echo READY$((40+2))")
    child.expect("READY42")
    child.sendline("cat README.md; exit 0")
    child.expect("the box changed nothing in the workdir")
    assert _end(child) == 0
    assert "[a]pply" not in (child.before or "")
    assert set(_runs(s)) == before


@pytest.mark.box
def test_a_prompt_run_prints_one_line_with_the_counts_and_the_apply_command(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    r = s.box("echo one > a.txt; echo two > b.txt", "shell", "--staged")
    assert r.returncode == 0, r.stderr
    (run,) = list(_runs(s))
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("hive-relay: staged: ")]
    assert lines == [f"hive-relay: staged: 2 changed, 0 flagged, 0 conflicts, not applied; apply: {ENTRY} apply {run}; "
                     f"review: {ENTRY} changes {run}"], r.stderr
    assert "[a]pply" not in r.stderr and not (s.workdir / "a.txt").exists()
    applied = subprocess.run([ENTRY, "apply", run], cwd=s.workdir, env=s.env, capture_output=True, text=True,
                             timeout=300, stdin=subprocess.DEVNULL)  # the exact command the line gives
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert (s.workdir / "a.txt").read_text() == "one\n" and (s.workdir / "b.txt").read_text() == "two\n"


@pytest.mark.box
def test_a_git_status_alone_leaves_no_layer_and_an_index_only_change_is_kept(box_sandbox: Sandbox) -> None:
    """`git status` in the box refreshes its index's stat cache: that is no change, and the layer goes.
    `git rm --cached` changes only the index: the run stays staged (nothing the box did is dropped)."""
    s = box_sandbox
    git = ["git", "-C", str(s.workdir), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "init"], check=True)
    r = s.box("git status --short; echo ok", "shell", "--staged")
    assert r.returncode == 0 and "the box changed nothing in the workdir" in r.stderr, r.stderr
    assert _runs(s) == {}
    r = s.box("git rm -q --cached README.md; echo ok", "shell", "--staged")
    assert r.returncode == 0 and "0 changed, 0 flagged, 0 conflicts, 1 git file, not applied" in r.stderr, r.stderr
    assert len(_runs(s)) == 1
    assert "README.md" in subprocess.run(git + ["ls-files"], capture_output=True, text=True).stdout
