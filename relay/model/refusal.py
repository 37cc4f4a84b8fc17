"""The one shape of every refusal the proxy sends: so that the agent can tell its user what to do.

Why: an agent that meets a bare 403 (or a closed tunnel) retries, or reports an outage. Each
refusal therefore says, in one sentence, that a policy refused it (not an outage), which rule
applies, and the command that changes it. The same sentence goes into the status line's reason
phrase (many clients show nothing of a refused CONNECT but that), the body, and the
`X-Hive-Relay-Rule` header. Pure: text in, text out.
"""

from __future__ import annotations

import os
import shlex


def _entry() -> str:
    """The command every hint names, as the user can type it from any directory: our own
    `bin/contribute-hive` by its absolute path. Never `invoke ...` nor `python -m relay`: typed in the
    project, invoke loads that project's `tasks.py`/`invoke.py`, and `-m` puts the cwd first on
    sys.path; a live box can write either in the workdir while the user reads our hint."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # relay/model/ -> the checkout
    script = os.path.join(checkout, "bin", "contribute-hive")
    return shlex.quote(script) if os.path.exists(script) else "hive-relay"


ENTRY = _entry()
POLICY = "by the hive-relay egress policy"
NOT_OUTAGE = "not an outage"


def sentence(target: str, reason: str, rule: str, fix: str) -> str:
    """`by the hive-relay egress policy (TARGET: REASON; rule: RULE), not an outage; FIX`: it follows
    the status (`403 Forbidden by ...`), or `refused` where there is no status line."""
    return f"{POLICY} ({target}: {reason}; rule: {rule or 'none'}), {NOT_OUTAGE}; {fix}"


def allow_fix(target: str, run: str) -> str:
    """The `allow` line for a host the rules do not (yet) allow."""
    return f"to allow it while the box runs: {ENTRY} allow {target} --run {run or 'RUN'}"


def rule_fix(what: str) -> str:
    """The fix for a refusal a live allow cannot lift (a rule's own limits, a malformed request)."""
    return f"to change it: {what} (`allow` adds hosts, it does not widen a rule's limits)"


def printable(text: str) -> str:
    return "".join(c if " " <= c <= "~" else "?" for c in text)
