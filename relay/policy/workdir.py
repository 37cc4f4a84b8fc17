"""Which directories may be a box's workdir: the one host tree the box can write.

A workdir is live on the host: whatever the box writes there runs later if the host executes or
autoloads it. A project checkout is the intended case. `$HOME` (or any of its ancestors) would
hand the box `~/.local/bin`, `~/.config/systemd/user`, `~/.config/autostart` and the user config
that may widen the next box; a system tree would hand it what root runs; a private dir such as
`/tmp` would replace the box's own private `/tmp` with the host's shared one. Pure: paths in, a
reason out.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

# Inside these, every file is something the host runs or trusts (as root, for a root caller).
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/proc", "/sys",
                "/dev", "/run", "/var/lib", "/var/spool")
# The box has its own private copy of these; a workdir there would show it the host's shared one.
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/var", "/dev/shm")
# Under $HOME: trees whose files run code or configure what runs (autostart, systemd units, shims).
HOME_CODE_TREES = (".config", ".local", "bin")


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def refusal(workdir: str, home: str, denied: Iterable[str], own: Iterable[str], config_home: str,
            path_dirs: Iterable[str] = ()) -> str | None:
    """Why `workdir` (a real path) cannot be a box's workdir, with the fix; None when it can.
    `path_dirs` are the real paths of the caller's $PATH entries: an executable the box drops there
    runs the next time the caller types its name."""
    cd_fix = "cd into your project's checkout, or pass --workdir DIR"
    if workdir == "/":
        return f"the workdir is /, the whole host; fix: {cd_fix}"
    if _inside(home, workdir):
        what = "your home directory" if workdir == home else f"an ancestor of your home directory ({home})"
        return (f"the workdir {workdir} is {what}: the box could write ~/.local/bin, ~/.config/autostart or "
                f"hive relay's own config, which run on the host later; fix: {cd_fix}")
    for tree in SYSTEM_TREES:
        if _inside(workdir, tree) or _inside(tree, workdir):
            return f"the workdir {workdir} holds system files ({tree}) the host runs or trusts; fix: {cd_fix}"
    if workdir in PRIVATE_DIRS:
        return (f"the workdir {workdir} is a shared system directory the box keeps private; "
                f"fix: use a directory of its own, e.g. mkdir {workdir.rstrip('/')}/myproject")
    for tree in (config_home, *(os.path.join(home, t) for t in HOME_CODE_TREES)):
        if _inside(workdir, tree):
            return (f"the workdir {workdir} lies in {tree}, whose files run code or configure what runs on the "
                    f"host; fix: {cd_fix}")
    for path in path_dirs:
        if _inside(workdir, path):
            return (f"the workdir {workdir} lies in {path}, a directory on your PATH: a program the box puts "
                    f"there runs when you type its name; fix: {cd_fix}")
    for path in denied:
        if _inside(workdir, os.path.normpath(path)):
            return f"the workdir {workdir} lies in the deny-listed {path}; fix: {cd_fix}"
    for path in own:
        if _inside(workdir, os.path.normpath(path)):
            return f"the workdir {workdir} lies in hive relay's own {path}; fix: {cd_fix}"
    return None


def own_checkout_in(workdir: str, checkout: str | None) -> str | None:
    """hive relay's own checkout (a real path) when it lies in the workdir, else None.

    Everything at the top of our checkout is something our entries or tools load: `invoke` runs
    `tasks.py` and any `invoke.py`/`invoke.yaml` beside it, `pytest` every `conftest.py` and
    `pytest.ini` from the top down, `python -m relay` (cwd first on sys.path) any `yaml.py` there,
    and the README tells you to `source completions/`. A list of such names is never complete, so
    the checkout is read-only as a whole in the box: nothing in it can be changed and no new name
    can appear at its top (the staged workdir, issue 25, is the other way)."""
    if checkout and _inside(checkout, workdir):
        return checkout
    return None
