#!/usr/bin/env bats
# The shell entry points: one-command onboarding and its error paths.

setup() {
  ROOT="$(cd "$BATS_TEST_DIRNAME/../.." && pwd)"
  WORK="$(mktemp -d)"
  export HOME="$WORK/home"
  mkdir -p "$HOME" "$WORK/checkout"
}

teardown() {
  rm -rf "$WORK"
}

@test "bootstrap prints the shell plan as JSON" {
  run "$ROOT/bin/contribute-hive" shell local --dry-run --json --workdir "$WORK/checkout"
  [ "$status" -eq 0 ]
  [[ "$output" == *'"backend": "shell"'* ]]
  [[ "$output" == *'"tier": "supervised"'* ]]
}

@test "unknown backend is exit 2 with one clear line" {
  run "$ROOT/bin/contribute-hive" nope --dry-run
  [ "$status" -eq 2 ]
  [[ "$output" == *"unknown backend 'nope'; choose one of: claude, codex, gemini, opencode, shell"* ]]
}

@test "no backend is exit 2" {
  run "$ROOT/bin/contribute-hive" --dry-run
  [ "$status" -eq 2 ]
  [[ "$output" == *"no backend given"* ]]
}

@test "the box runs a prompt and passes its exit code through" {
  run "$ROOT/bin/contribute-hive" shell local --quiet --workdir "$WORK/checkout" --prompt 'echo inside; exit 9'
  [ "$status" -eq 9 ]
  [[ "$output" == *"inside"* ]]
}
