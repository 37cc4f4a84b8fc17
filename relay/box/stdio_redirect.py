"""Point the process's stdout/stderr at other fds for the span of one box run.

The runner's children (bwrap, the agent) inherit fds 1 and 2 directly, so capturing what a box
prints (selftest probes, the verification run's errors) means swapping the fds, not sys.stdout.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def redirected(targets: Mapping[int, int]) -> Iterator[None]:
    """Within the block, fd N writes to targets[N]; the originals come back afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in targets}
    try:
        for fd, target in targets.items():
            os.dup2(target, fd)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
