"""OAuth login files kept on the host: the box's copy holds placeholders, the proxy holds the token.

A CLI logged in on the host (claude's `~/.claude/.credentials.json`) has an access token, a
refresh token and an expiry in one JSON file. The box gets a private copy of the CLI's state dir
(relay/trust/agentstate.py); `mask` turns that copy's login into placeholders with an expiry far in the
future, so the CLI believes it is logged in and never refreshes. The proxy's credential route asks
a `LoginStore` for the real access token on every request: it reads the host's file (safefs: no
link followed, bounded) and, when the token is near its expiry, refreshes it at the CLI's OAuth
token endpoint with the real refresh token, on the host, and writes the new tokens back atomically
(a temporary under an unguessable name, then rename; same mode). The host's file stays the truth:
nothing the box writes at that path ever comes back over it (agentstate keeps it aside).

codex's ChatGPT login (`~/.codex/auth.json`, `tokens.*`) has no expiry field: its access token is a
JWT, and codex refreshes when that token's `exp` has passed (checked with codex 0.171.0). So a login
without `expires` takes the token's own `exp`; the box's copy gets a JWT of the same shape with `exp`
far ahead (relay/model/credential_files.py), its refresh token a placeholder, and `last_refresh` the
copy's time. The refresh grant is the same JSON shape for both CLIs ({grant_type, refresh_token,
client_id}); OpenAI's answer carries a new id token (kept at `id_token`) and no `expires_in`.

gemini's Google login (`~/.gemini/oauth_creds.json`: `access_token`, `refresh_token`, `expiry_date` in
ms) refreshes at oauth2.googleapis.com as an RFC 6749 form with the CLI's public installed-app
`client_secret` (`refresh_body: form`); Google's answer has `expires_in` and keeps the refresh token.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ssl

from relay.host import safefs
from relay.model import credential_files
from relay.model.backend import LoginFile
from relay.model.vocab import RefreshBody

# The box's copy expires in the year 2100: the CLI never refreshes it (it could not: it holds no
# refresh token), and the proxy refreshes the real one on the host.
FAR_FUTURE_MS = 4_102_444_800_000
MAX_LOGIN_BYTES = 1 << 20
MAX_TOKEN_RESPONSE = 1 << 20
REFRESH_MARGIN_S = 300  # refresh this long before the token expires
REFRESH_TIMEOUT = 30.0
RETRY_AFTER_S = 60.0  # after a failed refresh, none again for this long unless the host's file changes


class LoginError(ValueError):
    """The login file or its refresh cannot give a token; the message never holds a token."""


def _get(data: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _set(data: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        data = data.setdefault(part, {})
        if not isinstance(data, dict):
            raise LoginError(f"the login file's {path} is not inside a JSON object")
    data[leaf] = value


def _jwt_exp(token: Any) -> float | None:
    """A JWT's `exp` claim (seconds since the epoch), read without verifying it; None: no JWT or no exp."""
    claims = credential_files.jwt_claims(token) if isinstance(token, str) else None
    exp = claims.get("exp") if claims else None
    return float(exp) if isinstance(exp, (int, float)) and not isinstance(exp, bool) else None


def expiry(data: dict, login: LoginFile) -> float | None:
    """When the login's token expires (seconds since the epoch): its `expires` field (ms), or, when the
    login names none, the token's own JWT `exp`; None when neither says."""
    if login.expires:
        expires = _get(data, login.expires)
        return expires / 1000 if isinstance(expires, (int, float)) and not isinstance(expires, bool) else None
    return _jwt_exp(_get(data, login.token))


def _iso_now(clock: Callable[[], float] = time.time) -> str:
    """codex's own `last_refresh` form: RFC 3339 in UTC with microseconds."""
    now = clock()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1_000_000):06d}Z"


def parse(raw: bytes | None, login: LoginFile) -> dict:
    """The login file as a JSON object holding a string access token (LoginError otherwise)."""
    if raw is None:
        raise LoginError(f"no login file {login.file} on the host")
    try:
        data = json.loads(raw)
    except ValueError:
        raise LoginError(f"the login file {login.file} is not JSON") from None
    if not isinstance(_get(data, login.token), str) or not _get(data, login.token):
        raise LoginError(f"the login file {login.file} has no {login.token}")
    return data


