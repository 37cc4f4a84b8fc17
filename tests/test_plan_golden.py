"""resolve() is pure: every backend × mode × profile (× tier) resolved against a host that exists only
in memory, with the real host's file calls made to raise, and compared with reviewed golden plans.

Regenerate after an intended change with `HIVE_RELAY_GOLDEN=1 pytest tests/test_plan_golden.py`, then
review the diff of tests/golden/plans/ like code: it is the whole decision, argv and mounts included.

The goldens are laid out for review, each form lossless (the test proves it when it writes them):
- one file per case, tests/golden/plans/BACKEND/CASE.json (the case's name with `-` for `/`);
- a case whose plan equals another's is not stored: SAME names it and the test asserts the equality;
- no derivation of the plan is stored twice: `command_line` is checked to be `shlex.join(command)`,
  and in `command` the renderers' output for the plan's own fields shows as `{"$rendered": "mounts"}`
  (bwrap's mount args or the engine's volumes, for the plan's `mounts`), `{"$rendered": "env"}` (the
  engine's --env for `env_set`, `env_pass`) and `{"$rendered": "argv"}` (the agent's `argv`). The
  marker stands only where the command holds exactly that rendering; the renderers themselves are
  tests/test_argv_golden.py's, and every flag and volume form a marker hides has a vector there;
- a big value used by two cases or more lies once in tests/golden/plans/shared/NAME.json (NAME from where
  it was first met; `used_by` lists the files that hold `{"$shared": "NAME"}` in its place);
- no line reaches 200 characters: a string holding JSON is stored parsed (`{"$json": ...}`, compact
  with sorted keys), base64 decoded (`{"$base64": TEXT, "prefix": ...}`), text by line (`{"$lines": [...]}`)
  and what is still long in pieces (`{"$concat": [...]}`).
"""

from __future__ import annotations

import base64
import binascii
import difflib
import json
import os
import re
import shlex
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

import relay.box.landlock  # noqa: F401
import relay.host.container_engine  # noqa: F401 - imported ahead: loading code is not reading the host
import relay.plan.resolve as planner
import relay.trust.gitdir  # noqa: F401
from relay.config.load import load_shipped
from relay.host import paths
from relay.host.fs_view import HostFs
from relay.model.backend import Matrix
from relay.model.errors import RelayError
from relay.model.host_facts import HostFacts
from relay.plan.resolve import Request, resolve

from .fakefs import HOME, TOOLS, WORKDIR, HostTouched, fake_host, no_host_io

GOLDEN = Path(__file__).parent / "golden" / "plans"
SHARED = "shared"
BACKENDS = ("claude", "codex", "gemini", "opencode", "shell")
AGENTS = BACKENDS[:-1]
ENV = {"HOME": HOME, "USER": "u", "SHELL": "/bin/bash", "PATH": "/usr/local/bin:/usr/bin:/bin",
       "XDG_RUNTIME_DIR": "/run/user/1000", "LANG": "C.UTF-8", "ANTHROPIC_API_KEY": "sk-never-in-a-plan",
       "SSH_AUTH_SOCK": "/run/user/1000/ssh-agent.sock"}
SUPERVISED = HostFacts(uid=1000, gid=1000, home=HOME, user="u", shell="/bin/bash", tty=True, bwrap="/usr/bin/bwrap",
                       bwrap_version="0.8.0", seccomp=True, landlock_abi=4, cgroup="v2", podman="/usr/bin/podman",
                       box_python="/usr/bin/python3", nofile=524288,
                       image="localhost/hive-relay-contributor:0123456789ab-u1000")
PROCESS = replace(SUPERVISED, bwrap=None, bwrap_version=None, bwrap_error="bubblewrap is not installed", cgroup=None)
GVISOR = replace(SUPERVISED, runsc="/usr/bin/runsc", runsc_version="runsc version 0.0~20240729.0",
                 runsc_platform="systrap", runsc_error=None)
NO_RUNSC = replace(SUPERVISED, runsc_error="runsc (gVisor) is not installed; fix: apt-get install runsc")

MAX_LINE = 200  # no golden line is this long
INLINE = 120  # a list or object whose JSON is no longer than this stays on one line
CUT = 120  # a string longer than this is stored in pieces (or parsed, decoded, by line)
SHARE_MIN = 400  # a value this long (compact JSON) met in two places is stored once, in shared/ ...
SHARE_KEEP = 200  # ... unless, its own shared parts taken out, less than this is left of it


