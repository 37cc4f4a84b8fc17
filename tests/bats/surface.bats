#!/usr/bin/env bats
# bin/contribute-hive from anywhere: through a symlink on PATH, from a directory that is not the checkout.

setup() {
  ROOT="$(cd "$BATS_TEST_DIRNAME/../.." && pwd)"
  TMP="$(mktemp -d)"
  mkdir -p "$TMP/onpath" "$TMP/project dir"
  ln -s "$ROOT/bin/contribute-hive" "$TMP/onpath/contribute-hive"
  ln -s "../onpath/contribute-hive" "$TMP/project dir/relative-link"
}

teardown() { rm -rf "$TMP"; }

@test "a symlink on PATH finds the checkout and prints the version" {
  cd "$TMP/project dir"
  run env PATH="$TMP/onpath:$PATH" contribute-hive --version
  [ "$status" -eq 0 ]
  [[ "$output" =~ ^hive-relay\ [0-9]+\.[0-9]+\.[0-9]+$ ]]
}

@test "a relative symlink works too, and the workdir is where the user stands" {
  cd "$TMP/project dir"
  run ./relative-link shell --dry-run
  [ "$status" -eq 0 ]
  [[ "$output" == *"workdir  $(pwd -P)"* ]]
}

@test "a usage error is one line with exit 2" {
  cd "$TMP"
  run "$TMP/onpath/contribute-hive" shell --dryrun
  [ "$status" -eq 2 ]
  [ "${#lines[@]}" -eq 1 ]
  [[ "${lines[0]}" == "hive-relay: error: unknown option --dryrun; fix: did you mean --dry-run?"* ]]
}
