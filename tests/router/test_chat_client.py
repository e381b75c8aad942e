"""The typed client over a real router: a failed chat turn raises its typed error and the session
goes on; coarser deltas on request."""

from __future__ import annotations

import pathlib

import pytest

from services.client import Client, InvalidArgument, TextDelta
from services.errors import Reason
from tests.router.test_request_defects import router_mesh


async def test_a_failed_turn_raises_typed_and_the_session_stays_usable(tmp_path: pathlib.Path,
                                                                       redis_url: str) -> None:
    async with router_mesh(tmp_path, redis_url) as (stub, _, _):
        address = stub.address  # type: ignore[attr-defined]
        async with Client(address, "key-a") as client, client.chat() as chat:
            ok = await chat.say("hello", max_tokens=4, ignore_eos=True)
            assert ok.finished.completion_tokens == 4
            with pytest.raises(InvalidArgument) as info:
                await chat.say("again", max_tokens=4, temperature=-1.0)
            assert info.value.reason == Reason.INVALID_TEMPERATURE
            with pytest.raises(InvalidArgument) as info:
                await chat.say("x" * 10, max_tokens=4, min_delta_tokens=99_999)
            assert info.value.reason == Reason.INVALID_DELTA_OPTIONS
            again = await chat.say("still there?", max_tokens=4, ignore_eos=True)
            assert again.finished.completion_tokens == 4


async def test_min_delta_tokens_gives_fewer_fuller_deltas(tmp_path: pathlib.Path, redis_url: str) -> None:
    async with router_mesh(tmp_path, redis_url) as (stub, _, _):
        async with Client(stub.address, "key-a") as client:  # type: ignore[attr-defined]
            fine = [e async for e in client.stream("hello", max_tokens=40, ignore_eos=True, return_token_ids=True)]
            coarse = [e async for e in client.stream("hello", max_tokens=40, ignore_eos=True, return_token_ids=True,
                                                     min_delta_tokens=10)]
    sizes = [len(e.token_ids) for e in coarse if isinstance(e, TextDelta)]
    assert sum(sizes) == 40 and sum(len(e.token_ids) for e in fine if isinstance(e, TextDelta)) == 40
    # the first delta goes at once; every other but the last holds at least 10 tokens
    assert all(n >= 10 for n in sizes[1:-1]) and len(sizes) <= 6, sizes
