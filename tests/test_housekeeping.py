"""What hive relay leaves behind and where to look: egress logs (no empty ones, pruned by age and
count, read back with `logs`) and `clean` (what it removes, how much, and what it must leave alone)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import REPO, Sandbox, podman_env, private_image_store, require_tool

KEEP_RUNS = 100  # relay/egress/log_files.py


def logs_dir(s: Sandbox) -> Path:
    return s.home / ".local" / "state" / "hive-relay" / "logs"


def invoke(s: Sandbox, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(REPO), *args], cwd=s.workdir,
                          env=s.env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hive-relay: error: ") and "; fix: " in lines[0], proc.stderr
    return lines[0]


def plant_log(directory: Path, stamp: str, run: str, body: str = '{"decision": "allow"}\n',
              age_days: float = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stamp}-shell-{run}.jsonl"
    path.write_text(body)
    if age_days:
        then = time.time() - age_days * 86400
        os.utime(path, (then, then))
    return path


def dead_pid() -> int:
    """A pid that belonged to a process that has exited (the launcher of a finished run)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.box
def test_a_run_without_traffic_writes_no_log_and_a_denied_one_is_readable(box_sandbox: Sandbox) -> None:
    require_tool("curl")
    s = box_sandbox
    quiet = s.box("true", "shell", "--allow-host", "allowed.test")
    assert quiet.returncode == 0, quiet.stderr
    assert not list(logs_dir(s).glob("*.jsonl")), "a run with no network traffic left an (empty) log"

    noisy = s.box("curl -s -o /dev/null https://denied.example/; true", "shell", "--allow-host", "allowed.test")
    assert noisy.returncode == 0, noisy.stderr
    (log,) = logs_dir(s).glob("*.jsonl")
    assert log.stat().st_size > 0
    run = log.name.removesuffix(".jsonl").split("-shell-", 1)[1]

    listing = s.relay("logs")
    assert listing.returncode == 0 and run in listing.stdout and "1 run," in listing.stdout, listing
    shown = s.relay("logs", run, "--denied")
    assert shown.returncode == 0, shown.stderr
    assert "denied.example:443" in shown.stdout and "deny" in shown.stdout
    # The same through invoke, with the run given by a part of its id; and the newest run by default.
    assert invoke(s, "logs", run.split("-")[1][:6], "--denied").stdout == shown.stdout
    assert s.relay("logs", "--denied").stdout == shown.stdout


def test_logs_refuses_an_unknown_run_with_one_line(sandbox: Sandbox) -> None:
    s = sandbox
    line = one_error_line(s.relay("logs", "nope"))
    assert "no egress logs yet" in line
    plant_log(logs_dir(s), "20260101-000000", "123-0000000a")
    plant_log(logs_dir(s), "20260101-000001", "124-0000000b")
    assert "no egress log matches 'nope'" in one_error_line(s.relay("logs", "nope"))
    assert "matches 2 runs" in one_error_line(s.relay("logs", "0000000"))
    assert "unknown option --deny" in one_error_line(s.relay("logs", "--deny"))
    assert "unknown option --deny" in one_error_line(invoke(s, "logs", "--deny"))
    assert not list(s.home.joinpath(".cache").glob("hive-relay/*")), "a usage error left something behind"


def test_logs_never_follows_a_link_or_blocks_on_a_fifo_and_escapes_control_characters(sandbox: Sandbox) -> None:
    s = sandbox
    d = logs_dir(s)
    secret = s.root / "secret.jsonl"
    secret.write_text('{"decision": "deny", "host": "SECRET-TARGET"}\n')
    d.mkdir(parents=True)
    (d / "20260101-000000-shell-1-00000001.jsonl").symlink_to(secret)
    os.mkfifo(d / "20260101-000001-shell-1-00000002.jsonl")
    plant_log(d, "20260101-000002", "1-00000003",
              '{"decision": "deny", "host": "evil\\u001b]0;pwned\\u0007.test", "port": 443, "reason": "x"}\nnot json\n')
    listing = s.relay("logs")
    assert listing.returncode == 0, listing.stderr
    assert "1-00000003" in listing.stdout and "1-00000001" not in listing.stdout and "1-00000002" not in listing.stdout
    for run in ("1-00000001", "1-00000002"):
        assert "no egress log matches" in one_error_line(s.relay("logs", run, timeout=30))
    shown = s.relay("logs", "last")
    assert shown.returncode == 0 and "SECRET" not in shown.stdout
    assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout and "evil?]0;pwned?.test:443" in shown.stdout
    assert "1 unreadable line skipped" in shown.stdout


