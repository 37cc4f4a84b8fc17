"""The rule book: the live egress rules of one box, the open connections they let through, and `--ask`.

Its own part because three kinds of thread meet here: workers judge requests by the rules, the control
thread changes them (`invoke allow|deny|ask`), and a change must reach what is already open (a deny cuts
the tunnels it no longer allows). So everything that changes while the box runs lives here, behind one
small interface: the rules are one immutable tuple replaced in a single assignment (a request is judged
wholly by one version; writers take `_rules_lock`), and the open tunnels, the `--ask` questions and their
watchers, and the hosts already announced are guarded by `_lock`. Nothing else in the proxy is shared.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
from collections.abc import Callable, Mapping

from relay.egress.answers import policy, response
from relay.egress.http_head import Request
from relay.egress.watch import LIKELY
from relay.model import http_rules
from relay.model import refusal as denial
from relay.model.allow_rules import HostRule, find_rule, fmt_hostport
from relay.model.errors import UsageError
from relay.model.record import record
from relay.policy import egress
from relay.policy.egress import NOT_LISTED, Decision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from relay.egress.decision_log import DecisionLog
    from relay.model.backend import CredentialRoute

MAX_TOLD = 20  # denied hosts announced on the caller's terminal, one line each
ASK_TIMEOUT = 30.0  # --ask: how long a denied request waits for `invoke ask` to answer
Resolver = Callable[[str, int], list[str]]


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def decide(rules: tuple[HostRule, ...], host: str, port: int, resolver: Resolver) -> Decision:
    """`egress.decide` with the DNS lookup done: the resolver is asked only when the verdict depends
    on the name's addresses, and a failed lookup is an I/O outcome (unreachable, "cannot resolve")."""
    decision = egress.decide(rules, host, port)
    if not decision.needs_dns:
        return decision
    try:
        addrs = resolver(host, port)
    except (OSError, UnicodeError) as err:
        detail = getattr(err, "strerror", None) or str(err)
        return Decision(False, host, port, f"cannot resolve {host}: {detail}", unreachable=True, cause="cannot resolve")
    return egress.decide(rules, host, port, tuple(addrs))


@record
class _Tunnel:
    """An open upstream connection, with what it was allowed for and where it actually went."""

    client: socket.socket
    upstream: socket.socket
    host: str
    port: int
    peer: tuple[str, int]
    method: str
    route: CredentialRoute | None = None  # a credential route's request: judged by its route's rules


def tls_required(rules: tuple[HostRule, ...], host: str, port: int) -> bool:
    """Whether a tunnel to host:port must open with a TLS ClientHello naming it: unless some rule that
    covers it says `tls=false` (an `--allow-ssh` rule, whose pin may be another, more specific, rule)."""
    return not any(not rule.tls and rule.matches(host, port) for rule in rules)


def still_allowed(rules: tuple[HostRule, ...], host: str, port: int, peer: tuple[str, int]) -> bool:
    """Would `rules` let a connection for host:port go to `peer` (the address it is connected to)? The
    peer stands in for DNS (no lookup: the verdict is on where the bytes flow now), so a pin that changed,
    a rule removed, or an address that is now internal all say no."""
    decision = egress.decide(rules, host, port, (peer[0],))
    if not decision.allowed:
        return False
    try:
        want = ipaddress.ip_address(peer[0])
        return any(ipaddress.ip_address(addr) == want and p == peer[1] for addr, p in decision.addrs)
    except ValueError:
        return False


def within_rule(rule: HostRule, req: Request, decision: Decision, inspected: bool = False) -> Decision:
    """`decision` unless the request breaks its rule's methods/paths (relay/model/http_rules.py): then a
    refusal labelled `http-rule`. A CONNECT under a rule with such limits is refused (the proxy
    cannot see the request inside the tunnel), and so is an absolute-URI request whose path is
    not normalised, whatever the rule. An `inspected` CONNECT (relay/egress/inspect.py) is judged request
    by request inside, so its rule's limits do not refuse the tunnel."""
    host, port = decision.host, decision.port
    if req.method == "CONNECT":
        if (rule.methods or rule.paths) and not inspected:
            return Decision(False, host, port, f"rule {rule.render()} limits methods or paths, which a tunnel hides; "
                            "send plain http:// requests", label="http-rule")
        return decision
    why = http_rules.refusal(http_rules.from_rule(rule.methods, rule.paths), req.method, req.path)
    return Decision(False, host, port, why, label="http-rule") if why else decision


