"""Shared fixtures: a fake HOME with secrets, a workdir, and helpers that run the real relay.

Every box test runs real bubblewrap. On a host that cannot start a box the box tests skip
with a loud reason, except under CI=true, where that is a failure: CI's machine type can.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from relay.host.probe import probe  # noqa: E402

from .fixtures import ca, proxies, tls_api  # noqa: E402, F401 - the shared fixtures (tests/fixtures.py), for every file

# `workdir: live`: most box tests check what the box itself can and cannot do, and read its writes
# straight from the workdir. The staged default has tests of its own (tests/escape/test_staged.py,
# tests/test_staged*.py), which pass --staged or use a config without this key.
SH_BACKENDS_CONFIG = """
workdir: live
backends:
{entries}
profiles:
  tight:
    extends: agent
    memory: 256MiB
    pids: 64
"""


def _sh_override(name: str) -> str:
    return (f"  {name}:\n    command: [/bin/sh]\n    prompt_command: [/bin/sh, -c, \"{{prompt}}\"]\n"
            f"    native: {{boxed: [], unsandboxed: []}}\n")


@dataclass
class Sandbox:
    """A fake HOME and workdir plus the environment the relay runs with."""

    root: Path
    home: Path
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)

    def relay(self, *args: str, timeout: float = 120, input: str | None = None,
              extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        env = {**self.env, **(extra_env or {})}
        return subprocess.run(
            [sys.executable, "-m", "relay", *args], cwd=self.workdir, env=env, capture_output=True,
            text=True, timeout=timeout, input=input if input is not None else "",
        )

    def box(self, script: str, backend: str = "shell", *args: str, **kw) -> subprocess.CompletedProcess:
        """Run `script` with /bin/sh inside BACKEND's box (sh-overridden agents keep their grants)."""
        return self.relay(backend, "local", "--quiet", "--prompt", script, *args, **kw)


def _make_sandbox(base: Path) -> Sandbox:
    base.chmod(0o755)
    home = base / "home"
    workdir = base / "work"
    for d in (home, workdir):
        d.mkdir(parents=True)
    (home / ".ssh").mkdir(mode=0o700)
    (home / ".ssh" / "id_rsa").write_text("PRIVATE-KEY-DO-NOT-LEAK\n")
    (home / ".claude").mkdir()
    (home / ".claude" / "settings.json").write_text('{"theme": "dark"}\n')
    (home / ".claude.json").write_text('{"numStartups": 1}\n')
    (home / ".codex").mkdir()
    (home / ".codex" / "auth.json").write_text('{"OPENAI_API_KEY": "sk-test"}\n')
    (home / ".gemini").mkdir()
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text("[default]\naws_secret_access_key=SECRET\n")
    (home / ".gitconfig").write_text("[user]\n\tname = Test User\n\temail = test@example.com\n")
    (home / ".netrc").write_text("machine example.com login x password SECRET\n")
    (home / "notes.txt").write_text("private notes\n")
    cfg = home / ".config" / "hive-relay"
    cfg.mkdir(parents=True)
    (cfg / "config.yaml").write_text(SH_BACKENDS_CONFIG.format(
        entries="".join(_sh_override(n) for n in ("claude", "codex", "gemini", "opencode"))))
    (workdir / "README.md").write_text("hello from the workdir\n")
    env = {
        "HOME": str(home),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "TERM": "xterm-256color",
        "USER": os.environ.get("USER", "tester"),
        "SHELL": "/bin/bash",
        "PYTHONPATH": str(REPO),
        "XDG_RUNTIME_DIR": str(base / "run"),
    }
    (base / "run").mkdir(mode=0o700)
    return Sandbox(root=base, home=home, workdir=workdir, env=env)


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return _make_sandbox(tmp_path)


def _can_box() -> str | None:
    facts = probe(use_cache=False)
    from relay.policy.tiers import supervised_ok

    if not supervised_ok(facts):
        return facts.bwrap_error or facts.seccomp_error or "no supervised box on this host"
    return None


BOX_PROBLEM = _can_box()


def require_box() -> None:
    if BOX_PROBLEM is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the box tests, but this host cannot: {BOX_PROBLEM}")
    pytest.skip(f"LOUD SKIP: cannot start a bubblewrap box here: {BOX_PROBLEM}")