def cases() -> Iterator[tuple[str, HostFacts, Request, dict[str, str]]]:
    """(name, facts, request, env) for one backend: each tier the host allows, each profile. The
    process tier cannot stage the workdir, so its cases ask for --live (the default's refusal there
    is a case of its own)."""
    for profile in (None, "default", "agent"):
        yield f"local/supervised-host/{profile or 'auto'}", SUPERVISED, Request("", profile=profile), ENV
        yield f"local/process-host/{profile or 'auto'}", PROCESS, Request("", profile=profile, live=True), ENV
        yield f"container/{profile or 'auto'}", SUPERVISED, Request("", mode="container", profile=profile), ENV
    yield "local/process-host/staged-default", PROCESS, Request(""), ENV
    yield "local/supervised-host/live", SUPERVISED, Request("", live=True), ENV
    yield "local/supervised-host/process", SUPERVISED, Request("", isolation="process", live=True), ENV
    yield "local/supervised-host/agent-prompt", SUPERVISED, Request("", prompt="fix the bug", timeout=60), ENV
    yield "container/prompt", SUPERVISED, Request("", mode="container", prompt="fix the bug"), ENV
    yield "container/live", SUPERVISED, Request("", mode="container", live=True), ENV
    yield "container/gvisor", GVISOR, Request("", mode="container", isolation="gvisor", live=True), ENV
    yield "container/gvisor-staged", GVISOR, Request("", mode="container", isolation="gvisor"), ENV
    yield "container/gvisor-no-runsc", NO_RUNSC, Request("", mode="container", isolation="gvisor"), ENV
    yield "local/process-host/opted-in", PROCESS, Request("", live=True), {**ENV, "HIVE_RELAY_UNSANDBOXED_ALL": "1"}
    sockets = {"allow_sockets": ("ssh-agent",), "allow_ssh": ("git.test",)}
    yield "local/supervised-host/sockets", SUPERVISED, Request("", **sockets), ENV
    yield "container/sockets", SUPERVISED, Request("", mode="container", live=True, **sockets), ENV
    yield "local/supervised-host/process-sockets", SUPERVISED, Request("", isolation="process", live=True,
                                                                        **sockets), ENV


def case_id(backend: str, name: str) -> str:
    return f"{backend}/{name.replace('/', '-')}"


CASES = [case_id(b, name) for b in BACKENDS for name, *_ in cases()]

# Cases that resolve to the very plan (or refusal) of another: asserted equal, stored once (as the value).
SAME = {
    # Where bubblewrap runs, the automatic choice is the agent profile.
    **{f"{b}/local-supervised-host-auto": f"{b}/local-supervised-host-agent" for b in BACKENDS},
    **{f"{b}/container-auto": f"{b}/container-agent" for b in BACKENDS},
    # Without bubblewrap an agent is refused for its hosts before staging is looked at.
    **{f"{b}/local-process-host-staged-default": f"{b}/local-process-host-auto" for b in AGENTS},
    # The shell has no hosts: the process tier runs it as is, and the opt-in changes nothing.
    "shell/local-process-host-opted-in": "shell/local-process-host-auto",
    # No runsc: container mode's gvisor is refused before anything of the backend counts.
    **{f"{b}/container-gvisor-no-runsc": "claude/container-gvisor-no-runsc" for b in BACKENDS[1:]},
    # Staged on runsc: podman's overlay volume cannot be mounted there, refused alike for every backend.
    **{f"{b}/container-gvisor-staged": "claude/container-gvisor-staged" for b in BACKENDS[1:]},
    # --allow-socket at the process tier is refused before anything of the backend counts.
    **{f"{b}/local-supervised-host-process-sockets": "claude/local-supervised-host-process-sockets"
       for b in BACKENDS[1:]},
}


def _opt_in(env: dict[str, str], backend: str) -> dict[str, str]:
    if env.pop("HIVE_RELAY_UNSANDBOXED_ALL", None):
        env[f"HIVE_RELAY_UNSANDBOXED_{backend.upper()}"] = "1"
    return env


@pytest.fixture()
def fake_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """hive relay's own paths as on the fake host (not this checkout's), and one time zone."""
    monkeypatch.setattr(paths, "PACKAGE_ROOT", Path("/opt/hive-relay"))
    monkeypatch.setattr(paths, "IN_CHECKOUT", True)
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


