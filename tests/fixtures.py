"""The fixtures every file shares, defined once (tests/conftest.py hands them to pytest): one test CA
for the session, with a server certificate for every API name the tests serve, and the TLS fake API
behind it. A file that needs a CA of its own (another name set, a CA the proxy must not trust) makes
one with servers.make_ca."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import fake_api
from .servers import make_ca

# Every name a shared-CA test serves under: the agents' APIs and logins, and github.com for grants.
API_NAMES = ("api.anthropic.com", "platform.claude.com", "api.openai.com", "chatgpt.com", "auth.openai.com",
             "generativelanguage.googleapis.com", "cloudcode-pa.googleapis.com", "oauth2.googleapis.com", "github.com")


@pytest.fixture(scope="session")
def ca(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ssl.SSLContext]:
    """(the CA file clients trust, a server context with the certificate for API_NAMES)."""
    return make_ca(tmp_path_factory.mktemp("ca"), API_NAMES)


@pytest.fixture
def tls_api(ca: tuple[Path, ssl.SSLContext]) -> Iterator[fake_api.Server]:
    """The fake API over TLS under the real API names, for one test."""
    server, _ = fake_api.start(tls=ca[1])
    yield server
    server.shutdown()


class Proxies:
    """Real EgressProxy instances on 127.0.0.1, each on a listener of its own and logging to one
    file; all stopped at the test's end (the `proxies` fixture)."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.started: list = []

    def __call__(self, *entries: str, backlog: int = 64, **kw) -> tuple:  # noqa: ANN003 - EgressProxy's own
        """(the started proxy, its port) for rules ENTRIES; KW goes to EgressProxy."""
        import socket

        from relay.egress.decision_log import DecisionLog
        from relay.egress.proxy import EgressProxy
        from relay.model.allow_rules import parse_rule

        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(backlog)
        proxy = EgressProxy(listener, tuple(parse_rule(e) for e in entries), DecisionLog(str(self.log), "test"), **kw)
        proxy.start()
        self.started.append(proxy)
        return proxy, listener.getsockname()[1]

    def stop(self) -> None:
        for proxy in self.started:
            proxy.stop()


@pytest.fixture
def proxies(tmp_path: Path) -> Iterator[Proxies]:
    """The proxy factory (Proxies), logging to tmp_path/egress.jsonl."""
    made = Proxies(tmp_path / "egress.jsonl")
    yield made
    made.stop()