class RuleBook:
    """One box's rules as they are now, and everything that must follow when they change."""

    def __init__(self, rules: tuple[HostRule, ...], log: DecisionLog, resolver: Resolver = system_resolver,
                 origins: Mapping[HostRule, str] | None = None, run_id: str = "", ask: bool = False,
                 notify: Callable[[str], None] | None = None, hint: str = "") -> None:
        self.rules = rules  # replaced whole (under `_rules_lock`), read in one read, never mutated
        self.live: set[HostRule] = set()  # rules added by `invoke allow` while the box runs
        # Where a rule came from, for its decision lines: a preset's name (presets.origins), "live".
        self.origins = dict(origins or {})
        self.log = log
        self.resolver = resolver
        self.run_id = run_id
        self.ask = ask  # --ask: hold a denied request while `invoke ask` (a watcher) answers
        self.notify = notify
        self.hint = hint  # added to a refusal of a host no rule lists: how to allow it ({host} {port} {target} {run})
        self._rules_lock = threading.Lock()  # serializes writers; readers take `self.rules` in one read
        self._lock = threading.Lock()  # guards the collections below
        self._told: set[str] = set()  # host:port the caller was told about (the first denial of each)
        self._watchers: list[socket.socket] = []
        self._questions: dict[str, threading.Event] = {}
        self._refusals: dict[str, str] = {}  # question -> why its answer (an allow) was refused
        # Connections being served to an upstream (CONNECT tunnels and plain-HTTP forwards), so that a
        # live `deny` can cut those the new rules no longer allow. Guarded by `_lock`: a socket is
        # shut down only while it is listed, and unlisted before it is closed (no fd reuse race).
        self._tunnels: dict[int, _Tunnel] = {}

    def serve_control(self, conn: socket.socket) -> None:
        """One `invoke allow|deny|ask` connection (relay/egress/control.py), on the caller's thread."""
        from relay.egress import control

        control.serve(conn, self.change_rules, self.add_watcher if self.ask else None)

    def close_watchers(self) -> None:
        """The proxy stops: every `invoke ask` watching is let go, and every held question answered."""
        with self._lock:
            watchers, self._watchers = self._watchers, []
        for conn in watchers:
            conn.close()
        self.wake(None)

    def add_watcher(self, conn: socket.socket) -> None:
        """`invoke ask`'s connection, kept to put questions on (`put_question`)."""
        conn.settimeout(5.0)  # a watcher that does not read its questions is dropped, never waited on
        with self._lock:
            self._watchers.append(conn)

    def put_question(self, host: str, port: int) -> tuple[bool, str]:
        """--ask: put the question to the watchers (once per host while it is open) and wait for an answer
        (an allow, a deny or a refusal of it), at most ASK_TIMEOUT. (answered, why the answer, an allow,
        was refused: "" when it was not); False when nobody watches or answered."""
        target = fmt_hostport(host, port)
        with self._lock:
            if not self._watchers:
                return False, ""
            event = self._questions.get(target)
            fresh = event is None
            if event is None:
                event = self._questions[target] = threading.Event()
            watchers = list(self._watchers)
        if fresh:
            line = (json.dumps({"ask": target}) + "\n").encode()
            for conn in watchers:
                try:
                    conn.sendall(line)
                except OSError:
                    with self._lock:
                        if conn in self._watchers:
                            self._watchers.remove(conn)
                    conn.close()
            with self._lock:
                if not self._watchers:
                    self._questions.pop(target, None)
                    return False, ""
        answered = event.wait(ASK_TIMEOUT)
        with self._lock:
            if self._questions.get(target) is event:
                del self._questions[target]
            refused = self._refusals.pop(target, "") if answered else ""
        return answered, refused

    def wake(self, target: str | None) -> None:
        """Answer the open questions: all of them after an allow (any new rule may cover them), else one."""
        with self._lock:
            events = list(self._questions.values()) if target is None else [self._questions.get(target)]
        for event in events:
            if event is not None:
                event.set()

    def change_rules(self, op: str, entry: str, uid: int, question: str = "") -> dict:
        """Add (`allow`) or remove (`deny`) a rule while the box runs: the new tuple replaces the old
        in one assignment, so a request is judged wholly by one of them. Logged as a JSON line.
        `question`: the held --ask request this answers; an allow refused here releases it at once,
        its 403 saying why (rather than after ASK_TIMEOUT)."""
        reply = self._change_rules(op, entry, uid)
        if question and op == "allow" and not reply.get("ok"):
            self._refuse_question(question, str(reply.get("error", "refused")), uid)
        return reply

    def _refuse_question(self, question: str, error: str, uid: int) -> None:
        with self._lock:
            if question not in self._questions:
                return  # not held (any more): nothing to release
            self._refusals[question] = error
        host, _, port = question.rpartition(":")
        self.log.event({"host": host.strip("[]"), "port": int(port) if port.isdigit() else 0, "method": "REFUSE",
                        "decision": "live-refuse", "reason": f"the live ask by uid {uid}: the allow was refused: {error}"})
        self.wake(question)

    def _change_rules(self, op: str, entry: str, uid: int) -> dict:
        from relay.egress import control

        if op == "refuse":  # `invoke ask` said no: the held request gets its 403 now; the rules stay
            try:
                rule = control.parse_rule(entry)
            except UsageError as err:
                return {"ok": False, "error": err.message.removeprefix("--allow-host ")}
            self.wake(rule.target)
            self.log.event({"host": rule.name, "port": rule.port or 443, "method": "REFUSE", "decision": "live-refuse",
                            "reason": f"the live ask by uid {uid}: refused"})
            return {"ok": True, "message": f"refused {rule.target}"}
        if op == "allow":
            error = self._useless_allow(entry)
            if error:
                return {"ok": False, "error": error}
        with self._rules_lock:
            try:
                rules, rule, message = control.apply(self.rules, op, entry)
            except UsageError as err:
                return {"ok": False, "error": err.message.removeprefix("--allow-host ")}
            self.rules = rules
            if op == "allow":
                self.live.add(rule)
            else:
                self.live = {r for r in self.live if r.target != rule.target}
        host, port = rule.name if not rule.wildcard else "*." + rule.name, rule.port or 443
        self.log.event({"host": host, "port": port, "method": op.upper(), "decision": f"live-{op}",
                        "reason": f"invoke {op} by uid {uid}: {message}", "rule": rule.render()})
        cut = self.cut(rules)  # what is already open is judged by the new rules too
        if cut:
            message += f"; cut {cut} open connection{'s' if cut > 1 else ''} it no longer allows"
        with self._lock:
            self._told.discard(fmt_hostport(host, port))  # a later denial is announced again
        self.wake(None if op == "allow" else rule.target)
        return {"ok": True, "message": message, "rules": [r.render() for r in rules]}

    def _useless_allow(self, entry: str) -> str:
        """Why a live allow of an unpinned name would change nothing (the name resolves to an internal
        address, which an unpinned rule never reaches: the DNS-rebinding guard), with the pinned entry
        that does what was meant; "" when it would work, or cannot be told (a bad entry, a failed lookup:
        `apply` and the request's own decision report those). Asked with the proxy's own resolver."""
        from relay.egress import control
        from relay.model.allow_rules import is_internal_address, is_unspecified_target

        try:
            rule = control.parse_rule(entry)
        except UsageError:
            return ""
        if rule.pin_addr is not None or rule.is_ip or rule.wildcard:
            return ""
        port = rule.port or 443
        try:
            addrs = self.resolver(rule.name, port)
        except (OSError, UnicodeError):
            return ""
        internal = [a for a in addrs if is_internal_address(a)]
        if not internal:
            return ""
        pinnable = [a for a in internal if not is_unspecified_target(a)]
        fix = (f"fix: pin it to the address meant: {denial.ENTRY} allow {fmt_hostport(rule.name, port)}="
               f"{fmt_hostport(pinnable[0], port)} --run {self.run_id or 'RUN'}" if pinnable else
               "fix: pin it to a reachable address with NAME:PORT=ADDR:PORT")
        return (f"{rule.target} resolves to internal address {internal[0]}, which an unpinned name is never "
                f"connected to (DNS rebinding guard), so allowing it would still deny it; {fix}")

    def track(self, client: socket.socket, upstream: socket.socket, host: str, port: int, method: str,
               route: CredentialRoute | None = None) -> int | None:
        """List an allowed connection as open; then judge it by the rules as they are now, so that a deny
        swapped in while it connected (after it was judged, before it was listed) cuts it too."""
        try:
            peer = upstream.getpeername()[:2]
        except OSError:
            return None
        tunnel = _Tunnel(client, upstream, host, port, (peer[0], peer[1]), method, route)
        key = id(tunnel)
        with self._lock:
            self._tunnels[key] = tunnel
        self.cut(self.rules, (key,))
        return key

    def untrack(self, key: int | None) -> None:
        """The worker is done with a connection `track` listed (None: it was never listed)."""
        if key is not None:
            with self._lock:
                self._tunnels.pop(key, None)

    def cut(self, rules: tuple[HostRule, ...], keys: tuple[int, ...] | None = None) -> int:
        """Shut down every open connection (or those of `keys`) that `rules` no longer allow; each cut is
        a JSON line. The serving worker then sees both ends end, and closes them. Returns how many."""
        cut: list[_Tunnel] = []
        with self._lock:
            for key in list(self._tunnels) if keys is None else keys:
                tunnel = self._tunnels.get(key)
                if tunnel is None:
                    continue
                judged = egress.route_rules(rules, tunnel.route) if tunnel.route is not None else rules
                if still_allowed(judged, tunnel.host, tunnel.port, tunnel.peer):
                    continue
                del self._tunnels[key]  # listed no more: the worker's close cannot race this shutdown
                for sock in (tunnel.client, tunnel.upstream):
                    try:  # the fd itself (a TlsStream's `raw`): never the TLS layer, under its reader
                        socket.socket.shutdown(getattr(sock, "raw", sock), socket.SHUT_RDWR)
                    except OSError:
                        pass
                cut.append(tunnel)
        for tunnel in cut:
            self.log.event({"host": tunnel.host, "port": tunnel.port, "method": tunnel.method, "decision": "live-cut",
                            "reason": f"open connection to {fmt_hostport(*tunnel.peer)} cut: the rules no longer "
                                      "allow it"})
        return len(cut)

    def extras(self, decision: Decision, rule: HostRule | None, **extra: object) -> dict[str, object] | None:
        """A decision line's extras: where its rule came from (`origin`), the rule itself when it
        carries options (tls=false, methods, paths), and `extra`."""
        out: dict[str, object] = dict(self.origin(decision) or {})
        if rule is not None and rule.options():
            out["rule"] = rule.render()
        out.update(extra)
        return out or None

    def origin(self, decision: Decision) -> dict[str, str] | None:
        """`{"preset": NAME}` when the rule that allowed this came from a preset (or a live allow)."""
        if not (self.origins or self.live) or not (decision.allowed or decision.unreachable):
            return None
        rule = find_rule(self.rules, decision.host, decision.port)
        if rule is not None and rule in self.live:
            return {"live": "allow"}
        origin = self.origins.get(rule) if rule is not None else None
        return {"preset": origin} if origin else None

    def tell(self, target: str, reason: str) -> None:
        """The caller's terminal hears of the first denial of each host:port, with the command that
        allows it while the box runs (at most MAX_TOLD hosts; the rest are in the exit summary)."""
        with self._lock:
            if target in self._told or len(self._told) > MAX_TOLD or self.notify is None:
                return
            self._told.add(target)
            last = len(self._told) > MAX_TOLD
        if last:
            self.notify(f"hive-relay: more hosts denied; the exit summary and `{denial.ENTRY} logs --denied` list them")
        else:
            self.notify(f"hive-relay: egress denied {target} ({reason}); to allow it now: "
                        f"{denial.ENTRY} allow {target} --run {self.run_id or 'RUN'}")

    def refusal(self, decision: Decision) -> bytes:
        """The answer to a request the policy denied (403) or could not serve (502/504), with the reason
        and the fix; the caller's terminal hears of the first denial of each host (`tell`)."""
        host, port = decision.host, decision.port
        target = fmt_hostport(host, port)
        if decision.unreachable:
            status = "504 Gateway Timeout" if decision.cause == "timed out" else "502 Bad Gateway"
            return response(status, host, port, decision.reason,
                            f"{host}:{port} is allowed, but this machine cannot reach it: "
                            f"{LIKELY.get(decision.cause, LIKELY['failed'])}", header="Unreachable")
        hint = ""
        rule = find_rule(self.rules, host, port)
        fix = denial.allow_fix(target, self.run_id)
        if decision.reason in (NOT_LISTED, egress.IP_NOT_LISTED):
            hint = self.hint.format(host=host, port=port, target=target, run=self.run_id or "RUN")
            self.tell(target, decision.reason)
        elif decision.label == "http-rule":
            fix = denial.rule_fix("widen the rule's ,method= / ,path= options in your config or --allow-host")
        elif decision.reason.startswith("resolves to internal address"):
            fix = f"to reach it on purpose, pin it: {denial.ENTRY} allow {target}=ADDR:{port} --run {self.run_id or 'RUN'}"
        return policy("403 Forbidden", host, port, decision.reason, rule.render() if rule else "", fix, hint)
