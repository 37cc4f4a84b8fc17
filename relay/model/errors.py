"""Errors that end a run, each carrying the exit code that the public interface promises.

Exit codes are part of the command surface (docs/usage.md, "Exit codes"): scripts branch on
them, so every failure path must raise one of these rather than a bare exception.
"""

from __future__ import annotations

EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_NO_RUN = 4  # `allow`/`deny --run RUN`: no live run of the caller by that name (relay/egress/control.py)
EXIT_TIMEOUT = 124
EXIT_UPSTREAM = 69  # sysexits EX_UNAVAILABLE: a --prompt run ended because an allowed host kept failing
EXIT_INTERNAL = 70  # a bug: one line, the traceback in a crash file (relay/commands/guarded.py)
EXIT_NO_CLUSTER = EXIT_REFUSED  # kube mode with no kubectl context (relay/modes/kube_run.py)
EXIT_MISSING = 127  # a tool the run needs is not installed (relay/modes/install.py), as a shell says it


class RelayError(Exception):
    """A failure the user can act on; `str(err)` is the one line we print."""

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UsageError(RelayError):
    """Bad flags, bad config, unknown backend: the user must change what they typed."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """A config file failed strict validation; the message names file, backend, key and fix."""


class RefusedError(RelayError):
    """The request cannot be enforced on this host, or an opt-in is missing."""

    exit_code = EXIT_REFUSED
