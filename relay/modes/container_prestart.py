"""Start the container engine before the plan exists, with the argv the same command had last time.

Why: a warm container launch is the engine's own run plus ours, and ours came first: the
interpreter, the planner and the host steps (~50 ms) before `podman run` could start, then the
engine's own ~35 ms before it reads its seccomp profile. The entry (bin/contribute-hive, `python -m
relay`) calls `begin` before it imports the planner: when this user's last launch of the very same
command line, in the same directory, was a podman container launch, its engine argv is in a memo,
and the engine starts at once, waiting at its start gate (relay/modes/engine_gate.py), while the plan
is made from scratch, as always.

The plan decides, never the memo: the runner `take`s the waiting engine only when the plan's argv,
environment and directory are exactly the ones it was started with; otherwise it is killed where it
waits (it has created nothing) and the plan's own engine starts behind the same gate. A command line
whose plan changed (a config file, the environment, the image) costs one killed engine, nothing else.

The memo (relay/host/memo.py, kind ENGINE_ARGV) is trusted as the other memos are: the cache dir is
read-only in every box and absent from containers. On top of that, a memo is used only when it is ours
alone (relay/host/memo.py: no other user owns the cache dir or the file) and its argv is in the
closed grammar of container_argv's podman run (`image_at`: a root-owned podman, only our options in
our spellings, this run's name, pidfile and gate as the one profile, our image, one this user's
engine had), so no option that acts before podman reads its profile can be in it. Neither a prompt nor a `-- CMD`
is ever kept in it: the prompt is a marker there, and a command line with `--` is not remembered.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping, Sequence

from relay.host import memo
from relay.host.phase_marks import mark
from relay.modes import engine_gate
from relay.modes.engine_gate import EngineGate
from relay.modes.image_tag import IMAGE_REPO
from relay.render.container_argv import ENTRYPOINT
from relay.trust.rundirs import path_for

RUN = "\0run\0"  # in a remembered argv: where the run id stood (argv words cannot hold NUL)
PROMPT = "\0prompt\0"  # ... and the prompt
PREFIX = ["--log-level=error", "run", "--rm", "-i", "--pull=never", "--name"]  # relay/render/container_argv.py
MAX_MEMO = 256 << 10
PROMPT_FLAGS = ("--prompt", "-r")  # relay/commands/options.py: ("prompt", "r", "PROMPT")


class _Prestart:
    """The engine started by `begin`, waiting at its gate, with the run id the plan must take."""

    def __init__(self, run_id: str, run_dir: str, gate: EngineGate) -> None:
        self.run_id, self.run_dir, self.gate = run_id, run_dir, gate


_ENTRY: list[str] | None = None  # the entry's own arguments (what `remember` keys on); None: no entry called begin
_PENDING: _Prestart | None = None
_STARTED: str | None = None  # the run id whose gated engine started a container (what `remember` may keep)


def _prompt_word(argv: Sequence[str]) -> tuple[int, str, str] | None:
    """Where the --prompt value stands in an entry's arguments, in the spellings the parser takes whole
    (`--prompt X`, `--prompt=X`, `-r X`, `-rX`): (the word's index, what precedes the value in that
    word, the value); None for none (an abbreviation or a grouped flag is not seen: the command line
    is then simply not remembered, see `remember`)."""
    for i, word in enumerate(argv):
        if word == "--":
            break
        if word in PROMPT_FLAGS and i + 1 < len(argv):
            return i + 1, "", argv[i + 1]
        for spelling in ("--prompt=", "-r"):
            if word.startswith(spelling) and len(word) > 2 and (spelling != "-r" or not word.startswith("--")):
                return i, spelling, word[len(spelling):]
    return None


def prompt_of(argv: Sequence[str]) -> str | None:
    """The --prompt value of an entry's arguments (`_prompt_word`), or None."""
    found = _prompt_word(argv)
    return found[2] if found else None


def entry_key(argv: Sequence[str], cwd: str, uid: int) -> str:
    """The memo's name for one command line: its words (the prompt's value a marker, in whichever
    spelling), the directory and the uid."""
    words = list(argv)
    found = _prompt_word(words)
    if found:
        words[found[0]] = found[1] + PROMPT
    return memo.key_of("engine-argv", str(uid), cwd, *words)


