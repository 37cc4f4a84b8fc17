"""The host-side egress proxy: CONNECT and absolute-URI HTTP, pinned to an allowlist.

It accepts on a listening socket that lives in the box's network namespace (handed over by
the in-box init), so the box reaches exactly this proxy and nothing else. Allowed streams
are spliced byte for byte, unbuffered, so SSE and websockets flow as they are produced.
Every decision is one JSON line in the run's log.

What is allowed is not decided here: `egress.decide` judges each request, and this module only
wires the parts that do the I/O around it, each in a module of its own with one job:

- relay/egress/reactor.py: accept, the connection cap, out-of-descriptor answers, request heads
  and their deadlines, a worker per complete head;
- relay/egress/http_head.py: the strict HTTP/1.1 parser (heads, body framing);
- relay/egress/rulebook.py: the live rules, `--ask`, the open tunnels a live deny cuts (the one
  place where state is shared between threads, behind its lock);
- relay/egress/forward.py: connect, the CONNECT splice, one absolute-URI request and its answer;
- relay/egress/routes.py: credential routes (the real key added on the host, TLS re-originated),
  relay/egress/redact.py scrubbing it from the answer;
- relay/egress/secret_scan.py: the host's real secrets searched for in what the box sends in clear,
  and the decoded view (chunks, gzip) of a body that the scrub and the scan both read;
- relay/egress/answers.py: every refusal the proxy writes, one shape, one way to send it;
- relay/egress/decision_log.py, relay/egress/watch.py: the decision log and the stuck-host watch.

What stays here is one request's path through them (`_serve`): parse, judge, connect, and either
tunnel (after judging the tunnel's first TLS record) or forward.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Mapping

from relay.egress import tlspeek
from relay.egress.answers import new_reply, policy, refuse, reply_begins, reply_begun, unanswered
from relay.egress.decision_log import DecisionLog
from relay.egress.forward import connect, forward, refuse_scanned, request_scan, scanned_splice, splice
from relay.egress.http_head import HEAD_TIMEOUT, Body, RequestError, parse_head
from relay.egress.reactor import MAX_CONNECTIONS, Reactor
from relay.egress.routes import Routes
from relay.egress.rulebook import Resolver, RuleBook, decide, system_resolver, tls_required, within_rule
from relay.egress.secret_scan import HostSecrets, SecretFound, Unscannable
from relay.egress.watch import UpstreamWatch
from relay.model import refusal as denial
from relay.model.allow_rules import HostRule, find_rule, fmt_hostport
from relay.policy import egress
from relay.policy.egress import NOT_LISTED, Decision

TYPE_CHECKING = False
if TYPE_CHECKING:
    import ssl

    from relay.model.backend import CredentialRoute


def _stderr_line(line: str) -> None:
    """One line on the terminal's stderr, readable in a raw-mode TUI too (CR before and after)."""
    try:
        sys.stderr.write(("\r" if sys.stderr.isatty() else "") + line + ("\r\n" if sys.stderr.isatty() else "\n"))
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class EgressProxy:
    """Serve one box: accept on its listener, decide, connect, splice. Lives as long as the launcher.

    One reactor thread accepts and reads request heads for every connection (an idle connection
    costs a socket, not a thread); a complete head is handed to a worker thread. At most
    `max_connections` connections are open at once (reading a head or being served); past that a
    new connection gets 503 and is closed. CONNECT tunnels are spliced both ways; an absolute-URI
    request is parsed strictly and sent upstream alone, with `Connection: close`."""

    def __init__(
        self,
        listener: socket.socket,
        rules: tuple[HostRule, ...],
        log: DecisionLog,
        resolver: Resolver = system_resolver,
        hint: str = "",
        max_connections: int = MAX_CONNECTIONS,
        head_timeout: float = HEAD_TIMEOUT,
        notify: Callable[[str], None] | None = _stderr_line,
        watch: UpstreamWatch | None = None,
        routes: tuple[CredentialRoute, ...] = (),
        keys: Mapping[str, str | Callable[[], str]] | None = None,
        tls: ssl.SSLContext | None = None,
        origins: Mapping[HostRule, str] | None = None,
        run_id: str = "",
        control: socket.socket | None = None,
        ask: bool = False,
        secrets: HostSecrets | None = None,
        inspect: Mapping[tuple[str, int], tuple[str, str]] | None = None,
    ) -> None:
        self.log = log
        self.notify = notify
        self.watch = watch or UpstreamWatch(notify)
        self.book = RuleBook(rules, log, resolver, origins, run_id, ask, notify, hint)
        # The host's real secrets, searched for in every request the box sends in clear (secret_scan.py).
        self.secrets = secrets if secrets is not None else HostSecrets()
        self.router = Routes(routes, dict(keys or {}), self.book, log, self.watch, tls, self.secrets)
        # Inspected hosts (relay/egress/inspect.py): (host, port) -> the run CA's leaf (cert, key) for it.
        self.inspector = None
        if inspect:
            from relay.egress.inspect import Inspector  # ssl: only a run that inspects pays for it here

            self.inspector = Inspector(inspect)
        self.keys = self.router.keys  # the caller may add a login's store once `open_tls` can serve it
        self.reactor = Reactor(listener, log, self._serve, control, self.book.serve_control, max_connections,
                               head_timeout)

    @property
    def rules(self) -> tuple[HostRule, ...]:
        """The rules as they are now (`change_rules` replaces them)."""
        return self.book.rules

    @property
    def max_connections(self) -> int:
        return self.reactor.max_connections

    @property
    def open_connections(self) -> int:
        return self.reactor.open_connections

    def gave_up(self) -> str | None:
        """For the runner's wait loop: why a non-interactive run should end now (an allowed host keeps
        failing and nothing allowed answers), or None."""
        return self.watch.gave_up()

    def start(self) -> None:
        self.reactor.start()

    def stop(self) -> None:
        self.reactor.stop()
        self.book.close_watchers()
        self.reactor.join()
        self.log.close()

    def change_rules(self, op: str, entry: str, uid: int, question: str = "") -> dict:
        """`invoke allow|deny|ask` while the box runs (relay/egress/rulebook.py)."""
        return self.book.change_rules(op, entry, uid, question)

    def open_tls(self, host: str, port: int) -> ssl.SSLSocket:
        """A verified TLS connection to an allowed host, for a request the host side makes itself (a
        login's refresh): relay/egress/routes.py."""
        return self.router.open_tls(host, port)

    # Workers: one per connection being served.

    def _serve(self, client: socket.socket, head: bytes, rest: bytes) -> None:
        upstream = None
        tracked = None
        new_reply()
        where: tuple[str, int, str] = ("-", 0, head.split(b" ", 1)[0][:16].decode("latin-1"))
        try:
            try:
                req = parse_head(head[:-4])
                body = Body(req) if req.method != "CONNECT" else None
                first = body.feed(rest) if body is not None else rest
            except RequestError as err:
                self.log.record(Decision(False, err.host, err.port, f"bad request: {err}"), head.split(b" ", 1)[0][:16].decode("latin-1"))
                refuse(client, policy("400 Bad Request", err.host, err.port, str(err), "",
                                      denial.rule_fix("send CONNECT host:port or one plain http:// request per "
                                                      "connection, with a canonical host name")))
                return
            if req.origin:
                assert body is not None
                upstream = self.router.serve(client, req, body, first, head)
                return
            book = self.book
            host, port, method = req.host, req.port, req.method
            where = (host, port, method)
            decision = decide(book.rules, host, port, book.resolver)
            if not decision.allowed and book.ask and decision.reason in (NOT_LISTED, egress.IP_NOT_LISTED):
                answered, refused = book.put_question(host, port)
                if answered:
                    decision = decide(book.rules, host, port, book.resolver)  # judged by the rules now
                if refused and not decision.allowed:  # the answer was an allow the proxy could not make
                    decision = Decision(False, host, port, f"the live ask's allow was refused: {refused}")
            rule = find_rule(book.rules, host, port) if decision.allowed else None
            inspected = body is None and self.inspector is not None and (host, port) in self.inspector
            if rule is not None:  # the rule's own limits (httprules), judged before any connect
                decision = within_rule(rule, req, decision, inspected)
            scanned = None
            if decision.allowed and body is not None:  # before the connect: a secret in the head goes nowhere
                try:
                    scanned, first = request_scan(self.secrets, req, head, body, first)
                except (SecretFound, Unscannable) as err:
                    refuse_scanned(self.log, client, req, host, port, err, book.extras(decision, rule))
                    return
            if decision.allowed:
                upstream, cause, detail = connect(decision)
                if upstream is None:
                    decision = Decision(False, host, port, detail, unreachable=True, cause=cause)
                else:
                    self.watch.ok(host, port)
            if inspected and decision.allowed and upstream is not None and rule is not None:
                from relay.egress import inspect

                assert self.inspector is not None
                inspect.serve(self.log, self.inspector, self.router, self.secrets, client, upstream, decision, rule,
                              first, lambda c, u: book.track(c, u, host, port, method), book.untrack,
                              book.extras(decision, rule), self.notify)
                return
            peek = body is None and decision.allowed and rule is not None and tls_required(book.rules, host, port)
            if not peek:  # a tunnel that is peeked at is logged once its first flight is judged
                self.log.record(decision, method, book.extras(decision, rule))
            if not decision.allowed:
                self.router.refuse_decision(client, decision)
                return
            assert upstream is not None
            tracked = book.track(client, upstream, host, port, method)
            if body is None:
                reply_begins()
                client.sendall(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                plain = False
                if peek:
                    assert rule is not None
                    flight = self._first_flight(client, first, decision, rule)
                    if flight is None:
                        return
                    first, plain = flight
                if plain and self.secrets:  # plain HTTP in the tunnel: the box's requests pass the secret scan
                    scanned_splice(self.log, client, upstream, self.secrets, host, port, first, self.notify)
                    return
                if first:
                    upstream.sendall(first)
                splice(client, upstream)
                return
            assert req.head is not None
            forward(self.log, client, upstream, req, body, first, scanned=scanned)
        except Exception as err:  # noqa: BLE001 - one failed request must not leave its client unanswered
            if not reply_begun():  # whatever failed, the client sent a whole request and is owed an answer
                detail = getattr(err, "strerror", None) or str(err) or type(err).__name__
                unanswered(self.log, client, *where, f"the proxy failed to serve the request: {detail}",
                           header="Error")
            elif not isinstance(err, OSError):  # answered already, but a bug is not to pass unseen
                self.log.event({"host": where[0], "port": where[1], "method": where[2], "decision": "error",
                                "reason": f"the proxy failed while serving: {type(err).__name__}: {err}"})
        finally:
            self.book.untrack(tracked)
            self.reactor.close(client, upstream)

    def _first_flight(self, client: socket.socket, first: bytes, decision: Decision,
                      rule: HostRule) -> tuple[bytes, bool] | None:
        """Read the tunnel's first TLS record (relay/egress/tlspeek.py, bounded in time and size) and judge it:
        the bytes to forward unchanged and whether they are plain HTTP, or None when the tunnel was refused
        (`sni-mismatch`, or `opaque-tunnel` for bytes that are not TLS at all; the client told why, as far
        as it can hear)."""
        host, port = decision.host, decision.port
        data, hello = tlspeek.read_client_hello(client, first)
        if not data and hello.kind == "bad":  # closed before its first byte: nothing to judge or forward
            self.log.record(decision, "CONNECT", self.book.extras(decision, rule, sni="-", closed="before the first byte"))
            return None
        problem = tlspeek.sni_problem(hello, host)
        if hello.kind == "opaque" and hello.reason == "plain HTTP" and port != 443:
            # Plain HTTP to an HTTP port (Node 20's fetch through relay/box/nodeproxy.py tunnels http://):
            # what an absolute-URI request could send, but for its Host header, which this proxy
            # rewrites there and cannot here (the README says so). TLS's port 443 never takes it.
            self.log.record(decision, "CONNECT", self.book.extras(decision, rule, sni="-", inner="plain HTTP"))
            return data, True
        if not problem:
            self.log.record(decision, "CONNECT", self.book.extras(decision, rule, sni=hello.sni or "-"))
            return data, False
        label = "opaque-tunnel" if hello.kind == "opaque" else "sni-mismatch"
        refused = Decision(False, host, port, problem, label=label)
        self.log.record(refused, "CONNECT", {**(self.book.extras(refused, rule) or {}), "rule": rule.render()})
        target = fmt_hostport(host, port)
        fix = (denial.rule_fix(f"list it with ,tls=false (e.g. --allow-host {rule.render()},tls=false) if it is "
                               "not TLS on purpose") if label == "opaque-tunnel" else
               denial.rule_fix(f"CONNECT to the host the TLS names ({hello.sni or 'none'}) and allow that"))
        said = "hive-relay: refused " + denial.sentence(target, problem, rule.render(), fix)
        if self.notify is not None:
            self.notify(said)
        if hello.kind in ("tls", "bad") and data[:1] == b"\x16":
            answer = tlspeek.ALERT_ACCESS_DENIED  # a TLS client hears a fatal alert, not text
        elif hello.reason == "plain HTTP":
            answer = policy("403 Forbidden", host, port, problem, rule.render(), fix)
        else:
            answer = said.encode("ascii", "replace") + b"\r\n"
        refuse(client, answer, wait=False)
        return None

