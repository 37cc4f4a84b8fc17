# hive relay deny list, POSIX shell copy. Sourced by bin/container-entrypoint.
# It must equal relay/policy/denylist.py: tests/bats/parity.bats expands both for the same HOME, uid
# and backend and fails on any difference. Edit the two together.

HIVE_SECRET_HOME='.ssh .gnupg .aws .azure .config/gcloud .kube .docker .config/gh .git-credentials .netrc .npmrc .pypirc .cargo/credentials .cargo/credentials.toml .password-store .local/share/keyrings'
HIVE_SECRET_SYSTEM='/etc/shadow /etc/shadow- /etc/gshadow /etc/gshadow- /etc/sudoers /etc/sudoers.d /etc/ssh/ssh_host_rsa_key /etc/ssh/ssh_host_ecdsa_key /etc/ssh/ssh_host_ed25519_key /etc/ssh/ssh_host_dsa_key /run/user/{uid} /run/docker.sock /var/run/docker.sock /run/podman /var/run/podman /run/containerd'
HIVE_PROTECT_WORKDIR='.git/hooks .git/config .bashrc .bash_profile .profile .zshrc .zshenv .zprofile .envrc .vscode .idea .mcp.json .claude/commands .claude/agents .claude/hooks .claude/settings.json .claude/settings.local.json .gemini/settings.json .codex/config.toml .claude/skills .claude/rules .claude/output-styles opencode.json opencode.jsonc'

# hive_each_secret_path CALLBACK HOME UID BACKEND [SSH_AUTH_SOCK]: CALLBACK PATH for each path, the
# Python order, no duplicates. Shell builtins only (no sed, awk or subshell): the container
# entrypoint runs this on every launch, before the agent starts, and each fork is time the user waits.
# A backend's extra `deny:` entries (config/backends.yaml) come after the system paths, as in Python:
# claude's ~/.claude/backups (its full copies of ~/.claude.json) is the only one.
hive_each_secret_path() {
  _cb=$1; _home=${2%/}; _uid=$3; _sock=${5-}
  _hive_seen='
'
  for _e in $HIVE_SECRET_HOME; do _hive_once "$_cb" "$_home/$_e"; done
  for _e in $HIVE_SECRET_SYSTEM; do
    case $_e in *'{uid}'*) _e=${_e%%'{uid}'*}$_uid${_e#*'{uid}'} ;; esac
    _hive_once "$_cb" "$_e"
  done
  case $4 in claude) _hive_once "$_cb" "$_home/.claude/backups" ;; esac
  case $_sock in /*) _hive_once "$_cb" "$_sock" ;; esac
}

_hive_once() {
  case $_hive_seen in *"
$2
"*) return 0 ;; esac
  _hive_seen="$_hive_seen$2
"
  "$1" "$2"
}

_hive_print() { printf '%s\n' "$1"; }

# hive_secret_paths HOME UID BACKEND [SSH_AUTH_SOCK]: one path per line, the Python order, no duplicates.
hive_secret_paths() { hive_each_secret_path _hive_print "$@"; }

# hive_protected_paths WORKDIR: write-protected paths inside the workdir, one per line.
hive_protected_paths() {
  for _e in $HIVE_PROTECT_WORKDIR; do printf '%s/%s\n' "${1%/}" "$_e"; done
}
