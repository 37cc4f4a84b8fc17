# Shared by bin/contribute-hive and bin/test: find the host tools, build .venv once.
# POSIX sh, sourced; sets ROOT, VENV, PY.
# Follow symlinks to the real script, so a link on PATH (ln -s .../bin/contribute-hive ~/.local/bin/)
# works from any directory; the workdir stays the caller's current directory.
# Every launch runs this: parameter expansion and builtins only, no fork unless a link is followed.
_hr_dir() { case $1 in */*) printf '%s' "${1%/*}" ;; *) printf . ;; esac; }
_hr_self=$0
while [ -h "$_hr_self" ]; do
  _hr_link=$(readlink -- "$_hr_self")
  case $_hr_link in
    /*) _hr_self=$_hr_link ;;
    *) _hr_self=$(_hr_dir "$_hr_self")/$_hr_link ;;
  esac
done
case $_hr_self in */*) _hr_bin=${_hr_self%/*} ;; *) _hr_bin=. ;; esac
case $_hr_bin in /*) ROOT=${_hr_bin%/*} ;; *) ROOT=$(CDPATH= cd -- "$_hr_bin/.." && pwd) ;; esac
[ -n "$ROOT" ] || ROOT=/
VENV=${HIVE_RELAY_VENV:-"$ROOT/.venv"}

say() { printf 'hive-relay: %s\n' "$*" >&2; }

# An interpreter every user can run: /usr/bin/python3 first (pyenv under /root is 0700).
pick_python() {
  for p in /usr/bin/python3 /usr/local/bin/python3; do
    if [ -x "$p" ]; then PY=$p; return 0; fi
  done
  p=$(command -v python3 2>/dev/null) || return 1
  [ -n "$p" ] && [ -x "$p" ] && PY=$p
}

apt_install() {
  # Install Debian packages when we are root; otherwise print the exact command.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing $* (apt-get)"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2; then
      apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2
    fi
  else
    say "missing: $*; fix: sudo apt-get install $*"
    return 1
  fi
}

ensure_host() {
  # Every launch pays for this: shell builtins only. Python's venv module is checked when a venv
  # is made (ensure_venv), not on each run.
  pick_python || apt_install python3 || { say "python3 is required"; exit 3; }
  pick_python
  if ! command -v bwrap >/dev/null 2>&1; then
    apt_install bubblewrap || no_bwrap_note
  fi
}

no_bwrap_note() {
  # What a run can still do without bubblewrap; the same rule as relay/plan/resolve.py choose_tier().
  if [ "$(id -u)" = 0 ]; then
    say "without bubblewrap every run is refused (exit 3): agents need its network box, and the process tier cannot confine root; an agent runs without any box only with HIVE_RELAY_UNSANDBOXED_<BACKEND>=1"
  else
    say "without bubblewrap, agent backends are refused (exit 3; HIVE_RELAY_UNSANDBOXED_<BACKEND>=1 runs one without the box) and the shell backend runs at the process tier with no network"
  fi
}

INVOKE_SHIM="# hive-relay invoke shim 2"

_hr_quote() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }

pin_invoke() {
  # The venv's `invoke`/`inv` load hive relay's tasks.py from any directory: invoke alone looks for
  # tasks.py from the cwd up ("Can't find any collection named 'tasks'!" in a project, or worse, a
  # tasks.py a box wrote there). The root is a config default, so `-r DIR` and invoke.yaml still
  # win; -I keeps the cwd off sys.path. pip rewrites the scripts on reinstall: checked on each run (no fork).
  for _hr_inv in invoke inv; do
    _hr_line=""
    { read -r _hr_line && read -r _hr_line; } < "$VENV/bin/$_hr_inv" 2>/dev/null || true
    [ "$_hr_line" = "$INVOKE_SHIM" ] && continue
    [ -e "$VENV/bin/$_hr_inv" ] || continue  # no invoke installed in this venv
    _hr_tmp="$VENV/bin/.$_hr_inv.hive-relay-tmp"
    {
      printf '%s\n' '#!/bin/sh' "$INVOKE_SHIM"
      printf 'exec %s -I -c %s %s "$@"\n' "$(_hr_quote "$VENV/bin/python")" "'import sys
root = sys.argv[1]
from invoke import Config
from invoke.main import program
class HiveRelayConfig(Config):
    @staticmethod
    def global_defaults():
        d = Config.global_defaults()
        d[\"tasks\"][\"search_root\"] = root
        return d
program.config_class = HiveRelayConfig
sys.argv = [\"invoke\", *sys.argv[2:]]
sys.exit(program.run())'" "$(_hr_quote "$ROOT")"
    } > "$_hr_tmp" && chmod 755 "$_hr_tmp" && mv -f "$_hr_tmp" "$VENV/bin/$_hr_inv"
  done
}

ensure_venv() {
  # $1: requirements file. Rebuilt when the file changes (stamp holds its checksum).
  req=$1
  stamp="$VENV/.hive-relay-stamp-${req##*/}"
  # Fast path (no fork): the stamp is newer than the requirements file.
  if [ -x "$VENV/bin/python" ] && [ -s "$stamp" ] && ! [ "$req" -nt "$stamp" ]; then
    pin_invoke
    return 0
  fi
  sum=$(cksum < "$req" | cut -d' ' -f1)
  have=""
  [ -f "$stamp" ] && read -r have < "$stamp" || true
  if [ -x "$VENV/bin/python" ] && [ "$have" = "$sum" ]; then
    touch "$stamp"  # same content, newer file (a checkout): next time the fast path
    pin_invoke
    return 0
  fi
  started=$(date +%s)
  if [ ! -x "$VENV/bin/python" ]; then
    if ! "$PY" -I -c 'import venv, ensurepip' >/dev/null 2>&1; then
      apt_install python3-venv || exit 3
    fi
    say "first run: creating $VENV with $PY (once; about 10 s with the packages below)"
    "$PY" -I -m venv "$VENV" >&2 || { say "could not create $VENV; fix: apt-get install python3-venv"; exit 3; }
  fi
  # Say what is installed: the pinned names, then pip's own steps as they happen.
  say "installing pinned Python packages from $(basename "$req"):" \
    $(sed -e 's/#.*//' -e 's/^-r .*//' -e 's/[[:space:]]//g' "$req" | grep -v '^$' | tr '\n' ' ')
  rcfile=$(mktemp)
  { "$VENV/bin/python" -I -m pip install --disable-pip-version-check --progress-bar off -r "$req" 2>&1; echo $? > "$rcfile"; } \
    | while IFS= read -r line; do
        case $line in
          Collecting*|Installing\ collected*|Successfully\ installed*|ERROR*|error*) say "pip: $line" ;;
        esac
      done
  rc=$(cat "$rcfile"); rm -f "$rcfile"
  [ "$rc" = 0 ] || { say "pip install failed (exit $rc); fix: check your network access to PyPI (or PIP_INDEX_URL)"; exit 3; }
  pin_invoke
  echo "$sum" > "$stamp"
  say "Python packages ready in $(( $(date +%s) - started )) s"
}
