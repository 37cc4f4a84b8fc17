"""Can this host run the gvisor tier: which runsc, its release, its platform, and a real probe run.

The gvisor tier (issue 31) runs the box on gVisor's user-space kernel (the Sentry), so a bug in the
host's kernel is out of the agent's direct reach. Everything the tier choice, `doctor` and the
refusal say about runsc comes from here:

- which runsc: `$HIVE_RELAY_RUNSC` (a path, or a name looked up on PATH), else `runsc` on PATH;
- its release (`runsc --version`: Debian's `0.0~20240729.0`, upstream's `release-20240729.0`), as a date;
- the platform: systrap where this runsc has it (releases from 2023 on; bookworm-backports'
  20240729 does), else ptrace. Never KVM: on this machine type /dev/kvm is PVM, where runsc's KVM
  platform hangs;
- rootless: a caller that is not root runs runsc with `--rootless`;
- a probe: `runsc do true` with that platform and `--network=none`, the exact flags a run uses.
  Success is memoized per (runsc binary, kernel, uid) in the cache dir; a failure is always
  probed again (a forged failure must not steer anything, a forged success only costs the run).

Cheap without the probe (a stat and `runsc --version`); the probe costs a sandbox start (about
150 ms here), paid only when `--isolation gvisor` is asked for and its memo is cold.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping

from relay.host import safefs
from relay.host.paths import cache_dir

FIX = ("fix: apt-get install -t bookworm-backports runsc (Debian 12; add `deb http://deb.debian.org/debian "
       "bookworm-backports main` to the apt sources first), or gVisor's own apt repository for a current release")
NEWER = "a current release from gVisor's own apt repository (https://gvisor.dev/docs/user_guide/install/)"
PROBE_TIMEOUT = 60
STALE_DAYS = 365
_VERSION = re.compile(r"(?:release-|0\.0~)(\d{4})(\d{2})(\d{2})")
CACHE_VERSION = 1


def find(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(runsc's path, None), or (None, why not, with the fix)."""
    wanted = env.get("HIVE_RELAY_RUNSC")
    if wanted:
        path = wanted if "/" in wanted else shutil.which(wanted, path=env.get("PATH", os.defpath))
        if not path or not os.path.isfile(path) or not os.access(path, os.X_OK):
            return None, (f"HIVE_RELAY_RUNSC={wanted} is not an executable file; fix: point it at runsc, or unset it "
                          f"to use the runsc on PATH ({FIX.removeprefix('fix: ')})")
        return path, None
    path = shutil.which("runsc", path=env.get("PATH", os.defpath))
    if path is None:
        return None, f"runsc (gVisor) is not installed; {FIX}"
    return path, None


