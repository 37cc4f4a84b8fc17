import gc

# A launch allocates some 100k objects and frees almost none: the cyclic collector's passes over
# them are ~10% of our own startup. Back on once the box runs (relay/modes/runner.py, startup_done).
gc.disable()

from relay.commands.cli import exit_now, main  # noqa: E402 - after the collector is off

exit_now(main())
