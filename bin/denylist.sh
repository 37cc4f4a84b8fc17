# hive relay deny list, POSIX shell copy. Sourced by bin/container-entrypoint.
# It must equal relay/policy/denylist.py: tests/bats/parity.bats expands both for the same HOME, uid
# and backend and fails on any difference. Edit the two together.

HIVE_SECRET_HOME='.ssh .gnupg .aws .azure .config/gcloud .kube .docker .config/gh .git-credentials .netrc .npmrc .pypirc .cargo/credentials .cargo/credentials.toml .password-store .local/share/keyrings'
HIVE_SECRET_SYSTEM='/etc/shadow /etc/shadow- /etc/gshadow /etc/gshadow- /etc/sudoers /etc/sudoers.d /etc/ssh/ssh_host_rsa_key /etc/ssh/ssh_host_ecdsa_key /etc/ssh/ssh_host_ed25519_key /etc/ssh/ssh_host_dsa_key /run/user/{uid} /run/docker.sock /var/run/docker.sock /run/podman /var/run/podman /run/containerd'
HIVE_PROTECT_WORKDIR='.git/hooks .git/config .bashrc .bash_profile .profile .zshrc .zshenv .zprofile .envrc .vscode .idea .mcp.json .claude/commands .claude/agents .claude/hooks .claude/settings.json .claude/settings.local.json .gemini/settings.json .codex/config.toml .claude/skills .claude/rules .claude/output-styles opencode.json opencode.jsonc'

# hive_secret_paths HOME UID BACKEND [SSH_AUTH_SOCK]: one path per line, the Python order, no duplicates.
# A backend's extra `deny:` entries are not here: the engine masks them (relay/render/container_argv.py) like
# every deny entry, and no shipped backend has any (BACKEND is kept for the call's shape).
hive_secret_paths() {
  _home=${1%/}; _uid=$2; _backend=$3; _sock=${4-}
  {
    for _e in $HIVE_SECRET_HOME; do printf '%s/%s\n' "$_home" "$_e"; done
    for _e in $HIVE_SECRET_SYSTEM; do printf '%s\n' "$_e" | sed "s/{uid}/$_uid/"; done
    case "$_sock" in /*) printf '%s\n' "$_sock" ;; esac
  } | awk '!seen[$0]++'
}

# hive_protected_paths WORKDIR: write-protected paths inside the workdir, one per line.
hive_protected_paths() {
  for _e in $HIVE_PROTECT_WORKDIR; do printf '%s/%s\n' "${1%/}" "$_e"; done
}
