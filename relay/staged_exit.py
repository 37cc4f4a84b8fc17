"""The end of a staged run, as the user meets it: one summary line, and on an interactive terminal a
prompt (apply all, review, keep staged, discard); with no change at all, the empty layer goes quietly.

Why a prompt at all: a staged run's work is invisible in the checkout until applied, and a user who
just watched the agent work expects to see it land. Why its default is "keep staged": the layer is
the only copy of the box's work, so Enter, Ctrl-C, end of input, a hang-up or any error here must
lose nothing; every answer but an explicit `d` + `y` leaves the run reviewable with `changes RUN`.

The answer is read only once the box is gone and the caller's terminal is back (relay/jobctl.py
restored its modes and made the launcher its foreground group), in cooked mode set here for the
question alone, after discarding what was typed before the question was shown (a keystroke meant for
the agent must not answer it). Pure parts (the counts, the lines, the parsing) are functions of their
inputs; `finish` is the thin layer that reads the layer and the terminal.
"""

from __future__ import annotations

import os
import signal
import sys
import termios
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from . import safefs, staged
from .denial import ENTRY
from .errors import RelayError
from .vocab import ExitChoice

PROMPT = "[a]pply all · [r]eview · [k]eep staged · [d]iscard"
ANSWER_LIMIT = 256


@dataclass(frozen=True)
class Counts:
    changed: int = 0
    flagged: int = 0
    conflicts: int = 0
    refused: int = 0
    git: int = 0  # files under .git in the layer (objects, refs) plus git state files that differ

    @property
    def empty(self) -> bool:
        return not (self.changed or self.git)


def counts_of(rv, git_state: int = 0) -> Counts:  # noqa: ANN001 - changes.Review
    """Pure: the counts of one review (and how many of the box's git state files differ from the host's)."""
    es = rv.entries
    return Counts(len(es), sum(e.flagged for e in es), sum(bool(e.conflict) for e in es),
                  sum(bool(e.refused) for e in es), rv.git + git_state)


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else many or word + 's'}"


def counts_text(c: Counts) -> str:
    """Pure: `3 changed, 1 flagged, 0 conflicts` (+ refused and git when there are any)."""
    text = f"{c.changed} changed, {c.flagged} flagged, {_plural(c.conflicts, 'conflict')}"
    if c.refused:
        text += f", {c.refused} refused"
    if c.git:
        text += f", {_plural(c.git, 'git file')}"
    return text


def summary_line(c: Counts, run: str) -> str:
    """Pure: the interactive run's one line above the prompt."""
    return f"staged: {counts_text(c)} (run {run}; nothing applied yet)"


def apply_command(c: Counts, run: str, entry: str = ENTRY) -> str:
    """Pure: the exact command that applies the run (leaving its flagged entries staged, if any)."""
    return f"{entry} apply {run}" + (" --skip-flagged" if c.flagged else "")


def prompt_run_line(c: Counts, run: str, entry: str = ENTRY) -> str:
    """Pure: a non-interactive run's last line: the counts and the exact commands to review and apply."""
    return f"staged: {counts_text(c)}, not applied; apply: {apply_command(c, run, entry)}; review: {entry} changes {run}"


def parse_answer(text: str) -> ExitChoice | None:
    """Pure: what the user typed at the prompt. Empty (Enter) keeps; unknown input is None (ask again)."""
    word = text.strip().lower()
    if not word:
        return ExitChoice.KEEP
    for choice in ExitChoice:
        if word in (choice.value, choice.value[0]) or (choice == ExitChoice.APPLY and word == "apply all"):
            return choice
    return None


def parse_yes(text: str) -> bool:
    """Pure: a y/N confirmation; only an explicit yes counts."""
    return text.strip().lower() in ("y", "yes")


# ---- the layer ---------------------------------------------------------------------------------

def git_state_changed(run: staged.Run) -> int:
    """How many of the box's kept git state files (HEAD, index of the workdir's repository) differ
    from the host's now (a `git rm --cached` or `git symbolic-ref` changes nothing else)."""
    top = next((g for g in run.meta.get("git") or [] if isinstance(g, dict)
                and g.get("host") == os.path.join(run.workdir, ".git")), None)
    if top is None:
        return 0
    n = 0
    for name in ("HEAD", "index"):
        key = os.path.join(str(top.get("private")), name)
        try:
            with safefs.base_dir(os.path.join(run.layer.root, "git")) as sfd:
                data = safefs.read_beneath(sfd, key, 256 << 20)
            if data is None:
                continue
            with safefs.base_dir(os.path.join(run.workdir, ".git")) as gfd:
                host = safefs.read_beneath(gfd, name, 256 << 20)
        except OSError:
            n += 1  # unreadable: count it as a change, so the layer is never dropped for it
            continue
        n += not (host == data or (name == "index" and host is not None and same_index(host, data)))
    return n


def same_index(a: bytes, b: bytes) -> bool:
    """Pure: the two indexes track the same paths at the same blobs, modes, stages and flags; only
    stat data (git's cache, refreshed by a plain `git status` in the box) may differ. An index that
    does not parse is never the same."""
    from .gitindex import BadIndex, parse

    try:
        x, y = parse(a), parse(b)
    except BadIndex:
        return False

    def key(ix) -> list[tuple]:  # noqa: ANN001 - gitindex.Index
        return [(e.name, e.mode, e.oid, e.flags, e.xflags) for e in ix.entries]

    return x.hash_len == y.hash_len and key(x) == key(y)


def counts(layer: staged.StagedLayer) -> tuple[staged.Run, Counts]:
    from .changes import review

    run = staged.load(layer)
    return run, counts_of(review(run), git_state_changed(run))


# ---- the terminal ------------------------------------------------------------------------------

