"""Per-run host state and its cleanup, done by a forked janitor so that even `kill -9` of the
launcher leaves nothing behind: no run dir, no cgroup, no placeholder files in the workdir,
and no lost edits to synced files such as ~/.claude.json.

The janitor is forked before any thread exists; it waits for the launcher's end of a pipe
to close (normal exit or death), then tears down and exits.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import signal
import stat
import time
from collections.abc import Callable
from contextlib import contextmanager

from relay.box import resource_limits
from relay.host import liveness, procs, safefs
from relay.model import credential_files
from relay.model.hashing import sha256
from relay.model.record import field, record
from relay.model.vocab import HostStep
from relay.trust import agentstate, gitdir, guard, rundirs, state_scan
from relay.trust.placeholders import Registry


@record(frozen=False)
class RunState:
    """What the janitor must undo for one run: its run dir, synced files' hashes, placeholders, guards and owner."""

    run_dir: str | None
    home: str
    sync: dict[str, str | None] = field(default_factory=dict)  # host path -> sha256 at copy-in (None: absent)
    # A synced file holding credentials (~/.claude.json): the box's copy is masked; the sha256 of that copy,
    # and the placeholders written, so a box that changed nothing there syncs nothing back.
    sync_box: dict[str, str | None] = field(default_factory=dict)
    sync_masks: dict[str, list] = field(default_factory=dict)
    placeholders: tuple[str, ...] = ()
    registry: Registry | None = None
    guarded: dict[str, guard.Snapshot] = field(default_factory=dict)
    owner: int = 0
    cgroup: resource_limits.Cgroup | None = None
    lock_dir: str | None = None  # our state dir: where the sync-back lock lives
    container_rm: list[str] | None = None  # argv that force-removes this run's container
    git: gitdir.GitPlan | None = None  # the private git dirs (relay/trust/gitdir.py)
    git_before: dict[str, str | None] = field(default_factory=dict)  # their state files at copy-in
    workdir: str = ""
    agent: agentstate.AgentState | None = None  # private copies of the agent's state dirs
    staged_root: str | None = None  # --staged: the run's layer (relay/trust/staged.py); git state is kept there
    # The exit report (relay/trust/exit_report.py), last: it moves aside workdir agent config, so it runs here,
    # where a launcher killed with `kill -9` cannot skip it.
    exit_report: Callable[[], list[str]] | None = None
    # The host steps made so far, in order (relay/plan/host_steps.py): what teardown undoes, in reverse.
    done: list[HostStep] = field(default_factory=list)
    # The run dir exists already: a podman run's engine start gate is in it (relay/modes/engine_gate.py).
    run_dir_made: bool = False


# The files synced back (e.g. ~/.claude.json) hold settings and project history, never bulk data.
MAX_SYNC = 16 << 20


def _read_host(path: str, base: str) -> bytes | None:
    """A host file as it is now (None: absent); links and special files are not synced."""
    return safefs.read_file(path, MAX_SYNC, base=base if safefs.beneath(path, base) else None)



def _digest(data: bytes | None) -> str | None:
    return None if data is None else sha256(data).hexdigest()


def box_copy_path(state: RunState, host_path: str) -> str:
    assert state.run_dir is not None
    rel = os.path.relpath(host_path, state.home)
    return os.path.join(state.run_dir, "home", rel)


def make_run_dir(state: RunState, with_tmp: bool = False, git_excludes: str | None = None) -> None:
    """The host step RUN_DIR: the private run dir, its box home, its tmp (process tier) and the box's
    git excludes file."""
    assert state.run_dir is not None
    if not state.run_dir_made:
        os.makedirs(state.run_dir, mode=0o700)
    os.makedirs(os.path.join(state.run_dir, "home"), mode=0o700)
    if git_excludes is not None:
        safefs.write_file(os.path.join(state.run_dir, "git-excludes"), git_excludes.encode(), 0o644, durable=False)
    if with_tmp:
        os.makedirs(os.path.join(state.run_dir, "tmp"), mode=0o700)


def make_git_dir(state: RunState) -> None:
    """The host step GIT_DIR: the private git dirs, with the digests the sync back judges against."""
    assert state.run_dir is not None and state.git is not None
    state.git_before = gitdir.prepare(state.git, state.run_dir, state.workdir)


