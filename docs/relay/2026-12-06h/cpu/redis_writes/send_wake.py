"""How long a send() of one PING to an idle redis-server takes after the sender slept or spun GAP s (the send
wakes Redis; measurement only, docs/benchmarks.md, eighth session). Start Redis first:
    redis-server --port 0 --unixsocket /tmp/wr/r.sock --save "" --appendonly no --daemonize yes
    taskset -c 1 python send_wake.py sleep   # or spin
"""

import socket
import statistics
import sys
import time

s = socket.socket(socket.AF_UNIX)
s.connect("/tmp/wr/r.sock")
cmd = b"*1\r\n$4\r\nPING\r\n"
for gap in (0, 0.002, 0.02, 0.15):
    ts = []
    for _ in range(60 if gap >= 0.1 else 300):
        if gap:
            t_end = time.perf_counter() + gap
            if sys.argv[1] == "spin":
                while time.perf_counter() < t_end:
                    pass
            else:
                time.sleep(gap)
        t0 = time.perf_counter()
        s.send(cmd)
        t1 = time.perf_counter()
        s.recv(100)
        ts.append((t1 - t0) * 1e6)
    print(sys.argv[1], gap, f"send p50 {statistics.median(ts):.1f} us p90 {statistics.quantiles(ts, n=10)[-1]:.1f}")