def to_template(argv: Sequence[str], run_id: str, prompt: str | None, image: int) -> list[str] | None:
    """ARGV with the run id and the prompt as markers, the prompt only where it stands whole in the
    container's command (after the image, index IMAGE); None when the prompt would still be kept (it
    is part of a longer word, or empty)."""
    out = []
    for i, word in enumerate(argv):
        if prompt is not None and i > image and word == prompt:
            out.append(PROMPT)
            continue
        # An option's own value that happens to equal the prompt (`--network none`) is the plan's, kept.
        if prompt is not None and (not prompt or prompt in word) and not (i <= image and word == prompt):
            return None
        out.append(word.replace(run_id, RUN))
    return out


def from_template(template: Sequence[str], run_id: str, prompt: str | None) -> list[str] | None:
    """The argv for this run; None when the template has a prompt and this command line has none."""
    if prompt is None and PROMPT in template:
        return None
    return [prompt if w == PROMPT and prompt is not None else w.replace(RUN, run_id) for w in template]


# The closed grammar of container_argv.build's podman argv (no gvisor runtime): after PREFIX, only
# these options, each in this spelling, up to the image; the container's command follows it (podman
# stops reading options at the image). Anything else (a `--opt=value` spelling, `--pull`, `--pod`,
# a global flag after `run`, a second profile) is not ours, and is never started: several options
# act before podman reads its profile, the gate.
FLAGS = frozenset({"--read-only", "-t", "--http-proxy=false", "--read-only-tmpfs=false"})
FIXED = {"--cap-drop": "ALL", "--network": "none", "--ipc": "private", "--userns": "keep-id",
         "--entrypoint": ENTRYPOINT}
FREE = frozenset({"--user", "--workdir", "--label", "--ulimit", "--pids-limit", "--memory", "--memory-swap",
                  "--volume", "--tmpfs", "--env"})
IMAGE = re.compile(re.escape(IMAGE_REPO) + r":[0-9a-f]{12}-u[0-9]+")


def image_at(argv: Sequence[str], run_dir: str) -> int | None:
    """The index of the image in ARGV when ARGV is container_argv's podman run for RUN_DIR's run (its
    name, pidfile and gate that run's, one profile, the image ours), else None."""
    run_id = os.path.basename(run_dir)[len("hive-relay-"):]
    if len(argv) < len(PREFIX) + 3 or not os.path.isabs(argv[0]) or os.path.basename(argv[0]) != "podman":
        return None
    if list(argv[1:1 + len(PREFIX)]) != PREFIX or argv[1 + len(PREFIX)] != f"hive-relay-{run_id}":
        return None
    profiles = 0
    i = 2 + len(PREFIX)
    while i < len(argv):
        word = argv[i]
        if not word.startswith("-"):
            break
        if word in FLAGS:
            i += 1
            continue
        if i + 1 >= len(argv):
            return None
        value = argv[i + 1]
        if word == "--security-opt":
            if value == f"seccomp={os.path.join(run_dir, engine_gate.PROFILE_NAME)}":
                profiles += 1
            elif value != "no-new-privileges":
                return None
        elif word == "--pidfile":
            if value != os.path.join(run_dir, "pid"):
                return None
        elif word in FIXED:
            if value != FIXED[word]:
                return None
        elif word not in FREE:
            return None
        i += 2
    if profiles != 1 or i >= len(argv) or not IMAGE.fullmatch(argv[i]):
        return None
    return i


