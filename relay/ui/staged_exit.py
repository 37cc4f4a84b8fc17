"""The end of a staged run, as the user meets it: one summary line, and on an interactive terminal a
prompt (apply all, review, keep staged, discard); with no change at all, the empty layer goes quietly.

Why a prompt at all: a staged run's work is invisible in the checkout until applied, and a user who
just watched the agent work expects to see it land. Why its default is "keep staged": the layer is
the only copy of the box's work, so Enter, Ctrl-C, end of input, a hang-up or any error here must
lose nothing; every answer but an explicit `d` + `y` leaves the run reviewable with `changes RUN`.

The answer is read only once the box is gone and the caller's terminal is back (relay/box/jobctl.py
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

from relay.model.errors import RelayError
from relay.model.refusal import ENTRY
from relay.model.vocab import ExitChoice
from relay.trust import staged
from relay.ui.staged_counts import Counts, apply_command, counts, counts_text, prompt_run_line, summary_line

PROMPT = "[a]pply all · [r]eview · [k]eep staged · [d]iscard"
ANSWER_LIMIT = 256


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
                from relay.trust.changes import discard

                discard(staged.load(layer), box_ended=True)
                return [f"staged: discarded run {layer.run}; the checkout is as it was"]
    except (_Interrupted, KeyboardInterrupt, EOFError):
        _say("")
        return keep


def _review(layer: staged.StagedLayer, env: Mapping[str, str]) -> None:
    """`changes RUN`, then `diff RUN` through the pager; Ctrl-C there belongs to the pager."""
    from relay.ui.changes_text import changes_main, diff_main

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        changes_main(layer.run, as_json=False, env=env)
        sys.stdout.flush()
        diff_main(layer.run, (), env=env)
        sys.stdout.flush()
    finally:
        signal.signal(signal.SIGINT, old)


def _apply_all(layer: staged.StagedLayer) -> list[str]:
    from relay.ui.changes_text import apply_at_exit

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
    lines: list[str] = []
    if layer.apply_at_exit:  # the review machinery is imported only for a run that uses it (~10 ms)
        from relay.ui.changes_text import apply_at_exit

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