def mask(raw: bytes, login: LoginFile, placeholder: str, clock: Callable[[], float] = time.time) -> bytes:
    """The box's copy: the same file with the access and refresh tokens replaced by `placeholder`
    and the expiry far in the future (so the CLI never tries to refresh). An access token that is a
    JWT becomes a JWT of the same shape instead (same claims, `exp` far ahead, a random signature):
    the CLI parses it for its expiry and account. `refreshed_at` becomes the copy's time. LoginError
    when the file is not a login this spec understands; the caller then gives the box no copy at all."""
    data = parse(raw, login)
    _set(data, login.token, credential_files.shaped_jwt(_get(data, login.token)) or placeholder)
    if _get(data, login.refresh_token) is not None:
        _set(data, login.refresh_token, placeholder)
    if login.expires and _get(data, login.expires) is not None:
        _set(data, login.expires, FAR_FUTURE_MS)
    if login.id_token and isinstance(_get(data, login.id_token), str):
        _set(data, login.id_token, credential_files.placeholder_for(_get(data, login.id_token)))
    if login.refreshed_at and _get(data, login.refreshed_at) is not None:
        _set(data, login.refreshed_at, _iso_now(clock))
    return json.dumps(data).encode()


Opener = Callable[[str, int], "ssl.SSLSocket"]  # ssl is imported by whoever opens one


