"""The engine's start gate and the prestart (relay/modes/engine_gate.py, relay/modes/container_prestart.py).

A warm container launch starts podman before the plan exists, with the argv the same command line
had last time, held at a FIFO in place of its seccomp profile. The plan decides: the waiting engine
goes on only when the plan's argv, env and cwd are exactly its own; otherwise it is killed where it
waits, having created nothing. These tests hold both sides, with the real engine: the warm launch
takes the prestart, and a memo that says otherwise (changed by hand, or stale) never reaches a
container; a launcher killed at the gate leaves no engine, container or run dir behind; a refused
launch leaves nothing either, and no engine noise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relay.host import memo
from relay.modes import container_prestart as cp
from relay.modes.engine_gate import PROFILE_NAME

from .conftest import PODMAN, Sandbox, own_processes, podman_env

# ---------------------------------------------------------------- pure: the memo's words


@pytest.mark.parametrize("argv, prompt", [
    (["shell", "container", "--prompt", "ls -la"], "ls -la"),
    (["shell", "container", "--prompt=ls"], "ls"),
    (["shell", "container", "-r", "ls"], "ls"),
    (["shell", "container", "-rls"], "ls"),
    (["shell", "container", "-q"], None),
    (["shell", "container", "--", "--prompt", "x"], None),  # words after `--` are the box's command
])
def test_the_prompt_is_found_in_the_spellings_the_parser_takes_whole(argv: list[str], prompt: str | None) -> None:
    assert cp.prompt_of(argv) == prompt


def test_the_memo_key_ignores_the_prompt_but_not_the_rest() -> None:
    one = cp.entry_key(["shell", "container", "--prompt", "a"], "/w", 1000)
    assert one == cp.entry_key(["shell", "container", "--prompt", "another prompt"], "/w", 1000)
    assert one != cp.entry_key(["shell", "container", "--prompt", "a"], "/other", 1000)
    assert one != cp.entry_key(["shell", "container", "--prompt", "a"], "/w", 1001)
    assert one != cp.entry_key(["shell", "container", "--live", "--prompt", "a"], "/w", 1000)


def test_a_template_keeps_neither_the_run_id_nor_the_prompt() -> None:
    argv = _ours()[:-1] + ["secret plan"]
    template = cp.to_template(argv, "1-2-3-4", "secret plan", cp.image_at(argv, RUN_DIR))
    assert template is not None and "1-2-3-4" not in json.dumps(template) and "secret plan" not in json.dumps(template)
    again = cp.from_template(template, "9-9-9-9", "other")
    assert again is not None and again[-1] == "other" and "hive-relay-9-9-9-9" in again
    assert cp.image_at(again, "/tmp/hive-relay-9-9-9-9") is not None
    assert cp.from_template(template, "9-9-9-9", None) is None  # a prompt run's argv never serves a run without one
    # A prompt that is part of a longer word would be kept: no template at all.
    longer = _ours()[:-1] + ["echo x; secret plan"]
    assert cp.to_template(longer, "1-2-3-4", "secret plan", cp.image_at(longer, RUN_DIR)) is None
    assert cp.to_template(_ours()[:-1] + [""], "1-2-3-4", "", cp.image_at(_ours(), RUN_DIR)) is None


RUN_DIR = "/tmp/hive-relay-1-2-3-4"
IMG = "localhost/hive-relay-contributor:0123456789ab-u1000"


def _ours(*options: str, image: str = IMG) -> list[str]:
    """container_argv's podman run for RUN_DIR, with OPTIONS added before the image."""
    return ["/usr/bin/podman", *cp.PREFIX, "hive-relay-1-2-3-4", "--read-only", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--network", "none", "--pidfile", f"{RUN_DIR}/pid",
            "--security-opt", f"seccomp={RUN_DIR}/{PROFILE_NAME}", "--volume", "/w:/w:rw", "--env", "A=b",
            *options, image, "/bin/bash", "-c", "--pull=always --network host"]


