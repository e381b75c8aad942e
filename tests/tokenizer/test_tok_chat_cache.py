"""Incremental chat tokenization equals full tokenization, turn after turn (issue: no re-tokenizing
whole conversations), on every tokenizer, with templates that keep and that rewrite earlier text."""

from __future__ import annotations

import pytest
from tok_artefacts import CHATML_TEMPLATE, LLAMA2_TEMPLATE
from tokenizers import Tokenizer

from services.tokenization.chat_cache import ChatPrefixCache, Plan
from services.tokenization.chat_template import BUILTIN_TEMPLATES, ChatTemplate
from services.tokenization.encoder import ChatInput, Encoder, EncoderLimits
from services.tokenization.loader import LoadedTokenizer

# Templates that rewrite earlier text as the conversation grows: the prefix must shrink, not lie.
COUNTING_TEMPLATE = ("{{ bos_token }}<|im_start|>system\nThis conversation has {{ messages|length }} messages"
                     "<|im_end|>\n" + CHATML_TEMPLATE)
WINDOW_TEMPLATE = ("{% for m in messages[-3:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATES = {"chatml": CHATML_TEMPLATE, "llama2": LLAMA2_TEMPLATE, "gemma": BUILTIN_TEMPLATES["gemma"],
             "counting": COUNTING_TEMPLATE, "window": WINDOW_TEMPLATE}
USER_TURNS = ["Hello! Ünïcödé café, 日本語のテキスト 👩‍👩‍👧‍👦", "  leading spaces and\ttabs\n\nnewlines",
              "def f(x):\n    return x  # code", "مرحبا بالعالم שלום", "e\u0301 combining marks", "last one?"]
REPLIES = [" Sure.", "Answer with trailing space ", "```py\nprint(1)\n```", " 🙂", "ok", "Done."]


def _full(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _incremental(cache: ChatPrefixCache, tok: Tokenizer, key: str, text: str) -> list[int]:
    plan = cache.plan(key, text)
    ids = cache.complete(plan, tok.encode(plan.suffix, add_special_tokens=False))
    assert ids is not None
    return ids


def _with_markers(loaded: LoadedTokenizer, template: str) -> Tokenizer:
    """A copy of the tokenizer in which the turn markers the template writes are special tokens,
    as they are in any real model that uses such a template (the shared fixture stays untouched)."""
    tok = Tokenizer.from_str(loaded.tokenizer.to_str())
    markers = [m for m in ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>") if m in template]
    if "bos_token" in template or "eos_token" in template:
        markers += ["<s>", "</s>"]
    tok.add_special_tokens(markers)
    return tok


@pytest.mark.parametrize("template_name", sorted(TEMPLATES))
@pytest.mark.parametrize("with_system", [True, False])
def test_incremental_equals_full_every_turn(any_tokenizer, template_name, with_system):
    source = TEMPLATES[template_name]
    tok = _with_markers(any_tokenizer, source)
    template = ChatTemplate(source, template_name, {"bos_token": "<s>", "eos_token": "</s>"})
    cache = ChatPrefixCache(tok)
    messages = [{"role": "system", "content": "You are terse. Ça va?"}] if with_system else []
    for turn, (user, reply) in enumerate(zip(USER_TURNS, REPLIES, strict=True)):
        messages.append({"role": "user", "content": user})
        text = template.render(messages, True)
        assert _incremental(cache, tok, "s1", text) == _full(tok, text), f"turn {turn}"
        messages.append({"role": "assistant", "content": reply})
    if template_name in ("chatml", "gemma", "llama2"):
        # Append-only templates: every turn after the first reused the earlier tokens.
        assert cache.hits == len(USER_TURNS) - 1
        assert cache.reused_tokens > 0


def test_template_rewriting_earlier_text_reuses_less(tiny_bl):
    tok = _with_markers(tiny_bl, COUNTING_TEMPLATE)
    counting = ChatTemplate(COUNTING_TEMPLATE, "counting", {"bos_token": "<s>", "eos_token": "</s>"})
    appending = ChatTemplate(CHATML_TEMPLATE, "chatml", {})
    reuse = {}
    for name, template in (("counting", counting), ("appending", appending)):
        cache = ChatPrefixCache(tok)
        messages: list[dict[str, str]] = []
        for user, reply in zip(USER_TURNS, REPLIES, strict=True):
            messages.append({"role": "user", "content": user})
            text = template.render(messages, True)
            assert _incremental(cache, tok, "k", text) == _full(tok, text)
            messages.append({"role": "assistant", "content": reply})
        reuse[name] = cache.reused_tokens
    # The message count sits in the first line: the counting template can reuse at most a BOS.
    assert reuse["counting"] <= len(USER_TURNS)
    assert reuse["appending"] > 10 * reuse["counting"]


def test_keys_are_isolated_and_budget_evicts(tiny_bl):
    tok = _with_markers(tiny_bl, CHATML_TEMPLATE)
    template = ChatTemplate(CHATML_TEMPLATE, "chatml", {})
    cache = ChatPrefixCache(tok, max_tokens=200)
    first = template.render([{"role": "user", "content": USER_TURNS[0]}], True)
    _incremental(cache, tok, "tenant-a/s", first)
    # Another key never sees tenant-a's prefix.
    assert cache.plan("tenant-b/s", first).anchor_id is None
    for i in range(20):
        _incremental(cache, tok, f"k{i}", template.render([{"role": "user", "content": f"m{i} " * 5}], True))
    assert cache.plan("tenant-a/s", first).anchor_id is None  # evicted by the token budget
    assert len(cache) < 21


async def test_encoder_uses_the_cache_and_falls_back_safely(tiny_bl, monkeypatch):
    tiny_bl.tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])  # a fresh load per test
    template = ChatTemplate(CHATML_TEMPLATE, "chatml", {})
    encoder = Encoder(tiny_bl, template, EncoderLimits(), workers=1)
    await encoder.start()
    try:
        messages = [{"role": "user", "content": USER_TURNS[0]}]
        for user, reply in zip(USER_TURNS[1:], REPLIES, strict=False):
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": user}]
            (ids,) = await encoder.tokenize([ChatInput(list(messages), True, cache_key="sess")])
            assert ids == _full(tiny_bl.tokenizer, template.render(messages, True))
        assert encoder.chat_cache is not None and encoder.chat_cache.hits >= 3
        # A plan whose boundary guard fails (wrong anchor id) must fall back to the whole text.
        real_plan = encoder.chat_cache.plan

        def bad_plan(key: str, text: str) -> Plan:
            plan = real_plan(key, text)
            return Plan(plan.key, plan.text, plan.prefix, plan.cut, -1, plan.prefix_anchors)

        monkeypatch.setattr(encoder.chat_cache, "plan", bad_plan)
        messages += [{"role": "assistant", "content": "x"}, {"role": "user", "content": "again"}]
        (ids,) = await encoder.tokenize([ChatInput(list(messages), True, cache_key="sess")])
        assert ids == _full(tiny_bl.tokenizer, template.render(messages, True))
    finally:
        await encoder.close()

