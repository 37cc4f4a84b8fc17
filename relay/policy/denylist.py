"""The deny list: what no box may read (secrets, host sockets) or write (hooks that run later).

`bin/denylist.sh` carries a POSIX-shell copy of these lists; the bats parity tests expand
both for the same HOME, USER and backend and fail on any difference, so edit them together.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # avoids importing typing at launch
if TYPE_CHECKING:
    from relay.model.fs_view import FsView

# Secrets under $HOME: hidden even when a grant covers them.
SECRET_HOME = (
    "~/.ssh", "~/.gnupg", "~/.aws", "~/.azure", "~/.config/gcloud", "~/.kube", "~/.docker",
    "~/.config/gh", "~/.git-credentials", "~/.netrc", "~/.npmrc", "~/.pypirc",
    "~/.cargo/credentials", "~/.cargo/credentials.toml", "~/.password-store",
    "~/.local/share/keyrings",
)
# Host secrets and daemon sockets outside $HOME: a root caller's box maps to uid 0 without
# capabilities, and uid 0 still passes owner permission checks on these files.
SECRET_SYSTEM = (
    "/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers",
    "/etc/sudoers.d", "/etc/ssh/ssh_host_rsa_key", "/etc/ssh/ssh_host_ecdsa_key",
    "/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_dsa_key",
    "/run/user/{uid}", "/run/docker.sock", "/var/run/docker.sock", "/run/podman",
    "/var/run/podman", "/run/containerd",
)
# Inside the workdir: write-protected, because the host runs them later (hooks, rc files,
# editor tasks, agent settings that can declare hooks or MCP servers). The `.git/` entries only
# matter where the workdir has no git dir (they mask `.git`, so none is created) or for the process
# tier; a git dir that exists is private and allowlisted instead (relay/trust/gitdir.py). Below the top level,
# agent config is moved aside at exit instead (relay/trust/workdir_aside.py).
PROTECT_WORKDIR = (
    ".git/hooks", ".git/config", ".bashrc", ".bash_profile", ".profile", ".zshrc", ".zshenv",
    ".zprofile", ".envrc", ".vscode", ".idea", ".mcp.json", ".claude/commands",
    ".claude/agents", ".claude/hooks", ".claude/settings.json", ".claude/settings.local.json",
    ".gemini/settings.json", ".codex/config.toml", ".claude/skills", ".claude/rules", ".claude/output-styles",
    "opencode.json", "opencode.jsonc",
)


def expand(entry: str, home: str, uid: int) -> str:
    """`~/x` → HOME/x and `{uid}` → the caller's uid; absolute paths stay as they are."""
    entry = entry.replace("{uid}", str(uid))
    if entry.startswith("~/"):
        return os.path.join(home, entry[2:])
    return entry


def secret_paths(home: str, uid: int, extra: tuple[str, ...], ssh_auth_sock: str | None) -> list[str]:
    """All hidden paths for one backend, in a stable order, without duplicates."""
    paths = [expand(e, home, uid) for e in SECRET_HOME + SECRET_SYSTEM + extra]
    if ssh_auth_sock and ssh_auth_sock.startswith("/"):
        paths.append(ssh_auth_sock)
    return list(dict.fromkeys(os.path.normpath(p) for p in paths))


def protected_paths(workdir: str) -> list[str]:
    return [os.path.join(workdir, rel) for rel in PROTECT_WORKDIR]


def nested_git_paths(workdir: str, fs: FsView) -> list[str]:
    """Hooks and config of existing submodules and linked worktrees under .git: they run on the host
    too. Superseded in bwrap and container boxes by the private git dir (relay/trust/gitdir.py): where
    that exists, every protected path under `.git` is dropped from the plan.
    (A repo the agent creates from scratch is not protected; see docs/threat-model.md.)
    The walk is os.walk's (top-down, links listed but not entered), through the planner's FsView."""
    found: list[str] = []
    git = os.path.join(workdir, ".git")
    for sub in ("modules", "worktrees"):
        base = os.path.join(git, sub)
        if fs.kind(base) != "dir":
            continue
        stack = [base]
        while stack:
            root = stack.pop()
            names = fs.listdir(root)
            dirs = [n for n in names if fs.kind(os.path.join(root, n)) == "dir"]
            files = [n for n in names if n not in dirs]
            if "objects" in dirs:
                dirs.remove("objects")
            if os.path.basename(root) != sub and ("HEAD" in files or "config" in files or "commondir" in files):
                found += [os.path.join(root, "hooks"), os.path.join(root, "config"),
                          os.path.join(root, "config.worktree")]
            if len(found) > 3000:
                return found
            stack += reversed([p for p in (os.path.join(root, d) for d in dirs) if fs.lkind(p) != "link"])
    return found