def copy_agent_state(state: RunState) -> None:
    """The host step AGENT_STATE: the agent's state dirs, copied into the box home."""
    assert state.run_dir is not None and state.agent is not None
    agentstate.copy_in(state.agent, os.path.join(state.run_dir, "home"))


def copy_sync_files(state: RunState, sync_files: tuple[str, ...]) -> None:
    """The host step SYNC_FILES: copies of the synced files in the box home, with their digests."""
    assert state.run_dir is not None
    box_home = os.path.join(state.run_dir, "home")
    for host_path in sync_files:
        try:
            data = _read_host(host_path, state.home)
        except OSError:
            continue  # a link or special file at the host path: the box starts without a copy, nothing syncs back
        state.sync[host_path] = _digest(data)
        paths = _secret_paths_of(state, host_path)
        if data is not None and paths:
            written: list = []
            try:
                data = credential_files.mask(data, paths, written=written)[0]
            except ValueError:  # not JSON: the box starts without a copy, and nothing syncs back over the host's
                state.sync.pop(host_path)
                continue
            state.sync_box[host_path], state.sync_masks[host_path] = _digest(data), written
        if data is not None and state.agent is not None and state.agent.secrets:
            data = _without_secrets(state, host_path, data)
            if data is None:
                continue
        if data is not None:
            safefs.write_file(box_copy_path(state, host_path), data, 0o600, base=box_home, make_dirs=True,
                              durable=False)  # the run dir is scratch: deleted at the end, never read after a crash


def _without_secrets(state: RunState, host_path: str, data: bytes) -> bytes | None:
    """The box's copy of a synced file with no host secret in it (relay/trust/state_scan.py): a JSON
    file gets a placeholder for each string value that holds one (put back at sync-back, as the
    table's masks are), anything else holds none or the box gets no copy (and nothing syncs back)."""
    assert state.agent is not None
    needles = agentstate.needles(state.agent)
    if not needles.search([data]) and not needles.search([state_scan.json_text(data)]):
        return data  # neither its bytes nor its decoded strings (a `\uXXXX` spelling) hold one
    shown = "~/" + os.path.relpath(host_path, state.home)
    try:
        masked, written = state_scan.masked_json(data, needles)
    except (ValueError, UnicodeError, RecursionError):
        state.sync.pop(host_path, None)
        state.agent.notes.append(f"{shown} holds a real credential of the host's; it is not copied into the box")
        return None
    state.sync_box[host_path] = _digest(masked)
    state.sync_masks[host_path] = state.sync_masks.get(host_path, []) + written
    state.agent.notes.append(f"{shown} holds a real credential of the host's (in {len(written)} "
                             f"value{'s' if len(written) != 1 else ''}); the box's copy has placeholders there")
    return masked


def _secret_paths_of(state: RunState, host_path: str) -> tuple[str, ...]:
    """The secret paths of a synced file the plan masks (its login_files), or none."""
    if state.agent is None:
        return ()
    rel = os.path.relpath(host_path, state.home)
    return tuple(p for r, paths in state.agent.secret_files if r == rel for p in paths)


