"""A protected path the plan saw as another box's placeholder can be gone by the time this box takes
the registry lock (its last user removed it). The registry makes it again as this box's placeholder,
so bwrap never meets a missing mount point ("Can't find source path"; seen in `invoke bench`'s ten
boxes started at once in one workdir)."""

from __future__ import annotations

import os
from pathlib import Path

from relay.trust.placeholders import Registry


def test_a_vanished_placeholder_is_made_again_and_released(tmp_path: Path) -> None:
    work, state = tmp_path / "work", tmp_path / "state"
    work.mkdir()
    gone_file, gone_dir = str(work / ".bashrc"), str(work / ".vscode")
    reg = Registry(str(state))
    reg.claim(os.getpid(), [], [gone_file, gone_dir], bases=(str(work),), dirs=frozenset({gone_dir}),
              mounted=frozenset({gone_file, gone_dir}))
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
    reg.claim(os.getpid(), [], [str(work / "sub" / ".envrc")], bases=(str(work),),
              mounted=frozenset({str(work / "sub" / ".envrc")}))
    assert not os.listdir(elsewhere)
    reg.release(os.getpid())


def test_a_path_missing_when_planned_is_never_made(tmp_path: Path) -> None:
    """A protected or denied path that was already missing at planning has no mount to lose: making
    it would plant an empty file that the next box's plan takes for a real one (and whose removal
    then breaks that box). Only what the plan mounts at is made again."""
    work, state = tmp_path / "work", tmp_path / "state"
    work.mkdir()
    reg = Registry(str(state))
    reg.claim(os.getpid(), [], [str(work / ".aws")], bases=(str(work),), mounted=frozenset())
    assert not os.path.lexists(work / ".aws")
    reg.release(os.getpid())


def test_nested_placeholders_are_all_removed(tmp_path: Path) -> None:
    """A placeholder dir holding another placeholder is removed too: children go first."""
    work, state = tmp_path / "work", tmp_path / "state"
    work.mkdir()
    reg = Registry(str(state))
    parent, child = str(work / ".claude"), str(work / ".claude" / "commands")
    reg.claim(os.getpid(), [(parent, True), (child, True)], [], bases=(str(work),))
    assert os.path.isdir(child)
    reg.release(os.getpid())
    assert not os.path.lexists(parent)
