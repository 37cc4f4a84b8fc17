"""A staged run's counts (changed, flagged, conflicts, refused, git state) and the lines that say them: shared by the exit prompt (staged_exit) and the review (changes_text). Pure but for `counts`, which reads the layer."""

from __future__ import annotations

import os

from relay.host import safefs
from relay.model.record import record
from relay.model.refusal import ENTRY
from relay.trust import staged


@record
class Counts:
    """The counts a staged run's exit line shows: changed, flagged, conflicting, refused and git files."""

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
    from relay.trust.gitindex import BadIndex, parse

    try:
        x, y = parse(a), parse(b)
    except BadIndex:
        return False

    def key(ix) -> list[tuple]:  # noqa: ANN001 - gitindex.Index
        return [(e.name, e.mode, e.oid, e.flags, e.xflags) for e in ix.entries]

    return x.hash_len == y.hash_len and key(x) == key(y)


def counts(layer: staged.StagedLayer) -> tuple[staged.Run, Counts]:
    from relay.trust.changes import review

    run = staged.load(layer)
    return run, counts_of(review(run), git_state_changed(run))