@contextmanager
def _sync_lock(state: RunState):  # noqa: ANN202
    """One lock for every run's sync-back, in our own state dir (never a name in the box's reach)."""
    lock_dir = state.lock_dir or os.path.join(state.home, ".local", "state", "hive-relay")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    with safefs.base_dir(lock_dir) as dfd:
        fd = safefs.open_beneath(dfd, "sync.lock", os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise safefs.UnsafePath(errno.EINVAL, "not a regular file", "sync.lock")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _sync_back(state: RunState, messages: list[str]) -> None:
    box_home = os.path.join(state.run_dir or "", "home")
    for host_path, before in state.sync.items():
        rel = os.path.relpath(box_copy_path(state, host_path), box_home)
        try:
            with safefs.base_dir(box_home) as dfd:
                box = safefs.read_beneath(dfd, rel, MAX_SYNC)
        except OSError as err:
            messages.append(f"did not sync {host_path} back: the box left {err.strerror or err} in its place")
            continue
        if box is None or _digest(box) == state.sync_box.get(host_path, before):
            continue
        try:
            with _sync_lock(state):
                current = _read_host(host_path, state.home)
                if host_path in state.sync_masks:  # placeholders the box left as they were: the host's values again
                    box = credential_files.restore(box, current, state.sync_masks[host_path])
                if _digest(current) == before:
                    live = agentstate.filter_synced(state.agent, host_path, current, box) \
                        if state.agent is not None else box
                    base = state.home if safefs.beneath(host_path, state.home) else None
                    if live is not None and live != current:  # None: the box's file had no data to take
                        safefs.write_file(host_path, live, 0o600, base=base)
                else:
                    keep = safefs.keep_aside(host_path, box, "conflict",
                                             base=state.home if safefs.beneath(host_path, state.home) else None)
                    messages.append(f"{host_path} changed on the host during the session; the box's copy is kept at {keep}")
        except OSError as err:
            messages.append(f"could not sync {host_path} back: {err.strerror or err}")


def _sync_git(state: RunState, messages: list[str]) -> None:
    """The allowlisted git state files back to the host; the rest kept aside for review."""
    assert state.run_dir is not None and state.git is not None
    aside_root = os.path.join(state.lock_dir or os.path.join(state.home, ".local", "state", "hive-relay"), "git-aside")
    tag = rundirs.run_id_of(state.run_dir)
    try:
        with _sync_lock(state):
            result = gitdir.sync_back(state.git, state.run_dir, state.git_before, aside_root, tag, state.workdir)
    except OSError as err:
        messages.append(f"could not sync the box's git state back: {err.strerror or err}; the host's .git is "
                        "as it was before the session, apart from objects, refs and logs")
        return
    messages += result.messages


def _stage_git(state: RunState, messages: list[str]) -> None:
    """--staged: the box's git state files go into its layer, never into the host's .git (its
    objects and refs are in the layer already: their binds stack on the overlay)."""
    from relay.trust.staged import keep_git_state

    assert state.run_dir is not None and state.git is not None and state.staged_root is not None
    try:
        keep_git_state(state.git, state.run_dir, state.staged_root)
    except OSError as err:
        messages.append(f"could not keep the box's git state in its layer: {err.strerror or err}")


# Undone after the janitor has handed the launcher its messages: removing the run dir is a dozen
# rmdirs (~5 ms on a disk-backed /tmp), and says nothing, so it overlaps the launcher's own closing
# work (the staged layer's review). The launcher still waits for it before it exits (wait_all).
LAST_QUIET = frozenset({HostStep.RUN_DIR})


def teardown(state: RunState, skip: frozenset[HostStep] = frozenset(), only: frozenset[HostStep] | None = None) -> list[str]:
    """Undo what the run made on the host, step by step in the reverse of the order it was made
    (relay/plan/host_steps.py); returns messages for the user. `skip` leaves steps for a later
    call with `only` (the janitor's LAST_QUIET)."""
    messages: list[str] = []
    for step in reversed(state.done):
        if step in skip or (only is not None and step not in only):
            continue
        try:
            _UNDO[step](state, messages)
        except Exception as err:  # noqa: BLE001 - one step's failure (a box's hostile file) never skips the rest
            messages.append(f"could not undo the host step {step}: {type(err).__name__}: {str(err)[:200]}; "
                            "the other steps ran")
    return messages


def _undo_cgroup(state: RunState, messages: list[str]) -> None:
    if state.cgroup is not None:
        state.cgroup.remove()


def _undo_guard(state: RunState, messages: list[str]) -> None:
    for path, before in state.guarded.items():
        message = guard.enforce(path, before, state.home)
        if message:
            messages.append(message)


def _undo_placeholders(state: RunState, messages: list[str]) -> None:
    if state.registry is not None:
        try:
            state.registry.release(state.owner)
        except OSError as err:
            messages.append(f"could not clean placeholder files: {err.strerror or err}")


def _undo_sync_files(state: RunState, messages: list[str]) -> None:
    _sync_back(state, messages)


def _undo_agent_state(state: RunState, messages: list[str]) -> None:
    if state.agent is not None and state.run_dir is not None:
        agentstate.sync_back(state.agent, os.path.join(state.run_dir, "home"), messages)


def _undo_git_dir(state: RunState, messages: list[str]) -> None:
    if state.git is not None and state.staged_root is not None:
        _stage_git(state, messages)
    elif state.git is not None:
        _sync_git(state, messages)


def _undo_nothing(state: RunState, messages: list[str]) -> None:
    """PASSWD: its files go with the run dir."""


def _undo_run_dir(state: RunState, messages: list[str]) -> None:
    if state.run_dir is not None:
        rundirs.remove_run_dir(state.run_dir)


def _undo_exit_watch(state: RunState, messages: list[str]) -> None:
    """Last: it moves aside workdir agent config, so it runs here, where a launcher killed with
    `kill -9` cannot skip it, once nothing else of the run is left."""
    if state.exit_report is not None:
        messages += state.exit_report()


_UNDO: dict[HostStep, Callable[[RunState, list[str]], None]] = {
    HostStep.CGROUP: _undo_cgroup,
    HostStep.GUARD: _undo_guard,
    HostStep.PLACEHOLDERS: _undo_placeholders,
    HostStep.PASSWD: _undo_nothing,
    HostStep.SYNC_FILES: _undo_sync_files,
    HostStep.AGENT_STATE: _undo_agent_state,
    HostStep.GIT_DIR: _undo_git_dir,
    HostStep.RUN_DIR: _undo_run_dir,
    HostStep.EXIT_WATCH: _undo_exit_watch,
}


def spawn(state: RunState) -> tuple[int, int]:
    """Fork the janitor. Returns (pid, write end of the lifeline pipe; close it to trigger cleanup)."""
    r, w = os.pipe()
    msg_r, msg_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the forked child
        try:
            # A session of its own: a signal to the launcher's process group (or the terminal's)
            # cannot stop the cleanup.
            os.setsid()
            gc.enable()  # the launcher's startup had it off (relay/__main__.py); this process lives as long as the box
            for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGHUP, signal.SIGTERM, signal.SIGTTOU):
                signal.signal(sig, signal.SIG_IGN)
            os.close(w)
            os.close(msg_r)
            keep = {r, msg_w, 2}
            os.closerange(0, 2)
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)
            for fd in range(3, 1024):
                if fd not in keep:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            said = b""
            while chunk := os.read(r, 4096):
                said += chunk
            if b"done" not in said.split():
                # The launcher died without tearing its box down: kill what it told us it started.
                words = said.split()
                clients = [p for i, w in enumerate(words[:-1]) if w == b"client" and (p := _told(words[i + 1]))]
                _kill_box([p for i, w in enumerate(words) if (p := _told(w)) and (i == 0 or words[i - 1] != b"client")])
                if state.container_rm:
                    # Also the clients we were never told of: the launcher may die between starting
                    # the engine client and telling us its pid.
                    clients += [c for c in _engine_clients(state.container_rm) if c not in clients]
                    _remove_container(state.container_rm, clients)
            # The exit watch judges the run once nothing else of it is left, the run dir included:
            # with one, nothing is deferred.
            later = LAST_QUIET if HostStep.EXIT_WATCH not in state.done else frozenset()
            messages = teardown(state, skip=later)
            try:
                os.write(msg_w, "\n".join(messages).encode())
            except OSError:
                pass
            os.close(msg_w)  # the launcher has its messages and goes on; it waits for the rest at exit
            if later:
                late = teardown(state, only=later)
                if late:  # a step that failed still says so, on the launcher's stderr (it is still waiting)
                    try:
                        os.write(2, "".join(f"hive-relay: {m}\n" for m in late).encode())
                    except OSError:
                        pass
        finally:
            os._exit(0)
    os.close(r)
    os.close(msg_w)
    _JANITOR_MESSAGES[pid] = msg_r
    return pid, w


