"""A host that exists only in memory, for proving the planner pure.

`MemFs` answers every FsView question from dicts; `no_host_io()` makes the real host's file
calls raise while resolve() runs, so a plan built under it was built from the fakes alone.
"""

from __future__ import annotations

import builtins
import io
import os
import posixpath
import resource
import shutil
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from relay.model.fs_view import FsView


class HostTouched(BaseException):
    """Raised by a patched host call: a BaseException, so no `except OSError`/`Exception` hides it."""


@dataclass
class MemFs(FsView):
    """A filesystem of plain data: files (path -> bytes), dirs, symbolic links (path -> target)
    and the set of executable files. Parents of every entry are directories."""

    files: dict[str, bytes] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/"})
    links: dict[str, str] = field(default_factory=dict)
    executables: set[str] = field(default_factory=set)
    sockets: dict[str, int] = field(default_factory=dict)  # path -> owner uid (for --allow-socket)

    @classmethod
    def build(cls, *, dirs: Iterable[str] = (), files: Mapping[str, bytes | str] | Iterable[str] = (),
              links: Mapping[str, str] | None = None, executables: Iterable[str] = (),
              sockets: Mapping[str, int] | None = None) -> MemFs:
        fs = cls()
        fs.sockets = dict(sockets or {})
        for path in fs.sockets:
            fs.files.setdefault(path, b"")  # kind() sees a socket as a file, as os.stat does
        items = files.items() if isinstance(files, Mapping) else ((f, b"") for f in files)
        for path, data in items:
            fs.files[path] = data.encode() if isinstance(data, str) else data
        fs.executables = set(executables)
        for path in fs.executables:
            fs.files.setdefault(path, b"#!/bin/sh\n")
        fs.links = dict(links or {})
        fs.dirs |= set(dirs)
        for path in [*fs.files, *fs.dirs, *fs.links]:
            parent = posixpath.dirname(path)
            while parent not in fs.dirs:
                fs.dirs.add(parent)
                parent = posixpath.dirname(parent)
        return fs

    def _resolve(self, path: str, follow_last: bool = True, depth: int = 0) -> str:
        assert path.startswith("/"), f"the planner asked about a relative path: {path!r}"
        if depth > 40:
            return path
        parts = [p for p in posixpath.normpath(path).split("/") if p]
        current = "/"
        for i, part in enumerate(parts):
            nxt = posixpath.join(current, part)
            last = i == len(parts) - 1
            if nxt in self.links and (follow_last or not last):
                target = posixpath.join(current, self.links[nxt])
                nxt = self._resolve(target, True, depth + 1)
            current = nxt
        return current

    def realpath(self, path: str) -> str:
        return self._resolve(path)

    def _kind_at(self, real: str) -> str:
        if real in self.links:
            return "link"
        if real in self.dirs:
            return "dir"
        return "file" if real in self.files else "missing"

    def kind(self, path: str) -> str:
        found = self._kind_at(self._resolve(path))
        return "missing" if found == "link" else found  # a dangling link

    def lkind(self, path: str) -> str:
        return self._kind_at(self._resolve(path, follow_last=False))

    def is_symlink(self, path: str) -> bool:
        return self.lkind(path) == "link"

    def lstat(self, path: str) -> tuple[str, int] | None:
        real = self._resolve(path, follow_last=False)
        if real in self.sockets:
            return "socket", self.sockets[real]
        kind = self._kind_at(real)
        return None if kind == "missing" else (kind, 0)

    def readlink(self, path: str) -> str | None:
        return self.links.get(self._resolve(path, follow_last=False))

    def listdir(self, path: str) -> list[str]:
        real = self._resolve(path)
        if real not in self.dirs:
            return []
        return sorted({posixpath.basename(p) for p in [*self.files, *self.dirs, *self.links]
                       if p != "/" and posixpath.dirname(p) == real})

    def read_bounded(self, path: str, limit: int) -> bytes | None:
        real = self._resolve(path, follow_last=False)
        data = self.files.get(real) if real not in self.links else None
        return None if data is None or len(data) > limit else data

    def which(self, name: str, path: str) -> str | None:
        candidates = [name] if "/" in name else [posixpath.join(d, name) for d in path.split(":") if d]
        for candidate in candidates:
            if self.kind(candidate) == "file" and self._resolve(candidate) in self.executables:
                return candidate
        return None


