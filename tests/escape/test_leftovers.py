"""What outlives the box: files git review misses that host tools run (the exit report), and host
state whose owner is gone (swept at the next launch, owners checked by pid and start time)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from relay.host import liveness, procs

from ..conftest import Sandbox

SITE = ".venv/lib/python3.11/site-packages"


def _git(s: Sandbox, *args: str) -> None:
    subprocess.run(["git", "-C", str(s.workdir), *args], check=True, capture_output=True, env=s.env)


def _project(s: Sandbox) -> None:
    """A checkout with an ignored virtualenv and node_modules, a tracked script and a tracked source file."""
    w = s.workdir
    (w / SITE).mkdir(parents=True)
    (w / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (w / ".venv" / "bin").mkdir()
    (w / "node_modules" / ".bin").mkdir(parents=True)
    (w / "node_modules" / "left-pad").mkdir()
    (w / "node_modules" / "left-pad" / "package.json").write_text('{"name": "left-pad"}\n')
    (w / "build").mkdir()
    (w / ".gitignore").write_text(".venv/\nnode_modules/\nbuild/\n")
    (w / "app.py").write_text("print('v1')\n")
    (w / "run.sh").write_text("#!/bin/sh\necho v1\n")
    (w / "run.sh").chmod(0o755)
    _git(s, "init", "-q")
    _git(s, "add", "-A")
    _git(s, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")


def _reports(s: Sandbox) -> list[Path]:
    return sorted((s.home / ".local" / "state" / "hive-relay" / "reports").glob("*.txt"))


def _log(s: Sandbox) -> list[dict]:
    logs = sorted((s.home / ".local" / "state" / "hive-relay" / "logs").glob("*.jsonl"))
    return [json.loads(line) for f in logs for line in f.read_text().splitlines()]


def test_exit_report_lists_what_git_does_not_show(box_sandbox: Sandbox, report) -> None:
    s = box_sandbox
    _project(s)
    script = (f"echo 'import os; os.system(\"id\")' > {SITE}/evil.pth; echo x > {SITE}/sitecustomize.py; "
              "ln -s ../left-pad/index.js node_modules/.bin/evil; "
              "printf '{\"name\":\"left-pad\",\"scripts\":{\"postinstall\":\"sh x\"}}' > node_modules/left-pad/package.json; "
              "printf '#!/bin/sh\\n' > build/tool; chmod +x build/tool; mkfifo .env.local; "
              "ln -s /etc/shadow .venv/bin/python3; echo done")
    proc = s.box(script, "claude", timeout=120)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    summary = [line for line in proc.stderr.splitlines() if "git does not show" in line]
    reports = _reports(s)
    listed = reports[0].read_text() if reports else ""
    expected = [f"{SITE}/evil.pth", f"{SITE}/sitecustomize.py", "node_modules/.bin/evil",
                "node_modules/left-pad/package.json", "build/tool", ".env.local", ".venv/bin/python3"]
    missing = [p for p in expected if str(s.workdir / p) not in listed]
    records = [r for r in _log(s) if r.get("event") == "exit-report"]
    ok = (len(summary) == 1 and summary[0].startswith("hive-relay: the box left 7 file(s)")
          and str(reports[0]) in summary[0] and not missing and "postinstall" in listed
          and len(records) == 1 and records[0]["count"] == 7)
    report.attack(ok)
    assert ok, f"{proc.stderr}\n{listed}\n{missing}\n{records}"


def test_exit_report_quiet_for_ordinary_source_edits(box_sandbox: Sandbox, report) -> None:
    s = box_sandbox
    _project(s)
    # a tracked file edited, a tracked script rewritten by rename, new untracked sources, a new dir
    script = ("echo \"print('v2')\" >> app.py; sed -i s/v1/v2/ run.sh; echo 'x = 1' > util.py; "
              "mkdir -p pkg && echo '' > pkg/__init__.py; git add util.py; echo done")
    proc = s.box(script, "claude", timeout=120)
    quiet = proc.returncode == 0 and "done" in proc.stdout and "git does not show" not in proc.stderr \
        and not _reports(s) and not [r for r in _log(s) if r.get("event") == "exit-report"]
    report.legit(quiet)
    assert quiet, proc.stderr
    assert "v2" in (s.workdir / "run.sh").read_text()


def _janitors(pid: int) -> list[int]:
    """The launcher's forked children that lead a session of their own: its janitor."""
    return sorted(c for c in procs.children(pid) if (f := procs.stat_fields(c)) is not None and int(f[3]) == c)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _wait_for(cond, what: str, limit: float = 60) -> None:  # noqa: ANN001
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def _registry(s: Sandbox) -> dict:
    path = s.home / ".local" / "state" / "hive-relay" / "placeholders.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _run_dirs(s: Sandbox, pid: int | None = None) -> list[Path]:
    """Run dirs (the launcher's own, not a transient `-verify` one), of one launcher when given."""
    return sorted(d for d in (s.root / "run").glob(f"hive-relay-{pid or ''}*") if not d.name.endswith("-verify")
                  and (pid is None or d.name.startswith(f"hive-relay-{pid}-")))


