"""A staged run's layer on the host: where it lives, what it records at launch, and which runs exist.

Layout, under hive relay's state dir (owner-only, beyond every box's reach):

    staged/RUN/meta.json   written once at launch: run id, backend, workdir, profile digest, the
                           protected paths, and `base_ctime_ns`, the change time of `stamp`
    staged/RUN/stamp       made just before the overlay is mounted: its ctime is the run's start on
                           the kernel's own clock
    staged/RUN/upper/      the overlay's upper layer: only what the box changed
    staged/RUN/work/       overlayfs's scratch dir
    staged/RUN/git/        the box's git state files (HEAD, index, ...), kept at exit, never synced
    staged/RUN/receipt.json  what was reviewed and applied, when and by whom (relay/trust/changes.py)

The base state costs nothing at launch. A host file whose ctime is older than the stamp is the
file the box started from (ctime cannot be set back by any tool); a newer ctime means the user
changed it during the run, and apply calls that a conflict. So launch stays O(1) in the size of
the checkout, and review pays only for what changed.

A layer belongs to its run until `apply` or `discard` empties it: the sweep of dead launchers'
run dirs (relay/host/liveness.py) and `invoke clean` never touch this tree.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping

from relay.box.overlay_layer import Layer
from relay.host import safefs
from relay.host.paths import state_dir
from relay.model.record import asdict, record

META = "meta.json"
RECEIPT = "receipt.json"
STAMP = "stamp"


@record
class StagedLayer:
    """The plan's part: which run, and where its layer lives."""

    run: str
    root: str  # staged/RUN
    apply_at_exit: bool = False  # --apply: what is not flagged is applied when the box ends
    # The mount targets of the workdir's masks (protected paths that do not exist): bwrap makes them
    # in the layer as empty files or dirs; they are the plan's, not the box's work, so review skips them.
    placeholders: tuple[str, ...] = ()

    @property
    def upper(self) -> str:
        return os.path.join(self.root, "upper")

    @property
    def work(self) -> str:
        return os.path.join(self.root, "work")


def staged_root(env: Mapping[str, str]) -> str:
    return os.path.join(state_dir(dict(env)), "staged")


def for_run(env: Mapping[str, str], run_id: str) -> StagedLayer:
    """Pure: where run `run_id`'s layer lives."""
    return StagedLayer(run_id, os.path.join(staged_root(env), run_id))


def _mkdir_private(path: str) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    os.mkdir(path, 0o700)  # a fresh run id: never there before (EEXIST is a refusal)


def create(layer: StagedLayer, workdir: str, meta: Mapping[str, object], base_ctime_ns: int | None = None) -> Layer:
    """Make the run's layer dirs and its meta.json; returns the overlay to mount. The upper dir
    takes the workdir's own mode and owner: it becomes the merged root the box sees.
    `base_ctime_ns`: the run's start when it began before its layer was made (kube mode's boxes)."""
    base = os.path.dirname(layer.root)
    os.makedirs(base, mode=0o700, exist_ok=True)
    os.chmod(base, 0o700)
    _mkdir_private(layer.root)
    st = os.stat(workdir)
    os.mkdir(layer.upper, 0o700)
    os.mkdir(layer.work, 0o700)
    os.chmod(layer.upper, st.st_mode & 0o7777)
    if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (0, 0):
        os.chown(layer.upper, st.st_uid, st.st_gid)
    with safefs.base_dir(layer.root) as rfd:
        safefs.create_new(rfd, STAMP, b"", 0o600, durable=False)
        base_ctime = os.stat(STAMP, dir_fd=rfd).st_ctime_ns if base_ctime_ns is None else base_ctime_ns
        record = {**meta, "run": layer.run, "workdir": workdir, "base_ctime_ns": base_ctime,
                  "started": time.time(), "uid": os.getuid()}
        # Not fsynced: the layer it describes is page cache too until the kernel writes it back.
        safefs.create_new(rfd, META, json.dumps(record, indent=1, sort_keys=True).encode(), 0o600, durable=False)
    return Layer(workdir, layer.upper, layer.work)


def read_json(root: str, name: str) -> dict | None:
    try:
        data = safefs.read_file(os.path.join(root, name), 16 << 20, base=root)
    except OSError:
        return None
    if data is None:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def write_json(root: str, name: str, value: Mapping[str, object]) -> None:
    safefs.write_file(os.path.join(root, name), json.dumps(value, indent=1, sort_keys=True).encode(), 0o600,
                      base=root)


@record
class Run:
    """One staged run as listed: its layer and meta."""

    layer: StagedLayer
    meta: dict

    @property
    def workdir(self) -> str:
        return str(self.meta.get("workdir", ""))

    @property
    def base_ctime_ns(self) -> int:
        value = self.meta.get("base_ctime_ns")
        return value if isinstance(value, int) else 0

    def running(self) -> bool:
        """True while the launcher that owns the run is alive (its box may still be writing)."""
        from relay.host.liveness import run_alive

        return run_alive(self.layer.run)

    def to_json(self) -> dict:
        return {"run": self.layer.run, **asdict(self.layer), "meta": self.meta}


