"""`allow`, `deny` and `ask`: the live-approval commands a user types in a second terminal, speaking to a running box's control socket (relay/egress/control.py) as its client."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from relay.egress.control import open_control, pick, request, runtime_base
from relay.model.allow_rules import parse_rule
from relay.model.errors import RefusedError, RelayError, UsageError


def ask(run: str | None = None, env: Mapping[str, str] | None = None, answers=None) -> int:  # noqa: ANN001
    """`invoke ask [--run RUN]`: in a second terminal, answer the questions of a box started with --ask.
    Each denied host is asked once: `y` allows it as asked, an entry (`NAME:PORT=ADDR:PORT`) allows
    that instead, anything else refuses it; the box's request waits meanwhile (up to ASK_TIMEOUT)."""
    import sys

    answers = answers or sys.stdin
    target = pick(runtime_base(env if env is not None else os.environ), run)
    sock = open_control(target)
    with sock:
        sock.sendall(b'{"op": "watch"}\n')
        lines = sock.makefile("r", encoding="utf-8", errors="replace")
        sock.settimeout(None)
        if not json.loads(lines.readline() or "{}").get("ok"):
            raise RefusedError(f"run {target.run_id} does not take questions (was it started with --ask?)")
        print(f"hive-relay: answering run {target.run_id}'s egress questions (Ctrl-C to stop)", flush=True)
        for line in lines:
            try:
                host = str(json.loads(line)["ask"])
            except (ValueError, KeyError, TypeError):
                continue
            shown = "".join(c if c.isprintable() else "?" for c in host)[:300]
            print(f"hive-relay: run {target.run_id} asks for {shown} (not in the egress allowlist). Allow it? "
                  "[y/N, or an entry such as NAME:PORT=ADDR:PORT]", flush=True)
            answer = (answers.readline() or "").strip()
            entry = shown if answer.lower() in ("y", "yes") else answer if answer and answer.lower() not in ("n", "no") \
                else ""
            try:
                reply = request(target, "allow" if entry else "refuse", entry or shown, question=host)
            except RelayError as err:
                print(f"hive-relay: {err.message}", flush=True)
                continue
            print(f"hive-relay: {reply.get('message') or reply.get('error')}", flush=True)
    print(f"hive-relay: run {target.run_id} ended", flush=True)
    return 0


def change(op: str, entry: str, run: str | None = None, env: Mapping[str, str] | None = None) -> int:
    """`invoke allow|deny HOST[:PORT] [--run RUN]`: one line saying what changed, or one error line."""
    try:
        parse_rule(entry)  # a bad entry is the caller's error, reported before any run is looked for
    except UsageError as err:
        raise UsageError(f"{op} {err.message.removeprefix('--allow-host ')}") from None
    target = pick(runtime_base(env if env is not None else os.environ), run)
    reply = request(target, op, entry)
    if not reply.get("ok"):
        raise UsageError(f"run {target.run_id}: {reply.get('error', 'refused')}")
    print(f"hive-relay: run {target.run_id}: {reply.get('message', 'done')}")
    return 0
