"""A protected path the plan saw as another box's placeholder can be gone by the time this box takes
the registry lock (its last user removed it). The registry makes it again as this box's placeholder,
so bwrap never meets a missing mount point ("Can't find source path"; seen in `invoke bench`'s ten
boxes started at once in one workdir)."""

from __future__ import annotations

import os
from pathlib import Path

from relay.placeholders import Registry


def test_a_vanished_placeholder_is_made_again_and_released(tmp_path: Path) -> None:
    work, state = tmp_path / "work", tmp_path / "state"
    work.mkdir()
    gone_file, gone_dir = str(work / ".bashrc"), str(work / ".vscode")
    reg = Registry(str(state))
    reg.claim(os.getpid(), [], [gone_file, gone_dir], bases=(str(work),), dirs=frozenset({gone_dir}))
    assert os.path.isfile(gone_file) and os.path.getsize(gone_file) == 0
    assert os.path.isdir(gone_dir) and not os.listdir(gone_dir)
    reg.release(os.getpid())
    assert not os.path.lexists(gone_file) and not os.path.lexists(gone_dir)


def test_a_real_existing_file_is_left_as_it_is(tmp_path: Path) -> None:
    """The twin: a real protected file the plan binds read-only is neither registered nor removed."""
    work, state = tmp_path / "work", tmp_path / "state"
    work.mkdir()
    real = work / ".bashrc"
    real.write_text("alias ll='ls -l'\n")
    reg = Registry(str(state))
    reg.claim(os.getpid(), [], [str(real)], bases=(str(work),))
    reg.release(os.getpid())
    assert real.read_text() == "alias ll='ls -l'\n"


def test_a_vanished_path_under_a_link_is_not_made(tmp_path: Path) -> None:
    """Made beneath its trusted base with no link followed: a parent swapped for a link is refused."""
    work, state, elsewhere = tmp_path / "work", tmp_path / "state", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "sub").symlink_to(elsewhere)
    reg = Registry(str(state))
    reg.claim(os.getpid(), [], [str(work / "sub" / ".envrc")], bases=(str(work),))
    assert not os.listdir(elsewhere)
    reg.release(os.getpid())
