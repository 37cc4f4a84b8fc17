"""The egress proxy as a process of its own (kube mode's proxy pod): `python3 -m relay.egress.proxy_main
--config FILE`. The same EgressProxy, allowlist and credential routes as the host-side proxy of the
other modes; each decision is one JSON line on stdout (the pod's log). Keys come from this
process's environment (the proxy pod's Secret), never from the config file.

Standard library only: it runs on the box image's python3 with just the relay package copied in.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading

from relay.egress.decision_log import DecisionLog
from relay.egress.proxy import EgressProxy
from relay.egress.secret_scan import HostSecrets, secret_forms
from relay.model.backend import CredentialRoute
from relay.policy.egress import parse_entries, route_key

WORKER_STACK = 512 << 10


class StdoutLog(DecisionLog):
    """The decision log on stdout, one flushed JSON line per decision (kubectl logs reads it)."""

    def __init__(self, backend: str) -> None:
        super().__init__(None, backend)
        self._fh = open(sys.stdout.fileno(), "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
        self._opened = True


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def routes_from(config: dict) -> tuple[CredentialRoute, ...]:
    return tuple(CredentialRoute(name=r["name"], secret_env=tuple(r["secret_env"]), upstream_host=r["upstream_host"],
                                 upstream_port=int(r["upstream_port"]), send=r["send"],
                                 box_env=tuple(tuple(x) for x in r.get("box_env", ())),  # type: ignore[misc]
                                 box_args=tuple(r.get("box_args", ())),
                                 methods=tuple(r.get("methods", ())), paths=tuple(r.get("paths", ())),
                                 push=bool(r.get("push", False)), git=bool(r.get("git", False)),
                                 basic_user=str(r.get("basic_user", "x-access-token")))
                 for r in config.get("routes", ()))


def main(argv: list[str] | None = None) -> int:
    import os

    parser = argparse.ArgumentParser(prog="python3 -m relay.egress.proxy_main")
    parser.add_argument("--config", required=True)
    ns = parser.parse_args(argv)
    # Small worker stacks: the pod's memory limit may be an RLIMIT_DATA (rootless on cgroup v1,
    # kube_podman.rlimit_resources), which counts each thread's stack mapping; at the default 8 MiB a
    # 256 MiB pod ran out of threads at about 30 (two per CONNECT tunnel). The workers are shallow.
    threading.stack_size(WORKER_STACK)
    config = load(ns.config)
    host, port = config["listen"].rsplit(":", 1)
    listener = socket.create_server((host, int(port)), backlog=128, reuse_port=False)
    routes = routes_from(config)
    keys = {r.name: key for r in routes if (key := route_key(r, os.environ)) is not None}
    tls = None
    if routes:
        import ssl

        tls = ssl.create_default_context()
    # The pod holds the route keys only: they are the host secrets its outbound scan looks for.
    secrets = HostSecrets([s for name, key in keys.items() if (s := secret_forms(f"the {name} route's key", key))])
    proxy = EgressProxy(listener, parse_entries(config.get("egress", ())), StdoutLog(config["backend"]),
                        routes=routes, keys=keys, tls=tls, notify=lambda line: print(line, file=sys.stderr, flush=True),
                        secrets=secrets)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    proxy.start()
    print(json.dumps({"listening": config["listen"], "backend": config["backend"]}), file=sys.stderr, flush=True)
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
