""".git by allowlist: each git redirection the box tries is refused or kept aside, while the git work
it does (add, commit, branch, stash, rebase, worktree add) reaches the host.

Proved from the host: after the box ran, a plain `git status`, `git commit` and `git fetch` (from a
local bare repository) run on the host execute nothing the box wrote. Every planted command would
create a marker file outside the workdir, which the box itself cannot write.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..conftest import Sandbox

ID = ["-c", "user.email=t@e", "-c", "user.name=t"]


def git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), "GIT_CONFIG_NOSYSTEM": "1",
           "LANG": "C.UTF-8"}
    return subprocess.run(["git", *ID, *args], cwd=cwd, env=env, capture_output=True, text=True, check=check)


def repo(s: Sandbox) -> Path:
    """The workdir as a repository with one commit, and a bare repository to fetch from."""
    wd = s.workdir
    git(wd, "init", "-q", "-b", "main")
    git(wd, "add", "README.md")
    git(wd, "commit", "-q", "-m", "init")
    bare = s.root / "upstream.git"
    git(s.root, "clone", "-q", "--bare", str(wd), str(bare))
    return wd


def marker(s: Sandbox) -> Path:
    """Outside the workdir: read-only in the box, so only a command the host runs can create it."""
    return s.root / "PWNED"


def host_git_runs_nothing(s: Sandbox, cwd: Path | None = None) -> bool:
    """A user's plain git on the host, after the box: status, commit, fetch. True when no planted
    command ran (and the repository still works)."""
    cwd = cwd or s.workdir
    git(cwd, "status")
    git(cwd, "commit", "-q", "--allow-empty", "-m", "on the host")
    git(cwd, "fetch", "-q", str(s.root / "upstream.git"))
    return not marker(s).exists()


def run(s: Sandbox, script: str) -> str:
    proc = s.box(script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


EVIL = "touch {m}"


def test_config_fsmonitor_and_hookspath(box: Sandbox, report) -> None:
    wd, m = repo(box), marker(box)
    out = run(box, f"""
        mkdir -p evilhooks && printf '#!/bin/sh\\ntouch {m}\\n' > evilhooks/pre-commit && chmod +x evilhooks/pre-commit
        git config core.fsmonitor "touch {m}" 2>/dev/null || echo FSMONITOR-REFUSED
        git config core.hooksPath "$PWD/evilhooks" 2>/dev/null || echo HOOKSPATH-REFUSED
        printf '[core]\\n\\tfsmonitor = touch {m}\\n' >> .git/config 2>/dev/null || echo APPEND-REFUSED
        printf '[core]\\n\\tfsmonitor = touch {m}\\n' > cfg && mv cfg .git/config 2>/dev/null || echo REPLACE-REFUSED
        echo work > work.txt && git add work.txt && git {' '.join(ID)} commit -qm 'box work' && echo COMMIT-OK
    """)
    refused = all(w in out for w in ("FSMONITOR-REFUSED", "HOOKSPATH-REFUSED", "APPEND-REFUSED", "REPLACE-REFUSED"))
    clean = host_git_runs_nothing(box)
    report.attack(refused and clean)
    works = "COMMIT-OK" in out and "box work" in git(wd, "log", "--format=%s").stdout
    report.legit(works)
    assert refused and clean, out
    assert works, out


def test_commondir_redirect(box: Sandbox, report) -> None:
    wd, m = repo(box), marker(box)
    out = run(box, f"""
        git init -q --bare evil.git && git -C evil.git config core.fsmonitor "touch {m}"
        cp -r .git/refs .git/objects evil.git/ 2>/dev/null; cp .git/HEAD evil.git/HEAD
        echo ../evil.git > .git/commondir && echo COMMONDIR-WRITTEN
        rm .git/commondir
        git checkout -q -b feature && echo more > more.txt && git add more.txt && git {' '.join(ID)} commit -qm feat && echo BRANCH-OK
        echo ../evil.git > .git/commondir
    """)
    clean = host_git_runs_nothing(box)
    kept = "commondir" in out and "kept for review" in out
    report.attack(clean and not (wd / ".git" / "commondir").exists() and kept)
    head = (wd / ".git" / "HEAD").read_text()
    works = "BRANCH-OK" in out and head == "ref: refs/heads/feature\n" and (wd / "more.txt").exists()
    report.legit(works)
    assert clean and not (wd / ".git" / "commondir").exists() and kept, out
    assert works, (out, head)


def test_hooks_planted_or_created(box: Sandbox, report) -> None:
    wd, m = repo(box), marker(box)
    hook = f"#!/bin/sh\\ntouch {m}\\n"
    out = run(box, f"""
        printf '{hook}' > .git/hooks/pre-commit 2>/dev/null || echo HOOK-REFUSED
        rm -rf .git/hooks 2>/dev/null; mv .git/hooks .git/old-hooks 2>/dev/null || echo HOOKS-PINNED
        echo wip > wip.txt && git add wip.txt && git stash -q && git stash pop -q && echo STASH-OK
    """)
    # The host repository without a hooks dir: the box's git dir is private, so one it creates stays there.
    for p in (wd / ".git" / "hooks").iterdir():
        p.unlink()
    (wd / ".git" / "hooks").rmdir()
    out2 = run(box, f"""
        mkdir -p .git/hooks && for h in pre-commit post-commit reference-transaction post-checkout; do
            printf '{hook}' > .git/hooks/$h && chmod +x .git/hooks/$h; done && echo CREATED-IN-BOX
        git {' '.join(ID)} commit -qm 'box commit' && echo COMMIT-OK
    """)
    clean = host_git_runs_nothing(box)
    blocked = "HOOK-REFUSED" in out and "HOOKS-PINNED" in out and clean and not (wd / ".git" / "hooks").exists()
    report.attack(blocked)
    works = "STASH-OK" in out and "COMMIT-OK" in out2 and "box commit" in git(wd, "log", "--format=%s").stdout
    report.legit(works)
    assert blocked, out + out2
    assert works, out + out2


def test_alternates_and_gc(box: Sandbox, report) -> None:
    wd = repo(box)
    elsewhere = box.workdir / "elsewhere-objects"
    out = run(box, f"""
        mkdir -p {elsewhere}
        echo {elsewhere} > .git/objects/info/alternates 2>/dev/null || echo ALTERNATES-REFUSED
        echo {elsewhere} > .git/objects/info/http-alternates 2>/dev/null || echo HTTP-ALTERNATES-REFUSED
        for i in 1 2 3; do echo $i > f$i && git add f$i && git {' '.join(ID)} commit -qm c$i; done
        git gc -q && git commit-graph write --reachable 2>&1 && echo GC-OK
    """)
    alternates = wd / ".git" / "objects" / "info" / "alternates"
    blocked = ("ALTERNATES-REFUSED" in out and "HTTP-ALTERNATES-REFUSED" in out and not alternates.exists()
               and host_git_runs_nothing(box))
    report.attack(blocked)
    works = "GC-OK" in out and git(wd, "fsck", "--no-progress", check=False).returncode == 0 and "c3" in git(wd, "log", "--format=%s").stdout
    report.legit(works)
    assert blocked, out
    assert works, out


def test_head_and_state_files_are_validated(box: Sandbox, report) -> None:
    wd = repo(box)
    before = (wd / ".git" / "HEAD").read_text()
    out = run(box, """
        git branch side && git pack-refs --all && echo PACKED
        printf 'ref: refs/heads/../../config\\n' > .git/HEAD
        printf 'not an index' > .git/index
        printf 'garbage\\n' > .git/ORIG_HEAD
    """)
    blocked = ((wd / ".git" / "HEAD").read_text() == before and git(wd, "status").returncode == 0
               and not (wd / ".git" / "ORIG_HEAD").exists() and "kept for review" in out)
    report.attack(blocked)
    packed = (wd / ".git" / "packed-refs").read_text() if (wd / ".git" / "packed-refs").exists() else ""
    works = "PACKED" in out and "refs/heads/side" in packed and git(wd, "rev-parse", "side").returncode == 0
    report.legit(works)
    assert blocked, out
    assert works, (out, packed)


def test_rebase_todo_with_exec_stays_aside(box: Sandbox, report) -> None:
    wd, m = repo(box), marker(box)
    out = run(box, f"""
        git checkout -q -b topic && echo t > t.txt && git add t.txt && git {' '.join(ID)} commit -qm topic
        git checkout -q main && echo mm > m.txt && git add m.txt && git {' '.join(ID)} commit -qm main-2
        git checkout -q topic && git {' '.join(ID)} rebase -q main && echo REBASE-OK
        GIT_SEQUENCE_EDITOR='sed -i "1i break\\nexec touch {m}"' git {' '.join(ID)} rebase -q -i main 2>&1; echo STOPPED
    """)
    blocked = not (wd / ".git" / "rebase-merge").exists() and "rebase-merge" in out
    git(wd, "rebase", "--continue", check=False)
    blocked = blocked and host_git_runs_nothing(box)
    report.attack(blocked)
    log = git(wd, "log", "--format=%s", "topic").stdout.split("\n")
    works = "REBASE-OK" in out and log[:3] == ["topic", "main-2", "init"]
    report.legit(works)
    assert blocked, out
    assert works, (out, log)


def test_worktree_add_and_worktree_redirects(box: Sandbox, report) -> None:
    wd, m = repo(box), marker(box)
    git(wd, "worktree", "add", "-q", str(wd / "old-wt"))
    out = run(box, f"""
        git worktree add -q wt2 && cd wt2 && echo w > w.txt && git add w.txt && git {' '.join(ID)} commit -qm in-wt2 && echo WT-OK
        cd ..
        printf '[core]\\n\\tfsmonitor = touch {m}\\n' > .git/worktrees/old-wt/config.worktree && echo CONFIG-WT-WRITTEN
        echo /elsewhere > .git/worktrees/old-wt/commondir 2>/dev/null || echo COMMONDIR-REFUSED
        echo /elsewhere/.git > .git/worktrees/old-wt/gitdir 2>/dev/null || echo GITDIR-REFUSED
        mkdir -p .git/worktrees/evil && echo /tmp > .git/worktrees/evil/commondir && echo ref: refs/heads/main > .git/worktrees/evil/HEAD
        echo "$PWD/evil-wt/.git" > .git/worktrees/evil/gitdir
    """)
    old = wd / ".git" / "worktrees" / "old-wt"
    blocked = ("COMMONDIR-REFUSED" in out and "GITDIR-REFUSED" in out and not (old / "config.worktree").exists()
               and not (wd / ".git" / "worktrees" / "evil").exists()
               and host_git_runs_nothing(box) and host_git_runs_nothing(box, wd / "old-wt"))
    report.attack(blocked)
    works = "WT-OK" in out and git(wd / "wt2", "status", "--short").returncode == 0 and \
        "in-wt2" in git(wd, "log", "--format=%s", "refs/heads/wt2", "--").stdout and host_git_runs_nothing(box, wd / "wt2")
    report.legit(works)
    assert blocked, out
    assert works, out


def test_linked_worktree_as_workdir(box: Sandbox, report) -> None:
    main = box.root / "main-repo"
    main.mkdir()
    git(main, "init", "-q", "-b", "main")
    (main / "a.txt").write_text("a\n")
    git(main, "add", "a.txt")
    git(main, "commit", "-q", "-m", "init")
    git(box.root, "clone", "-q", "--bare", str(main), str(box.root / "upstream.git"))
    shutil.rmtree(box.workdir)
    git(main, "worktree", "add", "-q", "-b", "wt", str(box.workdir))
    m = marker(box)
    common = main / ".git"
    out = run(box, f"""
        echo "gitdir: $PWD/evil" > .git 2>/dev/null || echo DOTGIT-REFUSED
        git config core.fsmonitor "touch {m}" 2>/dev/null || echo CONFIG-REFUSED
        printf '#!/bin/sh\\ntouch {m}\\n' > {common}/hooks/post-commit 2>/dev/null || echo HOOK-REFUSED
        echo x > {common}/commondir 2>/dev/null || echo MAIN-COMMONDIR-REFUSED
        echo b > b.txt && git add b.txt && git {' '.join(ID)} commit -qm in-linked && echo COMMIT-OK
    """)
    # The main repository's git dir is private in the box too: a commondir written there is kept aside.
    blocked = (all(w in out for w in ("DOTGIT-REFUSED", "CONFIG-REFUSED", "HOOK-REFUSED"))
               and not (common / "commondir").exists() and "kept for review" in out
               and host_git_runs_nothing(box) and host_git_runs_nothing(box, main))
    report.attack(blocked)
    works = "COMMIT-OK" in out and "in-linked" in git(main, "log", "--format=%s", "refs/heads/wt", "--").stdout
    report.legit(works)
    assert blocked, out
    assert works, out


def test_symlinked_hooks_neither_freeze_nor_open(box: Sandbox, report) -> None:
    wd, m = repo(box), marker(box)
    hooks = wd / ".git" / "hooks"
    for p in hooks.iterdir():
        p.unlink()
    hooks.rmdir()
    hooks.symlink_to("..")
    out = run(box, f"""
        printf '#!/bin/sh\\ntouch {m}\\n' > pre-commit 2>/dev/null && chmod +x pre-commit 2>/dev/null || echo HOOK-REFUSED
        printf '#!/bin/sh\\ntouch {m}\\n' > reference-transaction 2>/dev/null || echo REFTX-REFUSED
        echo edit >> README.md && echo new > new.txt && git add -A && git {' '.join(ID)} commit -qm box && echo COMMIT-OK
    """)
    blocked = "HOOK-REFUSED" in out and "REFTX-REFUSED" in out and host_git_runs_nothing(box)
    report.attack(blocked)
    works = "COMMIT-OK" in out and (wd / "new.txt").read_text() == "new\n"
    report.legit(works)
    assert blocked, out
    assert works, out


def test_rename_into_git_and_no_leftovers(box: Sandbox, report) -> None:
    wd = repo(box)
    listing = sorted(p.name for p in (wd / ".git").iterdir())
    out = run(box, """
        echo x > note && mv note .git/description.new && echo RENAME-OK
        git checkout -q -b other && echo SWITCH-OK
    """)
    after = sorted(p.name for p in (wd / ".git").iterdir())
    report.legit("RENAME-OK" in out and "SWITCH-OK" in out)
    clean = after == listing and not (wd / ".git" / "description.new").exists()
    report.attack(clean)
    assert "RENAME-OK" in out and "SWITCH-OK" in out, out
    assert clean, (listing, after)


def test_nested_repository_added_as_gitlink(box: Sandbox, report) -> None:
    wd, m = repo(box), marker(box)
    # A submodule that existed before: its absorbed `.git` file cannot be pointed elsewhere.
    lib = box.root / "lib"
    git(box.root, "init", "-q", str(lib))
    git(lib, "commit", "-q", "--allow-empty", "-m", "lib")
    git(wd, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "lib")
    git(wd, "commit", "-q", "-m", "add lib")
    out = run(box, f"""
        echo "gitdir: ../evil.git" > lib/.git 2>/dev/null || echo SUBMODULE-DOTGIT-REFUSED
        git -C lib config core.fsmonitor "touch {m}" 2>/dev/null || echo SUBMODULE-CONFIG-REFUSED
        git init -q sub && git -C sub config core.fsmonitor "touch {m}"
        git -C sub {' '.join(ID)} commit -q --allow-empty -m s
        git add sub 2>/dev/null && git {' '.join(ID)} commit -qm gitlink && echo GITLINK-ADDED
        git -C lib {' '.join(ID)} commit -q --allow-empty -m in-lib && echo LIB-COMMIT-OK
    """)
    blocked = ("SUBMODULE-DOTGIT-REFUSED" in out and "SUBMODULE-CONFIG-REFUSED" in out
               and not (wd / "sub" / ".git").exists() and "moved to" in out and host_git_runs_nothing(box))
    report.attack(blocked)
    works = "LIB-COMMIT-OK" in out and "in-lib" in git(wd / "lib", "log", "--format=%s").stdout
    report.legit(works)
    assert blocked, out
    assert works, out


def test_links_in_logs_and_refs_are_removed(box: Sandbox, report) -> None:
    wd = repo(box)
    target = box.workdir / "victim.txt"
    target.write_text("precious\n")
    git(wd, "add", "victim.txt")
    git(wd, "commit", "-q", "-m", "victim")
    out = run(box, f"""
        rm .git/logs/HEAD && ln -s {target} .git/logs/HEAD && echo LOG-LINKED
        mkdir -p elsewhere && mv .git/refs/tags elsewhere/ && ln -s "$PWD/elsewhere/tags" .git/refs/tags && echo REFS-LINKED
        git branch kept && echo BRANCH-OK
    """)
    git(wd, "checkout", "-q", "-b", "after")
    git(wd, "tag", "t1")
    blocked = (target.read_text() == "precious\n" and not (wd / ".git" / "logs" / "HEAD").is_symlink()
               and not (wd / ".git" / "refs" / "tags").is_symlink() and "LOG-LINKED" in out and "REFS-LINKED" in out)
    report.attack(blocked)
    works = "BRANCH-OK" in out and git(wd, "rev-parse", "kept").returncode == 0
    report.legit(works)
    assert blocked, out
    assert works, out


def test_container_mode_has_the_same_allowlist(csandbox: Sandbox, report) -> None:
    s = csandbox
    wd, m = repo(s), marker(s)
    proc = s.relay("shell", "container", "--quiet", "--prompt", f"""
        git config core.fsmonitor "touch {m}" 2>/dev/null || echo CONFIG-REFUSED
        echo c > c.txt && git add c.txt && git {' '.join(ID)} commit -qm in-container && echo COMMIT-OK
        echo /elsewhere > .git/commondir
    """, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    blocked = "CONFIG-REFUSED" in out and not (wd / ".git" / "commondir").exists() and host_git_runs_nothing(s)
    report.attack(blocked)
    works = "COMMIT-OK" in out and "in-container" in git(wd, "log", "--format=%s").stdout
    report.legit(works)
    assert blocked, out
    assert works, out


def test_concurrent_host_edit_is_never_overwritten(box: Sandbox, report) -> None:
    """The host stages a file while the box works: the host's index wins, the box's is kept aside."""
    wd = repo(box)
    (wd / "host.txt").write_text("host\n")
    (wd / "boxed.txt").write_text("box\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "shell", "local", "--quiet", "--prompt",
         "git add boxed.txt && git branch from-box && touch ready && while [ ! -e go ]; do sleep 0.05; done"],
        cwd=wd, env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (wd / "ready").exists():
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        git(wd, "add", "host.txt")
        (wd / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    staged = git(wd, "diff", "--cached", "--name-only").stdout.split()
    kept = "index: changed on the host during the session" in err and "kept for review" in err
    report.attack(staged == ["host.txt"] and kept)
    report.legit(proc.returncode == 0 and git(wd, "rev-parse", "from-box").returncode == 0)
    assert staged == ["host.txt"] and kept, (staged, err)
    assert proc.returncode == 0, out + err


def test_packed_refs_conflict_loses_no_branch(box: Sandbox, report) -> None:
    """The box packs its refs (deleting the loose ones) while the host rewrites packed-refs: the
    box's packed-refs is kept aside, and every branch it packed is still there on the host."""
    wd = repo(box)
    git(wd, "branch", "b1")
    git(wd, "branch", "b2")
    git(wd, "tag", "host-packed")
    git(wd, "pack-refs")  # packed-refs exists on the host before the box
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "shell", "local", "--quiet", "--prompt",
         "git branch b3 && git pack-refs --all && touch ready && while [ ! -e go ]; do sleep 0.05; done"],
        cwd=wd, env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (wd / "ready").exists():
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        git(wd, "tag", "-d", "host-packed")  # rewrites packed-refs on the host
        (wd / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    branches = git(wd, "branch", "--format=%(refname:short)").stdout.split()
    kept = "packed-refs: changed on the host during the session" in err
    kept = kept and "host-packed" not in git(wd, "tag").stdout  # the host's deletion stands
    report.attack(kept)
    report.legit(proc.returncode == 0 and sorted(branches) == ["b1", "b2", "b3", "main"])
    assert kept, err
    assert sorted(branches) == ["b1", "b2", "b3", "main"], (branches, err)


def test_dotgit_as_a_link_is_put_back(box: Sandbox, report) -> None:
    wd, m = repo(box), marker(box)
    store = box.root / "store.git"
    (wd / ".git").rename(store)
    (wd / ".git").symlink_to(store)
    out = run(box, f"""
        echo more >> README.md && git {' '.join(ID)} commit -qam via-link && echo COMMIT-OK
        rm .git 2>/dev/null && git init -q && git config core.fsmonitor "touch {m}" && echo REPLACED || echo RM-REFUSED
    """)
    # The link is pinned in the box (relay/box/linkpin.py: rm gets EBUSY); were it not, the exit puts it back.
    blocked = (("RM-REFUSED" in out or ("REPLACED" in out and "the link is back" in out))
               and (wd / ".git").is_symlink() and os.readlink(wd / ".git") == str(store) and host_git_runs_nothing(box))
    report.attack(blocked)
    works = "COMMIT-OK" in out and "via-link" in git(wd, "log", "--format=%s").stdout
    report.legit(works)
    assert blocked, out
    assert works, out


def test_no_git_dir_cannot_be_created_in_a_plain_workdir(box: Sandbox, report) -> None:
    """A workdir that is no repository: the box cannot make `.git` there (the host's next `git init`
    or a parent's git would read it), while other dirs and files are created as usual."""
    wd = box.workdir
    out = run(box, "git init -q 2>/dev/null || echo INIT-REFUSED; mkdir -p .git/hooks 2>/dev/null || echo MKDIR-REFUSED; "
                   "mkdir -p src && echo x > src/a && echo CREATE-OK")
    report.attack("INIT-REFUSED" in out and "MKDIR-REFUSED" in out and not (wd / ".git").exists())
    report.legit("CREATE-OK" in out and (wd / "src" / "a").exists())
    assert "INIT-REFUSED" in out and "MKDIR-REFUSED" in out and not (wd / ".git").exists(), out
    assert "CREATE-OK" in out, out


def test_two_boxes_in_a_workdir_without_git_both_start(box: Sandbox, report) -> None:
    """The first box masks the missing `.git` with an empty placeholder dir; the second must not take
    that placeholder for a repository (it used to fail to start, exit 3)."""
    first = subprocess.Popen([sys.executable, "-m", "relay", "shell", "local", "--quiet", "--prompt",
                              "touch first-up; while [ ! -e release ]; do sleep 0.05; done"],
                             cwd=box.workdir, env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (box.workdir / "first-up").exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        assert (box.workdir / ".git").is_dir(), "the first box masks the missing .git (the setup of this test)"
        second = box.box("echo SECOND", "shell", "--shared-live")  # a second live box, insisted on
        report.legit(second.returncode == 0 and "SECOND" in second.stdout)
        assert second.returncode == 0 and "SECOND" in second.stdout, second.stderr
        third = box.box("echo THIRD", "shell", "--staged")  # and a staged one beside them
        assert third.returncode == 0 and "THIRD" in third.stdout, third.stderr
    finally:
        (box.workdir / "release").write_text("")
        first.communicate(timeout=60)
    assert first.returncode == 0
    assert not (box.workdir / ".git").exists()  # the placeholder went with the last box
