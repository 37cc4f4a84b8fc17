"""The Python deny list, one path per line, for the bats parity test against bin/denylist.sh
(tests/bats/parity.bats): the shell copy and relay/policy/denylist.py must expand to the same paths."""

from __future__ import annotations

from relay.policy import denylist


def main(argv: list[str]) -> int:
    """`python -m relay.commands.denylist_cli secrets HOME UID BACKEND [SOCK]` / `protected WORKDIR`: one path per
    line, for the bats parity test against bin/denylist.sh."""
    if argv[:1] == ["secrets"] and len(argv) in (4, 5):
        from relay.config.load import load_shipped

        home, uid, backend = argv[1], int(argv[2]), argv[3]
        extra = load_shipped()[backend].deny
        print("\n".join(denylist.secret_paths(home.rstrip("/") or "/", uid, extra, argv[4] if len(argv) == 5 else None)))
        return 0
    if argv[:1] == ["protected"] and len(argv) == 2:
        print("\n".join(denylist.protected_paths(argv[1].rstrip("/"))))
        return 0
    print("usage: python -m relay.commands.denylist_cli secrets HOME UID BACKEND [SSH_AUTH_SOCK] | protected WORKDIR")
    return 2


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
