"""A sane user for a root caller's box.

A box started by root runs as uid/gid 1000 (plan.BOX_UID_FOR_ROOT; root in a box could remount its
binds). Without help, the box then names that uid after whoever owns 1000 on the host
(`cloudsdk@hive-relay`). Instead the box gets its own /etc/passwd and /etc/group, made in the run dir
and bound read-only over the host's: the box uid carries the caller's name and the box's HOME, and
the host's entry for the box uid (and the caller's own uid 0 entry, which nothing in the box can be)
is left out, so each name and each id appears once.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping

from relay.host import safefs
from relay.model.mounts import Mount
from relay.model.vocab import MountKind

FILES = ("passwd", "group")
TARGETS = tuple(f"/etc/{name}" for name in FILES)
LIMIT = 4 << 20


def mounts(run_dir: str) -> tuple[Mount, ...]:
    """The binds the plan adds for a root caller's supervised box (files written by `write`)."""
    return tuple(Mount(MountKind.RO_BIND, f"/etc/{name}", os.path.join(run_dir, f"etc-{name}")) for name in FILES)


def needed(plan_mounts: tuple[Mount, ...]) -> bool:
    return any(m.dst in TARGETS for m in plan_mounts)


def caller_name(uid: int, env: Mapping[str, str]) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        name = env.get("USER") or env.get("LOGNAME") or "user"
        return name if name.replace("-", "").replace("_", "").isalnum() else "user"


def _keep(line: str, name: str, box_id: int, caller_id: int) -> bool:
    fields = line.split(":")
    if len(fields) < 3 or line.startswith(("#", "+", "-")):
        return bool(line.strip()) and not line.startswith(("+", "-"))
    return fields[0] != name and fields[2] not in (str(box_id), str(caller_id))


def render(host_text: str, entry: str, name: str, box_id: int, caller_id: int) -> bytes:
    lines = [entry] + [ln for ln in host_text.splitlines() if _keep(ln, name, box_id, caller_id)]
    return ("\n".join(lines) + "\n").encode()


def write(run_dir: str, box_uid: int, box_gid: int, home: str, env: Mapping[str, str]) -> None:
    """Write the run dir's passwd and group for the box (0644: the box user reads them)."""
    name = caller_name(os.getuid(), env)
    shell = env.get("SHELL") if env.get("SHELL", "").startswith("/") else "/bin/sh"
    host = {f: (safefs.read_file(f"/etc/{f}", LIMIT) or b"").decode("utf-8", "replace") for f in FILES}
    texts = {
        "passwd": render(host["passwd"], f"{name}:x:{box_uid}:{box_gid}:{name} (hive relay box):{home}:{shell}",
                         name, box_uid, os.getuid()),
        "group": render(host["group"], f"{name}:x:{box_gid}:", name, box_gid, os.getgid()),
    }
    for f, data in texts.items():
        safefs.write_file(os.path.join(run_dir, f"etc-{f}"), data, 0o644, base=run_dir)
