"""Prometheus plumbing shared by every service: the /metrics endpoint and common buckets.

Each service defines its own metrics in its own module with these buckets; names follow
Prometheus conventions (`_seconds`, `_total`) and are documented in docs/metrics.md.
"""

from __future__ import annotations

from prometheus_client import start_http_server

# From 1 ms to 2 min: TTFT and end-to-end latency under load span five orders of magnitude.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0,
                   1.5, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)
# Inter-token latency: 0.1 ms (coalesced chunks on a fast GPU) to 2 s (a stalled engine).
ITL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
               0.075, 0.1, 0.2, 0.5, 1.0, 2.0)
FAST_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5)


def start_metrics_server(host: str, port: int) -> int:
    """Serve /metrics on host:port (0 = ephemeral) in a daemon thread; return the bound port.

    A negative port disables the endpoint and returns -1.
    """
    if port < 0:
        return -1
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_port)
