"""The gvisor box's init: the proxy's loopback port inside gVisor's own network stack, then the agent.

runsc runs the box with `--network=none`: gVisor's netstack holds a loopback and nothing else, and
the host cannot open a listener in it from outside (the supervised tier's `listen_in` joins a
kernel network namespace; gVisor's stack is not the kernel's). So this init, the box's first
process, binds `127.0.0.1:PORT` there (the address HTTPS_PROXY names in every tier), forks the
agent, and relays each connection it accepts to the host proxy's unix socket, bound into the box
at one fixed path (runsc `--host-uds=open` lets the Sentry connect to it through the gofer). It
reaches nothing else: the path's directory is opened before the agent starts and every connect is
made relative to it (an agent that renames /run/hive-relay away and links another host socket in
its place reaches nothing), and the proxy behind it decides every request.

The agent starts under the plan's seccomp filter (the same BPF program the supervised tier hands
bwrap; see spawn_filtered): gVisor's Sentry implements seccomp for the processes it runs, so the agent
gets EPERM for `socket(AF_UNIX)` (no other host socket is reachable either), io_uring, ptrace and
the rest; this init keeps AF_UNIX, which it needs for the relay, and runs nothing else.

The init's exit status is the agent's (a signal death is re-raised on itself, so runsc reports it
as the kernel would). Run as `python3 -I -S gvisor_init.py SOCKET HOST:PORT BPF|- -- ARGV...`
(stdlib only, no package import).
"""

import ctypes
import os
import signal
import socket
import struct
import sys
import threading

PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
CHUNK = 1 << 18
KEYBOARD = (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)


def load_seccomp(path):
    """Load the BPF program at `path` (struct sock_filter[]) on this process: no_new_privs, then
    prctl(PR_SET_SECCOMP). A missing or malformed program stops the box (exit 3): never run open."""
    with open(path, "rb") as fh:
        data = fh.read(1 << 20)
    if not data or len(data) % 8:
        raise OSError(0, f"malformed seccomp program {path} ({len(data)} bytes)")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    buf = ctypes.create_string_buffer(data, len(data))
    prog = struct.pack("HL", len(data) // 8, ctypes.addressof(buf))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
    prog_buf = ctypes.create_string_buffer(prog, len(prog))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog_buf), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")


def pump(src, dst):
    """One direction of a relayed connection; a half-close is passed on as one."""
    buf = bytearray(CHUNK)  # recv_into one buffer: no allocation per read (measured in the Sentry: +15%)
    view = memoryview(buf)
    try:
        while True:
            n = src.recv_into(buf)
            if not n:
                break
            dst.sendall(view[:n])
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def relay(client, path):
    try:
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):  # each read and write is a host call of the Sentry's
            up.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        up.connect(path)
    except OSError:
        client.close()
        return
    back = threading.Thread(target=pump, args=(up, client), daemon=True)
    back.start()
    pump(client, up)
    back.join()
    client.close()
    up.close()


def serve(listener, path):
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            continue
        threading.Thread(target=relay, args=(client, path), daemon=True).start()


def spawn_filtered(command, bpf):
    """Start the agent under the filter, without a fork of this process (a fork copies the address
    space in the Sentry: ~35 ms here). A seccomp filter belongs to the thread that loads it and is
    inherited by what that thread starts, so a short-lived thread loads it (with no_new_privs) and
    posix_spawn()s the agent (vfork: no copy); this init's other threads, the relay, stay unfiltered.
    The listener is close-on-exec (Python's default), so the agent does not inherit it."""
    out = {}

    def run():
        try:
            if bpf != "-":
                load_seccomp(bpf)
            # Every signal this init changed back to its default, as a fresh exec would have them: python3
            # itself ignores SIGPIPE and SIGXFSZ at startup, which the agent must not inherit (`yes | head`).
            out["pid"] = os.posix_spawnp(command[0], command, os.environ, setsigdef=KEYBOARD + (
                signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ))
        except OSError as err:
            out["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["pid"]


def main(argv):
    if len(argv) < 6 or argv[4] != "--":
        print("usage: gvisor_init.py SOCKET HOST:PORT BPF|- -- ARGV...", file=sys.stderr)
        return 2
    sep = argv.index("--")
    path, listen, bpf = argv[1:sep]
    command = argv[sep + 1:]
    listener = None
    if path != "-":
        # The socket's directory, opened before the agent exists, and every connect() made relative to it
        # (the init's cwd, below): /run is the box's to write, so an agent that renamed the directory away
        # and put a link to another host socket in its place must not steer the relay there (the path is
        # looked up at each connect; the directory held here is the one the proxy's socket is bound in,
        # and a mount point cannot be renamed or removed).
        held = os.open(os.path.dirname(path) or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        path = os.path.basename(path)
        host, _, port = listen.rpartition(":")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, int(port)))
        listener.listen(1024)
    try:
        pid = spawn_filtered(command, bpf)
    except OSError as err:
        os.write(2, f"hive-relay: cannot start {command[0]} in the gvisor box: {err.strerror or err}\n".encode())
        return 127 if isinstance(err, FileNotFoundError) else 3
    # Not dumpable: the agent runs as the same uid, and /proc/1/mem of an init that keeps AF_UNIX would
    # let it write code into the one process its filter does not hold (gVisor checks this as Linux does).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    # Keyboard signals belong to the agent's process group; the init only relays and waits.
    for sig in KEYBOARD:
        signal.signal(sig, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # runsc forwards these to the init: pass them on
        signal.signal(sig, lambda signum, _f: os.kill(pid, signum))
    if listener is not None:
        os.fchdir(held)  # the agent started in its own cwd; this init's connects resolve here
        os.close(held)
        threading.Thread(target=serve, args=(listener, path), daemon=True).start()
    while True:  # pid 1 of the box: orphans are reaped here too, the agent's status is the answer
        try:
            got, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            return 0
        if got != pid:
            continue
        if os.WIFEXITED(status):
            return os.WEXITSTATUS(status)
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            try:
                signal.signal(sig, signal.SIG_DFL)  # SIGKILL and SIGSTOP take no disposition: they need none
                os.kill(os.getpid(), sig)
            except (OSError, ValueError):
                pass
            return 128 + sig


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main(sys.argv))
