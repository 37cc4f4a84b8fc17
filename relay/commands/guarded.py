"""How every command ends: a RelayError is its one line and exit code, Ctrl-C is 130, a closed pipe is 141, and a bug is exit 70 with one line, its traceback kept in an owner-only crash file of the state dir."""

from __future__ import annotations

import os
import sys
import time

from relay.model.errors import EXIT_INTERNAL, RelayError
from relay.ui.banner import emit


def guarded(fn, *args, **kwargs) -> int:  # noqa: ANN001
    """Run fn, turning RelayError into its one line and exit code. First, the process's PATH loses
    its relative entries (relay/host/paths.py): no host-side tool is ever found in the workdir."""
    from relay.host.paths import drop_relative_path_entries

    drop_relative_path_entries(os.environ)
    try:
        return fn(*args, **kwargs)
    except RelayError as err:
        emit([f"hive-relay: error: {err.message}"])
        return err.exit_code
    except KeyboardInterrupt:
        emit(["hive-relay: interrupted"])
        return 130
    except BrokenPipeError:
        # `contribute-hive --dry-run | head`: the reader left; say nothing more, like `cat` would.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 141
    except Exception as err:  # noqa: BLE001 - a bug: the promised exit code and one line, not a traceback
        emit([f"hive-relay: internal error (a bug, not your input): {type(err).__name__}; {_crash_file(err)}"])
        return EXIT_INTERNAL


def _crash_file(err: BaseException) -> str:
    """The traceback in a new owner-only file of the state dir; the line that names it, or says why not."""
    import tempfile
    import traceback

    from relay.host.paths import state_dir

    try:
        root = os.path.join(state_dir(dict(os.environ)), "crashes")
        os.makedirs(root, mode=0o700, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), suffix=".txt", dir=root)
        with os.fdopen(fd, "w") as fh:
            fh.write("".join(traceback.format_exception(err)))
    except OSError as why:
        return f"the traceback could not be saved ({why.strerror or why})"
    return f"the traceback is in {path}; please report it"
