"""Method and path rules (relay/model/http_rules.py) on plain-HTTP rules and credential routes, and the one
shape every refusal takes (relay/model/refusal.py), through the real proxy."""

from __future__ import annotations

import json
import socket
import ssl
from pathlib import Path

import pytest

from relay.egress.decision_log import DecisionLog
from relay.egress.proxy import EgressProxy
from relay.model import http_rules
from relay.model.allow_rules import parse_rule
from relay.model.backend import CredentialRoute
from relay.model.errors import UsageError
from relay.model.http_rules import HttpRules, normalise_path, path_matches, refusal
from relay.model.refusal import ENTRY

from .servers import make_ca, start_echo, start_http, start_tcp

POLICY = "by the hive-relay egress policy"


@pytest.mark.parametrize("bad", ["/v1/../admin", "/v1/./x", "/v1//x", "/v1/%2e%2e/admin", "/v1%2fadmin", "/v1%5cx",
                                 "/v1/%2E/x", "/v1\\x", "v1/x", "/a%00b", "/v1/%2e%2E"])
def test_a_path_that_is_not_normalised_is_refused_whatever_the_rule(bad: str) -> None:
    with pytest.raises(http_rules.PathError):
        normalise_path(bad)
    assert refusal(HttpRules(), "GET", bad).startswith("the path is not normalised")


def test_prefixes_are_segment_wise_and_globs_stay_in_their_segment() -> None:
    assert path_matches("/v1", "/v1") and path_matches("/v1", "/v1/messages") and not path_matches("/v1", "/v1evil")
    assert path_matches("/v1/", "/v1/x") and path_matches("/v1/", "/v1") and not path_matches("/v1/", "/v2/x")
    assert path_matches("/repos/*/issues", "/repos/r/issues") and not path_matches("/repos/*/issues", "/repos/a/b/issues")
    assert path_matches("/repos/**", "/repos/a/b/c") and path_matches("/v1/models/*:generate", "/v1/models/g:generate")
    # Matched on the decoded path: an encoded letter is no way around a rule.
    assert refusal(HttpRules(paths=("/v1/",)), "GET", "/%76%31/x") == ""
    assert refusal(HttpRules(paths=("/v1/",)), "GET", "/v2/x?/v1/").startswith("path /v2/x is not under")


def test_git_push_needs_push_true_and_a_git_grant_carries_only_fetch() -> None:
    read = HttpRules()
    assert refusal(read, "GET", "/o/r.git/info/refs?service=git-upload-pack") == ""
    assert refusal(read, "POST", "/o/r.git/git-upload-pack") == ""
    for method, target in (("GET", "/o/r.git/info/refs?service=git-receive-pack"), ("POST", "/o/r.git/git-receive-pack"),
                           ("GET", "/o/r.git/info/refs?service=git-upload-pack&service=git-receive-pack"),
                           ("GET", "/o/r.git/info/refs?service=git-other")):
        assert "git push" in refusal(read, method, target)
    git = HttpRules(git_only=True)
    assert refusal(git, "GET", "/o/r.git/info/refs?service=git-upload-pack") == ""
    assert "not a git fetch" in refusal(git, "GET", "/api/v3/user")
    assert "not a git fetch" in refusal(git, "DELETE", "/o/r.git/git-upload-pack")
    push = HttpRules(push=True, git_only=True)
    assert refusal(push, "POST", "/o/r.git/git-receive-pack") == ""


def test_rule_options_parse_render_and_refuse_what_they_cannot_mean() -> None:
    rule = parse_rule("api.test:80,method=GET,method=HEAD,path=/v1/")
    assert (rule.methods, rule.paths, rule.tls) == (("GET", "HEAD"), ("/v1/",), True)
    assert parse_rule(rule.render()) == rule
    assert not parse_rule("ssh.test:22,tls=false").tls
    for bad in ("api.test,method=get", "api.test,path=v1", "api.test,path=/a/../b", "api.test,tls=maybe",
                "api.test,color=red"):
        with pytest.raises(UsageError):
            parse_rule(bad)


class _Proxy:
    def __init__(self, tmp_path: Path, entries: list[str], routes: tuple[CredentialRoute, ...] = (),
                 tls: ssl.SSLContext | None = None) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.path = tmp_path / "egress.jsonl"
        self.proxy = EgressProxy(self.listener, tuple(parse_rule(e) for e in entries), DecisionLog(str(self.path), "t"),
                                 notify=None, run_id="RUN-ID", routes=routes, keys={r.name: "sk-key" for r in routes},
                                 tls=tls, resolver=lambda host, port: ["10.9.9.9"])
        self.proxy.start()

    def ask(self, head: bytes) -> bytes:
        with socket.create_connection(self.listener.getsockname(), timeout=30) as sock:
            sock.sendall(head)
            out = b""
            while data := sock.recv(65536):
                out += data
            return out

    def entries(self) -> list[dict]:
        self.proxy.log.close()
        return [json.loads(line) for line in self.path.read_text().splitlines()]


