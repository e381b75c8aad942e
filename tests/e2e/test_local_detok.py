"""`--detokenize local` with real processes: a tokenizer, a sim engine and two routers over one
Redis, one detokenizing through the tokenizer's Detokenize stream, one in its own process
(router_svc/local_detok.py). The sim's greedy tokens are a pure function of the prompt, so the
two routers must send the client the same text, token for token, stop strings included; and a
router given tokenizer files that are not the tokenizer service's refuses to start."""

from __future__ import annotations

import json

import pytest

from services.client import Client
from services.errors import Reason, TokenrelayError
from tests.e2e.prockit import KEYS, Procs
from tests.meshkit import scrape
from tests.waiting import poll

PROMPTS = ["local or remote", "the same text either way", "x" * 300, "naïve 世界 🙂"]


@pytest.fixture
async def routers(tmp_path, redis_url):
    p = Procs(tmp_path, redis_url)
    try:
        await p.upstreams(engines=1)
        p.router("remote")
        p.router("local", "--detokenize", "local", "--tokenizer-files", str(p.model))
        await p.ready("remote", "local")
        yield p
    finally:
        p.stop()


async def test_local_detokenization_sends_what_the_tokenizer_service_sends(routers):
    p = routers
    sent = 0
    async with Client(p.addr["remote"], KEYS["t1"]) as remote, Client(p.addr["local"], KEYS["t1"]) as local:
        for prompt in PROMPTS:
            want = await remote.generate(prompt, max_tokens=48, ignore_eos=True, return_token_ids=True)
            got = await local.generate(prompt, max_tokens=48, ignore_eos=True, return_token_ids=True)
            sent += 1
            assert got.token_ids == want.token_ids   # the same engine output ...
            assert got.text == want.text             # ... turned into the same text
            assert got.finished.finish_reason == want.finished.finish_reason == "length"
            # A stop string from the middle of that text: both stop there, at the same token.
            stop = want.text[len(want.text) // 2:len(want.text) // 2 + 2]
            if not stop.strip("\ufffd"):
                continue
            want_stop = await remote.generate(prompt, max_tokens=48, ignore_eos=True, stop=[stop])
            got_stop = await local.generate(prompt, max_tokens=48, ignore_eos=True, stop=[stop])
            sent += 1
            assert (got_stop.text, got_stop.finished.finish_reason, got_stop.finished.stop_reason) == (
                want_stop.text, want_stop.finished.finish_reason, want_stop.finished.stop_reason)
            assert got_stop.finished.finish_reason == "stop" and stop not in got_stop.text
            assert got_stop.finished.completion_tokens == want_stop.finished.completion_tokens
    assert sent > len(PROMPTS)   # some stop strings were tried
    # Each router's requests were detokenized where it was told: the tokenizer service's count is
    # the remote router's requests alone, the local router counts its own.
    def detokenized(name: str) -> float:
        return sum(v for (metric, _), v in scrape(p.metrics[name]).items()
                   if metric == "tokenrelay_tokenizer_detok_requests_total")
    assert detokenized("tok") == sent
    assert detokenized("local") == sent


async def test_a_request_that_ends_early_leaves_no_state_in_the_router(routers):
    p = routers
    async with Client(p.addr["local"], KEYS["t1"]) as local:
        with pytest.raises(TokenrelayError) as cut:   # the call's deadline, mid-stream
            await local.generate("cut short " * 20, max_tokens=4000, ignore_eos=True, timeout=0.5)
        assert cut.value.reason == Reason.DEADLINE_EXCEEDED
        result = await local.generate("after", max_tokens=5, ignore_eos=True)
        assert result.finished.completion_tokens == 5

    def open_requests() -> float:
        return sum(v for (name, labels), v in scrape(p.metrics["local"]).items()
                   if name == "tokenrelay_tokenizer_detok_requests_total" and ("outcome", "closed") in labels)
    await poll(lambda: open_requests() >= 1, timeout=10, what="the cut request's state to be dropped")


async def test_tokenizer_files_that_are_not_the_services_are_refused_at_start(tmp_path, redis_url):
    from tokenizers import Tokenizer, models, pre_tokenizers

    other = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "other").mkdir()
    other.save(str(tmp_path / "other" / "tokenizer.json"))
    (tmp_path / "other" / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    p = Procs(tmp_path, redis_url)
    try:
        await p.upstreams(engines=1)
        p.router("wrong", "--detokenize", "local", "--tokenizer-files", str(tmp_path / "other"))
        await poll(lambda: p.procs["wrong"].poll() is not None, timeout=60, what="the router to refuse")
        assert p.procs["wrong"].returncode != 0
        log = p.log("wrong")
        assert "is not the tokenizer service's tokenizer" in log and "vocabulary 3 here" in log, log
    finally:
        p.stop()
