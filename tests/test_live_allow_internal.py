"""`invoke allow NAME` for a name that resolves to an internal address: an unpinned rule would never reach
it (the DNS-rebinding guard denies the name anyway), so the allow is refused with one line naming the
pinned entry that does what was meant. The twins: that pinned entry, and a name with public addresses,
are allowed. Through the real CLI and the real control socket of a real proxy (its resolver stands in for
DNS: no name here resolves to an internal address without editing /etc/hosts)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from relay.egress import control
from relay.egress.decision_log import DecisionLog
from relay.egress.proxy import EgressProxy
from relay.model.refusal import ENTRY

from .conftest import Sandbox

ADDRS = {"inside.test": ["10.1.2.3"], "mixed.test": ["93.184.216.34", "192.168.7.7"], "zero.test": ["0.0.0.0"],
         "public.test": ["93.184.216.34"]}


def _resolver(host: str, port: int) -> list[str]:
    if host not in ADDRS:
        raise OSError("Name or service not known")
    return ADDRS[host]


def test_allow_of_a_name_with_an_internal_address_names_the_pinned_form(sandbox: Sandbox, tmp_path: Path) -> None:
    base = tmp_path / "ctl"
    base.mkdir(mode=0o700)
    run_id = f"{control.liveness.me().token()}-1a2b3c4d"
    run_dir = base / f"hive-relay-{run_id}"
    run_dir.mkdir(mode=0o700)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    proxy = EgressProxy(listener, (), DecisionLog(str(tmp_path / "egress.jsonl"), "test"), notify=None,
                        resolver=_resolver, run_id=run_id, control=control.listen(str(run_dir)))
    proxy.start()
    env = {**sandbox.env, "XDG_RUNTIME_DIR": str(base)}

    def allow(entry: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "relay", "allow", entry], cwd=sandbox.workdir, env=env,
                              capture_output=True, text=True, timeout=60)

    try:
        refused = allow("inside.test")
        assert refused.returncode == 2, refused
        assert refused.stderr.strip().splitlines() == [
            f"hive-relay: error: run {run_id}: inside.test:443 resolves to internal address 10.1.2.3, which an "
            "unpinned name is never connected to (DNS rebinding guard), so allowing it would still deny it; fix: "
            f"pin it to the address meant: {ENTRY} allow inside.test:443=10.1.2.3:443 --run {run_id}"], refused.stderr
        port = allow("mixed.test:8443")  # one internal address among public ones is enough; its port is kept
        assert port.returncode == 2 and "resolves to internal address 192.168.7.7" in port.stderr
        assert f"{ENTRY} allow mixed.test:8443=192.168.7.7:8443" in port.stderr, port.stderr
        zero = allow("zero.test")  # 0.0.0.0 is never a connect target: no pin of it is suggested
        assert zero.returncode == 2 and "resolves to internal address 0.0.0.0" in zero.stderr
        assert "=0.0.0.0" not in zero.stderr and "NAME:PORT=ADDR:PORT" in zero.stderr, zero.stderr
        assert proxy.rules == ()  # nothing was added by the refusals
        # The twins: the pinned form the error named, a public name, and a name DNS does not know (yet).
        for entry in ("inside.test:443=10.1.2.3:443", "public.test", "unknown.test"):
            ok = allow(entry)
            assert ok.returncode == 0 and f"allowed {entry}" in ok.stdout, ok
        assert [r.render() for r in proxy.rules] == ["inside.test:443=10.1.2.3:443", "public.test", "unknown.test"]
    finally:
        proxy.stop()