@pytest.mark.box
def test_logs_are_pruned_by_age_and_count_after_a_run(box_sandbox: Sandbox) -> None:
    require_tool("curl")
    s = box_sandbox
    d = logs_dir(s)
    pid = dead_pid()
    empty = plant_log(d, "20260101-000000", f"{pid}-0000000e", body="")
    old = plant_log(d, "20260101-000001", f"{pid}-00000001", age_days=30)
    recent = [plant_log(d, f"20260102-{i:06d}", f"{pid}-{i:08x}") for i in range(KEEP_RUNS + 20)]
    other = d / "notes.txt"  # not ours: never removed
    other.write_text("mine\n")
    live = plant_log(d, "20260101-000002", f"{os.getpid()}-0000000f", body="")  # its launcher is alive
    proc = s.box("curl -s -o /dev/null https://denied.example/; true", "shell", "--allow-host", "allowed.test")
    assert proc.returncode == 0, proc.stderr
    names = {p.name for p in d.iterdir()}
    assert empty.name not in names and old.name not in names
    assert other.name in names and live.name in names
    ours = [n for n in names if n.endswith(".jsonl") and n != live.name]
    # The newest KEEP_RUNS finished runs, plus the run that just ended (its launcher was still alive).
    assert len(ours) == KEEP_RUNS + 1, len(ours)
    assert recent[-1].name in names and recent[19].name not in names and recent[20].name in names
    assert sum(1 for n in ours if not n.startswith("20260102-")) == 1  # the new run's own log is kept


