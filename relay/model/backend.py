"""The frozen types of the backend matrix, as config leaves them after every layer: a backend, its credential routes and login files, a profile as written, and the whole matrix. Types only: the YAML schema and load are relay/config/load.py, so the proxy pod imports these without any config I/O."""

from __future__ import annotations

from collections.abc import Mapping

from relay.model.http_rules import HttpRules
from relay.model.record import field as _field
from relay.model.record import record
from relay.model.vocab import RefreshBody


@record
class CredentialRoute:
    """A backend's API key kept on the host: the box talks plain HTTP to the proxy at
    `http://127.0.0.1:3128/<name>`, and the proxy re-originates TLS to `upstream` with the real key.

    `secret_env`: the host's variables holding the key, first set one wins (never passed into the box);
    `upstream`: host and port, the only place the key is ever sent; `send`: how (one of SENDS);
    `box_env`: variables set in the box (`{url}` the route's base URL, `{placeholder}` a fixed non-secret);
    `box_args`: argv added after the native flags (same placeholders)."""

    name: str
    secret_env: tuple[str, ...]
    upstream_host: str
    upstream_port: int
    send: str
    box_env: tuple[tuple[str, str], ...] = ()
    box_args: tuple[str, ...] = ()
    # An `auth:` grant of the user config (not a backend's route): its secret comes from a host command
    # (`secret_command`) or a file (`secret_file`, at JSON path `secret_json`) when not from variables.
    grant: bool = False
    secret_command: tuple[str, ...] = ()
    secret_file: str = ""
    secret_json: str = ""
    basic_user: str = "x-access-token"  # authorization-basic sends base64(basic_user:key)
    backends: tuple[str, ...] = ()  # a grant's `backends:`: only their runs get it (empty: every backend's)
    login: LoginFile | None = None  # the key is a login file's access token instead (relay/trust/logins.py)
    # What the route carries (relay/model/http_rules.py): `methods`/`paths` (empty: any), `push` (git's
    # receive-pack, never without it), `git` (nothing but git's fetch, and push with `push`).
    methods: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    push: bool = False
    git: bool = False
    # `inspect: true`: the box may also reach `upstream` directly over HTTPS (a CLI that takes no base URL);
    # the proxy terminates that TLS with the run CA's leaf and adds the key there (relay/egress/inspect.py).
    inspect: bool = False

    def http_rules(self) -> HttpRules:
        return HttpRules(self.methods, self.paths, self.push, self.git)


@record
class LoginFile:
    """A CLI's OAuth login file on the host (`file`, ~/…, inside one of the backend's home.rw dirs):
    the proxy reads the access token at `token` (a dotted JSON path), refreshes it on the host at
    `refresh_url` with the refresh token at `refresh_token` once `expires` (ms since the epoch) is
    near, and the box's copy holds placeholders at `token` and `refresh_token`.

    `expires` empty: the token is a JWT and its own `exp` claim is the expiry (codex's ChatGPT login).
    `id_token`: where the refresh's new id token goes (codex parses it for the account and plan).
    `refreshed_at`: an ISO-8601 time the CLI keeps of its last refresh (codex's `last_refresh`): set on
    a refresh on the host, and to the copy's time in the box, so the CLI there sees a fresh login.
    `unless`: (dotted path, value) pairs; while the file holds one of them the route does not apply
    (codex uses its ChatGPT login whenever `auth_mode` is `chatgpt`, even with a key in the file).
    `client_secret`: sent with the refresh grant where the endpoint wants one (Google's installed-app
    clients: the CLI's own public value, printed in its package, not the user's); `refresh_body`: the
    grant as JSON or as an RFC 6749 form."""

    file: str
    token: str
    refresh_token: str
    expires: str
    refresh_url: str
    client_id: str
    id_token: str = ""
    refreshed_at: str = ""
    unless: tuple[tuple[str, str], ...] = ()
    client_secret: str = ""
    refresh_body: RefreshBody = RefreshBody.JSON


@record
class Backend:
    """One agent CLI as the matrix describes it; all paths still in `~/…` form."""

    name: str
    description: str
    command: tuple[str, ...]
    prompt_command: tuple[str, ...]
    install_npm: str | None
    install_bin: str | None
    home_ro: tuple[str, ...]
    home_rw: tuple[str, ...]
    home_sync: tuple[str, ...]
    egress: tuple[str, ...]
    env_pass: tuple[str, ...]
    env_set: tuple[tuple[str, str], ...]
    native_boxed: tuple[str, ...]
    native_unsandboxed: tuple[str, ...]
    deny: tuple[str, ...]
    opt_in: str
    nested_userns: bool = False
    home_guard: tuple[str, ...] = ()
    home_keep: tuple[str, ...] = ()
    credentials: tuple[CredentialRoute, ...] = ()
    # Login files that stay in the box as they are, each with the reason (the plan says so when one exists).
    logins_in_box: tuple[tuple[str, str], ...] = ()
    # Credential files in its state dirs and the JSON paths of their secrets (relay/model/credential_files.py): the
    # box's copy holds placeholders of the same shape; with no route to hold them, the run refuses.
    secret_files: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Credentials in files the box's copy cannot mask (guarded settings: their sync-back and review would
    # carry a placeholder over the host's value): a secret found at these paths refuses the run.
    unmaskable: tuple[tuple[str, tuple[str, ...]], ...] = ()
    presets: tuple[str, ...] = ()  # egress presets on for this backend (relay/config/presets.py); none shipped
    # The CLI's own login, run on the host by `contribute-hive login BACKEND` (never in a box).
    login_command: tuple[str, ...] = ()


@record
class ProfileSpec:
    """A profile as written in config; `None` means "inherit", an empty tuple means "nothing"."""

    name: str
    extends: str | None = None
    backend_home: bool | None = None
    toolchain: bool | None = None
    network: bool | None = None
    home_ro: tuple[str, ...] | None = None
    home_rw: tuple[str, ...] | None = None
    env: tuple[str, ...] | None = None
    memory: int | None = None
    pids: int | None = None


@record
class Matrix:
    """Everything config says, after all layers: backends, user profiles, user opt-ins, sources."""

    backends: Mapping[str, Backend]
    profiles: Mapping[str, ProfileSpec]
    allow_unsandboxed: frozenset[str]
    sources: tuple[str, ...]
    presets: Mapping[str, tuple[str, ...]] = _field(default_factory=dict)  # the user config's named presets
    grants: tuple[CredentialRoute, ...] = ()  # the user config's `auth:` (never a repo's)
    workdir_mode: str = "staged"  # `workdir: staged | live` (user config; a repo may only force staged)
    workdir_forced: str | None = None  # the repo config that forces `workdir: staged` (its path)
    isolation: str | None = None  # `isolation:` of the user config: the tier when --isolation is not given
    vm_accel: str | None = None  # `vm: {accel: kvm|tcg}` of the user config: the VM tier's CPU when --vm-accel is not given
