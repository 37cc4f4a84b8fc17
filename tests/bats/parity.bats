#!/usr/bin/env bats
# The shell deny list (bin/denylist.sh) must equal the Python one (relay/policy/denylist.py).

setup() {
  ROOT="$(cd "$BATS_TEST_DIRNAME/../.." && pwd)"
  PY="${HIVE_RELAY_PYTHON:-$ROOT/.venv/bin/python}"
  . "$ROOT/bin/denylist.sh"
}

py_list() { PYTHONPATH="$ROOT" "$PY" -m relay.commands.denylist_cli "$@"; }

@test "secret paths are identical for every backend, HOME and uid" {
  for backend in claude codex gemini opencode shell; do
    for home in /home/alice /root "/home/bob/"; do
      for uid in 0 1000; do
        diff <(py_list secrets "$home" "$uid" "$backend") <(hive_secret_paths "$home" "$uid" "$backend") \
          || { echo "deny lists differ for backend=$backend HOME=$home uid=$uid (< python, > shell)"; return 1; }
      done
    done
  done
}

@test "the ssh-agent socket is denied by both" {
  diff <(py_list secrets /home/alice 1000 claude /tmp/ssh-XYZ/agent.1) \
       <(hive_secret_paths /home/alice 1000 claude /tmp/ssh-XYZ/agent.1)
  hive_secret_paths /home/alice 1000 claude /tmp/ssh-XYZ/agent.1 | grep -qx /tmp/ssh-XYZ/agent.1
}

@test "write-protected workdir paths are identical" {
  diff <(py_list protected /src/hive) <(hive_protected_paths /src/hive)
}

@test "the parity check itself catches a difference" {
  HIVE_SECRET_HOME="$HIVE_SECRET_HOME .extra-only-in-shell"
  run diff <(py_list secrets /home/alice 1000 shell) <(hive_secret_paths /home/alice 1000 shell)
  [ "$status" -ne 0 ]
  [[ "$output" == *".extra-only-in-shell"* ]]
}

@test "the container entrypoint refuses when a denied path is readable" {
  home="$(mktemp -d)"
  mkdir -p "$home/.ssh" && echo KEY > "$home/.ssh/id_rsa"
  run env HOME="$home" "$ROOT/bin/container-entrypoint" echo started
  rm -rf "$home"
  [ "$status" -eq 3 ]
  [[ "$output" == *"deny-listed path readable in the container:"*"/.ssh"* ]]
}

@test "the container entrypoint finds a leak the builtins must see: dotfiles only, an unsearchable dir, a HOME with a space" {
  # In the local box (not root there), so a 0444 directory cannot be searched: its names still leak.
  work="$(mktemp -d)"
  cp "$ROOT/bin/container-entrypoint" "$ROOT/bin/denylist.sh" "$work/"
  run "$ROOT/bin/contribute-hive" shell local --live --quiet --workdir "$work" --prompt \
    'mkdir -p "h x/.gnupg" "h x/.aws" "h x/.kube"; touch "h x/.gnupg/k" "h x/.aws/.c"; chmod 0444 "h x/.gnupg"; HOME="$PWD/h x" ./container-entrypoint echo started; rc=$?; chmod 0755 "h x/.gnupg"; rm -rf "h x"; exit $rc'
  rm -rf "$work"
  [ "$status" -eq 3 ]
  [[ "$output" == *"in the container: "*"/h x/.gnupg "*"/h x/.aws;"* ]]
  [[ "$output" != *".kube"* ]]
  [[ "$output" != *"started"* ]]
}

@test "the container entrypoint starts the agent when nothing denied is readable" {
  # Where the deny list is masked, as in our box (the host itself shows /etc/shadow to root). Live:
  # the test reads the last lines, and a staged run adds its exit line (and keeps the FIFO in a layer).
  work="$(mktemp -d)"
  cp "$ROOT/bin/container-entrypoint" "$ROOT/bin/denylist.sh" "$work/"
  run "$ROOT/bin/contribute-hive" shell local --live --quiet --workdir "$work" --prompt "./container-entrypoint echo started"
  rm -rf "$work"
  [ "$status" -eq 0 ]
  [ "${lines[-1]}" = "started" ]
}

@test "the container entrypoint waits for go, and stops when the launcher goes away" {
  # In the local box, as above, so the deny list is masked; the FIFO lives in the workdir (and goes
  # before the box ends, or the exit report names it after the lines the test reads).
  work="$(mktemp -d)"
  cp "$ROOT/bin/container-entrypoint" "$ROOT/bin/denylist.sh" "$work/"
  run "$ROOT/bin/contribute-hive" shell local --live --quiet --workdir "$work" --prompt \
    'mkfifo go; (sleep 0.3; echo go > go) & HIVE_RELAY_GO=./go ./container-entrypoint sh -c "echo started; echo go=\${HIVE_RELAY_GO:-unset}"; rc=$?; rm -f go; exit $rc'
  [ "$status" -eq 0 ]
  [ "${lines[-2]}" = "started" ]
  [ "${lines[-1]}" = "go=unset" ]
  rm -f "$work/go"
  run "$ROOT/bin/contribute-hive" shell local --live --quiet --workdir "$work" --prompt \
    'mkfifo go; (sleep 0.3; : > go) & HIVE_RELAY_GO=./go ./container-entrypoint echo started; rc=$?; rm -f go; exit $rc'
  rm -rf "$work"
  [ "$status" -eq 70 ]
  [[ "$output" == *"the launcher went away before the box was ready"* ]]
  [[ "$output" != *"started"* ]]
}
