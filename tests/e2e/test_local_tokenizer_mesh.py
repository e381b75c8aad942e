"""`--detokenize local` and `--tokenize-local-bytes` with real processes: a tokenizer, a sim engine
and three routers over one Redis: one using the tokenizer service for both, one detokenizing in its
own process (router_svc/local_detok.py), one tokenizing short prompts there too
(router_svc/local_tokenize.py). The sim's greedy tokens are a pure function of the prompt ids, so
every router must send the client the same ids and the same text, token for token, stop strings
and chats included; and a router given tokenizer files that are not the tokenizer service's
refuses to start."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from services.client import Client, Finished, TextDelta
from services.errors import Reason, TokenrelayError
from tests.e2e.prockit import KEYS, Procs
from tests.meshkit import scrape
from tests.waiting import poll
from tokenrelay_tools.cli.launcher import engine_args_for

PROMPTS = ["local or remote", "the same text either way", "x" * 300, "naïve 世界 🙂"]


@pytest.fixture
async def routers(tmp_path, redis_url):
    p = Procs(tmp_path, redis_url)
    try:
        await p.upstreams(engines=1)
        p.router("remote")
        p.router("local", "--detokenize", "local", "--tokenizer-files", str(p.model))
        p.router("both", "--detokenize", "local", "--tokenize-local-bytes", "200", "--tokenizer-files", str(p.model))
        await p.ready("remote", "local", "both")
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


async def test_short_prompts_tokenized_in_the_router_get_the_tokenizer_services_ids(routers):
    p = routers
    async with Client(p.addr["remote"], KEYS["t1"]) as remote, Client(p.addr["both"], KEYS["t1"]) as both:
        # PROMPTS[2] (300 bytes) is over the local bound: it goes to the tokenizer service.
        for prompt in [*PROMPTS, "<|endoftext|> is only text here"]:
            want = await remote.generate(prompt, max_tokens=24, ignore_eos=True, return_token_ids=True)
            got = await both.generate(prompt, max_tokens=24, ignore_eos=True, return_token_ids=True)
            assert got.finished.prompt_tokens == want.finished.prompt_tokens, prompt
            assert (got.token_ids, got.text) == (want.token_ids, want.text), prompt
        # The third turn takes the conversation past the 200-byte bound whether the 16-token replies
        # are 16 bytes (printable ASCII ids) or 48 (lone bytes the detokenizer replaces).
        turns = ["hello there", "and a second turn, longer than the first one " * 2, "a third turn " * 6]
        history, local_chats = [("system", "be brief")], 0
        async with remote.chat(system="be brief", session_id="s1") as a, both.chat(system="be brief",
                                                                                   session_id="s1") as b:
            for turn in turns:
                want = await a.say(turn, max_tokens=16, ignore_eos=True)
                got = await b.say(turn, max_tokens=16, ignore_eos=True)
                assert got.finished.prompt_tokens == want.finished.prompt_tokens
                assert got.text == want.text
                history.append(("user", turn))
                local_chats += sum(len(r.encode()) + len(c.encode()) for r, c in history) <= 200
                history.append(("assistant", want.text))
    assert 0 < local_chats < len(turns)   # the conversation outgrew the bound: both paths ran
    # Each finished turn's conversation with its reply was tokenized ahead of the next turn (which
    # still got the service's ids above) where it was within the bound, and left alone past it.

    def prefetched() -> dict[str, float]:
        return {dict(labels)["outcome"]: v for (metric, labels), v in scrape(p.metrics["both"]).items()
                if metric == "tokenrelay_router_chat_prefetch_total"}

    outcomes = await poll(lambda: sum(prefetched().values()) == len(turns) and prefetched(), what="prefetches")
    assert outcomes.get("done", 0) >= 1 and outcomes.get("failed", 0) == 0
    assert not any(metric == "tokenrelay_router_chat_prefetch_total" and v
                   for (metric, _), v in scrape(p.metrics["remote"]).items())   # nothing to tokenize ahead with
    # Encoded in the router: the two start probes, the short texts (all but the 300-byte one), the
    # chats within the bound, the prefetches; the rest went to the tokenizer service.
    tokenized = sum(v for (metric, labels), v in scrape(p.metrics["both"]).items()
                    if metric == "tokenrelay_tokenizer_tokenize_inputs_total")
    assert tokenized == 2 + len(PROMPTS) + local_chats + outcomes["done"]


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


async def test_a_chat_template_override_must_be_given_to_the_router_too(tmp_path, redis_url):
    p = Procs(tmp_path, redis_url)
    try:
        p.spawn("tok", "tokenizer_svc", "--tokenizer", str(p.model), "--chat-template", "gemma")
        p.spawn("e0", "engine_svc", "--backend", "sim", "--model", str(p.model), *engine_args_for(p.model, "sim"))
        await p.ready("tok", "e0")
        local = ["--tokenize-local-bytes", "4096", "--tokenizer-files", str(p.model)]
        p.router("plain", *local)
        p.router("same", *local, "--tokenizer-chat-template", "gemma")
        await p.ready("same")
        await poll(lambda: p.procs["plain"].poll() is not None, timeout=60, what="the router to refuse")
        assert p.procs["plain"].returncode != 0
        assert "a probe chat encodes to other ids" in p.log("plain") and "--tokenizer-chat-template" in p.log("plain")
        async with Client(p.addr["same"], KEYS["t1"]) as client:
            async with client.chat(system="s") as chat:
                reply = await chat.say("hi", max_tokens=3, ignore_eos=True)
        assert reply.finished.completion_tokens == 3
    finally:
        p.stop()


async def test_a_tokenizer_killed_mid_stream_costs_local_detokenization_nothing(routers):
    p = routers

    async def run(address: str, first: asyncio.Event) -> object:
        async with Client(address, KEYS["t1"]) as client:
            n = 0
            try:
                async for event in client.stream("keep going", max_tokens=120, ignore_eos=True):
                    if isinstance(event, TextDelta):
                        first.set()
                    if isinstance(event, Finished):
                        n = event.completion_tokens
            except TokenrelayError as exc:
                return exc.reason
            return n

    started = {name: asyncio.Event() for name in ("remote", "local")}
    runs = {name: asyncio.create_task(run(p.addr[name], started[name])) for name in started}
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 30)
    p.procs["tok"].send_signal(signal.SIGKILL)
    got = {name: await asyncio.wait_for(task, 60) for name, task in runs.items()}
    assert got["local"] == 120                              # finished: it needed no tokenizer any more
    assert got["remote"] == Reason.UPSTREAM_UNAVAILABLE     # its Detokenize stream broke: typed, retryable
