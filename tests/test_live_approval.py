"""Live approval: while a box runs, `allow HOST` from another terminal lets it reach the host and `deny HOST`
takes it away again; both are logged; a run that does not exist is one line and exit 4; another user's run
is refused. The 403 body tells the agent that a policy (not an outage) denied it, with the command."""

from __future__ import annotations

import json
import os
import queue
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relay.commands import live_rules
from relay.egress import control
from relay.model.errors import EXIT_NO_RUN, EXIT_REFUSED, RefusedError
from relay.model.refusal import ENTRY

from .conftest import REPO, Sandbox, require_tool
from .servers import start_http

LOOP = ("i=0; while [ ! -e stop ] && [ $i -lt 1200 ]; do i=$((i+1)); "
        "echo \"code=$(curl -s -o /dev/null -w '%{{http_code}}' http://svc.test:{port}/x)\"; sleep 0.2; done")


def _lines(proc: subprocess.Popen) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            q.put(line.strip())
        q.put(None)

    threading.Thread(target=read, daemon=True).start()
    return q


def _wait_for(q: queue.Queue, want: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            raise AssertionError(f"the box ended before printing {want}")
        if line == want:
            return
    raise AssertionError(f"no {want} within {timeout} s")


def _run_allow(s: Sandbox, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relay", *args], cwd=s.workdir, env=s.env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.box
@pytest.mark.parametrize("mode", ["local", "container"])
def test_allow_then_deny_a_host_while_the_box_runs(request: pytest.FixtureRequest, mode: str) -> None:
    require_tool("curl")
    s: Sandbox = request.getfixturevalue("csandbox" if mode == "container" else "box_sandbox")
    if mode == "container":  # the shared runtime dir holds other tests' runs: each test its own
        s.env["XDG_RUNTIME_DIR"] = str(s.root / "run")
    server, port, _ = start_http()
    box = subprocess.Popen([sys.executable, "-m", "relay", "shell", mode, "--quiet", "--prompt", LOOP.format(port=port)],
                           cwd=s.workdir, env=s.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        q = _lines(box)
        _wait_for(q, "code=403")
        entry = f"svc.test:{port}=127.0.0.1:{port}"
        allowed = _run_allow(s, "allow", entry)
        assert allowed.returncode == 0, allowed.stderr
        assert allowed.stdout.startswith("hive-relay: run ") and f"allowed {entry}" in allowed.stdout
        _wait_for(q, "code=200")
        denied = _run_allow(s, "deny", f"svc.test:{port}")
        assert denied.returncode == 0, denied.stderr
        assert f"denied svc.test:{port}" in denied.stdout
        _wait_for(q, "code=403")
        again = _run_allow(s, "deny", f"svc.test:{port}")  # nothing left to deny: one line, usage error
        assert again.returncode == 2 and "is not allowed in this run" in again.stderr, again.stderr
        asked = _run_allow(s, "ask")  # a run started without --ask takes no questions
        assert asked.returncode == 3 and "does not take questions" in asked.stderr, asked.stderr
    finally:
        (s.workdir / "stop").write_text("")
        try:
            _, err = box.communicate(timeout=120)
        finally:
            box.kill()
            server.shutdown()
    assert box.returncode == 0, err[-2000:]
    # The caller's terminal was told, at the first denial, the exact command.
    assert f"egress denied svc.test:{port} (not in the egress allowlist); to allow it now: {ENTRY} allow svc.test:{port} --run " in err
    logs = sorted((s.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    entries = [json.loads(line) for line in logs[-1].read_text().splitlines()]
    kinds = [e["decision"] for e in entries]
    assert "live-allow" in kinds and "live-deny" in kinds
    live = [e for e in entries if e["decision"].startswith("live-")]
    assert live[0]["rule"] == entry and f"by uid {os.getuid()}" in live[0]["reason"]
    assert any(e["decision"] == "allow" and e.get("live") == "allow" for e in entries)
    first_allow, first_live = kinds.index("allow"), kinds.index("live-allow")
    assert first_live < first_allow < kinds.index("live-deny") < len(kinds) - 1 and kinds[-1] == "deny"
    # The run dir (and the socket in it) is gone with the run.
    assert not list((Path(s.env["XDG_RUNTIME_DIR"])).glob("hive-relay-*"))


@pytest.mark.box
def test_the_403_body_says_policy_not_outage_with_the_command(box_sandbox: Sandbox) -> None:
    require_tool("curl")
    proc = box_sandbox.box("curl -s http://nowhere.test/x; echo; curl -s http://203.0.113.9/x")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line]
    assert lines[0].startswith("hive-relay: forbidden nowhere.test:80: not in the egress allowlist. by the hive-relay "
                               "egress policy (nowhere.test:80: not in the egress allowlist; rule: none), not an outage; "
                               f"to allow it while the box runs: {ENTRY} allow nowhere.test:80 --run "), lines[0]
    assert ("This is the sandbox's egress policy, not an outage: the user can allow it while this box runs "
            f"with `{ENTRY} allow nowhere.test:80 --run ") in lines[0]
    assert lines[0].endswith("`, or for later runs with --allow-host nowhere.test:80.")
    assert "IP literals are refused" in lines[1] and f"{ENTRY} allow 203.0.113.9:80 --run" in lines[1]
    run = lines[0].split("--run ")[1].split("`")[0]
    assert control.liveness.parse_run_id(run) is not None  # the real run id, not a placeholder


def test_no_such_run_is_one_line_and_exit_4(sandbox: Sandbox) -> None:
    for args in (("allow", "x.example.com", "--run", "1-2-deadbeef-cafecafe"), ("deny", "x.example.com")):
        proc = _run_allow(sandbox, *args)
        assert proc.returncode == EXIT_NO_RUN == 4, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "no live run of yours" in proc.stderr
    proc = subprocess.run([str(REPO / ".venv" / "bin" / "invoke"), "-r", str(REPO), "allow", "x.example.com", "--run",
                           "nope"], cwd=sandbox.workdir, env=sandbox.env, capture_output=True, text=True, timeout=60)
    if proc.returncode != 127:  # the invoke entry point, where the venv has it
        assert proc.returncode == 4 and "no live run of yours matches 'nope'" in proc.stderr, proc.stderr


def test_a_bad_entry_is_refused_before_any_run_is_looked_for(sandbox: Sandbox) -> None:
    proc = _run_allow(sandbox, "allow", "localhost:8080")
    assert proc.returncode == 2 and "=127.0.0.1:8080" in proc.stderr and "allow 'localhost:8080'" in proc.stderr


def _fake_run(base: Path, run_id: str, mode: int = 0o700) -> Path:
    path = base / f"hive-relay-{run_id}"
    path.mkdir()
    path.chmod(mode)
    return path


def test_another_users_run_is_refused_and_its_twin_is_found(tmp_path: Path) -> None:
    """A live run of ours is found (the twin); a run dir owned by another uid is refused by name (as root:
    root's allow never widens a user's box); an unprivileged caller cannot even see into one (0700)."""
    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    me = control.liveness.me()
    mine = _fake_run(base, f"{me.token()}-0a0b0c0d")
    sock = control.listen(str(mine))
    served: list[tuple[str, str]] = []

    def handle(op: str, entry: str, uid: int) -> dict:
        served.append((op, entry))
        return {"ok": True, "message": "fine"}

    def accept_one() -> None:
        conn, _ = sock.accept()
        control.serve(conn, handle)

    try:
        assert stat.S_IMODE(os.lstat(mine / "control").st_mode) == 0o600
        (run,) = control.live_runs(str(base))
        assert control.pick(str(base), None) == run and control.pick(str(base), "0a0b0c0d") == run
        t = threading.Thread(target=accept_one)
        t.start()
        assert control.request(run, "allow", "x.example.com") == {"ok": True, "message": "fine"}
        t.join(5)
        assert served == [("allow", "x.example.com")]
        # A run dir that is not private (0755) is not talked to.
        mine.chmod(0o755)
        assert control.live_runs(str(base)) == []
        with pytest.raises(RefusedError):
            control.request(run, "allow", "x.example.com")
        mine.chmod(0o700)
        # Another user's run, in both CI passes: the same real dir, seen by a caller of another uid (the
        # caller's uid is what pick and live_runs compare the real lstat with). As root, below, a real
        # dir chowned to nobody as well.
        real = os.getuid()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "getuid", lambda: real + 4242)
            with pytest.raises(RefusedError) as err:
                control.pick(str(base), run.run_id)
            assert err.value.exit_code == EXIT_REFUSED
            assert f"belongs to uid {real}, not to you (uid {real + 4242})" in err.value.message
            assert control.live_runs(str(base)) == []  # not listed either
            with pytest.raises(RefusedError, match="not private to you"):
                control.request(run, "allow", "x.example.com")
        assert served == [("allow", "x.example.com")]  # nothing reached the proxy's end
        assert control.pick(str(base), run.run_id) == run  # the twin: the owner still gets it
        if os.getuid() == 0:
            theirs = _fake_run(base, f"{me.token()}-0e0e0e0e")
            os.chown(theirs, 65534, 65534)
            with pytest.raises(RefusedError) as err:
                control.pick(str(base), f"{me.token()}-0e0e0e0e")
            assert err.value.exit_code == EXIT_REFUSED and "belongs to uid 65534" in err.value.message
            assert [r.run_id for r in control.live_runs(str(base))] == [run.run_id]
    finally:
        sock.close()


def test_apply_follows_the_allow_host_rules() -> None:
    from relay.model.allow_rules import parse_rule

    rules = (parse_rule("api.example.com"),)
    added, rule, message = control.apply(rules, "allow", "svc.test:8080=127.0.0.1:8080")
    assert added == rules + (rule,) and "pinned to 127.0.0.1:8080" in message
    assert control.apply(added, "allow", "svc.test:8080=127.0.0.1:8080")[0] == added
    assert control.apply(added, "deny", "api.example.com")[0] == (rule,)
    with pytest.raises(control.UsageError, match="NO_PROXY"):
        control.apply(rules, "allow", "127.0.0.1:80")
    with pytest.raises(control.UsageError, match="public suffix"):
        control.apply(rules, "allow", "*.com")


CLIENT = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(json.dumps({"op": "allow", "entry": "x.example.com"}).encode() + b"\\n")
print(s.makefile().readline().strip())
"""


def test_the_proxy_end_answers_only_its_own_uid() -> None:
    """The proxy's end checks SO_PEERCRED: another uid is refused and its request never reaches the rules;
    the twin, the same uid, is served. In both CI passes the proxy's end is made to run as another uid
    (its `os.getuid`), so the real peer, this user, is the stranger; as root also a real client as nobody."""
    import socket
    import tempfile

    base = tempfile.mkdtemp(prefix="hive-relay-ctl-test-")
    os.chmod(base, 0o755)
    path = os.path.join(base, "control")
    served: list[str] = []
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    os.chmod(path, 0o777)  # only the peer check stands between a stranger and the rules here
    listener.listen(4)

    real = os.getuid()
    owner = [real]  # who the proxy's end runs as, for the connection being served

    def serve_two() -> None:
        for _ in range(3 if real == 0 else 2):
            conn, _ = listener.accept()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(os, "getuid", lambda: owner[0])
                control.serve(conn, lambda op, entry, uid: served.append(f"{op} {entry} {uid}") or {"ok": True})

    t = threading.Thread(target=serve_two, daemon=True)
    t.start()
    try:
        same = subprocess.run(["/usr/bin/python3", "-c", CLIENT, path], capture_output=True, text=True, timeout=30)
        assert same.stdout.strip(), same
        assert json.loads(same.stdout) == {"ok": True} and served == [f"allow x.example.com {os.getuid()}"]
        owner[0] = real + 4242  # the proxy's end as another uid: this user's request is a stranger's now
        stranger = subprocess.run(["/usr/bin/python3", "-c", CLIENT, path], capture_output=True, text=True, timeout=30)
        reply = json.loads(stranger.stdout)
        assert reply == {"ok": False, "error": f"uid {real} may not change this run (it belongs to uid {real + 4242})"}
        assert len(served) == 1
        owner[0] = real
        if os.getuid() == 0:
            other = subprocess.run(["/usr/bin/python3", "-c", CLIENT, path], capture_output=True, text=True,
                                   timeout=30, user=65534, group=65534, extra_groups=[])
            assert other.stdout.strip(), other
            reply = json.loads(other.stdout)
            assert reply["ok"] is False and "uid 65534 may not change this run" in reply["error"], other
            assert len(served) == 1
        t.join(10)
    finally:
        listener.close()
        os.unlink(path)
        os.rmdir(base)


ASK_SCRIPT = ("while [ ! -e go ]; do sleep 0.1; done; "
              "curl -s -o /dev/null -w 'first=%{{http_code}}\\n' http://svc.test:{port}/x; "
              "s=$(date +%s); curl -s -o /dev/null -w 'other=%{{http_code}}\\n' http://other.test:{port}/x; "
              "echo took=$(( $(date +%s) - s ))")


@pytest.mark.box
@pytest.mark.parametrize("mode", ["local", "container"])
def test_ask_holds_the_denied_request_until_the_second_terminal_answers(request: pytest.FixtureRequest,
                                                                         mode: str) -> None:
    """--ask: the box's first request to an unlisted host waits while `ask` (a second terminal) is asked;
    the answer (a pinned entry) lets that very request through; a `n` for the next host gives its 403 at
    once. (Without --ask, `ask` is told the run takes no questions: the test above.)"""
    require_tool("curl")
    s: Sandbox = request.getfixturevalue("csandbox" if mode == "container" else "box_sandbox")
    s.env["XDG_RUNTIME_DIR"] = str(s.root / "run")
    server, port, _ = start_http()
    box = subprocess.Popen([sys.executable, "-m", "relay", "shell", mode, "--quiet", "--ask", "--prompt",
                            ASK_SCRIPT.format(port=port)], cwd=s.workdir, env=s.env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    asker = None
    try:
        deadline = time.monotonic() + 90
        while not control.live_runs(s.env["XDG_RUNTIME_DIR"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        asker = subprocess.Popen([sys.executable, "-m", "relay", "ask"], cwd=s.workdir, env=s.env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out = _lines(asker)
        first = out.get(timeout=30)
        assert first.startswith("hive-relay: answering run "), first
        (s.workdir / "go").write_text("")
        question = out.get(timeout=30)
        assert f"asks for svc.test:{port} (not in the egress allowlist). Allow it?" in question, question
        asker.stdin.write(f"svc.test:{port}=127.0.0.1:{port}\n")  # type: ignore[union-attr]
        asker.stdin.flush()  # type: ignore[union-attr]
        assert f"allowed svc.test:{port}=127.0.0.1:{port}" in out.get(timeout=30)
        question = out.get(timeout=30)
        assert f"asks for other.test:{port}" in question, question
        asker.stdin.write("n\n")  # type: ignore[union-attr]
        asker.stdin.flush()  # type: ignore[union-attr]
        assert f"refused other.test:{port}" in out.get(timeout=30)
        stdout, stderr = box.communicate(timeout=120)
        assert out.get(timeout=30).endswith("ended")
    finally:
        box.kill()
        if asker is not None:
            asker.kill()
        server.shutdown()
    assert box.returncode == 0, stderr[-2000:]
    assert "first=200" in stdout and "other=403" in stdout, stdout
    assert int(stdout.split("took=")[1].split()[0]) < 10  # refused at once, not after the 30 s wait
    proc = subprocess.run([sys.executable, "-m", "relay", "ask", "--run", "1-2-deadbeef-cafecafe"], cwd=s.workdir,
                          env=s.env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4 and "no live run of yours" in proc.stderr


def test_ask_answered_with_an_allow_the_proxy_refuses_releases_the_request_at_once(tmp_path: Path) -> None:
    """--ask, answered `y` for a name that resolves to an internal address: the allow is refused (an
    unpinned name never reaches an internal address) and the held request gets its 403 at once, saying
    why and how to pin it, instead of waiting out ASK_TIMEOUT. The twin: the pinned entry, answered to
    the next question, lets the same request through. The real control socket, `invoke ask`'s own loop."""
    import io
    import socket

    from relay.egress.decision_log import DecisionLog
    from relay.egress.proxy import EgressProxy
    from relay.egress.rulebook import ASK_TIMEOUT

    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    run_dir = _fake_run(base, f"{control.liveness.me().token()}-0a0b0c0d")
    server, port, _ = start_http()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def resolver(host: str, p: int) -> list[str]:
        if host == "internal.test":
            return ["127.0.0.1"]
        raise OSError(f"no such name {host}")

    proxy = EgressProxy(listener, (), DecisionLog(str(tmp_path / "egress.jsonl"), "test"), resolver=resolver,
                        notify=None, control=control.listen(str(run_dir)), ask=True)
    proxy.start()
    answers = io.StringIO(f"y\ninternal.test:{port}=127.0.0.1:{port}\n")
    asker = threading.Thread(target=live_rules.ask, kwargs={"env": {"XDG_RUNTIME_DIR": str(base)}, "answers": answers},
                             daemon=True)

    def get() -> tuple[bytes, float]:
        start = time.monotonic()
        with socket.create_connection(listener.getsockname(), timeout=ASK_TIMEOUT + 10) as s:
            s.sendall(f"GET http://internal.test:{port}/x HTTP/1.1\r\nHost: internal.test\r\n\r\n".encode())
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out, time.monotonic() - start

    try:
        asker.start()
        deadline = time.monotonic() + 10
        while not proxy.book._watchers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.book._watchers, "invoke ask is watching"
        refused, took = get()
        assert refused.startswith(b"HTTP/1.1 403 Forbidden"), refused
        assert b"the live ask's allow was refused: internal.test:" in refused, refused
        assert b"resolves to internal address 127.0.0.1" in refused and b"fix: pin it" in refused, refused
        assert took < 5, f"released at once, not after the {ASK_TIMEOUT:g} s wait: {took:.1f} s"
        served, took = get()
        assert served.startswith(b"HTTP/1.1 200 "), served  # the twin: the pinned answer lets it through
        assert took < 5
    finally:
        proxy.stop()
        server.shutdown()
        asker.join(10)
    lines = [json.loads(line) for line in (tmp_path / "egress.jsonl").read_text().splitlines()]
    refusal = [e for e in lines if e["decision"] == "live-refuse"]
    assert len(refusal) == 1 and "the allow was refused" in refusal[0]["reason"], lines
    assert refusal[0]["host"] == "internal.test" and refusal[0]["port"] == port
    assert [e["decision"] for e in lines if e.get("method") == "GET"] == ["deny", "allow"], lines
