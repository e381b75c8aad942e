"""The whole path on either event loop (services/eventloop.py): tokenizer, engine and router as real
processes on uvloop or on the standard loop (the mesh-wide TOKENRELAY_EVENT_LOOP), a Generate to its
end, a Cancel from a second connection, a bad request typed. Every other e2e test runs on the default
(`auto`: uvloop where installed), so this keeps the standard loop covered too."""

from __future__ import annotations

import pytest

from services.client import Client
from services.errors import InvalidArgument
from tests.e2e.prockit import KEYS, Procs, first_delta, outcome

pytest.importorskip("uvloop")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_the_mesh_serves_on_either_loop(loop: str, tmp_path, redis_url, monkeypatch) -> None:
    monkeypatch.setenv("TOKENRELAY_EVENT_LOOP", loop)
    p = Procs(tmp_path, redis_url)
    try:
        await p.upstreams(engines=1)
        p.router("r")
        await p.ready("r")
        for name in ("tok", "e0", "r"):
            assert f"event_loop_running={loop}" in (tmp_path / f"{name}.log").read_text(), p.log(name)
        async with Client(p.addr["r"], KEYS["t1"]) as a, Client(p.addr["r"], KEYS["t1"]) as b:
            done = await a.generate("hello", max_tokens=12, ignore_eos=True)
            assert done.finished.completion_tokens == 12 and done.text
            stream = a.stream("hold on", max_tokens=5000, ignore_eos=True, request_id="long")
            await first_delta(stream)
            assert await b.cancel("long") is True
            assert await outcome(stream) == "cancelled"
            with pytest.raises(InvalidArgument):
                await a.generate("x", max_tokens=4, top_p=2.0)
    finally:
        p.stop()
