"""kube mode's reaper: deletes the run's namespace when its launcher dies without doing so itself.

The launcher deletes the namespace in a `finally`, which covers an error, a timeout and Ctrl-C. A
`kill -9` (or an OOM kill, or a closed laptop lid's lost session) skips it, and a cluster has no
TTL for namespaces. So the launcher starts this small process first, in a session of its own (a
Ctrl-C to the terminal's process group does not reach it), and holds the write end of a pipe to
it. The read end sees `done` when the launcher cleaned up itself, and end-of-file with no `done`
when it died: then the reaper runs `kubectl delete namespace NS --wait=false` and exits. A pipe, not
a pid to poll: nothing to reuse, and no race with the launcher's own delete.

Inside the cluster the run's objects are owned by its Job (relay/modes/kube_run.py sets ownerReferences),
so the Job's `ttlSecondsAfterFinished` and `activeDeadlineSeconds` remove them even if this host is
gone for good; the empty namespace is what only a reaper can remove.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

DONE = b"done\n"


def start(delete: Sequence[str], env: Mapping[str, str]) -> int:
    """Start the reaper with its `kubectl ... delete namespace NS` argv (pinned to the run's context by
    relay/kube_run.Kubectl); returns the write end of its pipe (non-inheritable: the launcher's
    kubectl calls never hold it open)."""
    r, w = os.pipe()
    try:
        subprocess.Popen([sys.executable, "-P", "-m", "relay.modes.kube_reaper", str(r), *delete], pass_fds=(r,),
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, env={**env, "PYTHONPATH": _package_parent()})
    finally:
        os.close(r)
    return w


def _package_parent() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # relay/modes/ -> above relay/


def done(fd: int) -> None:
    """The launcher deleted the namespace itself: the reaper exits without a call."""
    try:
        os.write(fd, DONE)
    except OSError:
        pass
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    fd, delete = int(argv[0]), argv[1:]
    got = b""
    while chunk := os.read(fd, 64):
        got += chunk
        if len(got) > 64:
            break
    if got == DONE:
        return 0
    subprocess.run(delete, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
