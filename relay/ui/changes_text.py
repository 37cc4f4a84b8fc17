"""The staged run's review as the user reads it: the listing, one run's entries, the unified diff
(paged and coloured on a terminal, plain otherwise, binaries named), and the `changes`, `diff`,
`apply`, `discard` commands with their `--json` forms. The judging and the landing are in
relay/trust/changes.py; this module only renders and dispatches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from relay.host import safefs
from relay.model.errors import RelayError
from relay.model.refusal import ENTRY
from relay.trust import staged
from relay.trust.changes import DIFF_LIMIT, Entry, Review, apply, discard, receipt, review, select_entries

LETTER = {"git": "G", "added": "A", "modified": "M", "deleted": "D", "mode": "X", "symlink": "L", "dir": "A", "special": "!"}


def _age(started: object) -> str:
    if not isinstance(started, (int, float)):
        return "?"
    s = max(0, int(time.time() - started))
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h" if s < 172800 else f"{s // 86400}d"


def shown(text: str) -> str:
    """A box-chosen name as one printable line: a control character (an escape sequence could hide
    the flagged lines after it, a newline forge one) or a byte that is not UTF-8 is shown as \\xNN."""
    out = []
    for c in text:
        if c.isprintable() and c != "\\":
            out.append(c)
        elif c == "\\":
            out.append("\\\\")
        elif "\udc80" <= c <= "\udcff":  # surrogateescape: the byte that was not UTF-8
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        else:
            out.append(repr(c)[1:-1])  # ESC as \x1b, a newline as \n
    return "".join(out)


def entry_line(e: Entry) -> str:
    if e.note:
        return f"  G {shown(e.note)}"
    name = shown(e.path) + ("/" if e.kind == "dir" else "") + (f" -> {shown(e.link)}" if e.link is not None else "")
    bits = []
    if e.kind == "mode" and e.before_mode is not None and e.mode is not None:
        bits.append(f"mode {oct(e.before_mode & 0o7777)} -> {oct(e.mode & 0o7777)}")
    bits += [f"flagged {f['class']}: {f['why']}" for f in e.flags]
    if e.conflict:
        bits.append(f"CONFLICT: {e.conflict}")
    if e.refused:
        bits.append(f"refused: {e.refused}")
    return f"  {LETTER.get(e.kind, '?')} {name}" + (f"   [{'; '.join(bits)}]" if bits else "")


def summary(rv: Review) -> dict:
    es = rv.entries
    return {"files": len(es), "flagged": sum(e.flagged for e in es), "conflicts": sum(bool(e.conflict) for e in es),
            "refused": sum(bool(e.refused) for e in es), "git": rv.git}


def exit_line(layer: staged.StagedLayer) -> str:
    """The launcher's last line for a staged run that asks nothing: counts and the exact commands
    (relay/ui/staged_exit.py's, which also asks on an interactive terminal)."""
    from relay.ui.staged_counts import counts, prompt_run_line

    try:
        _, c = counts(layer)
    except (RelayError, OSError):
        return f"staged: the box's changes are in {layer.root}; review: {ENTRY} changes {layer.run}"
    if c.empty:
        # Nothing to review (the layer holds at most the masks' placeholders and copied-up dirs):
        # staged is the default, so an idle run must not leave a layer behind.
        staged.remove_layer(layer.root)
        return f"staged: the box changed nothing in the workdir (run {layer.run})"
    return prompt_run_line(c, layer.run)


def apply_at_exit(layer: staged.StagedLayer) -> list[str]:
    """--apply: what is not flagged lands now; conflicts and flagged entries stay staged."""
    try:
        done, held = apply(staged.load(layer), skip_flagged=True)
    except (RelayError, OSError) as err:
        return [f"staged: --apply did not run: {getattr(err, 'message', None) or err}; nothing was applied"]
    return [f"staged: applied {len(done)} change(s) at exit (--apply)" + (
        f"; kept staged: {', '.join(sorted({e.path for e, _ in held}))}" if held else "")]


def changes_main(spec: str | None, as_json: bool, env: Mapping[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    if spec is None:
        rows = []
        for run in staged.runs(env):
            s = summary(review(run))
            rows.append({"run": run.layer.run, "backend": run.meta.get("backend"), "workdir": run.workdir,
                         "age": _age(run.meta.get("started")), "running": run.running(), **s})
        if as_json:
            print(json.dumps(rows, indent=2))
            return 0
        if not rows:
            print("hive-relay: no staged runs (a local or container run is staged unless --live; kube runs are staged when they end)")
            return 0
        print(f"{'RUN':<40} {'BACKEND':<9} {'AGE':>5} {'FILES':>5} {'FLAGGED':>7}  STATE    WORKDIR")
        for r in rows:
            print(f"{r['run']:<40} {r['backend']!s:<9} {r['age']:>5} {r['files']:>5} {r['flagged']:>7}  "
                  f"{'running' if r['running'] else 'ended':<8} {r['workdir']}")
        return 0
    run = staged.find(env, spec)
    rv = review(run)
    if as_json:
        print(json.dumps(receipt(run, rv), indent=2))
        return 0
    s = summary(rv)
    print(f"hive-relay: run {run.layer.run} · {run.meta.get('backend')} · {run.workdir} · "
          f"{_age(run.meta.get('started'))} ago · {'running' if run.running() else 'ended'}")
    print(f"hive-relay: {s['files']} change(s), {s['flagged']} flagged, {s['conflicts']} conflict(s), "
          f"{s['refused']} refused" + (f"; {s['git']} git object/ref file(s) staged (applied with the whole run)"
                                        if s["git"] else ""))
    for e in rv.entries:
        print(entry_line(e))
    return 0


def _binary(data: bytes) -> bool:
    if b"\0" in data[:8192]:
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def diff_text(run: staged.Run, paths: Sequence[str] = ()) -> list[str]:
    import difflib  # only for a diff, never at launch

    rv = review(run)
    out: list[str] = []
    ufd = os.open(run.layer.upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with safefs.base_dir(run.workdir) as wfd:
            for e in select_entries(rv.entries, paths):
                a, b = f"a/{e.path}", f"b/{e.path}"
                if e.kind in ("symlink", "special", "dir") or e.refused:
                    out.append(f"{entry_line(e).strip()}\n")
                    continue
                old = _read_or_empty(wfd, e.path) if e.kind != "added" else b""
                new = _read_or_empty(ufd, e.path) if e.kind != "deleted" else b""
                if old is None or new is None or _binary(old) or _binary(new):
                    out.append(f"Binary files {a} and {b} differ\n")
                    continue
                head = []
                if e.kind == "mode" and e.before_mode is not None and e.mode is not None:
                    head = [f"old mode {oct(e.before_mode & 0o777)}\n", f"new mode {oct(e.mode & 0o777)}\n"]
                lines = list(difflib.unified_diff(old.decode().splitlines(True), new.decode().splitlines(True),
                                                  "/dev/null" if e.kind == "added" else a,
                                                  "/dev/null" if e.kind == "deleted" else b))
                out += [f"diff {a} {b}\n", *head, *(ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n"
                                                    for ln in lines)]
    finally:
        os.close(ufd)
    return out


def _read_or_empty(dfd: int, rel: str) -> bytes | None:
    try:
        return safefs.read_beneath(dfd, rel, DIFF_LIMIT) or b""
    except OSError:
        return None


def _colour(line: str) -> str:
    if line.startswith(("+++", "---", "diff ")):
        return f"\x1b[1m{line[:-1]}\x1b[0m\n"
    if line.startswith("+"):
        return f"\x1b[32m{line[:-1]}\x1b[0m\n"
    if line.startswith("-"):
        return f"\x1b[31m{line[:-1]}\x1b[0m\n"
    if line.startswith("@@"):
        return f"\x1b[36m{line[:-1]}\x1b[0m\n"
    return line


def diff_main(spec: str, paths: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    lines = diff_text(staged.find(env, spec), paths)
    if not sys.stdout.isatty():
        sys.stdout.write("".join(lines))
        return 0
    text = "".join(_colour(ln) for ln in lines)
    pager = shutil.which("less")
    if pager is None:
        sys.stdout.write(text)
        return 0
    proc = subprocess.Popen([pager, "-R", "-F", "-X"], stdin=subprocess.PIPE)
    try:
        assert proc.stdin is not None
        proc.stdin.write(text.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    proc.wait()
    return 0


def apply_main(spec: str, paths: Sequence[str], skip_flagged: bool, as_json: bool = False,
               env: Mapping[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    run = staged.find(env, spec)
    done, held = apply(run, paths, skip_flagged)
    if as_json:
        print(json.dumps({"run": run.layer.run, "applied": [e.to_json() for e in done],
                          "held": [{**e.to_json(), "why": why} for e, why in held]}, indent=2))
    else:
        for e in done:
            print(f"applied {entry_line(e).strip()}")
        for e, why in held:
            print(f"kept    {LETTER.get(e.kind, '?')} {e.path}   ({why})")
        print(f"hive-relay: applied {len(done)}, kept staged {len(held)} (run {run.layer.run})")
    # Conflicts and failures ask for the user's hand; flagged entries left by --skip-flagged and
    # refused special files are what was asked for.
    return 1 if any(why.startswith(("conflict", "not applied")) for _, why in held) else 0


def discard_main(spec: str, paths: Sequence[str], as_json: bool = False, env: Mapping[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    run = staged.find(env, spec)
    gone = discard(run, paths)
    if as_json:
        print(json.dumps({"run": run.layer.run, "discarded": gone}, indent=2))
    else:
        print(f"hive-relay: discarded {'the whole run' if gone == ['(all)'] else ', '.join(gone)} "
              f"(run {run.layer.run})")
    return 0