# Every way the planner could reach the real host's files, by module and name.
HOST_CALLS = ((builtins, "open"), (io, "open"), (os, "open"), (os, "stat"), (os, "lstat"), (os, "listdir"),
              (os, "scandir"), (os, "walk"), (os, "readlink"), (os, "access"), (os, "getcwd"),
              (os.path, "realpath"), (os.path, "exists"), (os.path, "isdir"), (os.path, "isfile"),
              (os.path, "islink"), (os.path, "expanduser"), (shutil, "which"), (resource, "getrlimit"))


@contextmanager
def no_host_io() -> Iterator[list[str]]:
    """Make every host file call raise HostTouched; yields the list of calls that were attempted."""
    attempted: list[str] = []
    saved = [(mod, name, getattr(mod, name)) for mod, name in HOST_CALLS]

    def refuse(label: str):  # noqa: ANN202 - a stand-in for any signature
        def call(*args: object, **kw: object) -> None:
            attempted.append(f"{label}{args!r}")
            raise HostTouched(f"{label}{args!r}")
        return call

    for mod, name, _ in saved:
        setattr(mod, name, refuse(f"{getattr(mod, '__name__', mod)}.{name}"))
    try:
        yield attempted
    finally:
        for mod, name, original in saved:
            setattr(mod, name, original)


# The fake host of the golden tests (tests/test_plan_golden.py, tests/test_argv_golden.py).
HOME = "/home/u"
WORKDIR = "/home/u/src/proj"
TOOLS = "/opt/hive-relay/.cache/npm"


def fake_host() -> MemFs:
    """A user's machine: a checkout with a git dir (and a submodule's), agent state dirs, secrets,
    toolchains, and the agent CLIs in hive relay's tool dir (gemini's not installed yet)."""
    return MemFs.build(
        dirs=["/bin", "/etc", "/usr/bin", "/usr/local/bin", "/lib", "/opt", "/proc", "/dev", "/sys", "/tmp",
              "/var/tmp", "/run/user/1000", f"{HOME}/.ssh", f"{HOME}/.claude/projects", f"{HOME}/.codex/sessions",
              f"{HOME}/.gemini", f"{HOME}/.config/opencode", f"{HOME}/.local/share/opencode",
              f"{HOME}/.cargo/bin", f"{HOME}/.local/bin", f"{WORKDIR}/.git/objects", f"{WORKDIR}/.git/refs/heads",
              f"{WORKDIR}/.git/hooks", f"{WORKDIR}/.git/modules/lib/objects", f"{WORKDIR}/.vscode", "/etc/sudoers.d"],
        files={
            f"{HOME}/.ssh/id_ed25519": "secret", f"{HOME}/.gitconfig": "[user]\n", f"{HOME}/.bashrc": "",
            f"{HOME}/.claude.json": "{}", f"{HOME}/.claude/settings.json": "{}", f"{HOME}/.codex/config.toml": "",
            f"{HOME}/.npmrc": "//registry/:_authToken=x", "/etc/shadow": "", "/etc/os-release": "ID=debian\n",
            f"{WORKDIR}/.git/HEAD": "ref: refs/heads/main\n", f"{WORKDIR}/.git/config": "[core]\n",
            f"{WORKDIR}/.git/hooks/pre-commit.sample": "", f"{WORKDIR}/.git/modules/lib/HEAD": "ref: x\n",
            f"{WORKDIR}/.git/modules/lib/config": "", f"{WORKDIR}/.envrc": "", f"{WORKDIR}/README.md": "hi\n",
            f"{WORKDIR}/.vscode/tasks.json": "{}",
        },
        links={f"{HOME}/.config/git": "../.gitconfig-dir", "/bin/sh": "dash"},
        executables=["/bin/bash", "/bin/dash", "/usr/bin/bwrap", "/usr/bin/podman", "/usr/bin/python3",
                     *(f"{TOOLS}/node_modules/.bin/{cli}" for cli in ("claude", "codex", "opencode"))],
        sockets={"/run/user/1000/ssh-agent.sock": 1000},  # the caller's ssh-agent ($SSH_AUTH_SOCK)
    )
