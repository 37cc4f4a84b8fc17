"""Read the secrets the proxy injects, on the host, once per launch: from the launcher's environment,
a host command (`gh auth token`) or a file (with a JSON path); and the host's real secrets the
outbound scan looks for (`host_secrets`: those values, the masked login files' tokens, the deny-listed
SSH private keys).

The plan names where each secret comes from (never its value); this module is the only place that
reads one. A command runs with an argv list (never a shell), no stdin, a timeout and bounded output;
a file is read through safefs (bounded, never blocking, no link swapped in followed). Every failure
is one line that names the grant and the fix, never the secret.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping

from relay.host import safefs
from relay.host.paths import which
from relay.model.backend import CredentialRoute
from relay.model.errors import RefusedError
from relay.policy import egress

TYPE_CHECKING = False
if TYPE_CHECKING:
    from relay.egress.secret_scan import HostSecrets

COMMAND_TIMEOUT = 15.0
EXITED_GRACE = 1.0  # how long the output of a command that exited may stay open (a child it left behind)
MAX_OUTPUT = 64 * 1024
_CACHE: dict[tuple[str, ...], str] = {}  # one launcher, one box: a command runs once per launch


def read_keys(routes: Iterable[CredentialRoute], env: Mapping[str, str]) -> dict[str, str]:
    """Route name -> its secret, for every route whose secret is there. A backend route with its
    variables unset is simply absent (the plan already kept the key in the box then); a grant whose
    secret cannot be read raises RefusedError with one line."""
    keys = {}
    for route in routes:
        key = read_key(route, env)
        if key is not None:
            keys[route.name] = key
    return keys


def read_key(route: CredentialRoute, env: Mapping[str, str]) -> str | None:
    if not route.grant:
        return egress.route_key(route, env)
    cache = (route.name, *route.secret_env, *route.secret_command, route.secret_file, route.secret_json)
    if cache not in _CACHE:
        _CACHE[cache] = _grant_secret(route, env)
    return _CACHE[cache]


def _fail(route: CredentialRoute, problem: str, fix: str) -> RefusedError:
    return RefusedError(f"auth grant {route.name}: {problem}; fix: {fix}")


def _grant_secret(route: CredentialRoute, env: Mapping[str, str]) -> str:
    if route.secret_env:
        key = egress.route_key(route, env)
        if key is None:
            raise _fail(route, f"none of {', '.join(route.secret_env)} is set",
                        "set one, or remove the grant from your user config")
        return _one_token(route, key, "its variable")
    if route.secret_command:
        return _one_token(route, _run(route, env), f"`{' '.join(route.secret_command)}`")
    return _one_token(route, _from_file(route, env), route.secret_file)


def _one_token(route: CredentialRoute, value: str, source: str) -> str:
    value = value.strip()
    if not value:
        raise _fail(route, f"{source} gave an empty secret", "check it on the host")
    if any(c <= " " or c > "~" for c in value):
        raise _fail(route, f"{source} did not give one printable token", "make it print only the token")
    return value


def _run(route: CredentialRoute, env: Mapping[str, str]) -> str:
    """The command's stdout: argv list, no shell, no stdin, COMMAND_TIMEOUT, at most MAX_OUTPUT bytes
    of stdout and of stderr (more is a failure, and the command is killed). It runs in a session of
    its own, killed as a whole at the end: nothing it started outlives the read."""
    argv = list(route.secret_command)
    shown = " ".join(argv)
    program = argv[0] if "/" in argv[0] else which(argv[0], path=env.get("PATH") or os.defpath)
    if program is None:
        raise _fail(route, f"`{shown}`: {argv[0]} not found on PATH", f"install {argv[0]} or use secret: {{env: [...]}}")
    try:
        proc = subprocess.Popen([program, *argv[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=dict(env), close_fds=True, start_new_session=True)
    except OSError as err:
        raise _fail(route, f"`{shown}` could not start: {err.strerror or err}", "check the command") from None
    out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for pipe in out:
        sel.register(pipe, selectors.EVENT_READ)
    deadline, problem = time.monotonic() + COMMAND_TIMEOUT, ""
    try:
        while sel.get_map() and not problem:
            if proc.poll() is not None and deadline > time.monotonic() + EXITED_GRACE:
                # It exited, but something it started in the background still holds its output
                # open: what it printed is read for a moment more, then that something is killed.
                deadline = time.monotonic() + EXITED_GRACE
            left = deadline - time.monotonic()
            if left <= 0:
                if proc.poll() is None:
                    problem = f"did not finish within {COMMAND_TIMEOUT:g} s"
                break
            for key, _ in sel.select(min(left, 0.1)):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                out[key.fileobj] += data
                if len(out[key.fileobj]) > MAX_OUTPUT:
                    problem = f"printed more than {MAX_OUTPUT >> 10} KiB"
        if problem:
            proc.kill()
        rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()) if not problem else 5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        problem = f"did not finish within {COMMAND_TIMEOUT:g} s"
    finally:
        sel.close()
        for pipe in out:
            pipe.close()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: whatever it left running goes too
        except OSError:
            pass
    if problem:
        raise _fail(route, f"`{shown}` {problem}", "check the command on the host")
    if rc != 0:
        said = bytes(out[proc.stderr]).decode("utf-8", "replace").strip().splitlines()
        detail = f": {said[-1][:200]}" if said else ""
        raise _fail(route, f"`{shown}` failed with exit code {rc}{detail}", "run it on the host and fix what it says")
    return bytes(out[proc.stdout]).decode("utf-8", "replace")


def _from_file(route: CredentialRoute, env: Mapping[str, str]) -> str:
    """The file (the user's own: a link is followed once, to a regular file opened without following
    anything further), bounded; with `secret_json`, the string at that dotted path."""
    path = route.secret_file
    if path.startswith("~/"):
        path = os.path.join(env.get("HOME") or "/", path[2:])
    try:
        data = safefs.read_file(os.path.realpath(path), 1 << 20)
    except (OSError, safefs.UnsafePath) as err:
        raise _fail(route, f"cannot read {route.secret_file}: {getattr(err, 'strerror', None) or err}",
                    "check the file is a regular, readable file") from None
    if data is None:
        raise _fail(route, f"{route.secret_file} does not exist", "create it or change secret.file")
    text = data.decode("utf-8", "replace")
    if not route.secret_json:
        return text
    try:
        value: object = json.loads(text)
    except ValueError:
        raise _fail(route, f"{route.secret_file} is not JSON", "point secret.file at a JSON file, or drop json") from None
    for part in route.secret_json.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if not isinstance(value, str):
        raise _fail(route, f"{route.secret_file} has no string at {route.secret_json}", "check the JSON path")
    return value


MAX_KEY_FILE = 64 * 1024  # an SSH private key is a few KiB
MAX_KEY_FILES = 64  # files looked at in one denied .ssh dir


def host_secrets(keys: Mapping[str, object], login_files: Iterable[tuple[str, tuple[str, ...]]],
                 denied: Iterable[str], home: str) -> HostSecrets:
    """The host's real secrets for the outbound scan (relay/egress/secret_scan.py), read here once (the
    login files again whenever they change): the value of every route and grant (`keys`; a login's
    store is left out, its file is in `login_files`), the tokens of each masked login file (host path,
    its JSON paths), and the private key lines of every SSH key the deny list hides (a denied `.ssh`
    dir's key files, a denied key file such as /etc/ssh/ssh_host_ed25519_key), read through safefs,
    bounded, and only when present and readable. Names only ever leave this function, never values."""
    from relay.egress.secret_scan import HostSecrets, Secret, secret_forms, ssh_key_lines

    def shown(path: str) -> str:
        return "~/" + os.path.relpath(path, home) if path.startswith(home.rstrip("/") + "/") else path

    fixed: list[Secret | None] = [secret_forms(f"the {name} route's key", key)
                                  for name, key in keys.items() if isinstance(key, str)]
    # ~/.ssh itself: in local mode the box's $HOME is a tmpfs, so the deny list need not name it, yet its
    # keys are the first thing a box must never send (red team: no SSH key was looked for there).
    for path in _key_files([*denied, os.path.join(home, ".ssh")]):
        try:
            data = safefs.read_file(path, MAX_KEY_FILE)
            if data is None or b"PRIVATE KEY-----" not in data:
                continue
            pub = safefs.read_file(path + ".pub", MAX_KEY_FILE) if os.path.lexists(path + ".pub") else None
        except OSError:  # root's host keys read as a user, a link: not this caller's to read
            continue
        lines = ssh_key_lines(data, pub)
        if lines:
            fixed.append(Secret(f"the SSH private key {shown(path)}", lines, tuple(len(ln) for ln in lines)))
    sources = [_login_source(path, paths, shown(path)) for path, paths in login_files]
    return HostSecrets([s for s in fixed if s is not None], sources)


def _key_files(denied: Iterable[str]) -> list[str]:
    """The files a denied path names that could be SSH private keys: a denied file itself, and the
    regular files (not links) directly in a denied `.ssh` dir, at most MAX_KEY_FILES of them."""
    out = []
    for path in denied:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if os.path.basename(path) == ".ssh" and os.path.isdir(path) and not os.path.islink(path):
            try:
                with os.scandir(path) as it:
                    names = sorted(e.path for e in it if e.is_file(follow_symlinks=False)
                                   and not e.name.endswith((".pub", "known_hosts", "known_hosts.old", "config",
                                                            "authorized_keys")))
            except OSError:
                continue
            out += names[:MAX_KEY_FILES]
        elif "ssh" in path and stat.S_ISREG(st.st_mode):
            out.append(path)
    return out


def _login_source(path: str, paths: tuple[str, ...], name: str) -> Callable[[], list]:
    """A masked login file's real tokens, read again only when the file changed (its inode, size or
    mtime: a refresh on the host rewrites it)."""
    from relay.egress.secret_scan import secret_forms
    from relay.model import credential_files

    seen: list = [None, []]

    def current() -> list:
        try:
            st = os.lstat(path)
        except OSError:
            return []
        ident = (st.st_ino, st.st_size, st.st_mtime_ns)
        if ident != seen[0]:
            raw = safefs.read_file(path, credential_files.MAX_FILE + 1)
            found = credential_files.values(raw, paths, credential_files.is_dotenv(path))
            seen[:] = [ident, [s for at, value in found if (s := secret_forms(f"{name} {at}", value)) is not None]]
        return seen[1]

    return current