def _cgroups(run_id: str) -> list[str]:
    return [p for c in ("memory", "pids") if os.path.isdir(p := f"/sys/fs/cgroup/{c}/hive-relay-{run_id}")]


def _start_waiting_box(s: Sandbox, flag: str) -> subprocess.Popen:
    """A box that waits until FLAG appears in the workdir (written by the test from the host)."""
    return subprocess.Popen([sys.executable, "-m", "relay", "claude", "local", "--quiet", "--prompt",
                             f"touch started-{flag}; while [ ! -e {flag} ]; do sleep 0.05; done; echo released"],
                            cwd=s.workdir, env=s.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _owned_by(s: Sandbox, pid: int) -> list[str]:
    return [p for p, e in _registry(s).items() if any(o["pid"] == pid for o in e["pids"])]


def test_launcher_and_janitor_killed_leave_nothing_after_the_next_box(box_sandbox: Sandbox, report) -> None:
    s = box_sandbox
    launcher = _start_waiting_box(s, "never")
    _wait_for(lambda: (s.workdir / "started-never").exists(), "the box running")
    run_dir = _run_dirs(s, launcher.pid)[0]
    run_id = run_dir.name.removeprefix("hive-relay-")
    assert liveness.parse_run_id(run_id) == liveness.me(launcher.pid)
    placeholders = _owned_by(s, launcher.pid)
    cgroups = _cgroups(run_id)
    janitors = [p for p in _janitors(launcher.pid) if _cmdline(p) == _cmdline(launcher.pid)]
    assert len(janitors) == 1, janitors
    os.kill(janitors[0], signal.SIGKILL)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.communicate(timeout=60)
    _wait_for(lambda: not os.path.exists(f"/proc/{janitors[0]}"), "the janitor's end")
    left = run_dir.exists() and all(os.path.lexists(p) for p in placeholders)
    assert left, "nothing was left behind: the test would prove nothing"
    nxt = s.box("echo next", "claude")
    assert nxt.returncode == 0, nxt.stderr
    clean = (not run_dir.exists() and not any(os.path.lexists(p) for p in placeholders)
             and not _owned_by(s, launcher.pid) and not _cgroups(run_id) and not _run_dirs(s))
    report.fault(clean)
    assert clean, (run_dir.exists(), placeholders, _registry(s), cgroups, _cgroups(run_id))


def test_reused_pid_is_not_an_owner_while_a_live_launcher_is(box_sandbox: Sandbox, report) -> None:
    s = box_sandbox
    # An unrelated live process holds the pid a dead launcher's records name, with another start time.
    squatter = subprocess.Popen(["sleep", "600"])
    try:
        real = liveness.me(squatter.pid)
        assert real.start is not None
        fake = liveness.Owner(squatter.pid, real.start - 7, real.boot)
        stale_dir = s.root / "run" / f"hive-relay-{fake.token()}-deadbeef"
        (stale_dir / "home").mkdir(parents=True)
        stale_file = s.workdir / ".stale-placeholder"
        stale_file.touch(mode=0o444)
        registry = s.home / ".local" / "state" / "hive-relay" / "placeholders.json"
        registry.parent.mkdir(parents=True, exist_ok=True)
        registry.write_text(json.dumps({str(stale_file): {"base": str(s.workdir), "pids": [fake.as_json()]}}))
        fake_cgroup = f"/sys/fs/cgroup/pids/hive-relay-{fake.token()}-deadbeef"
        made_cgroup = False
        if os.getuid() == 0 and os.path.isdir("/sys/fs/cgroup/pids"):
            try:
                os.mkdir(fake_cgroup)
                made_cgroup = True
            except OSError:
                pass
        # A live launcher's box runs meanwhile; a second box launches, sweeps and ends.
        first = _start_waiting_box(s, "go")
        try:
            _wait_for(lambda: _owned_by(s, first.pid) and _run_dirs(s, first.pid), "the first box's run dir and placeholders")
            first_dir = _run_dirs(s, first.pid)[0]
            first_refs = _owned_by(s, first.pid)
            second = s.box("echo second", "claude", "--shared-live")
            assert second.returncode == 0, second.stderr
            swept = not stale_dir.exists() and not stale_file.exists() and str(stale_file) not in _registry(s) \
                and not (made_cgroup and os.path.isdir(fake_cgroup))
            kept_parts = (first_dir.exists(), _owned_by(s, first.pid) == first_refs,
                          all(os.path.lexists(p) for p in first_refs), first.poll() is None)
            kept = all(kept_parts)
            (s.workdir / "go").touch()
            out, err = first.communicate(timeout=120)
        finally:
            if first.poll() is None:
                first.kill()
                first.communicate()
        kept = kept and first.returncode == 0 and "released" in out
        report.attack(swept)
        report.legit(kept)
        assert swept, (stale_dir.exists(), stale_file.exists(), _registry(s))
        assert kept, (kept_parts, out, err, first_refs)
        assert squatter.poll() is None  # the squatter itself is never touched
    finally:
        squatter.kill()
        squatter.wait()
        for left in Path("/sys/fs/cgroup/pids").glob(f"hive-relay-{squatter.pid}-*-deadbeef"):
            left.rmdir()