@pytest.fixture
def box_sandbox(sandbox: Sandbox) -> Sandbox:
    require_box()
    return sandbox


def own_processes() -> list[tuple[int, str]]:
    """(pid, command line with spaces) of this user's processes (real uid), for a census that counts
    only its own: another user's test pass, or a colleague's box, running the same command meanwhile
    must neither fail it nor pass it (CI runs the root and the unprivileged pass side by side)."""
    uid, out = os.getuid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if real_uid(pid) != uid:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                out.append((int(pid), fh.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:
            continue
    return out


def real_uid(pid: int | str) -> int | None:
    """The real uid of a process (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            return int(next(line.split()[1] for line in fh if line.startswith(b"Uid:")))
    except (OSError, StopIteration, ValueError):
        return None


def have(tool: str) -> bool:
    return shutil.which(tool) is not None


def require_tool(tool: str) -> None:
    if have(tool):
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must have {tool} installed (.ci/run installs it)")
    pytest.skip(f"LOUD SKIP: {tool} is not installed")


# Container mode: one image per user per session, built by the real relay with the real engine.
UID = os.getuid()
PODMAN = "podman"


_RUNTIME_DIR_WAS_THERE = os.path.exists(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/hive-relay-test-run-{UID}")


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001 - pytest's hook
    """`-m "not container"` (and `not kube`, `not vm`) is a real subset: a test that needs the image
    is a container test whatever its file says, so a newcomer's subset never builds 1.5 GB."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.id.split("-") if callspec is not None else []  # [curl-container], [container]
        fixtures = set(getattr(item, "fixturenames", ()))
        if {"image", "csandbox"} & fixtures or "container" in params:
            item.add_marker(pytest.mark.container)
        name = item.module.__name__ if getattr(item, "module", None) else ""
        module = name.rsplit(".", 1)[-1]
        if module.startswith("test_kube_podman") or module.startswith("test_kube_canary"):
            item.add_marker(pytest.mark.kube)
        if module in ("test_vm", "test_vm_tcg"):
            item.add_marker(pytest.mark.vm)
        # `-m "not box"`: the pure tests alone (plans, renderers, parsers), in seconds. A test that
        # starts a box, an engine, a pod or a VM, or a sandbox for the real CLI, is a box test.
        if (BOX_FIXTURES & fixtures or ".escape." in f".{name}." or module in BOX_MODULES
                or any(item.get_closest_marker(m) for m in ("container", "kube", "vm", "tty"))):
            item.add_marker(pytest.mark.box)


# Fixtures that give a test a real box or engine, and files whose tests need more than Python without
# one: the installed agent CLIs (settings inventories), real git (index, kube staging), real pytest or
# bin/ runs (surface).
BOX_FIXTURES = {"sandbox", "box", "box_sandbox", "csandbox", "image"}
BOX_MODULES = {"test_settings_inventory", "test_gitindex", "test_kube_stage", "test_kube_redteam", "test_surface"}


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001, ARG001 - pytest's hook
    """Leave nothing behind: the runtime dir this session made for podman, and the rootless pause
    process podman started in it (it keeps a user namespace alive after the last container)."""
    path = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/hive-relay-test-run-{UID}"
    if _RUNTIME_DIR_WAS_THERE or os.environ.get("XDG_RUNTIME_DIR") or not os.path.isdir(path):
        return
    try:
        pid = int(Path(path, "libpod", "tmp", "pause.pid").read_text().strip())
        if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"catatonit"):
            os.kill(pid, 9)
    except (OSError, ValueError):
        pass
    shutil.rmtree(path, ignore_errors=True)


def _stable_runtime_dir() -> str:
    """One runtime dir per user for every container test: rootless podman keys its pause process
    and run state on it, so a per-test dir would start a new user namespace each time."""
    path = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/hive-relay-test-run-{UID}"
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def podman_env() -> dict[str, str]:
    return {**os.environ, "XDG_RUNTIME_DIR": _stable_runtime_dir()}


def _require_podman() -> None:
    problem = None
    try:
        proc = subprocess.run([PODMAN, "info", "--format", "json"], capture_output=True, text=True, env=podman_env(),
                              timeout=120)
        if proc.returncode != 0:
            problem = proc.stderr.strip()[-300:]
    except (OSError, subprocess.TimeoutExpired) as err:
        problem = str(err)
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the container tests, but podman does not work: {problem}")
    pytest.skip(f"LOUD SKIP: podman does not work here: {problem}")


_IMAGE_FAILURE: list[str] = []
_SESSION_IMAGES: list[str] = []  # what the `image` fixture built or found: the guard below watches it


def private_image_store(root: Path) -> str:
    """A storage.conf for a private, empty vfs image store under `root`; set it as
    CONTAINERS_STORAGE_CONF for anything that may remove images (`clean --all`, the superseded-image
    sweep). Without it root's podman uses the machine's one store whatever $HOME says, and a test
    would remove the image every container test of this session (and of a side-by-side run) uses."""
    (root / "graph").mkdir(parents=True, exist_ok=True)
    (root / "runroot").mkdir(exist_ok=True)
    conf = root / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{root}/graph"\nrunroot = "{root}/runroot"\n')
    return str(conf)


@pytest.fixture(scope="module", autouse=True)
def _the_session_image_survives_each_module(request: pytest.FixtureRequest):
    """Fail the module that removed the machine's image, by name: otherwise the next container
    test rebuilds it for minutes and times out far from the cause (CI, stop 35). About 50 ms a
    module, and only once an image exists."""
    yield
    for tag in list(_SESSION_IMAGES):
        proc = subprocess.run([PODMAN, "image", "exists", tag], capture_output=True, env=podman_env(), timeout=120)
        if proc.returncode == 1:
            _SESSION_IMAGES.remove(tag)  # said once; the next user of `image` finds it missing too
            pytest.fail(f"{request.module.__name__} removed the session's image {tag}: a test that may remove "
                        "images must use a private store (tests/conftest.py: private_image_store)")


@pytest.fixture(scope="session")
def image() -> str:
    """Build (or find) this user's image once; returns its tag. A failed build fails every
    container test at once instead of being retried by each."""
    _require_podman()
    if _IMAGE_FAILURE:
        pytest.fail(f"the image build failed earlier in this session:\n{_IMAGE_FAILURE[0]}")
    proc = subprocess.run([sys.executable, "-m", "relay", "build-image"], cwd=REPO, env=podman_env(),
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        _IMAGE_FAILURE.append(proc.stdout[-2000:] + proc.stderr[-4000:])
        pytest.fail(f"build-image failed (exit {proc.returncode}):\n{_IMAGE_FAILURE[0]}")
    tag = proc.stdout.strip().splitlines()[-1]
    assert tag.startswith("localhost/hive-relay-contributor:") and tag.endswith(f"-u{UID or 1000}")
    _SESSION_IMAGES.append(tag)
    return tag


def _storage_conf() -> str | None:
    """Rootless podman finds its storage through $HOME; the sandbox has a fake HOME, so point it
    at the real user's storage (where the image was built)."""
    if UID == 0:
        return None
    proc = subprocess.run([PODMAN, "info", "--format", "{{.Store.GraphRoot}}\n{{.Store.RunRoot}}\n{{.Store.GraphDriverName}}"],
                          capture_output=True, text=True, env=podman_env())
    graph, run, driver = proc.stdout.split("\n")[:3]
    return f'[storage]\ndriver = "{driver}"\ngraphroot = "{graph}"\nrunroot = "{run}"\n'


@pytest.fixture
def mode_sandbox(request: pytest.FixtureRequest) -> Sandbox:
    """The sandbox for a test parametrized over `mode`: container mode's (the image, its storage), else a
    box sandbox (bubblewrap required, and CI fails rather than skips without it)."""
    if request.node.callspec.params["mode"] == "container":
        return request.getfixturevalue("csandbox")
    require_box()
    return request.getfixturevalue("sandbox")


@pytest.fixture
def csandbox(sandbox: Sandbox, image: str) -> Sandbox:
    conf = _storage_conf()
    if conf:
        path = sandbox.home / ".config" / "containers" / "storage.conf"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(conf)
    sandbox.env["XDG_RUNTIME_DIR"] = _stable_runtime_dir()
    return sandbox
