"""What a Redis command's write costs the loop (measurement only; docs/benchmarks.md, eleventh session): the
first write to an idle Redis over a unix socket after 10 ms asleep, two more right after it, and three
commands in one write.   python docs/relay/2026-12-07b/cpu/wcost.py uvloop|asyncio   (redis-server on PATH)
"""

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

import uvloop

SOCK = os.path.join(tempfile.mkdtemp(), "r.sock")
CMD = b"*2\r\n$3\r\nGET\r\n$3\r\nfoo\r\n"


class Replies(asyncio.Protocol):
    def __init__(self) -> None:
        self.lines = 0
        self.want = 0
        self.waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.lines += data.count(b"\r\n")
        if self.waiter is not None and self.lines >= self.want:
            self.waiter.set_result(None)
            self.waiter = None

    def expect(self, n: int) -> asyncio.Future[None]:
        self.lines, self.want = 0, n
        self.waiter = asyncio.get_running_loop().create_future()
        return self.waiter


def us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


async def main() -> None:
    loop = asyncio.get_running_loop()
    tr, pr = await loop.create_unix_connection(Replies, SOCK)
    first: list[float] = []
    more: list[float] = []
    together: list[float] = []
    for _ in range(400):
        await asyncio.sleep(0.01)
        done = pr.expect(3)
        t0 = time.perf_counter()
        tr.write(CMD)
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tr.write(CMD)
        tr.write(CMD)
        more.append(time.perf_counter() - t0)
        await done
        await asyncio.sleep(0.01)
        done = pr.expect(3)
        t0 = time.perf_counter()
        tr.write(CMD * 3)
        together.append(time.perf_counter() - t0)
        await done
    print(f"{sys.argv[1]}: first write {us(first):.1f} us, two more writes right after {us(more):.1f} us, "
          f"one write of three {us(together):.1f} us (medians)")


if __name__ == "__main__":
    redis = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", SOCK, "--save", ""],
                             stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    try:
        if sys.argv[1] == "asyncio":
            asyncio.run(main())
        else:
            uvloop.run(main())
    finally:
        redis.terminate()