def test_only_container_argvs_grammar_is_started() -> None:
    """The closed grammar: our argv passes (the words after the image are the box's command, whatever
    they look like); every option that acts before podman reads its profile, or another spelling,
    profile, image, name or pidfile does not."""
    assert cp.image_at(_ours(), RUN_DIR) == len(_ours()) - 4
    assert cp.image_at(_ours("-t", "--userns", "keep-id"), RUN_DIR) is not None
    for bad in (["--security-opt=seccomp=unconfined"], ["--security-opt", "seccomp=unconfined"],
                ["--security-opt", f"seccomp={RUN_DIR}/{PROFILE_NAME}"], ["--pull=always"], ["--pull", "always"],
                ["--pod", "new:x"], ["--url", "ssh://x"], ["--remote"], ["--runtime", "/x"], ["--root", "/x"],
                ["--hooks-dir", "/x"], ["--env-file", "/x"], ["--cidfile", "/x"], ["--network", "host"],
                ["--entrypoint", "/bin/sh"], ["--pidfile", "/tmp/other/pid"], ["--privileged"], ["--volume=/:/h"]):
        assert cp.image_at(_ours(*bad), RUN_DIR) is None, bad
    assert cp.image_at(_ours(image="docker.io/library/alpine"), RUN_DIR) is None
    assert cp.image_at(_ours(), "/tmp/hive-relay-9-9-9-9") is None  # another run's name, pidfile and gate
    assert cp.image_at(["podman", *_ours()[1:]], RUN_DIR) is None  # not absolute
    assert cp.image_at(["/usr/bin/docker", *_ours()[1:]], RUN_DIR) is None


def test_the_engine_must_be_roots_alone(tmp_path: Path) -> None:
    planted = tmp_path / "podman"
    planted.write_text("#!/bin/sh\n")
    planted.chmod(0o777)  # writable by anyone (and, unprivileged, not root's)
    assert not cp.engine_ok(str(planted))
    if os.path.exists("/usr/bin/podman"):
        assert cp.engine_ok("/usr/bin/podman")


def test_the_prompt_is_masked_only_in_the_boxs_command() -> None:
    """A prompt equal to an option's value (`none`) stays a value there: only the command's word is masked."""
    argv = _ours()[:-1] + ["none"]
    template = cp.to_template(argv, "1-2-3-4", "none", cp.image_at(argv, RUN_DIR))
    assert template is not None and template[template.index("--network") + 1] == "none"
    assert template[-1] == cp.PROMPT
    assert cp.entry_key(["shell", "container", "--prompt=one"], "/w", 0) == \
        cp.entry_key(["shell", "container", "--prompt=two"], "/w", 0)
    assert cp.entry_key(["shell", "container", "-rone"], "/w", 0) == cp.entry_key(["shell", "container", "-rtwo"], "/w", 0)


def test_an_engine_that_never_reads_the_gate_is_killed_with_one_line(tmp_path: Path) -> None:
    from relay.modes import engine_gate

    gate = engine_gate.make(str(tmp_path))
    gate.start(["sleep", "30"], dict(os.environ), str(tmp_path))
    start = time.monotonic()
    with pytest.raises(engine_gate.GateError, match="did not read its start gate"):
        gate.release(b"{}" * 10, timeout=0.5)
    assert gate.proc is None and time.monotonic() - start < 10  # killed, not left to wait


