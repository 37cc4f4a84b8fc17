"""Load: 10 concurrent boxes, each with 20 concurrent tunnels (200 in all) through their proxies, for
a bounded amount of work. Every request completes or is refused cleanly, and nothing leaks:
processes, file descriptors, temp files and cgroups are counted before and after."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ..conftest import Sandbox
from ..servers import start_echo
from ..test_box import _leftovers

CLIENT = r'''
import socket, sys, threading
port = int(sys.argv[1]); ok = []; refused = []; errors = []
def one(i):
    for j in range(10):
        try:
            s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
            host = "echo.test" if (i + j) % 5 else "denied.test"
            s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\n\r\n".encode())
            status = s.recv(4096).split(b"\r\n")[0]
            if b" 403 " in status:
                refused.append(1); s.close(); continue
            msg = (f"{i}-{j}-" * 500).encode(); s.sendall(msg); s.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
            (ok if got == msg else errors).append(1)
            s.close()
        except Exception as e:
            errors.append(repr(e))
ts = [threading.Thread(target=one, args=(i,)) for i in range(20)]
[t.start() for t in ts]; [t.join() for t in ts]
print("OK", len(ok), "REFUSED", len(refused), "ERRORS", len(errors))
'''


def _no_more(after: dict[str, int], before: dict[str, int]) -> bool:
    """Nothing left over: no count grew. (The census is machine-wide: a box of someone else's that
    ended meanwhile lowers it, which is no leftover of ours.)"""
    return all(after[k] <= before[k] for k in before)


def _ours(pid: str, root: str) -> bool:
    """A process of this test's: its cwd or its environment names the test's own sandbox root (the
    launchers, janitors and bwraps all start in the test's workdir with its HOME). Another run's boxes
    on a busy machine are not counted."""
    try:
        if os.readlink(f"/proc/{pid}/cwd").startswith(root):
            return True
        return root.encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def _mine(name: str) -> bool:
    try:
        return os.lstat(os.path.join("/tmp", name)).st_uid == os.getuid()
    except OSError:
        return False


def census(root: str = "/") -> dict[str, int]:
    procs = [p for p in os.listdir("/proc") if p.isdigit()]
    names = []
    for p in procs:
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if (b"bwrap" in cmdline or b"-m\x00relay" in cmdline) and _ours(p, root):
            names.append(cmdline)
    return {
        "relay processes": len(names),
        "test fds": len(os.listdir("/proc/self/fd")),
        # Only this user's: another user's runs (a second test pass, a colleague) come and go meanwhile.
        "tmp hive-relay entries": len([n for n in os.listdir("/tmp") if n.startswith("hive-relay-") and _mine(n)]),
    }


def test_ten_boxes_two_hundred_tunnels(box: Sandbox, report) -> None:
    before = census(str(box.root))
    echo, port = start_echo()
    (box.workdir / "client.py").write_text(CLIENT)
    try:
        launchers = [subprocess.Popen(
            [sys.executable, "-m", "relay", "shell", "--quiet", "--staged", "--timeout", "120", "--allow-host",
             f"echo.test:{port}=127.0.0.1:{port},tls=false", "--prompt", f"/usr/bin/python3 client.py {port}"],
            cwd=box.workdir, env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(10)]
        results = [p.communicate(timeout=300) for p in launchers]
    finally:
        echo.close()
    totals = {"OK": 0, "REFUSED": 0, "ERRORS": 0}
    for out, _err in results:
        words = out.split()
        for key in totals:
            if key in words:
                totals[key] += int(words[words.index(key) + 1])
    deadline = time.time() + 60  # the janitors' teardown, on a busy machine
    while time.time() < deadline and (not _no_more(census(str(box.root)), before) or _leftovers(box)):
        time.sleep(0.1)
    after = census(str(box.root))
    held = (all(p.returncode == 0 for p in launchers) and totals["ERRORS"] == 0
            and totals["OK"] + totals["REFUSED"] == 10 * 20 * 10 and totals["REFUSED"] == 400
            and _no_more(after, before) and not _leftovers(box))
    report.load(held)
    assert held, (totals, before, after, _leftovers(box), [p.returncode for p in launchers])