def test_clean_removes_caches_stale_state_and_the_stray_lock_and_says_how_much(sandbox: Sandbox) -> None:
    s = sandbox
    s.env["HIVE_RELAY_TOOLS"] = str(s.root / "shared-tools")
    # A private, empty image store: the machine's own images (CI's current one among them) are not
    # this test's to count or remove.
    s.env["CONTAINERS_STORAGE_CONF"] = private_image_store(s.root / "images")
    (s.root / "shared-tools" / "node_modules").mkdir(parents=True)
    cache = s.home / ".cache" / "hive-relay"
    cache.mkdir(parents=True)
    (cache / "probe.json").write_bytes(b"x" * 10000)
    (cache / "peers").mkdir()
    (cache / "peers" / "big").write_bytes(b"y" * 300000)
    stray = s.home / ".hive-relay-sync.lock"
    stray.write_text("")
    stale = s.root / "run" / f"hive-relay-{dead_pid()}-abcdef01"
    (stale / "home").mkdir(parents=True)
    (stale / "home" / "f").write_bytes(b"z" * 5000)
    alive = s.root / "run" / f"hive-relay-{os.getpid()}-abcdef02"
    alive.mkdir()
    d = logs_dir(s)
    empty = plant_log(d, "20260101-000000", f"{dead_pid()}-0000000e", body="")
    kept_log = plant_log(d, "20260101-000001", f"{dead_pid()}-0000000a")

    dry = s.relay("clean", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would remove" in dry.stdout and stray.exists() and stale.exists() and (cache / "probe.json").exists()

    memos = cache / "memo"  # the launch memos (relay/host/memo.py) the dry run's own config load made
    assert memos.is_dir()
    proc = s.relay("clean")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert memos.is_dir() and str(memos) not in out, "every launch makes them again: only --all removes them"
    for path in (cache / "probe.json", cache / "peers", stray, stale, empty):
        line = next((ln for ln in out.splitlines() if str(path) in ln), "")
        assert line.startswith("removed"), (path, out)
        assert not path.exists()
    assert "KiB" in next(ln for ln in out.splitlines() if str(cache / "peers") in ln)
    # Five of ours; clean also looks at /tmp, where a dead launcher's run dir from elsewhere may lie.
    items = [ln for ln in out.splitlines()[:-1] if ln.startswith("removed")]
    ours = [ln for ln in items if str(s.root) in ln]
    assert len(ours) == 5 and all("/tmp/hive-relay-" in ln for ln in items if ln not in ours), out
    assert out.splitlines()[-1].startswith(f"removed {len(items)} items, ") and "KiB" in out.splitlines()[-1]
    assert alive.exists() and kept_log.exists() and (s.root / "shared-tools" / "node_modules").exists()
    assert "$HIVE_RELAY_TOOLS" in out and "may be shared" in out
    again = s.relay("clean")
    assert again.returncode == 0 and "nothing to remove" in again.stdout
    assert invoke(s, "clean", "--dry-run").stdout.splitlines()[-1] == "nothing to remove"

    everything = s.relay("clean", "--all")
    assert everything.returncode == 0 and not kept_log.exists(), everything.stdout
    assert f"removed       cache          {memos}" in everything.stdout and not memos.exists()


def test_clean_never_follows_a_link_nor_removes_what_is_not_ours(sandbox: Sandbox) -> None:
    s = sandbox
    target = s.root / "precious"
    target.write_text("keep me\n")
    (s.home / ".hive-relay-sync.lock").symlink_to(target)
    cache = s.home / ".cache" / "hive-relay"
    cache.mkdir(parents=True)
    (cache / "link").symlink_to(s.root)
    stale_link = s.root / "run" / f"hive-relay-{dead_pid()}-abcdef03"
    stale_link.symlink_to(s.workdir)
    proc = s.relay("clean")
    assert proc.returncode == 0, proc.stderr
    assert target.read_text() == "keep me\n" and (s.home / ".hive-relay-sync.lock").is_symlink()
    assert (s.workdir / "README.md").exists() and stale_link.is_symlink()
    assert "precious" not in proc.stdout


# Both CI passes see another user's run dir: the same real dir seen by a caller of another uid (what
# `clean` and the janitor's sweep compare the real lstat with); the root pass also a dir really chowned
# to nobody, through the real `clean` command. Chosen at collection: never a skip.
OTHER_UID_CASES = ["seen-by-another-uid"] + (["chowned-to-nobody"] if os.getuid() == 0 else [])


@pytest.mark.parametrize("case", OTHER_UID_CASES)
def test_clean_leaves_another_users_run_dir_alone(sandbox: Sandbox, case: str) -> None:
    from relay.commands import clean
    from relay.trust import rundirs

    s = sandbox
    theirs = s.root / "run" / f"hive-relay-{dead_pid()}-abcdef04"
    theirs.mkdir()
    if case == "chowned-to-nobody":
        os.chown(theirs, 65534, 65534)
        proc = s.relay("clean")
        assert proc.returncode == 0 and theirs.exists() and str(theirs) not in proc.stdout
        return
    real = os.getuid()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "getuid", lambda: real + 4242)
        assert clean.stale_run_dirs(s.env) == [], "another user's stale run dir is not clean's to remove"
        assert rundirs.run_dirs(str(theirs.parent)) == 0 and theirs.exists(), "nor the janitor's sweep's"
    mine = [p for p in clean.stale_run_dirs(s.env) if p.startswith(str(s.root))]  # /tmp is shared
    assert mine == [str(theirs)], "the twin: its owner's clean removes it"
    proc = s.relay("clean")
    assert proc.returncode == 0 and not theirs.exists() and str(theirs) in proc.stdout


def test_clean_rejects_bad_input_with_one_line(sandbox: Sandbox) -> None:
    assert "unknown option --force" in one_error_line(sandbox.relay("clean", "--force"))
    assert "unexpected argument 'x'" in one_error_line(sandbox.relay("clean", "x"))
    assert "unknown option --force" in one_error_line(invoke(sandbox, "clean", "--force"))


@pytest.mark.parametrize("task", ["logs", "clean"])
def test_logs_and_clean_say_the_same_on_both_entries(sandbox: Sandbox, task: str) -> None:
    import re

    from relay.commands.cli import CLEAN_HELP, LOGS_HELP

    texts = LOGS_HELP if task == "logs" else CLEAN_HELP
    listing = invoke(sandbox, "--list").stdout
    assert re.search(rf"^\s+{task}\s+\S", listing, re.M), listing
    flat = [" ".join(invoke(sandbox, "--help", task).stdout.split()),
            " ".join(sandbox.relay(task, "--help").stdout.split())]
    for text in texts.values():
        for out in flat:
            assert " ".join(text.split()) in out, (text, out)


