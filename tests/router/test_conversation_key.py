"""Chats without a session id are tokenized incrementally too (`cache_key.tokenize_cache_key`): a
conversation that has a reply is keyed by its opening, so each turn that resends the whole
conversation finds the last turn's prefix at the tokenizer; one-shot chats get no key."""

from __future__ import annotations

from types import SimpleNamespace

from router_svc.cache_key import tokenize_cache_key
from router_svc.local_tokenize import LocalTokenize, template_of
from router_svc.types import GenerateInput, Sampling
from tests.router.core_fakes import OTHER, TENANT, core

SYSTEM = ("system", "You answer briefly.")
TURN1 = [SYSTEM, ("user", "What is a KV cache?")]
TURN2 = [*TURN1, ("assistant", "The attention keys and values kept per token."), ("user", "Why page it?")]
TURN3 = [*TURN2, ("assistant", "Fewer copies, less fragmentation."), ("user", "And share it?")]


def test_a_conversation_keeps_one_key_from_its_first_reply_on() -> None:
    assert tokenize_cache_key("t", "", TURN1) == ""                     # one-shot: no key, no cache entry
    key = tokenize_cache_key("t", "", TURN2)
    assert key.startswith("t/~") and tokenize_cache_key("t", "", TURN3) == key
    assert tokenize_cache_key("u", "", TURN3) != key                    # scoped by tenant
    other = [SYSTEM, ("user", "What is a page?"), *TURN2[2:]]
    assert tokenize_cache_key("t", "", other) != key                    # another opening
    assert tokenize_cache_key("t", "", [("system", "You answer briefly.\0user"), *TURN2[1:]]) != key
    assert tokenize_cache_key("t", "s1", TURN1) == tokenize_cache_key("t", "s1", TURN3) == "t/s1"


async def _run(c, tenant, messages) -> None:
    async for _ in c.router.generate(tenant, GenerateInput(Sampling(max_tokens=2), messages=messages)):
        pass


async def test_the_request_path_sends_the_key() -> None:
    c = core()
    for tenant, messages in ((TENANT, TURN1), (TENANT, TURN2), (TENANT, TURN3), (OTHER, TURN3)):
        await _run(c, tenant, messages)
    k = c.tokenizer.cache_keys
    assert k[0] == "" and k[1] == k[2] == tokenize_cache_key("t", "", TURN2) and k[3].startswith("u/~")


async def test_the_third_turn_is_encoded_from_the_seconds_prefix(local) -> None:
    # The tokenizer's own encoder (the one tokenizer_svc runs): turn 2 stores its prefix under the
    # conversation's key, turn 3 reuses it, and the ids are those of encoding the whole chat.
    tok = local.tokenizer
    service = SimpleNamespace(meta=SimpleNamespace(has_chat_template=True))   # never called
    lt = LocalTokenize(service, tok, template_of(tok, ""), 1 << 20)
    await lt.start()
    try:
        cache = lt.encoder.chat_cache
        assert cache is not None
        whole = await lt.tokenize(messages=TURN3)                        # no key: the plain encode
        assert (cache.hits, cache.misses) == (0, 0)
        for messages in (TURN1, TURN2, TURN3):
            ids = await lt.tokenize(messages=messages, cache_key=tokenize_cache_key("t", "", messages))
        assert (cache.hits, cache.misses) == (1, 1) and ids == whole
    finally:
        await lt.close()
