"""Opt-ins that carry the caller's agents into the box: `--allow-socket` and `--allow-ssh`.

The box denies `socket(AF_UNIX)` because a connectable host socket (docker, dbus, an agent) is a
way out of every other rule. `--allow-socket NAME|PATH` names exactly one host socket: it is bound
(the socket file alone, never the directory around it) at a box-private path, and only that box's
filter lets AF_UNIX sockets be created. The box keeps its own network namespace (abstract sockets
stay scoped to it), its private /tmp, /run and $HOME, and the deny list: every other host socket
stays out of sight.

`--allow-ssh HOST` lets ssh reach HOST:22 through the egress proxy: an allowlist rule for that
one port, and a GIT_SSH_COMMAND whose ProxyCommand speaks HTTP CONNECT to the box's proxy
listener over TCP (bash's /dev/tcp: no nc, socat or AF_UNIX needed, and it exists in both the
local box and the container image).

Pure: the host is read through the planner's FsView only (tests/test_plan_golden.py).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence

from relay.model.allow_rules import HostRule, is_loopback, normalize_host
from relay.model.errors import RefusedError, UsageError
from relay.model.record import record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from relay.model.fs_view import FsView

BOX_SOCKET_DIR = "/run/hive-relay/sockets"
SSH_AGENT_BOX = f"{BOX_SOCKET_DIR}/ssh-agent"
NAMES = ("ssh-agent", "gpg-agent")
SSH_PORT = 22
CONNECT_ENV = "HIVE_RELAY_SSH_CONNECT"


@record
class BoxSocket:
    """One host socket bound into the box: what the user named, the host file, where the box sees it."""

    name: str
    host: str
    box: str


def resolve_sockets(requested: Sequence[str], env: Mapping[str, str], home: str, uid: int,
                    fs: FsView) -> tuple[BoxSocket, ...]:
    """Each `--allow-socket` value as a checked BoxSocket; a bad one raises with its fix."""
    out: dict[str, BoxSocket] = {}
    for value in requested:
        sock = _one(value, env, home, uid, fs)
        out.setdefault(sock.host, sock)
    return tuple(out.values())


def _one(value: str, env: Mapping[str, str], home: str, uid: int, fs: FsView) -> BoxSocket:
    agent = env.get("SSH_AUTH_SOCK") or ""
    if value.startswith("/") and agent.startswith("/") and os.path.normpath(value) == os.path.normpath(agent):
        value = "ssh-agent"  # the caller's agent by its path: the same as naming it (SSH_AUTH_SOCK is set)
    if value == "ssh-agent":
        path = agent
        if not path.startswith("/"):
            raise UsageError("--allow-socket ssh-agent: SSH_AUTH_SOCK is not set to an absolute path, so there is no "
                             "agent to share; fix: start one (eval \"$(ssh-agent)\" && ssh-add) or pass its PATH")
        return BoxSocket(value, _checked(value, path, uid, fs), SSH_AGENT_BOX)
    if value == "gpg-agent":
        path = _gpg_socket(env, home, uid, fs) + ".extra"
        if fs.lstat(path) is None:
            raise UsageError(f"--allow-socket gpg-agent: the agent has no restricted socket {path} (its "
                             "`extra-socket` is off); fix: remove `extra-socket` from gpg-agent.conf and restart it "
                             "(gpgconf --kill gpg-agent), or pass the full socket's PATH to accept key export")
        # The agent's restricted socket, made for forwarding to a host you do not trust: it signs and
        # decrypts but refuses key export, key listing and passphrase presets (its standard socket would
        # hand the box every private key: KEYWRAP_KEY --export, then EXPORT_KEY). gpg finds its agent by
        # path only: in the box (no /run/user/UID, no GNUPGHOME) that is ~/.gnupg/S.gpg-agent, in the
        # box's own home: the socket alone, none of the keyrings.
        return BoxSocket(value, _checked(value, path, uid, fs), os.path.join(home, ".gnupg", "S.gpg-agent"))
    if not value.startswith("/"):
        raise UsageError(f"--allow-socket {value!r}: expected ssh-agent, gpg-agent or an absolute PATH to a socket; "
                         "fix: e.g. --allow-socket ssh-agent")
    path = os.path.normpath(value)
    return BoxSocket(path, _checked(value, path, uid, fs), path)


def _gpg_socket(env: Mapping[str, str], home: str, uid: int, fs: FsView) -> str:
    """Where gpg's standard socket is (what `gpgconf --list-dirs agent-socket` prints for the default
    GNUPGHOME): /run/user/UID/gnupg/S.gpg-agent when that exists, else GNUPGHOME/S.gpg-agent."""
    gnupghome = env.get("GNUPGHOME") or os.path.join(home, ".gnupg")
    candidates = [os.path.join(gnupghome, "S.gpg-agent")]
    if not env.get("GNUPGHOME"):
        candidates.insert(0, f"/run/user/{uid}/gnupg/S.gpg-agent")
    for path in candidates:
        if fs.lstat(path) is not None:
            return path
    raise UsageError(f"--allow-socket gpg-agent: no agent socket at {' or '.join(candidates)}; fix: start it "
                     "(gpgconf --launch gpg-agent) or pass the PATH `gpgconf --list-dirs agent-socket` prints")


def _checked(value: str, path: str, uid: int, fs: FsView) -> str:
    """`path` with its directories resolved, if its last component is a socket (not followed) owned
    by the caller; otherwise one line naming what is wrong."""
    real = os.path.join(fs.realpath(os.path.dirname(path)), os.path.basename(path))
    found = fs.lstat(real)
    where = f"--allow-socket {value}" + (f" ({path})" if value != path else "")
    if found is None:
        raise UsageError(f"{where}: no such socket; fix: check the path (is the agent running?)")
    kind, owner = found
    if kind == "link":
        raise UsageError(f"{where}: is a symbolic link, which is never followed; fix: pass the socket's own path")
    if kind != "socket":
        raise UsageError(f"{where}: is a {kind}, not a socket; fix: pass the path of a Unix socket")
    if owner != uid:
        raise RefusedError(f"{where}: owned by uid {owner}, not by you (uid {uid}); only your own sockets can "
                           "enter the box; fix: pass a socket you own")
    return real


# Where daemons keep sockets outside /run and /tmp (both private to the box already): other users'
# homes, /srv, /mnt, /media and /var (podman's conmon attach sockets under /var/lib/containers,
# postfix's under /var/spool, lxd's under /var/snap). Once AF_UNIX is allowed they are hidden behind an
# empty tmpfs, so a socket made there after the plan is out of sight too. /var/cache stays (the agent
# CLIs live there); the workdir, grants and tool dirs are bound back on top as usual.
SOCKET_HOMES = ("/home", "/root", "/srv", "/mnt", "/media")
VAR_KEPT = frozenset({"cache", "tmp"})


def socket_homes(fs: FsView) -> tuple[str, ...]:
    """The host dirs the box stops seeing when it may create AF_UNIX sockets (real dirs only: a link
    such as /var/run points into a dir the box already has privately)."""
    found = [d for d in SOCKET_HOMES if fs.lkind(d) == "dir"]
    found += [f"/var/{n}" for n in sorted(fs.listdir("/var")) if n not in VAR_KEPT and fs.lkind(f"/var/{n}") == "dir"]
    return tuple(found)


def parse_ssh_hosts(values: Sequence[str]) -> tuple[HostRule, ...]:
    """`--allow-ssh HOST[:PORT]` as egress rules for that port (22 unless given)."""
    rules = []
    for value in values:
        host, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
        try:
            name = normalize_host(host)
        except ValueError:
            raise UsageError(f"--allow-ssh {value!r}: not a host name; fix: e.g. --allow-ssh github.com") from None
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise UsageError(f"--allow-ssh {value!r}: port {port!r} must be a number from 1 to 65535")
        if is_loopback(name):
            # As --allow-host: the host's own loopback only through a named pin, never by its bare address
            # (ssh goes through the proxy, so 127.0.0.1 here would reach any service listening on the host).
            shown = port or SSH_PORT
            raise UsageError(f"--allow-ssh {value!r}: {name} is this host's loopback; fix: give it a name and pin it, "
                             f"e.g. --allow-ssh hostsvc.test:{shown} --allow-host hostsvc.test:{shown}=127.0.0.1:{shown}")
        rules.append(HostRule(name, int(port) if port else SSH_PORT, tls=False))  # ssh is not TLS
    return tuple(dict.fromkeys(rules))


# The ProxyCommand: CONNECT through the box's proxy over TCP, report a refusal in one line, then copy
# both ways. bash's `read` takes a socket byte by byte, so nothing after the header is swallowed.
_CONNECT = r"""exec 3<>/dev/tcp/ADDR/PORT || exit 1
printf 'CONNECT '"$1:$2"' HTTP/1.1\r\nHost: '"$1:$2"'\r\n\r\n' >&3
IFS= read -r status <&3
why=
while IFS= read -r line <&3; do
  line=${line/$'\r'/}
  case $line in '') break;; [Xx]-[Hh]ive-[Rr]elay-*) why=${line#*: };; esac
done
case $status in
  'HTTP/1.'?' 200'*) ;;
  *) echo "hive-relay: ssh to $1:$2 refused by the egress proxy: ${why:-$status}; fix: --allow-ssh $1" >&2
     exit 1;;
esac
cat <&3 &
trap 'kill $! 2>/dev/null' EXIT HUP TERM
cat >&3"""


def connect_script(listen: str) -> str:
    """The ProxyCommand's bash script for the box's proxy listener `listen` (ADDR:PORT); the box
    gets it in HIVE_RELAY_SSH_CONNECT, so ssh's %-expansion never sees it."""
    addr, _, port = listen.rpartition(":")
    return _CONNECT.replace("ADDR", addr).replace("PORT", port, 1)


def ssh_command() -> str:
    """GIT_SSH_COMMAND for the box: ssh through the proxy. The box has no known_hosts of yours
    (~/.ssh stays hidden), so a host key is accepted on first use into the box's private home."""
    return shlex.join(["ssh", "-o", f'ProxyCommand=/bin/bash -c "${CONNECT_ENV}" hive-relay-ssh %h %p',
                       "-o", "StrictHostKeyChecking=accept-new"])
