"""Escape probes run *inside* a real box by `invoke selftest` (stdlib only, `python3 -I -S`).

Each probe prints one JSON line: {"probe", "kind": attack|legit, "ok": bool, "detail"}.
For an attack, ok means the box refused it; for a legitimate use, ok means it worked.
"""

import errno
import fcntl
import json
import os
import pty
import socket
import sys
import termios


def report(probe, kind, ok, detail):
    print(json.dumps({"probe": probe, "kind": kind, "ok": bool(ok), "detail": detail}), flush=True)


def err_name(exc):
    return errno.errorcode.get(exc.errno, str(exc.errno)) if isinstance(exc, OSError) else type(exc).__name__


def read_ssh(home, planted=None):
    """`planted`: a key file the launcher put in the host's ~/.ssh for this run, so that the probe
    attacks a real target even when the user has no ~/.ssh of their own."""
    path = os.path.join(home, ".ssh")
    why = "opened but empty"
    if planted:
        try:
            with open(os.path.join(path, planted), "rb") as fh:
                got = fh.read(1)
        except OSError as exc:
            got, why = b"", err_name(exc)
        if got:
            return report("read ~/.ssh", "attack", False, f"read the planted key ~/.ssh/{planted}")
    try:
        names = os.listdir(path)
    except OSError as exc:
        return report("read ~/.ssh", "attack", True, f"listing refused: {err_name(exc)}"
                      + (f"; planted key: {why}" if planted else ""))
    readable = []
    for name in names:
        try:
            with open(os.path.join(path, name), "rb") as fh:
                if fh.read(1):
                    readable.append(name)
        except OSError:
            pass
    report("read ~/.ssh", "attack", not readable, f"readable: {readable}" if readable else
           "nothing readable" + (f"; planted key: {why}" if planted else ""))


def write_outside(workdir, home):
    """Try to write where the host would keep it. Writes that land in the box's private tmpfs
    (/tmp, $HOME) succeed by design; the launcher checks on the host that none of them arrived."""
    name = ".hive-relay-selftest-escape"
    targets = [os.path.join(os.path.dirname(workdir.rstrip("/")) or "/", name), os.path.join(home, name),
               "/usr/" + name, "/etc/" + name]
    wrote = []
    for path in targets:
        try:
            with open(path, "w") as fh:
                fh.write("escaped")
            wrote.append(path)
        except OSError:
            pass
    report("write outside the workdir", "attack-host", True, ",".join(wrote))


def write_workdir(workdir):
    path = os.path.join(workdir, f".hive-relay-selftest-{os.getpid()}")
    try:
        with open(path, "w") as fh:
            fh.write("ok")
        os.unlink(path)
        report("write inside the workdir", "legit", True, "created and removed a file")
    except OSError as exc:
        report("write inside the workdir", "legit", False, err_name(exc))


# Host sockets a box must never reach (the engines' and the system bus): in the vm tier the guest's
# AF_UNIX is its own kernel's, so the probe is whether any of these answers from inside.
HOST_SOCKETS = ("/run/podman/podman.sock", "/var/run/docker.sock", "/run/docker.sock", "/run/dbus/system_bus_socket",
                "/run/containerd/containerd.sock")


def af_unix(tier=None):
    if tier == "vm":
        reached = []
        for path in HOST_SOCKETS + tuple(p for p in (os.environ.get("XDG_RUNTIME_DIR"),) if p):
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(2)
                s.connect(path)
                reached.append(path)
            except OSError:
                pass
        report("AF_UNIX reaches a host socket", "attack", not reached,
               f"reached {reached}" if reached else "none (the guest's sockets are its own kernel's)")
        a, b = socket.socketpair()
        a.sendall(b"x")
        report("socketpair()", "legit", b.recv(1) == b"x", "works")
        return
    try:
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
        report("AF_UNIX socket()", "attack", False, "socket created")
    except OSError as exc:
        report("AF_UNIX socket()", "attack", exc.errno == errno.EPERM, err_name(exc))
    try:
        a, b = socket.socketpair()
        a.sendall(b"x")
        report("socketpair()", "legit", b.recv(1) == b"x", "works")
    except OSError as exc:
        report("socketpair()", "legit", False, err_name(exc))


def tiocsti(tier=None):
    if tier == "vm":
        # The caller's terminal is qemu's serial console: the guest has no tty of the host to ioctl.
        # TIOCSTI on a tty of the guest's own stays in the guest; report what it does there.
        master, slave = pty.openpty()
        try:
            fcntl.ioctl(slave, termios.TIOCSTI, b"x")
            what = "works on the guest's own pty only"
        except OSError as exc:
            what = err_name(exc)
        report("TIOCSTI into the caller's terminal", "attack", not os.isatty(0) or os.ttyname(0).startswith("/dev/ttyS"),
               f"no host tty in the guest ({what})")
        return
    master, slave = pty.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSTI, b"x")
        report("TIOCSTI injection", "attack", False, "ioctl succeeded")
    except OSError as exc:
        report("TIOCSTI injection", "attack", exc.errno == errno.EPERM, err_name(exc))


def host_pids(launcher_pid, tier=None):
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    try:
        with open(f"/proc/{launcher_pid}/cmdline", "rb") as fh:
            data = fh.read()
        seen = b"relay" in data or b"invoke" in data
    except OSError:
        seen = False
    if tier == "vm":  # the guest's own kernel threads and processes: none of them is the host's
        report("see host pids", "attack", not seen, f"{len(pids)} guest pids visible (its own kernel's)"
               + (", launcher visible" if seen else ", not the launcher"))
        return
    ok = len(pids) < 20 and not seen
    report("see host pids", "attack", ok, f"{len(pids)} pids visible" + (", launcher visible" if seen else ""))


def network(proxy, allowed, denied):
    if not proxy:
        try:
            socket.create_connection(("1.1.1.1", 443), timeout=3).close()
            report("direct connect", "attack", False, "connected to 1.1.1.1:443")
        except OSError as exc:
            report("direct connect", "attack", True, err_name(exc))
        return
    host, port = proxy.rsplit(":", 1)
    for target, kind, name in ((denied, "attack", "connect to a non-allowed host"),
                               (allowed, "legit", "connect to an allowed host")):
        if not target:
            continue
        try:
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            status = s.recv(4096).split(b"\r\n")[0].decode(errors="replace")
            s.close()
        except OSError as exc:
            status = f"error {err_name(exc)}"
        worked = " 200 " in status + " "
        report(name, kind, (not worked) if kind == "attack" else worked, f"{target}: {status}")
    try:
        socket.create_connection(("1.1.1.1", 443), timeout=3).close()
        report("direct connect skipping the proxy", "attack", False, "connected")
    except OSError as exc:
        report("direct connect skipping the proxy", "attack", True, err_name(exc))


def grants(paths):
    for path in paths:
        ok = os.access(path, os.R_OK)
        report(f"backend state {path}", "legit", ok, "readable" if ok else "not readable")


def main(args):
    opts = dict(a.split("=", 1) for a in args)
    home, workdir = os.environ.get("HOME", "/"), os.getcwd()
    read_ssh(home, opts.get("planted"))
    write_outside(workdir, home)
    write_workdir(workdir)
    af_unix(opts.get("tier"))
    tiocsti(opts.get("tier"))
    host_pids(int(opts.get("launcher", "1")), opts.get("tier"))
    network(opts.get("proxy"), opts.get("allowed"), opts.get("denied", "example.com:443"))
    grants([p for p in opts.get("grants", "").split(",") if p])


if __name__ == "__main__":
    main(sys.argv[1:])