def load(layer: StagedLayer) -> Run:
    """The run of a layer the caller already knows (the launcher's own, at exit)."""
    from relay.model.errors import RelayError

    meta = read_json(layer.root, META)
    if meta is None:
        raise RelayError(f"the staged run's record {layer.root}/{META} is missing or unreadable")
    return Run(layer, meta)


def runs(env: Mapping[str, str]) -> list[Run]:
    """Every staged run of this user with a readable meta.json, oldest first."""
    root = staged_root(env)
    try:
        entries = [e for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    out = []
    for entry in entries:
        meta = read_json(entry.path, META)
        if meta is not None:
            out.append(Run(StagedLayer(entry.name, entry.path), meta))
    return sorted(out, key=lambda r: float(r.meta.get("started") or 0))


def find(env: Mapping[str, str], spec: str) -> Run:
    """The run `spec` names: its id, a unique part of it, or `last`."""
    from relay.model.errors import UsageError
    from relay.model.refusal import ENTRY

    found = runs(env)
    if not found:
        raise UsageError("no staged runs; fix: launch a box (staged is the default; --live is not staged)")
    if spec == "last":
        return found[-1]
    exact = [r for r in found if r.layer.run == spec]
    hits = exact or [r for r in found if spec and spec in r.layer.run]
    if len(hits) != 1:
        what = "no staged run matches" if not hits else "more than one staged run matches"
        raise UsageError(f"{what} {spec!r}; fix: `{ENTRY} changes` lists them")
    return hits[0]


def keep_git_state(git, run_dir: str, layer_root: str) -> list[str]:  # noqa: ANN001 - gitdir.GitPlan
    """At exit (the box is dead), the box's git state files (HEAD, index, ...) from its private git
    dir into the layer, as they are: data for a later apply, never written to the host's .git."""
    kept: list[str] = []
    dest = os.path.join(layer_root, "git")
    os.makedirs(dest, mode=0o700, exist_ok=True)
    with safefs.base_dir(run_dir) as rfd, safefs.base_dir(dest) as dfd:
        for g in git.dirs:
            for name in g.state:
                key = os.path.join(g.private, name)
                try:
                    data = safefs.read_beneath(rfd, key, 256 << 20)
                except OSError:
                    continue
                if data is None:
                    continue
                with safefs.parent_of(dfd, key, create=True) as (pfd, leaf):
                    safefs.replace_in(pfd, leaf, data, 0o600, durable=False)
                kept.append(key)
    return kept


def launch_meta(plan) -> dict:  # noqa: ANN001 - plan.Plan (plan imports this module)
    """What meta.json records from the plan: enough to list, review and apply without it."""
    run = plan.container
    engine = {"engine": run.engine, "rootless": run.rootless} if run is not None else {}
    return {**engine,"backend": plan.backend, "mode": plan.mode, "tier": str(plan.tier), "profile": plan.profile,
            "profile_digest": plan.profile_digest, "protected": list(plan.protected), "denied": list(plan.denied),
            "interactive": plan.interactive, "placeholders": list(plan.staged.placeholders) if plan.staged else [],
            "git": [{"host": g.host, "private": g.private} for g in plan.git.dirs] if plan.git else []}


def drop_engine_work(root: str, engine: str | None, env: Mapping[str, str] | None = None) -> None:
    """A rootless engine's overlay makes its scratch dir `work/work` as the user namespace's root
    (a subordinate uid, mode 000): only that namespace can remove it, so `ENGINE unshare` does.
    The path is in our owner-only state dir, which no box reaches; `rm -rf` follows no link."""
    try:
        names = [n for n in os.listdir(root) if n == "work" or n.startswith("work-")]
    except OSError:
        return
    targets = []
    for name in names:
        target = os.path.join(root, name, "work")
        try:
            if os.lstat(target).st_uid != os.getuid():
                targets.append(target)
        except OSError:
            continue
    # Left empty by the unmount, it goes with a plain rmdir: the parent is ours (and ~100 ms of
    # `ENGINE unshare` saved per launch). Anything else in it is the namespace's to remove.
    left = []
    for target in targets:
        try:
            os.rmdir(target)
        except OSError:
            left.append(target)
    targets = left
    if not targets or not engine:
        return
    import subprocess

    try:
        subprocess.run([engine, "unshare", "rm", "-rf", "--", *targets], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120,
                       env=dict(env) if env is not None else None)
    except (OSError, subprocess.TimeoutExpired):
        pass


def remove_layer(root: str) -> None:
    """Drop a whole layer dir (discard, the verify probe's, the bench's); gone already is fine."""
    meta = read_json(root, META) or {}
    if meta.get("rootless") and isinstance(meta.get("engine"), str):
        drop_engine_work(root, meta["engine"])
    try:
        with safefs.base_dir(os.path.dirname(root)) as pfd:
            safefs.remove_tree(pfd, os.path.basename(root))
    except FileNotFoundError:
        pass
