"""The run's own CA for TLS inspection, made on the host with /usr/bin/openssl: a certificate the box
trusts, and a leaf per inspected name for the proxy.

Why this shape:
- The CA is made per run, in the run dir (which no box sees), and its key exists only while the
  leaves are minted: it is unlinked before the box starts, so nothing the box or a later run can do
  ever reaches it. The leaves' keys stay in the run dir (0700) for the proxy, and go with it.
- The CA carries a critical nameConstraints extension naming the inspected hosts only: a client
  that trusts it trusts it for those names and no other, whatever leaf anyone mints.
- openssl with argv lists (no `cryptography` module here, and none on the launch path): two or
  three processes of ~10 ms each, only in a run that inspects.
- The box's bundle is the host's system roots plus the run CA's certificate, so every other host's
  TLS verifies as before.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Sequence

from relay.model.record import record

OPENSSL = "/usr/bin/openssl"
DIR = "inspect"
SYSTEM_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")
MAX_BUNDLE = 4 << 20
_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


class CAError(OSError):
    """The run CA or a leaf could not be made (openssl missing or failing): the run stops."""


@record
class Leaf:
    """One inspected host's leaf in the run dir: its certificate and its key (the proxy's, never the box's)."""

    host: str
    cert: str
    key: str


def leaf_paths(run_dir: str, index: int, host: str) -> Leaf:
    """Where the i-th inspected host's leaf lies in the run dir (by index: no name is a path)."""
    base = os.path.join(run_dir, DIR)
    return Leaf(host, os.path.join(base, f"leaf-{index}.pem"), os.path.join(base, f"leaf-{index}.key"))


def _openssl(args: Sequence[str]) -> None:
    try:
        done = subprocess.run([OPENSSL, *args], capture_output=True, umask=0o077, timeout=30, check=False,
                              env={"PATH": "/usr/bin:/bin", "OPENSSL_CONF": "/dev/null"})
    except (OSError, subprocess.TimeoutExpired) as err:
        raise CAError(f"cannot run {OPENSSL}: {getattr(err, 'strerror', None) or err}") from None
    if done.returncode != 0:
        last = (done.stderr.decode("utf-8", "replace").strip().splitlines() or ["no message"])[-1][:200]
        raise CAError(f"{OPENSSL} {args[0]} failed: {last}")


def system_roots() -> bytes:
    """The host's system trust store as one PEM file (the first that exists), or b"" when none does."""
    for path in SYSTEM_BUNDLES:
        try:
            with open(path, "rb") as f:
                return f.read(MAX_BUNDLE)
        except OSError:
            continue
    return b""


def make(run_dir: str, hosts: Sequence[str], bundle_name: str, run_id: str = "") -> tuple[Leaf, ...]:
    """The run CA, a leaf per host (canonical names), and the box's bundle (`run_dir/bundle_name`,
    0644: system roots + the CA's certificate). The CA's key is gone when this returns."""
    base = os.path.join(run_dir, DIR)
    os.mkdir(base, 0o700)
    ca_key, ca_cert = os.path.join(base, "ca.key"), os.path.join(base, "ca.pem")
    permitted = ",".join(f"permitted;DNS:{h}" for h in hosts)
    label = f"hive relay run CA {run_id[:40]}".strip()
    try:
        _openssl(["req", "-x509", *_EC, "-keyout", ca_key, "-out", ca_cert, "-days", "2", "-subj", f"/CN={label}",
                  "-set_serial", str(secrets.randbits(63)),
                  "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
                  "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                  "-addext", f"nameConstraints=critical,{permitted}"])
        leaves = []
        for i, host in enumerate(hosts):
            leaf = leaf_paths(run_dir, i, host)
            _openssl(["req", "-x509", *_EC, "-keyout", leaf.key, "-out", leaf.cert, "-days", "2", "-subj", f"/CN={host}",
                      "-CA", ca_cert, "-CAkey", ca_key, "-set_serial", str(secrets.randbits(63)),
                      "-addext", f"subjectAltName=DNS:{host}", "-addext", "extendedKeyUsage=serverAuth",
                      "-addext", "basicConstraints=critical,CA:FALSE",
                      "-addext", "keyUsage=critical,digitalSignature"])
            leaves.append(leaf)
    finally:
        try:
            os.unlink(ca_key)  # the CA signs nothing after this: no key left to reach, in any box or run
        except FileNotFoundError:
            pass
    with open(ca_cert, "rb") as f:
        cert = f.read(1 << 16)
    roots = system_roots()
    data = roots.rstrip(b"\n") + b"\n" + cert if roots else cert
    path = os.path.join(run_dir, bundle_name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, data)
    finally:
        os.close(fd)
    return tuple(leaves)
