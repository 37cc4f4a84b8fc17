import gc

# A launch allocates some 100k objects and frees almost none: the cyclic collector's passes over
# them are ~10% of our own startup. Back on where the process starts to live long: a task (cli.main),
# kube mode, an image build or npm install (cli.contribute), the box's run (relay/modes/runner.py),
# the janitor (relay/trust/janitor.py).
gc.disable()

from relay.commands.entry import run  # noqa: E402 - after the collector is off

run()