def test_a_memo_not_ours_alone_is_not_read(tmp_path: Path) -> None:
    """A cache dir or memo file another user could write (root launched with that user's cache dir):
    a miss, and nothing is put there."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    memo.put(env, memo.MemoKind.ENGINE_ARGV, "k", b"data")
    assert memo.get(env, memo.MemoKind.ENGINE_ARGV, "k", 100) == b"data"
    kept = tmp_path / "cache" / "hive-relay" / "memo" / memo.MemoKind.ENGINE_ARGV.value / "k"
    kept.chmod(0o620)
    assert memo.get(env, memo.MemoKind.ENGINE_ARGV, "k", 100) is None
    kept.chmod(0o600)
    (tmp_path / "cache" / "hive-relay").chmod(0o770)
    assert memo.get(env, memo.MemoKind.ENGINE_ARGV, "k", 100) is None
    memo.put(env, memo.MemoKind.ENGINE_ARGV, "k2", b"data")
    assert not kept.with_name("k2").exists()
    (tmp_path / "cache" / "hive-relay").chmod(0o700)
    if os.geteuid() == 0:
        os.chown(tmp_path / "cache" / "hive-relay", 65534, 65534)
        assert memo.get(env, memo.MemoKind.ENGINE_ARGV, "k", 100) is None


# ---------------------------------------------------------------- the real engine

def _launch(s: Sandbox, script: str, *extra: str, trace: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    more = {"HIVE_RELAY_TRACE": str(trace)} if trace else {}
    return s.relay("shell", "container", "--quiet", *extra, "--prompt", script, extra_env={**more, **(env or {})})


def _memos(s: Sandbox) -> list[Path]:
    return sorted((s.home / ".cache" / "hive-relay" / "memo" / memo.MemoKind.ENGINE_ARGV.value).glob("*"))


def _run_dirs(s: Sandbox) -> list[Path]:
    return sorted(Path(s.env["XDG_RUNTIME_DIR"]).glob("hive-relay-*"))



@pytest.mark.container
def test_the_second_launch_takes_its_prestarted_engine(csandbox: Sandbox, tmp_path: Path) -> None:
    s = csandbox
    first = _launch(s, "echo first", trace=tmp_path / "1.json")
    assert first.returncode == 0 and "first" in first.stdout, first.stderr[-2000:]
    assert "prestarted" not in json.loads((tmp_path / "1.json").read_text())
    [kept] = _memos(s)
    assert b"echo first" not in kept.read_bytes()  # the prompt is a marker there
    second = _launch(s, "echo second", trace=tmp_path / "2.json")
    assert second.returncode == 0 and "second" in second.stdout, second.stderr[-2000:]
    marks = json.loads((tmp_path / "2.json").read_text())
    assert "prestarted" in marks and "prestart_taken" in marks, marks
    assert marks["prestarted"] < marks["cli"] < marks["released"] < marks["box_ready"]
    assert "Error" not in second.stderr


@pytest.mark.container
def test_a_memo_that_is_not_the_plan_never_reaches_a_container(csandbox: Sandbox, tmp_path: Path) -> None:
    """A remembered argv changed by hand to mount the caller's ~/.ssh: the prestarted engine waits at
    its gate, the plan differs, so it is killed there and the plan's own engine runs. The box sees no key."""
    s = csandbox
    assert _launch(s, "true").returncode == 0
    [kept] = _memos(s)
    entry = json.loads(kept.read_text())
    at = entry["argv"].index("--workdir")
    entry["argv"][at:at] = ["--volume", f"{s.home / '.ssh'}:/leak:ro"]
    kept.write_text(json.dumps(entry))
    proc = _launch(s, "ls /leak 2>&1; cat /leak/id_rsa 2>&1; echo done", trace=tmp_path / "t.json")
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
    assert "PRIVATE-KEY" not in proc.stdout and "No such file" in proc.stdout
    marks = json.loads((tmp_path / "t.json").read_text())
    assert "prestarted" in marks and "prestart_taken" not in marks, marks
    assert "Error" not in proc.stderr  # the killed engine said nothing
    # The launch remembered its own argv again: the next one takes its prestart.
    assert json.loads(kept.read_text())["argv"][at] != "--volume"


@pytest.mark.container
def test_a_changed_plan_for_the_same_command_line_gets_its_own_engine(csandbox: Sandbox, tmp_path: Path) -> None:
    """The same words, another plan (the workdir became a git checkout): the prestart is killed, the
    run has the plan's own engine, with the git dir bound."""
    s = csandbox
    assert not (s.workdir / ".git").exists()
    assert _launch(s, "true").returncode == 0
    subprocess.run(["git", "init", "-q", str(s.workdir)], check=True)  # the plan now binds the git dir
    proc = _launch(s, "test -d .git/objects && echo HAS-GIT", trace=tmp_path / "t.json")
    assert proc.returncode == 0 and "HAS-GIT" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    marks = json.loads((tmp_path / "t.json").read_text())
    assert "prestarted" in marks and "prestart_taken" not in marks, marks


@pytest.mark.container
def test_a_refused_launch_after_a_prestart_leaves_nothing(csandbox: Sandbox) -> None:
    """The same command line, but the user config now fails to load: exit 2 with our one line, the
    waiting engine killed (no podman error), no run dir left."""
    s = csandbox
    assert _launch(s, "true").returncode == 0
    before = _run_dirs(s)
    conf = s.home / ".config" / "hive-relay" / "config.yaml"
    good = conf.read_text()
    conf.write_text("egress: [unclosed\n")
    try:
        proc = _launch(s, "true")
    finally:
        conf.write_text(good)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Error:" not in proc.stderr and proc.stderr.count("hive-relay:") == 1, proc.stderr
    assert _run_dirs(s) == before
    assert not [c for _, c in own_processes() if "podman" in c and str(s.workdir) in c]


