"""The router follows its tokenizer replicas while it serves (a `dns:` entry of a scaled Deployment):
a replica that appears gets work at once, one that goes is retired once its Detokenize sessions end,
and nothing in flight fails across the change. Real tokenizer services on loopback; the DNS answers
are scripted (a test cannot change what a name resolves to), the rest is `TokenizerDiscovery` and
`TokenizerUpstream` as the router runs them."""

from __future__ import annotations

import asyncio
import pathlib

from router_svc.discovery import TokenizerDiscovery
from router_svc.tokenizer_upstream import TokenizerUpstream
from tests.tokenizer.tok_artefacts import build_bytelevel
from tests.waiting import poll
from tokenizer_svc.app import TokenizerApp
from tokenizer_svc.config import TokenizerSettings


async def test_replicas_added_and_removed_while_serving(tmp_path: pathlib.Path) -> None:
    directory = build_bytelevel(tmp_path / "tok")
    apps = [TokenizerApp(TokenizerSettings(tokenizer=str(directory), port=0, workers=1, shutdown_grace=0.2))
            for _ in range(2)]
    for app in apps:
        await app.start()
    a, b = (app.address for app in apps)
    answer: list[str] = [a]

    async def scripted(entries: list[str], timeout: float) -> list[str] | None:
        return list(answer) if answer else None     # None: the lookup failed

    upstream = TokenizerUpstream([a], timeout=10)
    discovery = TokenizerDiscovery(["dns:tokenizers.example:7000"], upstream, interval=0.05, resolver=scripted)
    try:
        await upstream.info()
        assert discovery.follows
        discovery.start()
        want = [12, 345, 55]                                  # an id sequence every replica decodes alike
        expected = await upstream.tokenize(text="hello there")
        session = upstream.detokenizer("held")               # opened on a, kept open across the change
        session.start([], False, [], {})
        answer[:] = [a, b]                                    # scaled up
        await poll(lambda: upstream.addresses == [a, b], what="the new replica in rotation")
        calls_b = apps[1].encoder.batcher.batches_run         # type: ignore[union-attr]
        for _ in range(6):
            assert await upstream.tokenize(text="hello there") == expected
        assert apps[1].encoder.batcher.batches_run > calls_b  # type: ignore[union-attr]
        answer[:] = []                                        # a failed lookup: nothing changes
        await asyncio.sleep(0.2)
        assert upstream.addresses == [a, b]
        answer[:] = [b]                                       # scaled down: a is retired
        await poll(lambda: upstream.addresses == [b], what="a out of rotation")
        calls_a = apps[0].encoder.batcher.batches_run         # type: ignore[union-attr]
        for _ in range(4):
            assert await upstream.tokenize(text="hello there") == expected
        assert apps[0].encoder.batcher.batches_run == calls_a  # type: ignore[union-attr]
        session.send(want, final=True)                        # the session on a still finishes
        out = await asyncio.wait_for(session.next(), 10)
        assert getattr(out, "finished", False) and getattr(out, "tokens_consumed", 0) == len(want), out
        session.close(flushed=True)
        await poll(lambda: not upstream._retired, timeout=10, what="a closed once idle")
        fresh = upstream.detokenizer("after")                 # new sessions open on b
        fresh.start([], False, [], {})
        fresh.send(want, final=True)
        assert getattr(await asyncio.wait_for(fresh.next(), 10), "finished", False)
        fresh.close(flushed=True)
    finally:
        await discovery.close()
        await upstream.close()
        for app in apps:
            await app.stop()