class LoginStore:
    """The real token of one login file, for the proxy's route (`__call__` returns it, refreshed on
    the host first when near its expiry). `opener(host, port)` gives a verified TLS socket to the
    token endpoint (the proxy's, so the egress rules and their pins apply)."""

    def __init__(self, path: str, login: LoginFile, home: str, opener: Opener,
                 clock: Callable[[], float] = time.time, lock_dir: str | None = None,
                 margin: float = REFRESH_MARGIN_S) -> None:
        self.path, self.login, self.home, self.opener, self.clock = path, login, home, opener, clock
        self.margin = margin  # the token must still be good this long, or it is refreshed first
        self.lock_dir = lock_dir  # our state dir: one refresh at a time across every launcher on the host
        self._lock = threading.Lock()
        self.refreshed = 0
        self.refresh_posts = 0  # refresh grants sent (answered or not)
        # (the file's identity, when) of the last failed refresh: a box's requests cannot make the host
        # post the real refresh token again and again into the endpoint's rate limits
        self._failed: tuple[tuple[int, int, int], float] | None = None
        self._ident: tuple[int, int, int] = (0, 0, 0)

    def _read(self) -> tuple[dict, int]:
        try:
            base, rel = self.home, os.path.relpath(self.path, self.home)
            with safefs.base_dir(base) as dfd:
                st = safefs.lstat_beneath(dfd, rel)
                raw = safefs.read_beneath(dfd, rel, MAX_LOGIN_BYTES)
        except OSError as err:
            raise LoginError(f"cannot read the login file {self.login.file}: {err.strerror or err}") from None
        if st is not None:
            self._ident = (st.st_ino, st.st_size, st.st_mtime_ns)
        return parse(raw, self.login), (st.st_mode & 0o777 if st is not None else 0o600)

    def _fresh(self, data: dict) -> bool:
        expires = expiry(data, self.login)
        return expires is None or expires > self.clock() + self.margin

    def expires_at(self) -> float | None:
        """When the host file's token expires (seconds since the epoch), or None if it names no expiry."""
        return expiry(self._read()[0], self.login)

    def __call__(self) -> str:
        data, _ = self._read()
        if self._fresh(data):
            return _get(data, self.login.token)
        # One refresh at a time (threads here, other boxes' launchers): a refresh token is often good
        # for one use, so whoever comes second reads the file the first one wrote.
        with self._lock, self._host_lock():
            data, mode = self._read()
            if not self._fresh(data):
                failed = self._failed
                if failed is not None and failed[0] == self._ident and self.clock() - failed[1] < RETRY_AFTER_S:
                    raise LoginError(f"the refresh of the login in {self.login.file} failed {self.clock() - failed[1]:.0f} s "
                                     "ago and the file has not changed since; log in again on the host")
                try:
                    data = self._refresh(data, mode)
                    self._failed = None
                except LoginError:
                    data, _ = self._read()  # the CLI on the host may have refreshed it meanwhile
                    if not self._fresh(data):
                        self._failed = (self._ident, self.clock())
                        raise
            return _get(data, self.login.token)

    @contextlib.contextmanager
    def _host_lock(self) -> Iterator[None]:
        if self.lock_dir is None:
            yield
            return
        try:
            os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
            with safefs.base_dir(self.lock_dir) as dfd:
                fd = safefs.open_beneath(dfd, "login.lock", os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o600)
        except OSError as err:
            raise LoginError(f"cannot lock the login refresh: {err.strerror or err}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise LoginError("cannot lock the login refresh: login.lock is not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _refresh(self, data: dict, mode: int) -> dict:
        refresh = _get(data, self.login.refresh_token)
        if not isinstance(refresh, str) or not refresh:
            raise LoginError(f"the login in {self.login.file} expired and holds no refresh token; log in again on the host")
        grant = {"grant_type": "refresh_token", "refresh_token": refresh, "client_id": self.login.client_id}
        if self.login.client_secret:
            grant["client_secret"] = self.login.client_secret
        answer = self._post(grant)
        token = answer.get("access_token")
        if not isinstance(token, str) or not token:
            raise LoginError(f"the refresh at {self.login.refresh_url} gave no access token; log in again on the host")
        _set(data, self.login.token, token)
        if isinstance(answer.get("refresh_token"), str) and answer["refresh_token"]:
            _set(data, self.login.refresh_token, answer["refresh_token"])
        if self.login.id_token and isinstance(answer.get("id_token"), str) and answer["id_token"]:
            _set(data, self.login.id_token, answer["id_token"])
        if self.login.expires:
            lifetime = answer.get("expires_in")
            lifetime = lifetime if isinstance(lifetime, (int, float)) and lifetime > 0 else 3600
            _set(data, self.login.expires, int((self.clock() + lifetime) * 1000))
        if self.login.refreshed_at:
            _set(data, self.login.refreshed_at, _iso_now(self.clock))
        try:
            safefs.write_file(self.path, json.dumps(data).encode(), mode or 0o600, base=self.home)
        except OSError as err:
            raise LoginError(f"cannot update the login file {self.login.file}: {err.strerror or err}") from None
        self.refreshed += 1
        return data

    def _post(self, form: dict[str, str]) -> dict:
        """One POST to the token endpoint over the opener's TLS, as JSON or as an RFC 6749 form
        (`refresh_body`); the answer as a JSON object."""
        rest = self.login.refresh_url.removeprefix("https://")
        authority, _, path = rest.partition("/")
        host, _, port = authority.partition(":")
        if self.login.refresh_body == RefreshBody.FORM:
            from urllib.parse import urlencode  # only on a refresh, and only for a form endpoint

            body, kind = urlencode(form).encode(), "application/x-www-form-urlencoded"
        else:
            body, kind = json.dumps(form).encode(), "application/json"
        head = (f"POST /{path} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: {kind}\r\n"
                f"Accept: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        self.refresh_posts += 1
        try:
            sock = self.opener(host, int(port or 443))
        except (OSError, ValueError) as err:
            raise LoginError(f"cannot reach {authority} to refresh the login: {err}") from None
        raw = b""
        try:
            sock.settimeout(REFRESH_TIMEOUT)
            sock.sendall(head + body)
            deadline = time.monotonic() + REFRESH_TIMEOUT  # the whole answer, not each read
            while len(raw) <= MAX_TOKEN_RESPONSE:
                if time.monotonic() > deadline:
                    raise TimeoutError("no complete answer in time")
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                raw += chunk
        except (TimeoutError, OSError) as err:
            raise LoginError(f"the refresh at {authority} failed: {err}") from None
        finally:
            sock.close()
        head_part, _, payload = raw.partition(b"\r\n\r\n")
        status = head_part.split(b" ", 2)[1:2]
        if status != [b"200"]:
            raise LoginError(f"the refresh at {authority} answered {status[0].decode('latin-1') if status else 'nothing'}; "
                             "log in again on the host")
        if b"transfer-encoding: chunked" in head_part.lower():
            payload = _unchunk(payload)
        try:
            answer = json.loads(payload)
        except ValueError:
            raise LoginError(f"the refresh at {authority} answered no JSON") from None
        if not isinstance(answer, dict):
            raise LoginError(f"the refresh at {authority} answered no JSON object")
        return answer


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, data = data.partition(b"\r\n")
        try:
            n = int(size.split(b";")[0] or b"0", 16)
        except ValueError:
            raise LoginError("the token endpoint's chunked answer is malformed") from None
        if n == 0:
            break
        out, data = out + data[:n], data[n + 2:]
    return out
