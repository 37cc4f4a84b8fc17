"""Credential routes: a box's CLI talks plain HTTP to `http://127.0.0.1:3128/<route>/...` as if the proxy
were its API, and the proxy re-originates the request over TLS to the route's one upstream, with the
real key the box never sees.

Its own part because it is the only place a secret enters the traffic: the key is read (or a login
refreshed) here, written only into the head for the route's own upstream, over TLS verified for
that name, and scrubbed from the answer (relay/egress/redact.py). The host's own login refreshes
reach their token endpoint through here too (`open_tls`), under the same rules and log.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from relay.egress.answers import policy, refuse, response
from relay.egress.forward import CONNECT_TIMEOUT, connect, forward, refuse_scanned, relay_response, request_scan
from relay.egress.http_head import Body, Request, route_head
from relay.egress.redact import Redactor
from relay.egress.rulebook import RuleBook, decide
from relay.egress.secret_scan import HostSecrets, SecretFound, Unscannable
from relay.model import http_rules
from relay.model import refusal as denial
from relay.model.allow_rules import HostRule
from relay.model.record import replace
from relay.policy import egress
from relay.policy.egress import Decision

TYPE_CHECKING = False
if TYPE_CHECKING:
    import ssl  # at run time only when a credential route is used (importing it costs ~5 ms per launch)

    from relay.egress.decision_log import DecisionLog
    from relay.egress.tls_stream import TlsStream
    from relay.egress.watch import UpstreamWatch
    from relay.model.backend import CredentialRoute


class Routes:
    """One box's credential routes and their keys. `keys` is the caller's to fill in (a login's store is
    added once the proxy can open its refresh connection); a key is only ever written into its own
    route's upstream head."""

    def __init__(self, routes: tuple[CredentialRoute, ...], keys: dict[str, str | Callable[[], str]],
                 book: RuleBook, log: DecisionLog, watch: UpstreamWatch, tls: ssl.SSLContext | None = None,
                 secrets: HostSecrets | None = None) -> None:
        self.routes = routes
        self.keys = keys  # route name -> its key; only ever written into that route's upstream head
        self.book = book
        self.log = log
        self.watch = watch
        self.tls = tls
        self.secrets = secrets if secrets is not None else HostSecrets()

    def refuse_decision(self, client: socket.socket, decision: Decision) -> None:
        """Answer a request the policy denied (403) or could not serve (502/504): a plain request's or a
        route's. An unreachable upstream counts towards the stuck-host watch."""
        if decision.unreachable:
            self.watch.failed(decision.host, decision.port, decision.cause)
        refuse(client, self.book.refusal(decision))

    def serve(self, client: socket.socket, req: Request, body: Body, first: bytes, said: bytes = b"") -> socket.socket | None:
        """An origin-form request to `/<route>/...`: to the route's one upstream (as the egress policy
        pins it), over TLS verified for that name, with the client's credential headers replaced by the
        real key; the response streamed back. Returns the upstream socket (closed by the caller).
        What the box sent (`said`, the head as it came, and the body) passes the secret scan before the
        key is read: the box's placeholder is fine to send, a real host secret is not."""
        match = egress.match_route(self.routes, req.path)
        if match.route is None:
            self.log.record(Decision(False, "-", 0, f"bad request: {match.reason}"), req.method)
            refuse(client, response("404 Not Found", "-", 0, match.reason,
                                    "Plain-HTTP requests to the proxy go to a credential route, /ROUTE/path."))
            return None
        route = match.route
        host, port = route.upstream_host, route.upstream_port
        extra: dict[str, object] = {"route": route.name, "path": match.path.partition("?")[0][:200]}
        if route.grant:
            extra["grant"] = True
        if req.method not in egress.ROUTE_METHODS:
            reason = f"method {req.method} is not carried on a credential route (it could echo the key back)"
            self.log.record(Decision(False, host, port, reason), req.method, extra)
            refuse(client, response("405 Method Not Allowed", host, port, reason,
                                    f"Use one of {', '.join(sorted(egress.ROUTE_METHODS))}."))
            return None
        limits = route.http_rules()
        why = http_rules.refusal(limits, req.method, match.path)
        if why:  # the route's own methods/paths, git's push (relay/model/http_rules.py): before the key is read
            refused = Decision(False, host, port, why, label="http-rule")
            self.log.record(refused, req.method, {**extra, "rule": f"/{route.name}: {limits.describe()}"})
            refuse(client, policy("403 Forbidden", host, port, why, f"/{route.name}: {limits.describe()}",
                                  denial.rule_fix(f"widen {'auth' if route.grant else 'credentials'}.{route.name}'s "
                                                  "methods/paths (or push: true) in your user config")))
            return None
        try:
            scanned, first = request_scan(self.secrets, req, said, body, first)
        except (SecretFound, Unscannable) as err:
            refuse_scanned(self.log, client, req, host, port, err, extra)
            return None
        key = self.keys.get(route.name)
        try:
            if callable(key):  # a login's token (logins.LoginStore): read, and refreshed, on the host
                key = key()
            if key is None:
                raise ValueError(f"no key for route {route.name} on the host")
            path, credential = egress.apply_credential(route, key, match.path)
        except (ValueError, OSError) as err:  # OSError: a login's refresh that could not reach its host
            decision = Decision(False, host, port, str(err))
            self.log.record(decision, req.method, extra)
            refuse(client, response("502 Bad Gateway", host, port, str(err), "Check the key's variable on the host."))
            return None
        decision, upstream = self.verified(egress.route_rules(self.book.rules, route), host, port)
        if not decision.allowed:
            self.log.record(decision, req.method, extra)
            self.refuse_decision(client, decision)
            return None
        assert upstream is not None
        self.watch.ok(host, port)
        routed = replace(req, host=host, port=port, head=route_head(req, path, host, port, credential))
        redact = Redactor(egress.key_forms(route, key))
        tracked = self.book.track(client, upstream, host, port, req.method, route)
        try:
            status = forward(self.log, client, upstream, routed, body, first,
                             relay=lambda up, down: relay_response(up, down, redact, req.method, req.version),
                             scanned=scanned)
        finally:
            self.book.untrack(tracked)
        extra["status"] = status
        extra["rule"] = f"/{route.name}: {limits.describe()}"  # the route's methods/paths that let it through
        if redact.count:
            extra["redacted"] = redact.count  # the upstream echoed the key: scrubbed, and said so
        self.log.record(Decision(True, host, port, f"credential route {route.name}", decision.addrs), req.method, extra)
        return upstream

    def verified(self, rules: tuple[HostRule, ...], host: str, port: int) -> tuple[Decision, TlsStream | None]:
        """Decide `host:port` under `rules`, connect, and verify TLS for the name: the upstream of a
        credential route and of the host's own login refresh. Not allowed or not reachable: the
        decision says why and there is no socket."""
        decision = decide(rules, host, port, self.book.resolver)
        if not decision.allowed:
            return decision, None
        sock, cause, detail = connect(decision)
        if sock is None:
            return Decision(False, host, port, detail, unreachable=True, cause=cause), None
        upstream, detail = self._tls(sock, host)
        if upstream is None:
            return Decision(False, host, port, detail, unreachable=True, cause="failed"), None
        return decision, upstream

    def open_tls(self, host: str, port: int) -> TlsStream:
        """A verified TLS connection to an allowed host (the egress rules and their pins apply), for a
        request the host side makes itself: a login's refresh (relay/trust/logins.py). Logged like any other."""
        decision, upstream = self.verified(self.book.rules, host, port)
        self.log.record(decision, "POST", {"login_refresh": True})
        if upstream is None:
            raise OSError(decision.reason)
        return upstream

    def _tls(self, sock: socket.socket, host: str) -> tuple[TlsStream | None, str]:
        """TLS to the route's upstream, verified for its name (SNI), within CONNECT_TIMEOUT."""
        if self.tls is None:
            import ssl

            self.tls = ssl.create_default_context()
        context = self.tls
        try:
            from relay.egress.tls_stream import TlsStream  # with ssl, on the first route's use

            sock.settimeout(None)
            return TlsStream.client(context, sock, host, CONNECT_TIMEOUT), ""
        except (OSError, ValueError) as err:
            sock.close()
            reason = getattr(err, "reason", None) or getattr(err, "strerror", None) or type(err).__name__
            return None, f"TLS to {host} failed: {reason}"
