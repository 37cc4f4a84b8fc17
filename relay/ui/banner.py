"""What the user sees on stderr: the launch banner, notes, and the exit summary."""

from __future__ import annotations

import sys

from relay.model.vocab import LoginHold, WorkdirMode
from relay.plan.resolve import Plan, login_opt_in


def human_size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def short_path(path: str, home: str) -> str:
    if home and home != "/" and (path == home or path.startswith(home.rstrip("/") + "/")):
        return "~" + path[len(home.rstrip("/")):]
    return path


def egress_summary(plan: Plan) -> str:
    if plan.proxy_listen is None:
        return "no network"
    if not plan.egress:
        return "egress: none (proxy refuses all)"
    shown = ", ".join(plan.egress[:2])
    more = len(plan.egress) - 2
    return f"egress {len(plan.egress)} host{'s' if len(plan.egress) != 1 else ''}: {shown}" + (f" +{more}" if more > 0 else "")


def banner_lines(plan: Plan, home: str) -> list[str]:
    if plan.unsandboxed:
        return [
            f"hive-relay: WARNING: {plan.backend} runs WITHOUT the hive relay box (opt-in set); "
            f"only its native sandbox applies: {' '.join(plan.argv)}",
        ]
    where = plan.mode if plan.mode == str(plan.tier) else f"{plan.mode} · {plan.tier}"  # not "container · container"
    if plan.vm is not None:  # the VM tier names its CPU: an emulated one is the same boundary, tens of times slower
        where += " (emulated: qemu TCG, no KVM)" if plan.vm.emulated else " (KVM)"
    first = (f"hive-relay: {plan.backend} · {where} · profile {plan.profile} "
             f"({plan.profile_digest}) · workdir {short_path(plan.workdir, home)} ({plan.workdir_mode})")
    second = (f"hive-relay: {egress_summary(plan)} · limits {human_size(plan.limits.memory)} mem, "
              f"{plan.limits.pids} procs via {plan.limits.method}")
    if plan.log_path:
        second += f" · log {short_path(plan.log_path, home)}"
    lines = [first, second]
    if plan.interactive and plan.credentials:  # what the box holds, per route: a short table, not a paragraph
        for r in plan.credentials:
            source = f"~/{r.login.file.removeprefix(home.rstrip('/') + '/')}" if r.login else \
                (next(iter(r.secret_env), "") or "a grant")
            lines.append(f"hive-relay: credential {r.name:<16} {source} -> {r.upstream_host}:{r.upstream_port}  "
                         "(the box holds a placeholder; the proxy adds the real one)")
    in_box = [u.file for u in plan.login_files if u.held == LoginHold.IN_BOX]
    if in_box:  # HIVE_RELAY_LOGIN_IN_BOX_<BACKEND>=1: said loudly, every launch
        lines.append(f"hive-relay: WARNING: login in the box as it is ({login_opt_in(plan.backend)}=1): "
                     + ", ".join(short_path(f, home) for f in in_box))
    if plan.sockets:  # --allow-socket: said loudly, every launch
        shown = ", ".join(f"{s.name} -> {s.box}" for s in plan.sockets)
        lines.append(f"hive-relay: WARNING: host sockets in this box (AF_UNIX allowed): {shown}")
    if plan.inspected_hosts:  # inspection is never silent: every launch says which hosts
        lines.append(f"hive-relay: TLS inspected (this run's CA, trusted in the box): {', '.join(plan.inspected_hosts)}")
    if plan.ssh:
        lines.append(f"hive-relay: ssh through the proxy to: {', '.join(plan.ssh)}")
    if plan.staged is not None:
        from relay.model.refusal import ENTRY

        lines.append(f"hive-relay: staged: the box's writes stay in {short_path(plan.staged.root, home)} until you "
                     f"apply them (`{short_path(ENTRY, home)} changes {plan.staged.run}`)")
    elif plan.workdir_mode == WorkdirMode.LIVE:
        lines.append("hive-relay: live: the box writes your checkout directly, and what it plants there runs when "
                     "you next build or commit (staged is the default: drop --live, or `workdir: live` in your config)")
    return lines


def note_lines(notes: tuple[str, ...] | list[str]) -> list[str]:
    return [f"hive-relay: note: {note}" for note in notes]


def emit(lines: list[str]) -> None:
    if lines:
        try:
            sys.stderr.write("\n".join(lines) + "\n")
            sys.stderr.flush()
        except OSError:
            pass
