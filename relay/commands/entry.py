"""The entries' whole body (bin/contribute-hive, `python -m relay`): a warm container launch's engine
first (relay/modes/container_prestart.py), then the planner, then the command, whose end kills a
prestarted engine no box took. An interrupt while the planner is still being imported ends the same
way as one later: the engine killed, its run dir gone, one line and exit 130, no traceback."""

from __future__ import annotations

import os
import sys


def run() -> None:
    from relay.modes.container_prestart import abandon, begin

    begin(sys.argv[1:])
    try:
        from relay.commands.cli import exit_now, main
    except KeyboardInterrupt:
        abandon()
        os.write(2, b"hive-relay: interrupted\n")
        os._exit(130)
    except BaseException:
        abandon()
        raise
    exit_now(main())