def _engine_of(launcher: int) -> int | None:
    """The launcher's podman child, if it has one now."""
    try:
        kids = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    except OSError:
        return None
    for kid in kids:
        try:
            if Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"podman"):
                return int(kid)
        except OSError:
            continue
    return None


@pytest.mark.container
def test_a_launcher_killed_at_the_gate_leaves_no_engine_container_or_run_dir(csandbox: Sandbox) -> None:
    """kill -9 while the engine waits at its gate (the launcher stopped before its control dir, made
    just before the go, exists): the engine reads end of file and exits on its own, having created
    no container; the run dir goes with the next launch's sweep."""
    s = csandbox
    assert _launch(s, "true").returncode == 0  # remembered: the next launch prestarts within ~20 ms
    caught = None
    for _attempt in range(20):
        launcher = subprocess.Popen([sys.executable, "-m", "relay", "shell", "container", "--quiet", "--prompt", "true"],
                                    cwd=s.workdir, env=s.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        gate = engine = None
        while engine is None and time.monotonic() < deadline and launcher.poll() is None:
            found = [p for p in _run_dirs(s) if p.name.startswith(f"hive-relay-{launcher.pid}-")]
            gate = found[0] if found and (found[0] / PROFILE_NAME).exists() else None
            engine = _engine_of(launcher.pid) if gate is not None else None
            time.sleep(0.0005)
        if gate is not None and engine is not None:
            launcher.send_signal(signal.SIGSTOP)
            if not (gate / "ctl").exists():
                caught = (launcher, gate, engine)
                break
            launcher.send_signal(signal.SIGCONT)
        launcher.wait(timeout=120)
    assert caught is not None, "never stopped a launcher with its engine waiting at the gate"
    launcher, gate, engine = caught
    name = f"hive-relay-{gate.name[len('hive-relay-'):]}"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 60
    while Path(f"/proc/{engine}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{engine}").exists(), "the engine outlived its launcher at the gate"
    names = subprocess.run([PODMAN, "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True,
                           env=podman_env()).stdout.split()
    assert name not in names
    assert _launch(s, "true").returncode == 0  # its sweep removes the dead launcher's run dir
    assert not gate.exists()


@pytest.mark.container
def test_tools_planted_in_the_workdir_never_run_for_a_prestart(csandbox: Sandbox, tmp_path: Path) -> None:
    """`python -m relay` with `.` and an empty entry on PATH (the entry that does not clean it in shell):
    the prestarted podman looks its conmon and runtime up on PATH, so the prestart cleans PATH first,
    as every command does. Planted conmon, runc, crun and podman in the workdir never run; the launch
    (the second one takes its prestart) works."""
    s = csandbox
    marker = tmp_path / "planted-ran"
    for tool in ("conmon", "runc", "crun", "podman", "catatonit"):
        planted = s.workdir / tool
        planted.write_text(f"#!/bin/sh\necho {tool} >> {marker}\nexit 1\n")
        planted.chmod(0o755)
    env = {"PATH": f".::{s.env['PATH']}"}
    assert _launch(s, "echo one", env=env).returncode == 0
    proc = _launch(s, "echo two", env=env, trace=tmp_path / "t.json")
    assert proc.returncode == 0 and "two" in proc.stdout, proc.stderr[-2000:]
    assert "prestart_taken" in json.loads((tmp_path / "t.json").read_text())
    assert not marker.exists(), marker.read_text()


@pytest.mark.container
def test_a_memo_outside_the_grammar_or_for_a_gone_image_is_never_started(csandbox: Sandbox, tmp_path: Path) -> None:
    """An option that acts before podman reads its profile (`--pull=always`), or an image this user's
    engine does not have: no prestart at all, so no pull and no "image not known" on the terminal."""
    s = csandbox
    assert _launch(s, "true").returncode == 0
    [kept] = _memos(s)
    good = kept.read_text()
    entry = json.loads(good)
    at = entry["argv"].index("--workdir")
    for change in ("pull", "image"):
        bad = json.loads(good)
        if change == "pull":
            bad["argv"][at:at] = ["--pull=always"]
        else:
            i = next(i for i, w in enumerate(bad["argv"]) if w.startswith("localhost/hive-relay-contributor:"))
            bad["argv"][i] = "localhost/hive-relay-contributor:000000000000-u1000"
        kept.write_text(json.dumps(bad))
        proc = _launch(s, "echo ran", trace=tmp_path / f"{change}.json")
        assert proc.returncode == 0 and "ran" in proc.stdout, proc.stderr[-2000:]
        assert "prestarted" not in json.loads((tmp_path / f"{change}.json").read_text()), change
        assert "Error" not in proc.stderr and "Trying to pull" not in proc.stderr, proc.stderr


@pytest.mark.container
def test_an_engine_client_killed_under_a_running_box_leaves_no_container(csandbox: Sandbox) -> None:
    """The client dies while its container runs (as Ctrl-C could kill it between create and start):
    the launcher removes the container itself before it returns, not only a dead launcher's janitor."""
    s = csandbox
    launcher = subprocess.Popen([sys.executable, "-m", "relay", "shell", "container", "--quiet", "--prompt", "sleep 60"],
                                cwd=s.workdir, env=s.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    found: list[Path] = []
    while not found and time.monotonic() < deadline:
        found = [p for p in _run_dirs(s) if p.name.startswith(f"hive-relay-{launcher.pid}-") and (p / "pid").exists()]
        time.sleep(0.02)
    assert found, "the container never started"
    name = found[0].name
    engine = _engine_of(launcher.pid)
    assert engine is not None
    os.kill(engine, signal.SIGKILL)
    launcher.wait(timeout=120)
    names = subprocess.run([PODMAN, "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True,
                           env=podman_env()).stdout.split()
    assert name not in names, launcher.stderr.read() if launcher.stderr else ""


def test_a_cache_dir_another_user_can_move_is_not_trusted(tmp_path: Path) -> None:
    """root with another user's cache dir: the dir above it is that user's, who could move ours away and
    put a link or another tree in its place. Every cache file (memos, probe.json, verified.json, the
    ready images) is then a miss; in a settled place (ours or root's, or sticky, above it) it is read."""
    from relay.modes import trial_run

    theirs = tmp_path / "theirs"
    env = {"XDG_CACHE_HOME": str(theirs)}
    memo.put(env, memo.MemoKind.ENGINE_ARGV, "k", b"data")
    (theirs / "hive-relay" / "verified.json").write_text('["forgedkey0123456789abcd"]')
    assert memo.get(env, memo.MemoKind.ENGINE_ARGV, "k", 100) == b"data"
    assert trial_run._load(env) == ["forgedkey0123456789abcd"]
    theirs.chmod(0o777)  # anyone may rename what is in it (no sticky bit)
    assert memo.get(env, memo.MemoKind.ENGINE_ARGV, "k", 100) is None
    assert trial_run._load(env) == []
    theirs.chmod(0o1777)  # sticky, as /tmp: no one else can move our dir
    assert memo.get(env, memo.MemoKind.ENGINE_ARGV, "k", 100) == b"data"
    if os.geteuid() == 0:
        theirs.chmod(0o755)
        os.chown(theirs, 65534, 65534)  # another user's dir above ours
        assert memo.get(env, memo.MemoKind.ENGINE_ARGV, "k", 100) is None
        assert trial_run._load(env) == []


def test_a_superseded_image_is_no_longer_ready_for_a_prestart(tmp_path: Path) -> None:
    """After a build removes the old tag, a memo naming it must not prestart (podman would only say
    "image not known"): the removal forgets the tag's ready mark; the other tags keep theirs."""
    import hashlib

    from relay.modes import image_tag

    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    keys = [hashlib.sha256(json.dumps(["/usr/bin/podman", "podman", os.getuid(), img]).encode()).hexdigest()[:24]
            for img in (IMG, IMG.replace("0123", "4567"))]
    path = Path(image_tag._ready_path(env))
    path.parent.mkdir(parents=True, mode=0o700)
    path.write_text(json.dumps(keys))
    assert image_tag.ready_image("/usr/bin/podman", IMG, env)
    image_tag.forget_images("/usr/bin/podman", [IMG], env)
    assert not image_tag.ready_image("/usr/bin/podman", IMG, env)
    assert image_tag.ready_image("/usr/bin/podman", IMG.replace("0123", "4567"), env)
