"""`hive-relay clean` / `invoke clean`: remove what hive relay left on this host, and say what and how much.

What it removes (each only when it is the caller's own, reached with no link followed):
- the caches: `~/.cache/hive-relay` (probe and plan memos, bench peers; the launch memos of parsed
  configs and compiled filters only with `--all`: each launch makes them again) and the selftest's
  scratch dir beside it;
- superseded container images: ours for this uid (and the offline bases) other than the current
  ones, through relay/modes/image.py, never forced, so an image a container uses stays;
- the installed agent CLIs: the default tool dir only (never one named by $HIVE_RELAY_TOOLS, which may
  be shared);
- stale state: run dirs of launchers that are gone, empty and old egress logs, and the stray
  `~/.hive-relay-sync.lock` older versions left in $HOME (the sync lock now lives in the state dir).

`--all` also removes every egress log of a finished run, the launch memos, and the current image and base. Nothing
that a running box uses is touched: while a box runs, the CLIs, images and run dirs stay.

Staged runs (relay/trust/staged.py) are listed one per line, each with its age and counts; their layers
hold the box's unapplied work, so only `--staged-older-than DAYS` removes them (those of ended runs
older than DAYS, each named as it goes; `--all` does not), and never one whose launcher runs.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Mapping

from relay.commands.logs import human_bytes
from relay.egress import log_files as logs_mod
from relay.host import liveness, safefs
from relay.host.paths import IN_CHECKOUT, PACKAGE_ROOT, cache_dir, tool_dir
from relay.model.record import record
from relay.trust import rundirs

STRAY_SYNC_LOCK = ".hive-relay-sync.lock"


@record(frozen=False)
class Item:
    """One thing `clean` found: what it is, where, its size, and why it was kept when it was."""

    what: str
    path: str
    size: int | None
    kept: str | None = None  # why it was not removed
    detail: str | None = None  # what it is, shown on its line (a staged run: id, age, counts)


def du(path: str) -> int:
    """Bytes under `path` (lstat only; no link followed; other devices counted too, as rm frees them)."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_blocks * 512 if st.st_blocks else st.st_size
    total = 0
    for _, _, files, dfd in os.fwalk(path, follow_symlinks=False):
        for name in files:
            try:
                s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            total += s.st_blocks * 512 if s.st_blocks else s.st_size
    return total


def _ours(path: str) -> os.stat_result | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
        return None
    return st


