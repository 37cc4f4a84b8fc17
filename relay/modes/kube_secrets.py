"""kube mode's credential policy on the cluster: every credential route of the plan (a backend's key
from a variable, an `auth:` grant's host command or file, a login file's OAuth token) reaches the
proxy pod as a value in its Secret, and never a box.

The pod's proxy (relay/egress/proxy_main.py) reads keys from its environment only, so each route is carried
under a key name of its own (`HIVE_RELAY_KEY_N`), whatever its source on the host. The values are
read here, on the host, once per run, through the same code as the other modes (relay/egress/secret_source.py
for grants, relay/trust/logins.py for logins). A login's token must last the run: when it would expire
before the run's deadline it is refreshed on the host first (the host's file gets the new tokens,
as a local run's proxy would write them), and a token that still would not last is refused, with
the fix, rather than a run that fails half-way. The pod never holds a refresh token.

Pure parts (`carried`) take the plan; `secret_values` is the thin reader.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Mapping

from relay.model.backend import CredentialRoute
from relay.model.errors import RefusedError
from relay.model.record import record, replace

KEY_PREFIX = "HIVE_RELAY_KEY_"
MARGIN_S = 600  # a login token must outlive the run's deadline by this much


@record
class Carried:
    """One route as the cluster's proxy serves it: the route with its key under `key`, and where the
    value comes from on the host (`source`: env | grant | login)."""

    route: CredentialRoute
    key: str
    source: str


def carried(routes: tuple[CredentialRoute, ...]) -> list[Carried]:
    """Pure: every route, renamed to a key of its own, stripped of how the host finds its value."""
    out = []
    for i, r in enumerate(routes):
        source = "login" if r.login is not None else "grant" if r.grant else "env"
        key = f"{KEY_PREFIX}{i}"
        out.append(Carried(replace(r, secret_env=(key,), login=None, grant=False, secret_command=(), secret_file="",
                                   secret_json=""), key, source))
    return out


def _opener(env: Mapping[str, str]):  # noqa: ANN202 - logins.Opener
    context = ssl.create_default_context(cafile=env.get("SSL_CERT_FILE") or None)

    def open_tls(host: str, port: int) -> ssl.SSLSocket:
        return context.wrap_socket(socket.create_connection((host, port), timeout=30), server_hostname=host)

    return open_tls


def _login_token(route: CredentialRoute, env: Mapping[str, str], lasts_s: float) -> str:
    from relay.host.paths import state_dir
    from relay.trust.logins import LoginError, LoginStore

    assert route.login is not None
    # A token that would expire before the run's deadline is refreshed now (on the host, which
    # writes its real new expiry back to the file, as a local run's proxy would).
    store = LoginStore(route.login.file, route.login, env.get("HOME", "/"), _opener(env),
                       lock_dir=state_dir(dict(env)), margin=lasts_s)
    try:
        token = store()
        expires = store.expires_at()
    except LoginError as err:
        raise RefusedError(f"kube mode cannot carry the login {route.login.file} to the cluster: {err}; fix: log in "
                           "again on the host, or set an API key variable") from None
    if expires is not None and expires < time.time() + lasts_s:
        raise RefusedError(f"the login {route.login.file} expires before this run's deadline, even refreshed; fix: a "
                           "shorter --timeout, or an API key variable")
    return token


def secret_values(plan, env: Mapping[str, str]) -> dict[str, str]:  # noqa: ANN001 - plan.Plan
    """Key name -> value for every carried route whose value the host has (an unset backend
    variable is simply absent: the plan already noted it). A grant or login that cannot be read
    refuses the run (exit 3) with one line naming it."""
    from relay.egress import secret_source

    lasts = (plan.timeout or 1800) + MARGIN_S
    values = {}
    for c, route in zip(carried(plan.credentials), plan.credentials, strict=True):
        if c.source == "login":
            values[c.key] = _login_token(route, env, lasts)
        else:
            value = secret_source.read_key(route, env)
            if value is not None:
                values[c.key] = value
    return values