# ---------------------------------------------------------------------------------------------------
# The plans, and their golden form


def _splice(tokens: list, segment: list[str], marker: str, seen: list[str], *, tail: bool = False) -> list:
    """tokens with the first run equal to segment (at the end only, for `tail`) as {"$rendered": marker};
    what it took out goes to seen."""
    n = len(segment)
    starts = [len(tokens) - n] if tail else range(len(tokens) - n + 1)
    for i in starts:
        if n and i >= 0 and tokens[i:i + n] == segment:
            seen += segment
            return [*tokens[:i], {"$rendered": marker}, *tokens[i + n:]]
    return tokens


def compact_command(plan: planner.Plan, rendered: list[str]) -> list:
    """The plan's command with what its renderers made of its own fields as markers (module docstring);
    the renderers' part goes to rendered."""
    tokens: list = _splice(list(plan.command), list(plan.argv), "argv", [], tail=True)
    fd_binds = {(s.box, s.host): planner.SOCKET_FD + i for i, s in enumerate(plan.sockets)}
    tokens = _splice(tokens, planner.bwrap_argv.mount_args(plan.mounts, fd_binds), "mounts", rendered)
    if plan.container is not None:
        staged = (plan.workdir, plan.staged.upper, plan.staged.work) if plan.staged else None
        volumes = planner.container_argv.volume_args(plan.mounts, HOME, plan.container.kind, staged)
        tokens = _splice(tokens, volumes, "mounts", rendered)
        env = [x for k, v in sorted(plan.env_set) for x in ("--env", f"{k}={v}")]
        tokens = _splice(tokens, env + [x for n in plan.env_pass for x in ("--env", n)], "env", rendered)
    return tokens


def shapes(argv: list[str]) -> set[str]:
    """The forms of an argv, paths and sizes aside: its flags, and each volume's or tmpfs's options."""
    out = {a for a in argv if a.startswith("--")}
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag in ("--volume", "--tmpfs") and ":" in value:
            opts = re.sub(r"size=\d+", "size=N", re.sub(r"=/[^,]*", "=PATH", value.rsplit(":", 1)[-1]))
            out.add(f"{flag} ...:{opts}")
    return out


def resolve_all(backend: str) -> tuple[dict[str, object], dict[str, object], list[str], set[str]]:
    """Every case's plan (its --dry-run --json) or refusal, its golden form, the host calls
    attempted meanwhile, and the shapes of the argv the markers stand for."""
    backends = load_shipped()
    matrix = Matrix(backends=backends, profiles={}, allow_unsandboxed=frozenset(), sources=())
    fs = fake_host()
    plans: dict[str, object] = {}
    forms: dict[str, object] = {}
    rendered: list[str] = []
    # The entry point's path is where this checkout lies (relay/model/refusal.py): one name in the goldens.
    entry, planner.ENTRY = planner.ENTRY, "contribute-hive"
    try:
        with no_host_io() as attempted:
            for name, facts, request, env in cases():
                request = replace(request, backend=backend, workdir=WORKDIR, run_id="1-golden")
                key = case_id(backend, name)
                try:
                    plan = resolve(backends[backend], matrix, request, facts, _opt_in(dict(env), backend), fs=fs, now=0)
                except RelayError as err:
                    plans[key] = forms[key] = {"refused": type(err).__name__, "exit": err.exit_code,
                                               "message": err.message}
                    continue
                plans[key] = plan.to_json()
                form = dict(plans[key])
                if form.pop("command_line") != shlex.join(plan.command):
                    form["command_line"] = "not shlex.join(command)"  # shows in the diff
                form["command"] = compact_command(plan, rendered)
                forms[key] = form
    finally:
        planner.ENTRY = entry
    return plans, forms, attempted, shapes(rendered)


# ---------------------------------------------------------------------------------------------------
# Lossless forms for long strings


def encode(value: object) -> object:
    if isinstance(value, dict) and set(value) == {"$rendered"}:
        return value
    if isinstance(value, dict):
        assert not any(k.startswith("$") for k in value), "a plan key starting with $ collides with the markers"
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, str) and len(value) > CUT:
        return _encode_string(value)
    return value