def _rm(path: str) -> None:
    """Remove a file or a tree. shutil.rmtree works on fds and never follows a link (checked below)."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        assert shutil.rmtree.avoids_symlink_attacks
        shutil.rmtree(path)
    else:
        os.unlink(path)


def live_boxes(home: str) -> list[int]:
    """Processes of this user that run inside a hive relay box for this HOME (their environment has
    HIVE_RELAY=1 and HOME=home; the box keeps the caller's HOME path)."""
    found = []
    me = os.getuid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if me and os.stat(f"/proc/{name}").st_uid != me:
                continue
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read(1 << 20)
        except OSError:
            continue
        words = env.split(b"\0")
        if b"HIVE_RELAY=1" in words and b"HOME=" + os.fsencode(home) in words:
            found.append(int(name))
    return found


def stale_run_dirs(env: Mapping[str, str]) -> list[str]:
    out = []
    for base in rundirs.bases(env):
        for name in rundirs.names(base):
            if not liveness.gone(name, rundirs.PREFIX):
                continue  # not one of ours, or its launcher (pid and start time) still runs
            path = os.path.join(base, name)
            st = _ours(path)
            if st is not None and stat.S_ISDIR(st.st_mode):
                out.append(path)
    return out


def tools_are_ours(env: Mapping[str, str]) -> str | None:
    """The tool dir when clean may remove it: the default location, owned by the caller; else None."""
    if env.get("HIVE_RELAY_TOOLS"):
        return None
    path = tool_dir(env)
    default = os.path.realpath(os.path.join(PACKAGE_ROOT, ".cache", "npm") if IN_CHECKOUT
                               else os.path.join(cache_dir(env), "npm"))
    st = _ours(path)
    return path if path == default and st is not None and stat.S_ISDIR(st.st_mode) else None


def _engine(env: Mapping[str, str]) -> str | None:
    """The engine container mode would use (plan.choose_engine's order), found without a host probe."""
    path = env.get("PATH", os.defpath)
    wanted = env.get("HIVE_RELAY_ENGINE")
    if wanted:
        return wanted if "/" in wanted and os.access(wanted, os.X_OK) else shutil.which(wanted, path=path)
    return shutil.which("podman", path=path) or shutil.which("docker", path=path)


def _engine_storage_exists(engine: str, env: Mapping[str, str]) -> bool:
    """Asking rootless podman about images starts a pause process and creates its config and storage
    dirs; a user who never used container mode has no image of ours, so do not ask then."""
    from relay.host.container_engine import engine_kind

    if engine_kind(engine) != "podman" or env.get("CONTAINERS_STORAGE_CONF"):
        return True
    if os.getuid() == 0:
        return os.path.isdir("/var/lib/containers/storage")
    data = env.get("XDG_DATA_HOME") or os.path.join(env.get("HOME", "/"), ".local", "share")
    config = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME", "/"), ".config")
    return (os.path.isdir(os.path.join(data, "containers", "storage"))
            or os.path.isfile(os.path.join(config, "containers", "storage.conf")))


def image_items(env: Mapping[str, str], everything: bool) -> tuple[list[str] | None, list[Item], str | None]:
    """(engine argv, images to remove, why images were skipped)."""
    from relay.config.load import load_matrix
    from relay.model.errors import RelayError
    from relay.modes import image, image_tag

    engine = _engine(env)
    if engine is None:
        return None, [], "no container engine"
    if not _engine_storage_exists(engine, env):
        return None, [], "the engine has no storage for this user"
    try:
        spec = image_tag.spec_from_env(load_matrix(dict(env), workdir=None).backends, os.getuid(), os.getgid(), env)
        current = {spec.tag, spec.base}
        from relay.modes.kube_proxy_image import proxy_image_tag

        # kube mode's proxy image for the current box image (kube pods run as uid 1000: spec_for).
        kube = image_tag.spec_from_env(load_matrix(dict(env), workdir=None).backends, 1000, 1000, env)
        current.add(proxy_image_tag(kube.tag))
    except RelayError as err:
        return None, [], f"the current image is unknown ({err.message})"
    items = [Item("image", ref, size) for ref, size in image.ours([engine], os.getuid(), env)
             if everything or ref not in current]
    return [engine], items, None


def plan_clean(env: Mapping[str, str], everything: bool,
               staged_days: float | None = None) -> tuple[list[Item], list[str], list[str] | None]:
    """(what to remove, notes, the engine argv for images)."""
    items: list[Item] = []
    notes: list[str] = []
    boxes = live_boxes(env.get("HOME", "/"))
    if boxes:
        notes.append(f"{len(boxes)} box process{'es' if len(boxes) != 1 else ''} running (pid "
                     f"{', '.join(map(str, boxes[:5]))}): the agent CLIs and the images are kept")
    cache = str(cache_dir(env))
    tools = tools_are_ours(env)
    if _ours(cache):
        with os.scandir(cache) as it:
            for entry in sorted(it, key=lambda e: e.name):
                path = os.path.join(cache, entry.name)
                if tools and (path == tools or safefs.beneath(tools, path)):
                    continue  # the CLIs are their own item below
                if entry.name == "memo" and not everything:
                    continue  # the launch memos: bounded, and every launch (this one too) makes them again
                if _ours(path):
                    items.append(Item("cache", path, du(path)))
    scratch = os.path.join(os.path.dirname(cache), "hive-relay-selftest")
    if _ours(scratch):
        items.append(Item("cache", scratch, du(scratch)))
    if tools and not boxes:
        items.append(Item("agent CLIs", tools, du(tools)))
    elif env.get("HIVE_RELAY_TOOLS"):
        notes.append(f"the agent CLIs in $HIVE_RELAY_TOOLS ({tool_dir(env)}) are kept: that dir may be shared")
    if not boxes:
        for path in stale_run_dirs(env):
            items.append(Item("stale run dir", path, du(path)))
    home = env.get("HOME", "/")
    stray = os.path.join(home, STRAY_SYNC_LOCK)
    st = _ours(stray)
    if st is not None and stat.S_ISREG(st.st_mode):
        items.append(Item("stray lock", stray, st.st_size))
    for path in selftest_keys(home):
        items.append(Item("selftest key", path, du(path)))
    logs_dir = logs_mod.logs_dir(env)
    for f in _doomed_logs(logs_dir, everything):
        items.append(Item("egress log", os.path.join(logs_dir, f.name), f.size))
    items += staged_items(env, staged_days)
    engine = None
    if not boxes:
        engine, images, skipped = image_items(env, everything)
        items += images
        if skipped:
            notes.append(f"images: skipped, {skipped}")
    return items, notes, engine


def staged_items(env: Mapping[str, str], older_than_days: float | None, now: float | None = None) -> list[Item]:
    """Every staged run, each on a line of its own: its layer is the box's unapplied work, so it is
    removed only when the user asked for runs older than an age (`--staged-older-than DAYS`), and
    never while its launcher runs. The ones kept say why and how to review them."""
    import time

    from relay.model.refusal import ENTRY
    from relay.trust.staged import runs
    from relay.ui.staged_counts import counts, counts_text

    now = time.time() if now is None else now
    out = []
    for run in runs(env):
        started = run.meta.get("started")
        age = now - started if isinstance(started, (int, float)) else None
        try:
            what = counts_text(counts(run.layer)[1])
        except Exception:  # noqa: BLE001 - an unreadable layer is still listed
            what = "changes unreadable"
        days = "age unknown" if age is None else f"{age / 86400:.1f} days old"
        item = Item("staged run", run.layer.root, du(run.layer.root), detail=f"run {run.layer.run}: {days}, {what}")
        if run.running():
            item.kept = f"{item.detail}; its box is running"
        elif older_than_days is None:
            item.kept = (f"{item.detail}; not applied: `{ENTRY} changes {run.layer.run}`; "
                         "prune with --staged-older-than DAYS")
        elif age is None or age < older_than_days * 86400:
            item.kept = f"{item.detail}; younger than {older_than_days:g} days"
        out.append(item)
    return out


SELFTEST_KEY_PREFIX = "id_hive_relay_selftest_"  # relay/commands/selftest.py plants these for one run


def selftest_keys(home: str) -> list[str]:
    """Keys a selftest that was killed left in ~/.ssh (regular files of ours, with our prefix)."""
    ssh = os.path.join(home, ".ssh")
    if _ours(ssh) is None:
        return []
    try:
        names = sorted(n for n in os.listdir(ssh) if n.startswith(SELFTEST_KEY_PREFIX))
    except OSError:
        return []
    return [os.path.join(ssh, n) for n in names
            if (st := _ours(os.path.join(ssh, n))) is not None and stat.S_ISREG(st.st_mode)]


def _doomed_logs(directory: str, everything: bool) -> list[logs_mod.LogFile]:
    """The logs prune() would remove (or, with --all, every log of a finished run)."""
    import time

    files = [f for f in logs_mod.scan(directory) if not logs_mod.run_alive(f.run)]
    if everything:
        return files
    now = time.time()
    doomed = [f for f in files if f.size == 0 or now - f.mtime > logs_mod.KEEP_DAYS * 86400]
    kept = [f for f in files if f not in doomed]
    return doomed + kept[:max(0, len(kept) - logs_mod.KEEP_RUNS)]


def _remove(item: Item, env: Mapping[str, str], engine: list[str] | None) -> None:
    if item.what == "image":
        from relay.modes import image

        assert engine is not None
        why = image.remove(engine, item.path, env)
        item.kept = "in use by a container" if why and "in use" in why else why
        return
    if item.what == "egress log":
        directory, name = os.path.split(item.path)
        with safefs.base_dir(directory) as dfd:
            ok = safefs.unlink_beneath(dfd, name, only_if=lambda st: stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid())
        item.kept = None if ok else "changed meanwhile"
        return
    if item.what == "staged run":
        from relay.trust.changes import discard
        from relay.trust.staged import find

        run = find(env, os.path.basename(item.path))
        if run.running():
            item.kept = "its box started running meanwhile"
            return
        discard(run)
        return
    if item.what in ("stray lock", "selftest key"):
        with safefs.base_dir(os.path.dirname(item.path)) as dfd:
            ok = safefs.unlink_beneath(dfd, os.path.basename(item.path),
                                       only_if=lambda st: stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid())
        item.kept = None if ok else "changed meanwhile"
        return
    if _ours(item.path) is None:
        item.kept = "changed meanwhile"
        return
    _rm(item.path)


def human(n: int | None) -> str:
    return "size unknown" if n is None else human_bytes(n)


def clean(dry_run: bool = False, everything: bool = False, env: Mapping[str, str] | None = None,
          staged_older_than: float | None = None) -> int:
    from relay.model.errors import RelayError

    env = dict(os.environ if env is None else env)
    items, notes, engine = plan_clean(env, everything, staged_older_than)
    verb = "would remove" if dry_run else "removed"
    freed = 0
    done = 0
    for item in items:
        if not dry_run and not item.kept:
            try:
                _remove(item, env, engine)
            except OSError as err:
                item.kept = err.strerror or str(err)
            except RelayError as err:
                item.kept = err.message
        if item.kept:
            print(f"kept          {item.what:<14} {item.path}  ({item.kept})")
            continue
        done += 1
        freed += item.size or 0
        print(f"{verb:<13} {item.what:<14} {item.path}  {human(item.size)}" + (f"  ({item.detail})" if item.detail else ""))
    for note in notes:
        print(f"note: {note}")
    if done:
        print(f"{verb} {done} item{'s' if done != 1 else ''}, {human_bytes(freed)}")
    else:
        print("nothing to remove")
    return 0
