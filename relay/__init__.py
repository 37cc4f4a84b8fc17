"""hive relay: run a coding agent inside a box that cannot read your secrets or phone home.

The package turns config plus a user request into a frozen Plan (pure functions),
then a thin runner executes that plan with bubblewrap, seccomp and a host-side proxy.
"""

__version__ = "0.1.0"
