"""The real egress proxy with one credential route, for the credential-route benchmark: route
`/bench` sends `x-api-key` to bench.test:443, pinned to the local TLS server, verified against the
benchmark's throwaway CA. Its own process, as in a real run (the launcher holds it, not the client).

    credproxy.py CAFILE UPSTREAM_PORT [noscan]   (prints its port and its CPU clock's port, then serves until killed)

With `noscan`, the proxy as it was before the outbound secret scan (relay/egress/secret_scan.py): no
host secrets searched for in requests, and a 2xx body searched for the key's two ends only, not
its middle. The benchmark runs both in the same run, for the scan's cost as a ratio.
"""

import random
import socket
import ssl
import string
import sys
import time

from relay.egress.proxy import DecisionLog, EgressProxy
from relay.model.allow_rules import parse_rule
from relay.model.backend import CredentialRoute


def main() -> None:
    cafile, upstream = sys.argv[1], int(sys.argv[2])
    scan = sys.argv[3:] != ["noscan"]
    # Shaped as a real key (an Anthropic key is 108 characters): the scrub's cost grows with its length.
    rng = random.Random(29)  # one generator: a new one per character made the key 95 times the same letter,
    # which the scrubber's searches find (and dismiss) far faster than a real key's (helper round, stop 45)
    key = "sk-ant-api03-" + "".join(rng.choice(string.ascii_letters + string.digits + "-_") for _ in range(95))
    secrets = None
    if scan:  # the route's key, and a deny-listed SSH key's lines, as a real run holds them
        import base64

        from relay.egress.secret_scan import HostSecrets, Secret, secret_forms

        lines = tuple(base64.b64encode(random.Random(i).randbytes(54)).decode()[:70] for i in range(5))
        secrets = HostSecrets([secret_forms("the bench route's key", key), Secret("an SSH key", lines, tuple(70 for _ in lines))])
    else:
        from relay.egress import redact, routes

        class EndsOnly(redact.Redactor):
            def __init__(self, forms, least=None) -> None:  # noqa: ANN001
                super().__init__(forms, least)
                self.ends = [b for b in self.ends if b[1] == 0 or b[1] + len(b[2]) == len(b[0])]

        routes.Redactor = EndsOnly
    route = CredentialRoute("bench", ("BENCH_KEY",), "bench.test", 443, "x-api-key")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    proxy = EgressProxy(listener, (parse_rule(f"bench.test:443=127.0.0.1:{upstream}"),), DecisionLog(None, "bench"),
                        routes=(route,), keys={"bench": key},
                        tls=ssl.create_default_context(cafile=cafile), notify=None, secrets=secrets)
    proxy.start()
    print(listener.getsockname()[1], flush=True)
    # Its own CPU time, for the bench to read between rounds: CLOCK_PROCESS_CPUTIME_ID counts every
    # thread, the finished ones too, to the nanosecond (/proc's utime and stime tick every 10 ms, ±7% of
    # a quick run's sum: more than the scan's cost being measured).
    clock = socket.socket()
    clock.bind(("127.0.0.1", 0))
    clock.listen(8)
    print(clock.getsockname()[1], flush=True)
    while True:
        conn, _ = clock.accept()
        with conn:
            conn.sendall(repr(time.process_time()).encode())


if __name__ == "__main__":
    main()
