"""Live approval: `invoke allow|deny HOST[:PORT] [--run RUN]` changes a running box's egress rules.

The channel is a Unix socket, `control`, in the run's host-side run dir (`$XDG_RUNTIME_DIR/hive-relay-RUN`,
made by the launcher with mode 0700 and never bound into the box; the box could not open an AF_UNIX socket
anyway, seccomp refuses it). Both ends check who is on the other side:

- the caller (`request`) only talks to a run dir that is a real directory (no link), owned by the caller's
  uid with mode 0700, holding a socket owned by the caller: a run of another user is refused by name
  (root included: root's `allow` never widens a user's box), and an unprivileged caller cannot even
  list another user's 0700 run dir;
- the proxy (`serve`) answers only a peer whose SO_PEERCRED uid is its own.

One JSON line each way. An entry is parsed by `hosts.parse_rule`, so a live allow follows the same rules
as `--allow-host` (loopback refused with the pinned form as the fix; a name that resolves to an internal
address is still denied unless pinned; an IP literal is allowed only as itself). The proxy swaps its rule
tuple in one assignment, so every request is judged by the old rules or the new ones, never a mix; the
connections already open are judged by the new rules too, and those they no longer allow are cut.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import struct
from collections.abc import Callable, Mapping

from relay.host import liveness, safefs
from relay.model.allow_rules import HostRule, parse_rule
from relay.model.errors import EXIT_NO_RUN, RefusedError, RelayError, UsageError
from relay.model.record import record
from relay.model.refusal import ENTRY
from relay.trust import rundirs

SOCKET_NAME = "control"
MAX_MESSAGE = 4096
TIMEOUT = 5.0


class NoRunError(RelayError):
    """`--run RUN` names no live run of the caller, or there is none at all."""

    exit_code = EXIT_NO_RUN


def runtime_base(env: Mapping[str, str]) -> str:
    """Where run dirs live (relay/trust/rundirs.py)."""
    return rundirs.base(env)


# --- the proxy's end ---------------------------------------------------------------------------------

def listen(run_dir: str) -> socket.socket:
    """Bind `RUN_DIR/control` (mode 0600) in the run dir the janitor made (0700; it removes the dir, the
    socket with it, at the end). The path is reached through the dir's fd (/proc/self/fd/N/control): a
    long $XDG_RUNTIME_DIR does not run into the 108-byte limit of a socket path, and the dir itself is
    opened with O_NOFOLLOW."""
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise RelayError(f"the run dir {run_dir} is not private to you; not listening for `{ENTRY} allow`")
        sock = safefs.bind_unix(fd, SOCKET_NAME, 8)  # listening before anyone can see it listed as live
        try:
            os.chmod(SOCKET_NAME, 0o600, dir_fd=fd)
        except OSError:
            sock.close()
            raise
    finally:
        os.close(fd)
    return sock


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def serve(conn: socket.socket, handle: Callable[..., dict],
          watch: Callable[[socket.socket], None] | None = None) -> None:
    """Answer one request on an accepted connection: `handle(op, entry, uid)` gives the reply (with
    `question=` too when `invoke ask` says which held request the op answers). The op `watch`
    (`invoke ask`) hands the connection to `watch`, which keeps it to send questions on."""
    keep = False
    try:
        conn.settimeout(TIMEOUT)
        try:
            uid = peer_uid(conn)
            data = _read_line(conn)  # read (bounded) even from a stranger, so that it hears the refusal
            if uid != os.getuid():
                reply = {"ok": False, "error": f"uid {uid} may not change this run (it belongs to uid {os.getuid()})"}
            else:
                try:
                    message = json.loads(data)
                    op, entry = str(message["op"]), str(message.get("entry", ""))
                    question = str(message.get("question", ""))[:MAX_MESSAGE]
                except (ValueError, KeyError, TypeError):
                    reply = {"ok": False, "error": "malformed request"}
                else:
                    if op == "watch" and watch is not None:
                        conn.sendall(b'{"ok": true, "message": "watching"}\n')
                        conn.settimeout(None)
                        keep = True
                        watch(conn)
                        return
                    reply = handle(op, entry, uid, question=question) if question else handle(op, entry, uid)
            conn.sendall((json.dumps(reply) + "\n").encode())
        except OSError:
            pass
    finally:
        if not keep:
            conn.close()


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(MAX_MESSAGE)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_MESSAGE:
            raise OSError("request too long")
    return data.split(b"\n", 1)[0]


def apply(rules: tuple[HostRule, ...], op: str, entry: str) -> tuple[tuple[HostRule, ...], HostRule, str]:
    """The rules after `allow` (the entry added, unless already there) or `deny` (every rule for the
    entry's host and port removed: the box's own and the presets' too). Raises UsageError."""
    rule = parse_rule(entry)
    if op == "allow" and rule.inspect:  # no leaf was minted for it: the tunnel would not be what it says
        raise UsageError(f"{rule.render()}: inspection is chosen at launch (the run CA and its leaves are made "
                         "before the box starts); fix: allow it without inspect=true, or relaunch with --inspect")
    if op == "allow":
        if rule in rules:
            return rules, rule, f"{rule.render()} was already allowed"
        return rules + (rule,), rule, f"allowed {rule.render()} ({rule.action()})"
    if op == "deny":
        kept = tuple(r for r in rules if r.target != rule.target)
        if len(kept) == len(rules):
            raise UsageError(f"{rule.target} is not allowed in this run, so there is nothing to deny")
        gone = ", ".join(r.render() for r in rules if r.target == rule.target)
        return kept, rule, f"denied {rule.target} (removed {gone})"
    raise UsageError(f"unknown operation {op!r}")


# --- the caller's end --------------------------------------------------------------------------------

@record
class Run:
    """A live run's control socket, found by scanning run dirs: its run id and the socket's path."""

    run_id: str
    path: str


def _private_dir(path: str) -> os.stat_result | None:
    """lstat of a run dir that is the caller's own: a directory (not a link), owner == caller, 0700."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        return None
    return st


def live_runs(base: str) -> list[Run]:
    """The caller's runs whose launcher is alive and whose proxy listens (oldest first)."""
    runs = []
    for name in rundirs.names(base):
        run_id = rundirs.run_id_of(name)
        owner = liveness.parse_run_id(run_id) if re.fullmatch(liveness.RUN_ID_RE, run_id) else None
        path = os.path.join(base, name)
        if owner is None or not liveness.alive(owner) or _private_dir(path) is None:
            continue
        with safefs.base_dir(base) as dfd:
            try:
                sock_st = safefs.lstat_beneath(dfd, f"{name}/{SOCKET_NAME}")
            except OSError:
                sock_st = None
        if sock_st is not None and stat.S_ISSOCK(sock_st.st_mode) and sock_st.st_uid == os.getuid():
            runs.append(Run(run_id, path))
    return runs


def pick(base: str, which: str | None) -> Run:
    """The run `--run` names (a run id or a unique part of one), or the caller's only live run."""
    if which is not None:
        if "/" in which or not which or which in (".", ".."):
            raise UsageError(f"--run {which[:40]!r}: not a run id; fix: `{ENTRY} logs` lists the runs")
        path = os.path.join(base, f"hive-relay-{which}")
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        if st is not None and st.st_uid != os.getuid():
            raise RefusedError(f"run {which} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
                               "only the user who started a box can change it")
    runs = live_runs(base)
    if which is not None:
        found = [r for r in runs if r.run_id == which] or [r for r in runs if which in r.run_id]
        if len(found) == 1:
            return found[0]
        if not found:
            raise NoRunError(f"no live run of yours matches {which!r} in {base}; fix: "
                             + (f"pick one of: {', '.join(r.run_id for r in runs)}" if runs else "start a box first"))
        raise UsageError(f"{which!r} matches {len(found)} live runs ({', '.join(r.run_id for r in found)}); "
                         "fix: give more of the run id")
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise NoRunError(f"no live run of yours in {base}; fix: start a box first (or set XDG_RUNTIME_DIR as it "
                         "was for the box)")
    raise UsageError(f"{len(runs)} live runs: {', '.join(r.run_id for r in runs)}; fix: pick one with --run RUN")


def open_control(run: Run) -> socket.socket:
    """A connected socket to the run's proxy (for `request` and `ask`): the run dir is checked again
    (ours, 0700, no link) and the socket reached through its fd, so a dir swapped in between is never
    talked to; the proxy at the other end must run as us (SO_PEERCRED)."""
    fd = os.open(run.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
            raise RefusedError(f"the run dir {run.path} is not private to you; not talking to it")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(TIMEOUT)
        try:
            sock.connect(f"/proc/self/fd/{fd}/{SOCKET_NAME}")
            if peer_uid(sock) != os.getuid():
                raise RefusedError(f"the proxy of run {run.run_id} does not run as you; not talking to it")
        except OSError as err:
            sock.close()
            raise NoRunError(f"run {run.run_id} does not answer ({err.strerror or err}); it has probably "
                             f"ended; fix: `{ENTRY} logs` lists the runs") from None
        except RefusedError:
            sock.close()
            raise
        return sock
    finally:
        os.close(fd)


def request(run: Run, op: str, entry: str, question: str = "") -> dict:
    """Send one request to the run's proxy; the reply as a dict. The run dir is checked again and the
    socket reached through its fd, so a dir swapped in between is never talked to. `question`: the
    held request (`invoke ask`) this answers, so that an allow the proxy refuses releases it at once."""
    with open_control(run) as sock:
        try:
            sock.sendall((json.dumps({"op": op, "entry": entry, **({"question": question} if question else {})})
                          + "\n").encode())
            data = _read_line(sock)
        except OSError as err:
            raise NoRunError(f"run {run.run_id} does not answer ({err.strerror or err}); it has probably "
                             f"ended; fix: `{ENTRY} logs` lists the runs") from None
    try:
        reply = json.loads(data)
    except ValueError:
        raise RelayError(f"run {run.run_id} sent no valid answer") from None
    return reply if isinstance(reply, dict) else {"ok": False, "error": "invalid answer"}