def test_clean_removes_superseded_images_but_not_the_current_one_another_uids_or_one_in_use(
        sandbox: Sandbox, tmp_path: Path) -> None:
    from relay.config.load import load_matrix
    from relay.modes import image_tag as image

    from .conftest import _stable_runtime_dir, require_tool

    require_tool("podman")
    s = sandbox
    s.env["XDG_RUNTIME_DIR"] = _stable_runtime_dir()  # rootless podman keys its pause process on it
    s.env["CONTAINERS_STORAGE_CONF"] = private_image_store(tmp_path / "storage")  # never the user's real images
    env = {**os.environ, **s.env}
    uid = os.getuid() or 1000
    current = image.spec_from_env(load_matrix(env, workdir=None).backends, os.getuid(), os.getgid(), env).tag
    old, busy = f"{image.IMAGE_REPO}:000000000000-u{uid}", f"{image.IMAGE_REPO}:111111111111-u{uid}"
    foreign = f"{image.IMAGE_REPO}:000000000000-u{uid + 4242}"
    from relay.modes.kube_podman import proxy_image_tag  # kube mode's proxy image: the current one stays

    proxy_now = proxy_image_tag(image.spec_from_env(load_matrix(env, workdir=None).backends, 1000, 1000, env).tag)
    proxy_old = f"{image.PROXY_REPO}:000000000000"
    empty = tmp_path / "rootfs"
    empty.mkdir()
    (empty / "f").write_bytes(b"x" * 200000)

    def podman(*args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=120, **kw)

    try:
        tar = subprocess.run(["tar", "-C", str(empty), "-c", "."], capture_output=True, check=True).stdout
        for ref in (old, busy, foreign, current, proxy_old, proxy_now):
            imported = subprocess.run(["podman", "import", "-q", "-", ref], env=env, input=tar, capture_output=True,
                                      timeout=120)
            assert imported.returncode == 0, imported.stderr
        assert podman("create", "--name", f"hk-busy-{os.getpid()}", busy, "true").returncode == 0
        proc = s.relay("clean")
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert any(ln.startswith("removed") and old in ln and "KiB" in ln for ln in lines), proc.stdout
        assert any(ln.startswith("kept") and busy in ln and "in use by a container" in ln for ln in lines)
        assert foreign not in proc.stdout and current not in proc.stdout and proxy_now not in proc.stdout
        left = podman("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
        assert old not in left and proxy_old not in left and {busy, foreign, current, proxy_now} <= set(left), left
        # In-process, `clean` works on its env's store, never the process's own (the machine's).
        from relay.commands import clean as clean_mod

        def machine_images() -> list[str]:
            return sorted(subprocess.run(["podman", "images", "-q"], env=podman_env(), capture_output=True, text=True,
                                         timeout=120).stdout.split())

        real = machine_images()
        assert clean_mod.clean(env=env, everything=True) == 0
        left = podman("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
        assert set(left) == {busy, foreign}, left
        assert machine_images() == real
    finally:
        podman("rm", "-a", "-f")
        podman("rmi", "-a", "-f")


def test_every_logs_and_changes_hint_names_the_entry_the_user_can_type(sandbox: Sandbox) -> None:
    """`hive-relay` may not be on PATH (issue 27): the hints of `logs` and `changes` name our own
    entry by its path, as every other hint does."""
    from relay.model.refusal import ENTRY

    s = sandbox
    staged = s.relay("shell", "local", "--staged", "--quiet", "--prompt", "echo x > made.txt")
    assert staged.returncode == 0, staged.stderr
    for args in (("logs", "nosuchrun"), ("changes", "nosuchrun")):
        proc = s.relay(*args)
        assert proc.returncode != 0 and "hive-relay logs" not in proc.stderr and "hive-relay changes" not in proc.stderr
        assert ENTRY in proc.stderr, proc.stderr
    d = logs_dir(s)
    plant_log(d, "20260101-000001", f"{dead_pid()}-0000000a")
    listing = s.relay("logs")
    assert listing.returncode == 0 and f"`{ENTRY} logs RUN` shows one" in listing.stdout, listing.stdout