def test_plain_http_rules_limit_methods_and_paths_and_a_tunnel_under_them_is_refused(tmp_path: Path) -> None:
    server, port, _ = start_http()
    p = _Proxy(tmp_path, [f"plain.test:{port}=127.0.0.1:{port},method=GET,path=/ok"])
    try:
        assert b"hello from the fake upstream" in p.ask(f"GET http://plain.test:{port}/ok/x HTTP/1.1\r\n\r\n".encode())
        for head in (f"POST http://plain.test:{port}/ok HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
                     f"GET http://plain.test:{port}/other HTTP/1.1\r\n\r\n",
                     f"GET http://plain.test:{port}/ok/../other HTTP/1.1\r\n\r\n",
                     f"CONNECT plain.test:{port} HTTP/1.1\r\n\r\n"):
            answer = p.ask(head.encode()).decode("latin-1")
            assert answer.startswith(f"HTTP/1.1 403 Forbidden {POLICY}"), answer
            assert f"rule: plain.test:{port}=127.0.0.1:{port},method=GET,path=/ok" in answer
        kinds = [e["decision"] for e in p.entries()]
        assert kinds == ["allow", "http-rule", "http-rule", "http-rule", "http-rule"], kinds
    finally:
        p.proxy.stop()
        server.shutdown()


def test_a_credential_route_refuses_a_path_outside_its_api(tmp_path: Path) -> None:
    ca_file, server_ctx = make_ca(tmp_path, ("api.example",))

    def serve(conn: socket.socket, _n: int) -> None:
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            head = b""
            while b"\r\n\r\n" not in head:
                head += tls.recv(65536)
            body = head.split(b"\r\n", 1)[0]
            tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    _, port = start_tcp(serve)
    route = CredentialRoute("r", ("K",), "api.example", port, "x-api-key", paths=("/v1/",))
    p = _Proxy(tmp_path, [f"api.example:{port}=127.0.0.1:{port}"], (route,),
               ssl.create_default_context(cafile=str(ca_file)))
    try:
        assert p.ask(b"GET /r/v1/messages HTTP/1.1\r\nHost: x\r\n\r\n").endswith(b"GET /v1/messages HTTP/1.1")
        for target in ("/r/admin/keys", "/r/v1/../admin", "/r/v1%2f..%2fadmin"):
            answer = p.ask(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode()).decode("latin-1")
            assert answer.startswith(f"HTTP/1.1 403 Forbidden {POLICY}"), answer
            assert "X-Hive-Relay-Rule: /r: no git push; paths /v1/" in answer
        # Sorted: the allow line is written once its answer was relayed, so on a busy machine it can
        # follow the next request's refusal.
        assert sorted(e["decision"] for e in p.entries()) == ["allow", "http-rule", "http-rule", "http-rule"]
    finally:
        p.proxy.stop()


def test_every_refusal_class_carries_the_policy_sentence_rule_and_fix(tmp_path: Path) -> None:
    """Not listed, an IP literal, an internal answer, a host that is not canonical, a rule's limits,
    a tunnel that is not TLS: each says it is the policy's (not an outage), which rule, and the fix."""
    _, echo = start_echo()
    p = _Proxy(tmp_path, ["inside.test", f"limited.test:{echo}=127.0.0.1:{echo},path=/x",
                          f"web.test:443=127.0.0.1:{echo}"])
    try:
        cases = {
            "not listed": (b"CONNECT evil.test:443 HTTP/1.1\r\n\r\n", f"{ENTRY} allow evil.test:443 --run RUN-ID"),
            "ip literal": (b"CONNECT 2130706433:443 HTTP/1.1\r\n\r\n", f"{ENTRY} allow 127.0.0.1:443 --run RUN-ID"),
            "internal": (b"CONNECT inside.test:443 HTTP/1.1\r\n\r\n", f"{ENTRY} allow inside.test:443=ADDR:443"),
            "not canonical": (b"CONNECT evil.test%00.inside.test:443 HTTP/1.1\r\n\r\n", "to change it:"),
            "rule limits": (f"CONNECT limited.test:{echo} HTTP/1.1\r\n\r\n".encode(), "to change it:"),
            "plain path": (f"GET http://limited.test:{echo}/y HTTP/1.1\r\n\r\n".encode(), "to change it:"),
            "opaque": (b"CONNECT web.test:443 HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n", "tls=false"),
        }
        for name, (head, fix) in cases.items():
            answer = p.ask(head).decode("latin-1")
            status = answer.split("HTTP/1.1 ")[-1].split("\r\n")[0]
            assert status[:3] in ("400", "403"), (name, answer)
            assert POLICY in status and "not an outage" in status and "rule: " in status, (name, status)
            assert fix in status, (name, status)
            assert "X-Hive-Relay-Rule: " in answer, (name, answer)
    finally:
        p.proxy.stop()