_JANITOR_MESSAGES: dict[int, int] = {}


def _told(word: bytes) -> tuple[int, bytes | None] | None:
    """A pid the launcher told us, as `PID@STARTTIME` (or a bare PID): the start time tells the box's
    process from another that took its pid since (pid_max is 32768 here; a busy host recycles fast)."""
    pid, _, start = word.partition(b"@")
    return (int(pid), start or None) if pid.isdigit() else None


def _same(pid: int, start: bytes | None) -> bool:
    """`pid` is still the process we were told about (or we were told no start time)."""
    fields = procs.stat_fields(pid)
    return start is None or fields is None or fields[19] == start


def _kill_box(told: list[tuple[int, bytes | None]]) -> None:
    """SIGKILL the box's bwrap processes (checked by cmdline: a pid may have been reused), and the
    process group each one leads: bwrap is spawned as a group leader, and the box's init stays in
    that group. So even when we were told only bwrap's own pid (the launcher died before it could
    name the init) and bwrap is already gone, the init goes too, and with it the pid namespace.
    A group is only killed while a bwrap is still in it, so a recycled pid is never hit."""
    for pid, start in told:
        if not _same(pid, start):
            continue  # that pid is someone else's now: neither it nor the group it leads is ours
        try:
            if _argv0(pid) == b"bwrap":
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        if any(_argv0(member) == b"bwrap" for member in procs.processes_where(2, pid)):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


