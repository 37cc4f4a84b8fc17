"""kube mode's proxy image: the box image plus an explicit, stdlib-only file set of relay (what the proxy pod's two entries import), tagged by content. Built offline in seconds."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Mapping

from relay.host.paths import PACKAGE_DIR
from relay.model.hashing import sha256
from relay.modes.image_tag import PROXY_REPO
from relay.modes.kube_objects import PROXY_PYTHONPATH

# What the proxy pod runs (`python3 -m relay.egress.proxy_main`, `-m relay.modes.kube_bundle`) and
# everything they import, by path under relay/: an explicit file set, stdlib only at module level
# (tests/test_house.py checks that it is closed under imports). The image holds these and no more.
PROXY_POD_FILES = (
    "__init__.py",
    "config/__init__.py", "config/profiles.py",
    "egress/__init__.py", "egress/answers.py", "egress/control.py", "egress/decision_log.py", "egress/forward.py",
    "egress/http_head.py", "egress/proxy.py", "egress/proxy_main.py", "egress/reactor.py", "egress/redact.py", "egress/secret_scan.py",
    "egress/routes.py", "egress/rulebook.py", "egress/tlspeek.py", "egress/watch.py", "egress/inspect.py",
    "egress/tls_stream.py",
    "host/__init__.py", "host/liveness.py", "host/procs.py", "host/safefs.py",
    "model/__init__.py", "model/allow_rules.py", "model/backend.py", "model/errors.py", "model/hostname.py",
    "model/http_rules.py", "model/record.py", "model/refusal.py", "model/vocab.py",
    "modes/__init__.py", "modes/kube_bundle.py",
    "policy/__init__.py", "policy/egress.py",
    "trust/__init__.py", "trust/rundirs.py",
)


def _relay_sources() -> tuple[str, ...]:
    return PROXY_POD_FILES


def proxy_image_tag(image: str) -> str:
    """The proxy image by content: the box image it starts from, plus the proxy pod's files."""
    h = sha256(image.encode())
    for name in _relay_sources():
        h.update(name.encode() + b"\0" + (PACKAGE_DIR / name).read_bytes() + b"\0")
    return f"{PROXY_REPO}:{h.hexdigest()[:12]}"


def build_proxy_image(podman: list[str], image: str, env: Mapping[str, str]) -> str:
    """FROM the box image, COPY the relay package (stdlib only at the proxy's end): seconds, offline."""
    tag = proxy_image_tag(image)
    if subprocess.run([*podman, "image", "exists", tag], env=dict(env)).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory(prefix="hive-relay-proxy-image-") as ctx:
        for name in _relay_sources():
            os.makedirs(os.path.dirname(os.path.join(ctx, "relay", name)), exist_ok=True)
            with open(os.path.join(ctx, "relay", name), "wb") as fh:
                fh.write((PACKAGE_DIR / name).read_bytes())
        with open(os.path.join(ctx, "Containerfile"), "w") as fh:
            fh.write(f"FROM {image}\nCOPY relay {PROXY_PYTHONPATH}/relay\n")
        proc = subprocess.run([*podman, "build", "--network", "none", "-q", "-t", tag, ctx], capture_output=True,
                              text=True, env=dict(env))
        if proc.returncode != 0:
            raise RuntimeError(f"building {tag} failed: {proc.stderr[-500:]}")
    return tag
