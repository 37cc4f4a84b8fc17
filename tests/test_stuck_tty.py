"""An interactive session stuck on an allowed host that keeps failing: one line on the terminal naming
the host, the count and the cause, said once; the session is not ended for it (pexpect, real tty)."""

from __future__ import annotations

import io
import sys

import pexpect
import pytest

from .conftest import Sandbox, require_tool
from .test_unreachable import closed_port

pytestmark = [pytest.mark.box, pytest.mark.tty]


def test_the_stuck_line_reaches_the_terminal_once_and_the_session_goes_on(box_sandbox: Sandbox) -> None:
    require_tool("curl")
    s, port = box_sandbox, closed_port()
    child = pexpect.spawn(sys.executable, ["-m", "relay", "shell", "local", "--quiet", "--allow-host",
                                           f"svc.test:{port}=127.0.0.1:{port}"],
                          cwd=str(s.workdir), env=s.env, encoding="utf-8", timeout=60, dimensions=(24, 120))
    seen = io.StringIO()
    child.logfile_read = seen
    try:
        child.sendline(f"for i in 1 2 3 4 5 6 7 8 9 10; do curl -s -o /dev/null http://svc.test:{port}/; done; "
                       "echo LOOP$((40+2))")
        child.expect(f"svc.test:{port} is allowed but failed 5 times")
        child.expect("nothing listens there")
        child.expect("LOOP42")
        child.sendline("echo STILL$((40+2))")
        child.expect("STILL42")  # an interactive session is never ended for it
        child.sendline("exit 0")
        child.expect(pexpect.EOF)
        assert "unreachable (allowed, but failed)" in child.before
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert seen.getvalue().count("is allowed but failed") == 1  # said once, though it failed 10 times
