"""Polish that users notice: the dry run speaks like the banner, doctor's MISS lines carry a fix and leave
nothing behind, selftest prints only its table, and a root caller's box user has a sane name."""

from __future__ import annotations

import pytest

from .conftest import Sandbox


@pytest.mark.box
def test_dry_run_says_egress_none_like_the_banner_and_prints_human_sizes(box_sandbox: Sandbox) -> None:
    s = box_sandbox
    dry = s.relay("shell", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    egress = next(ln for ln in lines if ln.startswith("egress "))
    limits = next(ln for ln in lines if ln.startswith("limits "))
    assert egress.split(None, 1)[1] == "none (proxy refuses all)", egress
    assert limits.startswith("limits   8GiB memory, 512 processes via "), limits
    ran = s.relay("shell", "local", "--prompt", "true")
    assert ran.returncode == 0, ran.stderr
    assert "egress: none (proxy refuses all)" in ran.stderr and "limits 8GiB mem" in ran.stderr
    tight = s.relay("shell", "--profile", "tight", "--dry-run").stdout
    assert "limits   256MiB memory, 64 processes" in tight
    assert "egress   no network" in s.relay("shell", "--profile", "default", "--dry-run").stdout
