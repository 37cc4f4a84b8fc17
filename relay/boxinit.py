"""In-box init: open the proxy listener inside the box, hand it out, then become the agent.

Runs as the first program inside bwrap, already under the seccomp filter, with the stdlib
only (`python3 -I -S`). It binds 127.0.0.1:PORT in the box's own network namespace and sends
the *listening* socket to the launcher over an inherited socketpair (SCM_RIGHTS); the
host-side proxy accepts on it directly. So the box never needs an AF_UNIX socket() and no
bridge process lives in the box. Then it execs the agent, which becomes the box's main process.
"""

import os
import socket
import sys


def _fail(message: str, code: int) -> None:
    sys.stderr.write(f"hive-relay (in box): {message}\n")
    sys.stderr.flush()
    os._exit(code)


def main(args: list) -> None:
    ctrl_fd, listen, argv = None, None, None
    i = 0
    while i < len(args):
        if args[i] == "--ctrl-fd":
            ctrl_fd, i = int(args[i + 1]), i + 2
        elif args[i] == "--listen":
            listen, i = args[i + 1], i + 2
        elif args[i] == "--":
            argv = args[i + 1 :]
            break
        else:
            _fail(f"unknown init argument {args[i]!r}", 2)
    if not argv:
        _fail("no command to run", 2)
    if ctrl_fd is not None:
        ctrl = socket.socket(fileno=ctrl_fd)
        if listen:
            host, port = listen.rsplit(":", 1)
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, int(port)))
            listener.listen(1024)
            socket.send_fds(ctrl, [b"L"], [listener.fileno()])
            listener.close()
        else:
            ctrl.sendall(b"N")
        # Wait until the launcher says the proxy is serving, so the agent's first request succeeds.
        ctrl.recv(1)
        ctrl.close()
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        _fail(f"{argv[0]}: command not found inside the box (is it installed outside $HOME or in a grant?)", 127)
    except PermissionError:
        _fail(f"{argv[0]}: permission denied inside the box", 126)
    except OSError as err:
        _fail(f"{argv[0]}: cannot start: {err.strerror}", 126)


if __name__ == "__main__":
    main(sys.argv[1:])