def _encode_string(s: str) -> object:
    if s[:1] in "{[":
        try:
            parsed = json.loads(s)
        except ValueError:
            parsed = None
        if isinstance(parsed, (dict, list)) and _compact(parsed) == s:
            return {"$json": encode(parsed)}
    m = re.fullmatch(r"([^,]*base64,)([A-Za-z0-9+/]+=*)", s)
    if m:
        try:
            text = base64.b64decode(m[2], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            text = None
        if text is not None and base64.b64encode(text.encode()).decode() == m[2]:
            return {"$base64": encode(text), "prefix": m[1]}
    if "\n" in s:
        return {"$lines": [encode(line) for line in s.split("\n")]}
    return {"$concat": _cut(s)}


def _cut(s: str) -> list[str]:
    """s in pieces of at most CUT characters, each ending at a space or separator where one is near."""
    out = []
    while len(s) > CUT:
        i = max(s.rfind(c, CUT // 2, CUT) for c in " ,;:/&|")
        i = i + 1 if i > 0 else CUT
        out.append(s[:i])
        s = s[i:]
    return [*out, s]


def decode(value: object, shared: dict[str, object]) -> object:
    """The inverse of encode and of the sharing (the command's markers stay)."""
    if isinstance(value, list):
        return [decode(v, shared) for v in value]
    if not isinstance(value, dict):
        return value
    if "$shared" in value:
        return decode(shared[value["$shared"]], shared)
    if "$json" in value:
        return _compact(decode(value["$json"], shared))
    if "$base64" in value:
        return value["prefix"] + base64.b64encode(decode(value["$base64"], shared).encode()).decode()
    if "$lines" in value:
        return "\n".join(decode(value["$lines"], shared))
    if "$concat" in value:
        return "".join(decode(value["$concat"], shared))
    return {k: decode(v, shared) for k, v in value.items()}


def _compact(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------------
# Sharing: each big value met in two places or more, once


def _walk(value: object, path: tuple[str, ...]) -> Iterator[tuple[object, tuple[str, ...], bool]]:
    """(node, path, entering) for every list and object below value (not value itself), depth first."""
    items = value.items() if isinstance(value, dict) else ((None, v) for v in value) if isinstance(value, list) else ()
    for key, child in items:
        if isinstance(child, (dict, list)):
            sub = (*path, key) if key is not None and not key.startswith("$") else path
            yield child, sub, True
            yield from _walk(child, sub)
            yield child, sub, False


def share(files: dict[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    """files with every big value used twice or more as {"$shared": NAME}, and the NAME → value blobs.

    A value that only ever lies inside one shared value stays in it. A shared value with less than
    SHARE_KEEP left once its own shared parts are out is not worth a file and stays in place."""
    counts: Counter[str] = Counter()
    first: dict[str, tuple[tuple[str, ...], str]] = {}
    for name in sorted(files):
        for node, path, entering in _walk(files[name], ()):
            if entering and len(c := _compact(node)) >= SHARE_MIN:
                counts[c] += 1
                first.setdefault(c, (path, name))
    candidates = {c for c, n in counts.items() if n >= 2}
    # `within`: the candidates each occurrence of a candidate lies in. Larger first, so that a value's
    # holders are decided before it: it is shared unless all of it lies in one shared value.
    chosen: set[str] = set()
    within: dict[str, set[tuple[str, ...]]] = {c: set() for c in candidates}
    for name in sorted(files):
        stack: list[str] = []
        for node, _, entering in _walk(files[name], ()):
            c = _compact(node) if isinstance(node, (dict, list)) else ""
            if c not in candidates:
                continue
            if entering:
                within[c].add(tuple(stack))
                stack.append(c)
            else:
                stack.pop()
    for c in sorted(candidates, key=len, reverse=True):
        holders = {next((h for h in reversed(chain) if h in chosen), None) for chain in within[c]}
        if len(holders) > 1 or None in holders:
            chosen.add(c)
    for c in sorted(chosen, key=len):  # small first: what is left of a value once its parts are out
        if len(_compact(_swap(json.loads(c), chosen - {c}))) < SHARE_KEEP:
            chosen.discard(c)
    names = _name(chosen, first)
    blobs = {names[c]: _swap(json.loads(c), chosen - {c}, names) for c in chosen}
    return {name: _swap(value, chosen, names) for name, value in files.items()}, blobs


def _swap(value: object, chosen: set[str], names: dict[str, str] | None = None) -> object:
    """value with its parts in chosen as references (value itself kept)."""
    def swap(v: object) -> object:
        if isinstance(v, (dict, list)) and (c := _compact(v)) in chosen:
            return {"$shared": names[c] if names else "?"}
        return inner(v)

    def inner(v: object) -> object:
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v
    return inner(value)


# Names for shared values whose place says too little.
ALIASES = {"argv": "claude-settings"}


def _name(chosen: set[str], first: dict[str, tuple[tuple[str, ...], str]]) -> dict[str, str]:
    """Each shared value's name: the keys to where it was first met; with the case it was met in
    where values met at that place differ."""
    by_path: dict[str, list[str]] = {}
    for c in sorted(chosen, key=lambda c: (first[c], c)):
        path = ".".join(first[c][0]) or "value"
        by_path.setdefault(ALIASES.get(path, path), []).append(c)
    names = {}
    for path, values in by_path.items():
        for i, c in enumerate(values):
            name = path if len(values) == 1 else f"{path}@{first[c][1].replace('/', '-')}"
            names[c] = name if name not in names.values() else f"{name}-{i}"
    return names


# ---------------------------------------------------------------------------------------------------
# The files


def render(value: object, level: int = 0) -> str:
    """JSON with sorted keys, two spaces a level, a short list or object on one line."""
    flat = json.dumps(value, sort_keys=True)
    if not isinstance(value, (dict, list)) or len(flat) <= INLINE or not value:
        return flat
    pad = "  " * (level + 1)
    if isinstance(value, dict):
        body = [f"{pad}{json.dumps(k)}: {render(value[k], level + 1)}" for k in sorted(value)]
        return "{\n" + ",\n".join(body) + "\n" + "  " * level + "}"
    return "[\n" + ",\n".join(pad + render(v, level + 1) for v in value) + "\n" + "  " * level + "]"


_EXPECTED: dict[str, object] = {}


def expected() -> dict[str, object]:
    """The resolved plans, and the golden files they make (relative path → text), made once a session;
    with HIVE_RELAY_GOLDEN=1 they are written, and files no case makes any more deleted."""
    if not _EXPECTED:
        plans: dict[str, object] = {}
        forms: dict[str, object] = {}
        tried = {}
        rendered: set[str] = set()
        for backend in BACKENDS:
            p, f, tried[backend], r = resolve_all(backend)
            plans |= p
            forms |= f
            rendered |= r
        stored = {k: encode(v) for k, v in forms.items() if k not in SAME}
        files, blobs = share(stored)
        for k in files:  # lossless: the stored form is the plan's
            assert decode(files[k], blobs) == json.loads(json.dumps(forms[k])), f"{k}: its stored form loses"
        texts = {f"{k}.json": render(v) + "\n" for k, v in files.items()}
        users: dict[str, set[str]] = {k: set() for k in blobs}
        for holder, value in [*files.items(), *blobs.items()]:
            for node, _, entering in _walk([value], ()):
                if entering and isinstance(node, dict) and "$shared" in node:
                    users[node["$shared"]].add(holder)
        texts |= {f"{SHARED}/{k}.json": render({"used_by": sorted(users[k]), "value": v}) + "\n"
                  for k, v in blobs.items()}
        _EXPECTED.update(plans=plans, texts=texts, attempted=tried, rendered=rendered)
        if os.environ.get("HIVE_RELAY_GOLDEN") == "1":
            for path in on_disk():
                if path not in texts:
                    (GOLDEN / path).unlink()
            for path, text in texts.items():
                (GOLDEN / path).parent.mkdir(parents=True, exist_ok=True)
                (GOLDEN / path).write_text(text)
            for d in GOLDEN.iterdir():
                if d.is_dir() and not any(d.iterdir()):
                    d.rmdir()
    return _EXPECTED


def on_disk() -> set[str]:
    return {str(p.relative_to(GOLDEN)) for p in GOLDEN.rglob("*") if p.is_file()}


def _differs(path: str, want: str) -> str | None:
    """None when the golden file holds want, else a unified diff of just that file."""
    have = (GOLDEN / path).read_text() if (GOLDEN / path).is_file() else ""
    if have == want:
        return None
    diff = difflib.unified_diff(have.splitlines(), want.splitlines(), f"golden/plans/{path}", "resolved", lineterm="")
    lines = list(diff)
    more = f"\n... {len(lines) - 120} more diff lines" if len(lines) > 120 else ""
    return "\n".join(lines[:120]) + more


def _fail_on_diff(paths: list[str], texts: dict[str, str]) -> None:
    diffs = [d for p in paths if (d := _differs(p, texts[p]))]
    if diffs:
        pytest.fail("\n\n".join(diffs) + "\n\nreview, then regenerate with HIVE_RELAY_GOLDEN=1", pytrace=False)


# ---------------------------------------------------------------------------------------------------
# The tests


@pytest.mark.parametrize("backend", BACKENDS)
def test_resolve_reads_nothing(backend: str, fake_checkout: None) -> None:
    assert expected()["attempted"][backend] == []  # no host call, even one swallowed by an `except`


@pytest.mark.parametrize("case", CASES)
def test_plan_matches_its_golden(case: str, fake_checkout: None) -> None:
    got = expected()
    if case in SAME:
        plans = got["plans"]
        if plans[case] != plans[SAME[case]]:
            a, b = (render(plans[k]).splitlines() for k in (SAME[case], case))
            pytest.fail(f"{case} no longer resolves as {SAME[case]}: if that is meant, take it out of SAME in "
                        "this file and regenerate with HIVE_RELAY_GOLDEN=1\n" +
                        "\n".join(difflib.unified_diff(a, b, SAME[case], case, lineterm="")), pytrace=False)
        assert not (GOLDEN / f"{case}.json").exists(), f"{case} is in SAME: its golden file is stale"
        return
    _fail_on_diff([f"{case}.json"], got["texts"])


def test_shared_values_match_their_goldens(fake_checkout: None) -> None:
    texts = expected()["texts"]
    _fail_on_diff(sorted(p for p in texts if p.startswith(f"{SHARED}/")), texts)


def test_golden_files_are_the_cases(fake_checkout: None) -> None:
    """No stale file, none missing, and no two stored cases alike (those go to SAME)."""
    got = expected()
    texts = got["texts"]
    assert sorted(on_disk() - set(texts)) == [], "stale golden files: regenerate with HIVE_RELAY_GOLDEN=1"
    assert sorted(set(texts) - on_disk()) == [], "missing golden files: regenerate with HIVE_RELAY_GOLDEN=1"
    seen: dict[str, str] = {}
    alike = []
    for case in CASES:
        if case not in SAME:
            key = json.dumps(got["plans"][case], sort_keys=True)
            if key in seen:
                alike.append(f"{case!r}: {seen[key]!r}")
            seen.setdefault(key, case)
    assert alike == [], "these cases resolve alike: add them to SAME"
    assert set(SAME) <= set(CASES) and not set(SAME.values()) & set(SAME)


def test_the_markers_renderings_have_argv_goldens(fake_checkout: None) -> None:
    """What a `$rendered` marker stands for is the renderers' output, which the plan goldens no longer
    show: every flag and volume form in it has a whole vector in tests/golden/argv/ (test_argv_golden)."""
    vectors = [json.loads(p.read_text()) for p in sorted((GOLDEN.parent / "argv").glob("*_argv.*.json"))]
    covered = set().union(*(shapes(v) for v in vectors if isinstance(v, list)))
    assert sorted(expected()["rendered"] - covered) == []


def test_no_golden_line_is_long() -> None:
    """A reviewer reads a golden's diff: no line of the plan or argv goldens is MAX_LINE long."""
    long = [f"{p.relative_to(GOLDEN.parent)}:{n}: {len(line)} characters"
            for d in ("plans", "argv") for p in sorted((GOLDEN.parent / d).rglob("*.json"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if len(line) >= MAX_LINE]
    assert long == []


def test_the_fake_host_is_what_the_planner_saw(fake_checkout: None) -> None:
    """The harness itself: the same request against the real FsView would read the host (so the
    golden run above proves something), and the fake answers as the real one would."""
    fs = fake_host()
    assert fs.realpath(f"{HOME}/.config/git") == f"{HOME}/.gitconfig-dir" and fs.kind(f"{HOME}/.config/git") == "missing"
    assert fs.lkind(f"{HOME}/.config/git") == "link" and fs.which("sh", "/bin") == "/bin/sh"
    assert fs.listdir(f"{WORKDIR}/.git/modules") == ["lib"] and fs.which("gemini", f"{TOOLS}/node_modules/.bin") is None
    with no_host_io() as attempted, pytest.raises(HostTouched):
        resolve(load_shipped()["shell"], Matrix(load_shipped(), {}, frozenset(), ()),
                Request("shell", workdir=WORKDIR, run_id="1-golden"), SUPERVISED, dict(ENV), now=0, fs=HostFs())
    assert attempted