def engine_ok(path: str) -> bool:
    """A root-owned regular file no one else may write (a podman a box or another user planted is not)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def begin(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> None:
    """The entry's first call (before the planner is imported): start the remembered engine, if any.
    Never fails the launch: anything unexpected leaves no prestart, and the launch starts its engine
    itself."""
    global _ENTRY, _PENDING
    _ENTRY = list(argv)
    env = os.environ if environ is None else environ
    if "--" in _ENTRY or env.get("HIVE_RELAY_PRESTART") == "0":
        return
    try:
        if environ is None:
            # As every command does first (relay/commands/guarded.py), and before anything runs by
            # name: podman looks its conmon and runtime up on PATH, and a relative entry is the workdir.
            from relay.host.paths import drop_relative_path_entries

            drop_relative_path_entries(os.environ)
        cwd = os.getcwd()
        data = memo.get(env, memo.MemoKind.ENGINE_ARGV, entry_key(_ENTRY, cwd, os.getuid()), MAX_MEMO)
        if not data:
            return
        entry = json.loads(data)
        template, workdir = entry["argv"], entry["cwd"]
        if not (isinstance(template, list) and all(isinstance(w, str) for w in template) and isinstance(workdir, str)):
            return
        from relay.host.liveness import new_run_id

        run_id = new_run_id()
        run_dir = path_for(env, run_id)
        argv_now = from_template(template, run_id, prompt_of(_ENTRY))
        image = image_at(argv_now, run_dir) if argv_now is not None else None
        if argv_now is None or image is None or not engine_ok(argv_now[0]):
            return
        from relay.modes.image_tag import ready_image

        if not ready_image(argv_now[0], argv_now[image], env):
            return  # gone since (an upgrade's new tag): its engine would only say "image not known"
        os.mkdir(run_dir, 0o700)
    except Exception:  # noqa: BLE001 - a memo of any wrong shape (nesting too deep included) is a miss
        return
    try:
        gate = engine_gate.make(run_dir)
    except OSError:
        _remove_run_dir(run_dir)
        return
    try:
        from relay.box.resource_limits import raise_nofile

        raise_nofile()  # as the runner does before its own engine: the client's fd limit is the same either way
        gate.start(argv_now, env, workdir)
    except Exception:  # noqa: BLE001 - no engine (or a word Popen refuses): the launch starts its own
        gate.cancel()
        _remove_run_dir(run_dir)
        return
    _PENDING = _Prestart(run_id, run_dir, gate)
    mark("prestarted")


def run_id() -> str | None:
    """The run id a prestarted engine's argv names (the request must take it), or None."""
    return _PENDING.run_id if _PENDING is not None else None


def take(run_dir: str | None) -> EngineGate | None:
    """The runner's call, once the plan exists: the prestarted gate if RUN_DIR is its run dir (the plan
    took its run id), else None, with any prestart cancelled and its run dir removed. The caller
    starts the plan's engine behind the gate (EngineGate.start keeps the waiting one only if its
    argv, env and cwd are the plan's)."""
    global _PENDING
    pre, _PENDING = _PENDING, None
    if pre is None:
        return None
    if run_dir != pre.run_dir:
        pre.gate.cancel()
        _remove_run_dir(pre.run_dir)
        return None
    return pre.gate


def abandon() -> None:
    """The entry's last call: a prestart nothing took (the command ended before its box) is killed
    and its run dir removed."""
    take(None)


def started(run_id: str) -> None:
    """The gated engine of RUN_ID started its container: its argv may be remembered."""
    global _STARTED
    _STARTED = run_id


def remember(command: Sequence[str], workdir: str, run_id: str, prompt: str | None, env: Mapping[str, str]) -> None:
    """After a launch whose gated engine started: keep its argv for the next identical command line
    (only when the entry called `begin`, the prompt the parser saw is the one `prompt_of` sees, and
    no `-- CMD` was given). Best effort, and written only when it changed."""
    if _ENTRY is None or run_id != _STARTED or not run_id or "--" in _ENTRY or prompt_of(_ENTRY) != prompt:
        return
    image = image_at(command, path_for(env, run_id))
    template = to_template(command, run_id, prompt, image) if image is not None else None
    if template is None:
        return
    data = json.dumps({"argv": template, "cwd": workdir}).encode()
    key = entry_key(_ENTRY, os.getcwd(), os.getuid())
    if memo.get(env, memo.MemoKind.ENGINE_ARGV, key, MAX_MEMO) != data:
        memo.put(env, memo.MemoKind.ENGINE_ARGV, key, data)


def _remove_run_dir(run_dir: str) -> None:
    """A run dir only `begin` made: the gate's FIFO, then the dir."""
    try:
        os.unlink(os.path.join(run_dir, engine_gate.PROFILE_NAME))
    except OSError:
        pass
    try:
        os.rmdir(run_dir)
    except OSError:
        pass
