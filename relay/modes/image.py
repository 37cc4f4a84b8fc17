"""The container-mode image: its content-addressed tag, the offline base, and the build.

The tag is a digest of everything that goes into the image (Dockerfile, entrypoint, deny list,
base, CLI versions, contributor uid), so a changed pin or entrypoint is a new tag and an
existing tag never needs rebuilding. The engine's layer cache makes rebuilds after a pin bump
reuse the base and user layers.

The default base is built here, without any registry: mmdebstrap from the host's own Debian
mirror (read from apt's sources), plus Node and npm from the npm registry, `import`ed as an image.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from relay.host import procs
from relay.host.container_engine import engine_kind, info
from relay.host.paths import PACKAGE_ROOT
from relay.model.errors import RefusedError
from relay.model.refusal import ENTRY
from relay.modes.image_tag import (
    BASE_PACKAGES,
    BASE_REPO,
    CONTEXT_FILES,
    IMAGE_REPO,
    NODE_PACKAGE,
    NODE_VERSION,
    NPM_VERSION,
    PROXY_REPO,
    ImageSpec,
    debian_suite,
    forget_images,
    known_ready,
    remember,
    spec_from_env,
)
from relay.modes.install import MissingToolError, find_npm
from relay.render.container_argv import ContainerRun


class ImageError(MissingToolError):
    """The image (the container's copy of the CLIs) could not be built: exit 127, as when npm
    cannot install a CLI for local mode. The message says which step failed and the fix."""


def dockerfile_defaults() -> dict[str, str]:
    """ARG defaults written in Dockerfile.contributor (tests keep them equal to the config pins)."""
    text = (PACKAGE_ROOT / "Dockerfile.contributor").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S*)", text, flags=re.M))


Progress = Callable[[str], None]


def say(line: str) -> None:
    print(f"hive-relay: {line}", file=sys.stderr, flush=True)


def exists(engine: list[str], ref: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether `ref` is in the store the caller's `env` picks (CONTAINERS_STORAGE_CONF), as for every
    engine call here; None: this process's environment."""
    # podman's `image exists` answers in ~50 ms, a third of `image inspect`.
    check = ["image", "exists", ref] if engine_kind(engine[0]) == "podman" else \
        ["image", "inspect", "--format", "{{.Id}}", ref]
    probe = subprocess.run([*engine, *check],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return probe.returncode == 0


QUIET_TICK = 5.0  # no silent gap longer than this during a build: say what is still running
_STEP = re.compile(r"^(?:\[\d+/\d+\] )?STEP (\d+)/(\d+): (.*)$")


def _run(argv: list[str], step: str, fix: str, *, env: Mapping[str, str] | None = None,
         out: TextIO | None = None, tick: float = QUIET_TICK) -> None:
    """Run one build stage with its output digested: the engine's `STEP n/m: ...` lines become one
    line each, a quiet stretch says what is still running every `tick` s, and the rest (layer ids,
    npm's chatter) is kept for the failure report only."""
    out = out or sys.stderr
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=dict(env) if env is not None else None)
    except FileNotFoundError:
        raise ImageError(f"{step}: {argv[0]} is not installed; fix: {fix}") from None
    assert proc.stdout is not None
    start = last = time.monotonic()
    current, pending, tail = step, b"", collections.deque(maxlen=40)

    def show(text: str) -> None:
        print(f"hive-relay: {text}", file=out, flush=True)

    fd = proc.stdout.fileno()
    while True:
        if not procs.readable(fd, max(0.0, last + tick - time.monotonic())):
            show(f"{current}: still running ({time.monotonic() - start:.0f} s)")
            last = time.monotonic()
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", "replace").rstrip("\r")
            tail.append(line)
            if m := _STEP.match(line):
                current = f"{step} {m.group(1)}/{m.group(2)}"
                show(f"{current}: {m.group(3)[:160]}")
                last = time.monotonic()
            elif time.monotonic() - last >= tick:
                show(f"{current}: still running ({time.monotonic() - start:.0f} s): {line.strip()[:120]}")
                last = time.monotonic()
    rc = proc.wait()
    if rc != 0:
        for line in tail:
            print(line, file=out)
        raise ImageError(f"{step} failed (exit {rc}); fix: {fix}")


def debian_mirror(paths: tuple[str, ...] = ("/etc/apt/sources.list.d/*.sources", "/etc/apt/sources.list",
                                               "/etc/apt/sources.list.d/*.list")) -> str | None:
    """The host's own Debian mirror (first deb URI for the main archive), so no host is hard-coded."""
    for pattern in paths:
        for path in sorted(glob.glob(pattern)):
            try:
                text = open(path).read()
            except OSError:
                continue
            for block in re.split(r"\n\s*\n", text):
                uris = re.search(r"^URIs:\s*(\S+)", block, flags=re.M)
                suites = re.search(r"^Suites:\s*(.+)$", block, flags=re.M)
                if uris and suites and "security" not in uris.group(1) and "-" not in suites.group(1).split()[0]:
                    return uris.group(1)
            for m in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+([a-z]+)\s", text, flags=re.M):
                if "security" not in m.group(1):
                    return m.group(1)
    return None


def _npm_fetch(package: str, dest: str, env: Mapping[str, str]) -> str:
    """`npm pack` one package into dest and return the tarball path (uses the caller's npm config)."""
    npm = find_npm(env)
    if npm is None:
        raise ImageError("building the base needs npm on the host to fetch Node; fix: apt-get install npm")
    proc = subprocess.run([npm, "pack", "--silent", "--pack-destination", dest, package], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=dict(env))
    names = proc.stdout.split()
    if proc.returncode != 0 or not names:
        raise ImageError(f"npm could not fetch {package}: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}; "
                         "fix: check access to the npm registry")
    return os.path.join(dest, names[-1])


def _extract_package(tarball: str, target: str) -> None:
    """Unpack an npm tarball's package/ dir into target (npm tarballs are flat, no links)."""
    os.makedirs(target, exist_ok=True)
    import tarfile  # here: every container launch imports this module, and only a build unpacks

    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            if not member.name.startswith("package/"):
                continue
            member.name = member.name[len("package/"):]
            # Plain files and dirs only: no links, devices or absolute/parent paths from a tarball.
            if member.name and (member.isfile() or member.isdir()) and ".." not in member.name.split("/"):
                tar.extract(member, target, set_attrs=False)
                if member.isfile():
                    os.chmod(os.path.join(target, member.name), 0o755 if member.mode & 0o111 else 0o644)


def _stage_node(work: str, env: Mapping[str, str], node_version: str, npm_version: str) -> str:
    """/usr/local with Node and npm from the npm registry, laid out in `work`; returns its path."""
    node_tgz = _npm_fetch(f"{NODE_PACKAGE}@{node_version}", work, env)
    npm_tgz = _npm_fetch(f"npm@{npm_version}", work, env)
    unpacked = os.path.join(work, "node-package")
    _extract_package(node_tgz, unpacked)
    local = os.path.join(work, "local")
    os.makedirs(os.path.join(local, "bin"))
    shutil.copy2(os.path.join(unpacked, "bin", "node"), os.path.join(local, "bin", "node"))
    os.chmod(os.path.join(local, "bin", "node"), 0o755)
    _extract_package(npm_tgz, os.path.join(local, "lib", "node_modules", "npm"))
    for name in ("npm", "npx"):
        os.symlink(f"../lib/node_modules/npm/bin/{name}-cli.js", os.path.join(local, "bin", name))
    return local


def bootstrap_base(engine: list[str], tag: str, env: Mapping[str, str], say: Progress = say,
                   node_version: str = NODE_VERSION, npm_version: str = NPM_VERSION) -> None:
    """A minimal Debian from the host's own mirror (mmdebstrap: as root, or rootless in a user
    namespace), plus Node and npm from the npm registry, imported as `tag`."""
    mmdebstrap = shutil.which("mmdebstrap", path=env.get("PATH", os.defpath) + ":/usr/sbin:/sbin")
    if mmdebstrap is None:
        raise ImageError(f"the base image {tag} is missing and building it needs mmdebstrap; fix: apt-get install "
                         "mmdebstrap, or pass --base with an image that has node 20+, npm and git")
    mirror = debian_mirror()
    if mirror is None:
        raise ImageError("no Debian mirror found in /etc/apt/sources.list*; fix: pass --base IMAGE")
    import tempfile  # building only: a warm launch never needs it

    work = tempfile.mkdtemp(prefix="hive-relay-base-")
    # Rootless mmdebstrap works as a subordinate uid in a user namespace: it must be able to enter here.
    os.chmod(work, 0o755)
    try:
        suite = debian_suite()
        say(f"[base 1/3] Node {node_version} and npm {npm_version} from the npm registry")
        local = _stage_node(work, env, node_version, npm_version)
        say(f"[base 2/3] mmdebstrap {suite} (minbase + {', '.join(BASE_PACKAGES)}) from the host's Debian mirror")
        rootfs = os.path.join(work, "rootfs.tar")
        _run([mmdebstrap, "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "--quiet",
              f"--customize-hook=sync-in {local} /usr/local", "--customize-hook=rm -rf \"$1\"/var/lib/apt/lists/*",
              suite, rootfs, mirror],
             "mmdebstrap", "check access to the Debian mirror in /etc/apt/sources.list* (and /etc/subuid for "
             "your user when not root)", env=dict(env))
        say(f"[base 3/3] import as {tag}")
        _run([*engine, "import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
              rootfs, tag], "image import", f"check the container engine ({ENTRY} doctor)", env=env)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _npm_config(env: Mapping[str, str], key: str) -> str | None:
    """One setting of the host's npm (its user/global config, not just the environment)."""
    npm = find_npm(env)
    if npm is None:
        return None
    out = subprocess.run([npm, "config", "get", key], capture_output=True, text=True, env=dict(env),
                         stdin=subprocess.DEVNULL).stdout.strip()
    return None if out in ("", "null", "undefined") else out


def _npm_cafile(env: Mapping[str, str]) -> str | None:
    """The CA bundle the host's npm trusts (a registry behind a TLS-inspecting proxy needs it)."""
    for candidate in (env.get("NPM_CONFIG_CAFILE"), env.get("npm_config_cafile"), _npm_config(env, "cafile")):
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


def _npm_registry(env: Mapping[str, str]) -> str:
    out = _npm_config(env, "registry") or ""
    return out if out.startswith(("http://", "https://")) else ""


def ensure_base(engine: list[str], base: str, env: Mapping[str, str], say: Progress = say) -> None:
    if exists(engine, base, env):
        return
    archive = env.get("HIVE_RELAY_BASE_ARCHIVE")
    if archive and os.path.isfile(archive):
        say(f"loading the base image from {archive}")
        _run([*engine, "load", "-q", "-i", archive], "image load", f"check {archive} (made by --save-base)", env=env)
        if exists(engine, base, env):
            return
    if not base.startswith(f"{BASE_REPO}:"):
        say(f"pulling {base}")
        _run([*engine, "pull", base], f"pull {base}", "pass --base with an image you have locally", env=env)
        return
    bootstrap_base(engine, base, env, say)


def build(engine: list[str], spec: ImageSpec, env: Mapping[str, str], *, rebuild: bool = False,
          say: Progress = say) -> str:
    """Make sure the image for `spec` exists; returns its tag. Progress goes to stderr."""
    tag = spec.tag
    if not rebuild and exists(engine, tag, env):
        say(f"image {tag} is up to date")
        return tag
    ensure_base(engine, spec.base, env, say)
    import tempfile  # building only: a warm launch never needs it

    context = tempfile.mkdtemp(prefix="hive-relay-image-")
    try:
        for name in CONTEXT_FILES:
            os.makedirs(os.path.dirname(os.path.join(context, name)) or context, exist_ok=True)
            shutil.copy2(PACKAGE_ROOT / name, os.path.join(context, name))
        cafile = _npm_cafile(env)
        ca_target = os.path.join(context, "npm-ca.pem")
        if cafile:
            shutil.copyfile(cafile, ca_target)
        else:
            open(ca_target, "w").close()
        args = dict(spec.build_args)
        args.update(BASE=spec.base, CONTRIBUTOR_UID=str(spec.uid), CONTRIBUTOR_GID=str(spec.gid),
                    NPM_REGISTRY=_npm_registry(env))
        argv = [*engine, "build", "--network", "host", "-f", os.path.join(context, "Dockerfile.contributor"),
                "-t", tag, "--label", "hive-relay.image=contributor"]
        if rebuild:
            argv.append("--no-cache")
        for name, value in sorted(args.items()):
            argv += ["--build-arg", f"{name}={value}"]
        say(f"building {tag} from Dockerfile.contributor on {spec.base} (layers are cached)")
        _run([*argv, context], "image build", f"read the build output above; `{ENTRY} doctor` checks the engine",
             env=dict(env))
    finally:
        shutil.rmtree(context, ignore_errors=True)
    say(f"built {tag}")
    _remove_superseded(engine, tag, spec, say, env)
    return tag


def _remove_superseded(engine: list[str], tag: str, spec: ImageSpec, say: Progress,
                       env: Mapping[str, str] | None = None) -> None:
    """Older images of ours for this uid (a pin or entrypoint changed) and older offline bases are
    1.5 GB each; drop their tags. Layers still in use by anything else stay. `env` picks the store:
    the one the build used."""
    listing = subprocess.run([*engine, "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                             text=True, stdin=subprocess.DEVNULL, env=env).stdout.split()
    old = [ref for ref in listing if ref != tag and (
        (ref.startswith(f"{IMAGE_REPO}:") and ref.endswith(f"-u{spec.uid}")) or
        (ref.startswith(f"{BASE_REPO}:") and ref != spec.base))]
    if not old:
        return
    proc = subprocess.run([*engine, "rmi", *old], capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env)
    if proc.returncode == 0:
        say(f"removed superseded images: {', '.join(old)}")
        forget_images(engine[0], old, env if env is not None else os.environ)


def save_base(engine: list[str], base: str, path: str) -> None:
    _run([*engine, "save", "-q", "-o", path, base], "image save", f"check that {path} is writable")
    os.chmod(path, 0o644)


def ours(engine: list[str], uid: int, env: Mapping[str, str] | None = None) -> list[tuple[str, int | None]]:
    """Our images on this engine, with their sizes in bytes (None when the engine does not say): the
    contributor images for `uid` (the image uid: 1000 for root callers, see spec_for), the bases, and
    kube mode's proxy images (relay/modes/kube_podman.py: the box image plus the relay package).
    `env` is the caller's environment (CONTAINERS_STORAGE_CONF picks the store), as for `remove`."""
    image_uid = uid if uid else 1000
    if engine_kind(engine[0]) == "podman":
        proc = subprocess.run([*engine, "images", "--format", "json"], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, env=env)
        try:
            rows = [(name, row.get("Size")) for row in json.loads(proc.stdout or "[]") for name in row.get("Names") or ()]
        except ValueError:
            rows = []
    else:
        proc = subprocess.run([*engine, "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, env=env)
        rows = [(ref, None) for ref in proc.stdout.split()]
    return [(ref, size if isinstance(size, int) else None) for ref, size in rows
            if (ref.startswith(f"{IMAGE_REPO}:") and ref.endswith(f"-u{image_uid}")) or ref.startswith(f"{BASE_REPO}:")
            or ref.startswith(f"{PROXY_REPO}:")]


def remove(engine: list[str], ref: str, env: Mapping[str, str] | None = None) -> str | None:
    """Untag one image without force (an image a container still uses stays); the engine's reason
    when it refused, else None. `env` picks the store: the one `ours` listed, never another."""
    proc = subprocess.run([*engine, "rmi", ref], capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env)
    if proc.returncode == 0:
        return None
    return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]


def forget_if_gone(run: ContainerRun, env: Mapping[str, str]) -> str | None:
    """After the engine exited before the container started: when the image it was told to run is
    gone (removed since an earlier launch remembered it), forget it and say so; None otherwise."""
    if not known_ready(run, env) or exists([run.engine], run.image, env):
        return None
    remember(run, env, ready=False)
    return f"the image {run.image} is gone (removed since an earlier run); fix: run again, and it is built anew"


def ensure_ready(run: ContainerRun, matrix, env: Mapping[str, str]) -> None:  # noqa: ANN001 - Matrix
    """Build the image if this is its first use; refuse clearly if the engine does not answer.
    A warm launch asks the engine nothing (an `image exists` costs 50-90 ms, a fifth of the whole
    container launch): the tag names the image by content, so one this user's engine had before is
    remembered in the cache dir. On a miss the image check runs (`info` costs ~450 ms, so it runs
    only when the image is missing, to tell a broken engine from a first run)."""
    if known_ready(run, env):
        return
    engine = [run.engine]
    if exists(engine, run.image, env):
        remember(run, env, ready=True)
        return
    found = info(run.engine)
    if found.error:
        raise RefusedError(f"container mode cannot start: {found.error}; fix: `{ENTRY} doctor` shows the engine's "
                           "state (podman needs no daemon: apt-get install podman)")

    from relay.host.podman_storage import ensure_overlay

    ensure_overlay(run.engine, env, say)  # a new rootless user's vfs storage: overlay, before the image lands
    spec = spec_from_env(matrix.backends, os.getuid(), os.getgid(), env)
    say(f"first container run: building {spec.tag} (once; later runs reuse it)")
    build(engine, spec, env)
    if exists(engine, run.image, env):
        remember(run, env, ready=True)
