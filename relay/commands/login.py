"""`contribute-hive login BACKEND`: the CLI's own login, run on the host, outside any box.

A login started inside the box cannot finish: codex's ChatGPT sign-in waits for its browser
callback on 127.0.0.1:1455 in the box's network namespace, where the host's browser cannot reach
it, and a login the box made would be the box's to keep. On the host the CLI writes its credential
where it always does (`~/.claude/.credentials.json`, ...); the box then gets placeholders, and the
proxy adds the real token (relay/trust/logins.py).

The CLI runs with the user's own environment and terminal, but in an empty private directory:
started in the project, it would read that project's config (`.mcp.json` servers, hooks,
settings), which a box may have written.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping

from relay.config.load import backend_names, load_matrix
from relay.model.backend import Backend
from relay.model.errors import UsageError
from relay.modes.install import cli_path, ensure_cli


def login_argv(backend: Backend, env: Mapping[str, str]) -> list[str]:
    """The login command with its program resolved (the pinned CLI in the tool dir first)."""
    argv = list(backend.login_command)
    if argv and argv[0] == backend.install_bin:
        argv[0] = cli_path(backend, env) or argv[0]
    return argv


def no_login(backend: Backend) -> UsageError:
    """The one line for a backend without a login command: which variable to set instead."""
    names = [n for r in backend.credentials for n in r.secret_env]
    fix = f"set {' or '.join(names[:2])} on the host (the proxy keeps it there)" if names else \
        "give the backend a `login_command:` in your user config"
    return UsageError(f"{backend.name} has no login command of its own; fix: {fix}")


def login(name: str, env: Mapping[str, str]) -> int:
    matrix = load_matrix(env, workdir=None)
    backend = matrix.backends.get(name)
    if backend is None:
        raise UsageError(f"unknown backend {name!r}; choose one of: {', '.join(backend_names(matrix))}")
    if not backend.login_command:
        raise no_login(backend)
    for path, why in backend.logins_in_box:  # said before, not after: the user may rather set a key
        print(f"hive-relay: note: this login ({path}) is copied into {name}'s boxes as it is: {why}",
              file=sys.stderr)
    if backend.secret_files and not any(r.login and r.login.refresh_url for r in backend.credentials):
        from relay.plan.resolve import login_opt_in

        keys = [n for r in backend.credentials for n in r.secret_env][:1]
        print(f"hive-relay: note: {name}'s boxes hold an API-key login on the host (placeholders in the box); "
              f"an OAuth login no route holds makes them refuse to start unless "
              f"{keys[0] + ' is set or ' if keys else ''}{login_opt_in(name)}=1", file=sys.stderr)
    ensure_cli(backend, env, backend.login_command[0])
    argv = login_argv(backend, env)
    print(f"hive-relay: {name}'s own login, on this host (outside any box, in an empty directory): "
          f"{' '.join(backend.login_command)}", file=sys.stderr, flush=True)
    where = tempfile.mkdtemp(prefix=f"hive-relay-login-{name}-")
    try:
        rc = _call(argv, where, env)
    except FileNotFoundError:
        raise UsageError(f"{argv[0]} is not installed; fix: contribute-hive {name} installs it on first use") from None
    finally:
        shutil.rmtree(where, ignore_errors=True)
    if rc == 0:
        print(f"hive-relay: {name} is logged in on the host; its boxes get placeholders, and the proxy adds "
              "the real credential", file=sys.stderr)
    else:
        print(f"hive-relay: {name}'s login ended with exit {rc}; nothing changed in hive relay", file=sys.stderr)
    return rc


def _call(argv: list[str], cwd: str, env: Mapping[str, str]) -> int:
    """Run the login in the foreground; SIGTERM/SIGHUP to us go on to it (and we still clean up),
    Ctrl-C reaches it from the terminal and we wait for it to finish."""
    proc = subprocess.Popen(argv, cwd=cwd, env=dict(env))
    forward = {sig: signal.signal(sig, lambda s, _f: proc.send_signal(s)) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:
                continue  # the CLI got the same Ctrl-C: its exit code says what it did with it
    finally:
        for sig, old in forward.items():
            signal.signal(sig, old)