def version(path: str) -> tuple[str | None, datetime.date | None]:
    """runsc's version line and its release date (None when it says neither)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    line = out.splitlines()[0].strip() if out.strip() else None
    m = _VERSION.search(out)
    if m is None:
        return line, None
    try:
        return line, datetime.date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
    except ValueError:
        return line, None


def platform(path: str) -> str:
    """systrap where this runsc has it (its `flags` help names it), else ptrace; never kvm."""
    try:
        out = subprocess.run([path, "flags"], capture_output=True, text=True, timeout=10)
        text = out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError):
        text = ""
    return "systrap" if "systrap" in text else "ptrace"


def base_flags(platform_name: str, rootless: bool) -> list[str]:
    """The flags every runsc call of a run shares (the probe's too): its platform, no network of its
    own (gVisor's netstack with a loopback only), no cgroup setup (the launcher places runsc in the
    run's cgroup itself), host unix sockets reachable only where a mount shows one (the proxy's)."""
    return [f"--platform={platform_name}", "--directfs=false", "--network=none", "--ignore-cgroups",
            "--host-uds=open", *(["--rootless"] if rootless else [])]  # directfs: see render/gvisor_oci.py


def probe_run(path: str, platform_name: str, rootless: bool) -> str | None:
    """Start a real sandbox (`runsc do true`); None when it ran, else what failed (one line)."""
    with tempfile.TemporaryDirectory(prefix="hive-relay-runsc-") as state:
        argv = [path, "--root", state, *base_flags(platform_name, rootless), "do", "--quiet", "true"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT, cwd="/",
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"runsc --platform={platform_name} did not start a sandbox within {PROBE_TIMEOUT} s"
        except OSError as err:
            return f"{path}: {err.strerror or err}"
    if done.returncode == 0:
        return None
    lines = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
    return f"runsc --platform={platform_name} failed its probe run (exit {done.returncode}): " + (
        lines[-1][:300] if lines else "no output")


def _key(path: str, uid: int) -> str:
    st = os.stat(path)
    return json.dumps([CACHE_VERSION, os.path.realpath(path), st.st_mtime_ns, st.st_size, os.uname().release, uid])


def facts(env: Mapping[str, str], use_cache: bool = True, build_init: bool = True) -> dict[str, str | None]:
    """The runsc fields of HostFacts: runsc, runsc_version, runsc_platform, runsc_error (None when the
    tier can run here), and where the tier can run, the box's init (relay/host/native_init.py: the
    compiled one, built on first use unless `build_init` is False, or None for the Python one)."""
    got = _runsc_facts(env, use_cache)
    if got["runsc_error"] is None:
        from relay.host import native_init

        init, note = native_init.find(env, build=build_init)
        got.update(gvisor_init=init, gvisor_init_note=note)
    return got


def _runsc_facts(env: Mapping[str, str], use_cache: bool) -> dict[str, str | None]:
    path, error = find(env)
    if path is None:
        return {"runsc": None, "runsc_version": None, "runsc_platform": None, "runsc_error": error}
    uid = os.getuid()
    memo = cache_dir(env) / "runsc-probe.json"
    key = _key(path, uid)
    if use_cache:
        try:
            data = json.loads(safefs.read_owned_file(str(memo), 16 << 10) or b"{}")
            if isinstance(data, dict) and data.get("key") == key and isinstance(data.get("platform"), str) \
                    and data["platform"] in ("systrap", "ptrace"):
                return {"runsc": path, "runsc_version": data.get("version") if isinstance(data.get("version"), str)
                        else None, "runsc_platform": data["platform"], "runsc_error": None}
        except (OSError, ValueError):
            pass
    line, _ = version(path)
    chosen = platform(path)
    error = probe_run(path, chosen, uid != 0)
    if error is not None:
        return {"runsc": path, "runsc_version": line, "runsc_platform": chosen, "runsc_error": f"{error}; {FIX}"}
    if use_cache:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            safefs.write_file(str(memo), json.dumps({"key": key, "version": line, "platform": chosen}).encode(), 0o600)
        except OSError:
            pass
    return {"runsc": path, "runsc_version": line, "runsc_platform": chosen, "runsc_error": None}


def rows(got: Mapping[str, str | None], today: datetime.date | None = None) -> list[tuple[str, bool, str]]:
    """doctor's rows from `facts()`: runsc (path and release, a warning when it is over a year old), its
    platform and rootless use, and the probe run (the gvisor tier only; never a failure of the others)."""
    path = got["runsc"]
    if path is None:
        return [("gvisor: runsc", False, f"{got['runsc_error']} (the gvisor tier only)")]
    line = got["runsc_version"]
    m = _VERSION.search(line or "")
    try:
        date = datetime.date(int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None
    except ValueError:
        date = None
    today = today or datetime.date.today()
    age = f"; warning: released {date.isoformat()}, over a year ago; fix: {NEWER}" if date and (
        today - date).days > STALE_DAYS else ""
    rootless = "rootless (--rootless)" if os.getuid() != 0 else "as root"
    out = [
        ("gvisor: runsc", True, f"{path}: {line or 'version unknown'}{age}"),
        ("gvisor: platform", True, f"{got['runsc_platform']} ({rootless}; never kvm)"),
        ("gvisor: probe", got["runsc_error"] is None, got["runsc_error"] or "runsc do true starts a sandbox"),
    ]
    if got["runsc_error"] is None:  # a warning, never a failure: the Python init does the same, slower
        init, note = got.get("gvisor_init"), got.get("gvisor_init_note")
        out.append(("gvisor: init", True, note if init else f"the Python init ({note}; it costs ~100 ms a launch more)"))
    return out