def _argv0(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return os.path.basename(fh.read().split(b"\0")[0])
    except OSError:
        return None


def _remove_container(rm_argv: list[str], clients: list[tuple[int, bytes | None]], patience: float = 60.0) -> None:
    """Force-remove the run's container until its engine client is gone: a launcher killed while
    the engine was still creating the container must not leave one behind a moment later."""
    import subprocess

    deadline = time.monotonic() + patience
    while True:
        try:
            subprocess.run(rm_argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if not any(liveness.running(pid) and _same(pid, start) for pid, start in clients) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid, start in clients:
        if not _same(pid, start):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _engine_clients(rm_argv: list[str]) -> list[tuple[int, bytes | None]]:
    """This user's engine clients running our container (`ENGINE ... --name NAME ...`, argv0 the
    engine's own name): the run's name is unique (it carries the run id), so no one else's match."""
    engine, name = os.path.basename(rm_argv[0]).encode(), rm_argv[-1].encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != os.getuid():
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read(1 << 16).split(b"\0")
        except OSError:
            continue
        pairs = zip(argv, argv[1:], strict=False)
        if os.path.basename(argv[0]) == engine and any(a == b"--name" and b == name for a, b in pairs):
            fields = procs.stat_fields(int(entry))
            found.append((int(entry), fields[19] if fields is not None else None))
    return found


def tell(lifeline: int, *words: object) -> None:
    """Tell the janitor about the box (its pids) or that teardown is orderly ("done")."""
    def word(w: object) -> str:
        if isinstance(w, int) and not isinstance(w, bool):
            fields = procs.stat_fields(w)  # read now, while it is surely the box's process
            return f"{w}@{fields[19].decode()}" if fields is not None else str(w)
        return str(w)

    try:
        os.write(lifeline, (" ".join(word(w) for w in words) + "\n").encode())
    except OSError:
        pass


def finish(pid: int, lifeline: int) -> list[str]:
    """Trigger cleanup and wait for its messages (all but LAST_QUIET's steps are done by then);
    returns them. The janitor itself is waited for by wait_all."""
    tell(lifeline, "done")
    try:
        os.close(lifeline)
    except OSError:
        pass
    msg_fd = _JANITOR_MESSAGES.pop(pid, None)
    data = b""
    if msg_fd is not None:
        while True:
            try:
                chunk = os.read(msg_fd, 65536)
            except InterruptedError:
                continue
            if not chunk:
                break
            data += chunk
        os.close(msg_fd)
    _FINISHING.append(pid)
    return [m for m in data.decode(errors="replace").split("\n") if m]


_FINISHING: list[int] = []


def wait_all() -> None:
    """Wait for every janitor told to finish: the run is cleaned up when the launcher exits."""
    while _FINISHING:
        pid = _FINISHING.pop()
        while True:
            try:
                os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
            except ChildProcessError:
                break


def sweep_stale_run_dirs(base: str) -> None:
    """Remove run dirs of launchers that died together with their janitor (e.g. a reboot); the
    owner is checked by pid and start time (see sweep)."""
    from relay.trust.rundirs import run_dirs

    run_dirs(base)
