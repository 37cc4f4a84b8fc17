"""The real egress proxy with one credential route, for the credential-route benchmark: route
`/bench` sends `x-api-key` to bench.test:443, pinned to the local TLS server, verified against the
benchmark's throwaway CA. Its own process, as in a real run (the launcher holds it, not the client).

    credproxy.py CAFILE UPSTREAM_PORT   (prints its port, then serves until killed)
"""

import socket
import ssl
import sys
import time

from relay.egress.proxy import DecisionLog, EgressProxy
from relay.model.allow_rules import parse_rule
from relay.model.backend import CredentialRoute


def main() -> None:
    cafile, upstream = sys.argv[1], int(sys.argv[2])
    route = CredentialRoute("bench", ("BENCH_KEY",), "bench.test", 443, "x-api-key")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    proxy = EgressProxy(listener, (parse_rule(f"bench.test:443=127.0.0.1:{upstream}"),), DecisionLog(None, "bench"),
                        routes=(route,), keys={"bench": "sk-bench-" + "k" * 40},
                        tls=ssl.create_default_context(cafile=cafile), notify=None)
    proxy.start()
    print(listener.getsockname()[1], flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