def terminal_fd() -> int | None:
    """The caller's terminal when stdin, stdout and stderr (where the question goes) are terminals
    and we are the terminal's foreground group (a background job would stop on the read)."""
    try:
        if os.isatty(0) and os.isatty(1) and os.isatty(2) and os.tcgetpgrp(0) == os.getpgrp():
            return 0
    except OSError:
        pass
    return None


class _Interrupted(Exception):
    pass


def _raise(signum: int, _frame: object) -> None:
    raise _Interrupted(signal.Signals(signum).name)


@contextmanager
def cooked(fd: int) -> Iterator[None]:
    """The terminal in canonical mode with echo and key signals for the question, as it was after."""
    old = termios.tcgetattr(fd)
    new = termios.tcgetattr(fd)
    new[0] |= termios.ICRNL
    new[1] |= termios.OPOST | termios.ONLCR
    new[3] |= termios.ICANON | termios.ECHO | termios.ECHOE | termios.ISIG
    new[6][termios.VMIN], new[6][termios.VTIME] = 1, 0
    saved = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT)}
    try:
        termios.tcsetattr(fd, termios.TCSANOW, new)
        termios.tcflush(fd, termios.TCIFLUSH)  # typeahead meant for the agent never answers
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        try:
            termios.tcsetattr(fd, termios.TCSADRAIN, old)
        except termios.error:
            pass


def read_line(fd: int) -> str | None:
    """One answer line; None at end of input."""
    data = b""
    while not data.endswith(b"\n") and len(data) < ANSWER_LIMIT:
        try:
            chunk = os.read(fd, ANSWER_LIMIT)
        except InterruptedError:
            continue
        if not chunk:
            return None if not data else data.decode(errors="replace")
        data += chunk
    return data.decode(errors="replace")


def _say(text: str, end: str = "\n") -> None:
    sys.stderr.write(text + end)
    sys.stderr.flush()


def ask(fd: int, layer: staged.StagedLayer, c: Counts, env: Mapping[str, str],
        ask_line: Callable[[str], str | None] | None = None) -> list[str]:
    """The prompt loop; returns the closing lines. Everything but `d` + `y` or `a` keeps the run staged."""
    keep = [f"staged: kept; review: {ENTRY} changes {layer.run}; apply: {apply_command(c, layer.run)}"]

    def read(question: str) -> str | None:
        if ask_line is not None:
            return ask_line(question)
        with cooked(fd):  # flushed before the question shows: an answer typed after it is kept
            _say(question, end="")
            return read_line(fd)

    _say(f"hive-relay: {summary_line(c, layer.run)}")
    try:
        while True:
            answer = read(f"hive-relay: {PROMPT} (Enter: keep) ")
            if answer is None:
                _say("")
                return keep
            choice = parse_answer(answer)
            if choice is None:
                _say("hive-relay: answer a, r, k or d")
                continue
            if choice == ExitChoice.KEEP:
                return keep
            if choice == ExitChoice.REVIEW:
                _review(layer, env)
                continue
            if choice == ExitChoice.APPLY:
                return _apply_all(layer)
            sure = read(f"hive-relay: discard run {layer.run} ({counts_text(c)}) for good? [y/N] ")
            if sure is None:  # end of input: nothing more will be typed
                _say("")
                return keep
            if parse_yes(sure):
                from .changes import discard

                discard(staged.load(layer), box_ended=True)
                return [f"staged: discarded run {layer.run}; the checkout is as it was"]
    except (_Interrupted, KeyboardInterrupt, EOFError):
        _say("")
        return keep


def _review(layer: staged.StagedLayer, env: Mapping[str, str]) -> None:
    """`changes RUN`, then `diff RUN` through the pager; Ctrl-C there belongs to the pager."""
    from .changes_text import changes_main, diff_main

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        changes_main(layer.run, as_json=False, env=env)
        sys.stdout.flush()
        diff_main(layer.run, (), env=env)
        sys.stdout.flush()
    finally:
        signal.signal(signal.SIGINT, old)


def _apply_all(layer: staged.StagedLayer) -> list[str]:
    from .changes_text import apply_at_exit

    lines = [ln.replace(" at exit (--apply)", "") for ln in apply_at_exit(layer)]
    try:
        _, left = counts(layer)
    except (RelayError, OSError):
        return lines
    if not left.empty:
        lines.append(f"staged: still staged: {counts_text(left)}; review: {ENTRY} changes {layer.run}")
    return lines


def finish(layer: staged.StagedLayer, interactive: bool, env: Mapping[str, str]) -> list[str]:
    """The runner's hook, after the box is torn down and the terminal is back (its other lines
    already shown): the closing lines; on an interactive terminal, after the question."""
    from .changes_text import apply_at_exit

    lines: list[str] = []
    if layer.apply_at_exit:
        lines += apply_at_exit(layer)
    try:
        run, c = counts(layer)
    except (RelayError, OSError):
        return [*lines, f"staged: the box's changes are in {layer.root}; review: {ENTRY} changes {layer.run}"]
    if c.empty and not layer.apply_at_exit:
        try:  # our own run, its box gone: an empty layer holds nothing to review
            staged.remove_layer(run.layer.root)
        except OSError:
            return [*lines, f"staged: the box changed nothing in the workdir (run {layer.run})"]
        return [*lines, "staged: the box changed nothing in the workdir"]
    if c.empty:
        return lines
    fd = terminal_fd() if interactive and not layer.apply_at_exit else None
    if fd is None:
        return [*lines, prompt_run_line(c, layer.run)]
    try:
        return [*lines, *ask(fd, layer, c, env)]
    except Exception as err:  # noqa: BLE001 - whatever failed, the layer stays: nothing is lost
        return [*lines, f"staged: the prompt failed ({err}); kept staged: {ENTRY} changes {layer.run}"]
