"""`invoke bench`'s container rows run for real (issues 25 and 27): warm staged, --live and a bare
engine run in paired rounds, their ratios and the staged − live difference, and the rows and the
1.5× target the report prints. No timing is asserted: the machine is shared."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from relay.dev import bench_container

from .conftest import REPO, Sandbox

pytestmark = pytest.mark.container


def test_the_warm_container_rows_run_and_report_ratios_against_a_bare_run(csandbox: Sandbox, image: str) -> None:
    s = csandbox
    env = {**s.env, "PYTHONPATH": str(REPO)}
    engine = shutil.which("podman", path=env.get("PATH")) or "podman"
    out = bench_container.measure(engine, image, env, str(s.workdir), runs=2)
    assert "skipped" not in out, out
    bare = f"bare {os.path.basename(engine)} run true"
    assert set(out["launch"]) == {bare, bench_container.STAGED, bench_container.LIVE}
    for m in out["launch"].values():
        assert m["failures"] == 0 and len(m["times"]) == 2, m
    assert all(out["ratios"][n] is not None and out["ratios"][n] > 0 for n in (bench_container.STAGED,
                                                                                bench_container.LIVE))
    assert isinstance(out["staged_added_ms"], float)
    lines, targets = bench_container.rows(out)
    text = "\n".join(lines)
    assert "bare engine run (paired rounds)" in text and "staged − live" in text and "--live" in text
    (name, (value, _met)), = targets.items()
    assert "1.5× bare engine run" in name and value.endswith("×")
    # The staged runs' layers are gone (they changed nothing), and the checkout is as it was.
    assert sorted(p.name for p in s.workdir.iterdir()) == ["README.md"]


def test_the_new_user_rows_refuse_root_and_name_both_launches(tmp_path: Path) -> None:
    if os.getuid() == 0:
        out = bench_container.new_user("podman", dict(os.environ))
        assert "skipped" in out and "rootless user" in out["skipped"]
    else:  # the real run builds the image in a fresh storage (minutes): `invoke bench --new-user`
        fresh = bench_container._fresh_env({"HOME": "/h", "XDG_CONFIG_HOME": "/x", "CONTAINERS_CONF": "/c",
                                            "HIVE_RELAY_TOOLS": "/t", "PATH": "/bin"}, str(tmp_path), "/tmp/hr-x")
        assert fresh["HOME"] == str(tmp_path) and "XDG_CONFIG_HOME" not in fresh and "CONTAINERS_CONF" not in fresh
        assert fresh["HIVE_RELAY_TOOLS"] == "/t" and fresh["XDG_RUNTIME_DIR"] == "/tmp/hr-x"
    new = {"base": "loaded", "storage_driver": "overlay", "bare_s": 0.2,
           "first launch": {"seconds": 90.0, "exit_code": 0, "ratio": 450.0, "said": []},
           "second launch": {"seconds": 0.5, "exit_code": 0, "ratio": 2.5, "said": []}}
    lines, _ = bench_container.rows({"skipped": "no image"}, new)
    text = "\n".join(lines)
    assert "new rootless user: first launch" in text and "new rootless user: second launch" in text
    assert "450.00× bare engine run" in text and "container launch | not measured | no image" in text
