"""Tokenize: validate inputs, render chats, encode in batches off the event loop, enforce limits.

Semantics (documented for clients):
* A call carries 1..max_batch inputs; an empty call, an input with neither text nor chat, or a
  chat without messages is `EMPTY_PROMPT`. An empty *text* is allowed and encodes to its special
  tokens only (e.g. just BOS when `add_special_tokens` is set), as the tokenizer itself does.
* Text: encoded with `add_special_tokens` as given. Chat: rendered with the chat template, then
  encoded with `add_special_tokens=False` (the template writes BOS etc.), as transformers does;
  the input's `add_special_tokens` flag is ignored for chats.
* Special-token text (`special_text.py`): unless an input allows special tokens, the text of a
  special token in a text, or in a chat message's content or role, is tokenized as ordinary text;
  the special tokens a chat template writes stay special. With `allow_special_tokens` it is
  parsed as the token it spells (what the tokenizer itself does).
* Limits: an input over `max_input_bytes` UTF-8 bytes is `INPUT_TOO_LARGE` (checked before any
  work is queued); one that encodes to more than `max_input_tokens` ids is `PROMPT_TOO_LONG`.
  One bad input fails its whole call, never the other calls batched with it.
* Overload: more than `max_pending` inputs, or more than `max_pending_bytes` of text, queued or
  being encoded → `UNAVAILABLE/OVERLOADED` at once (with a retry hint), never a late timeout.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from opentelemetry.trace import SpanKind

from services.errors import InvalidArgument, Reason, TokenrelayError
from services.tokenization import metrics
from services.tokenization.batcher import Batcher
from services.tokenization.chat_cache import ChatPrefixCache, Plan
from services.tokenization.chat_template import ChatTemplate
from services.tokenization.loader import LoadedTokenizer
from services.tokenization.special_text import SpecialText
from services.tracing import child_span, tracer

_tracer = tracer("tokenrelay.tokenizer")


@dataclass(frozen=True, slots=True)
class TextInput:
    text: str
    add_special_tokens: bool = True
    allow_special_tokens: bool = False   # parse special-token text in `text` as special tokens


@dataclass(frozen=True, slots=True)
class ChatInput:
    messages: Sequence[Mapping[str, str]]
    add_generation_prompt: bool = True
    # Opaque session key: when set, a turn that extends the previous one under this key only
    # tokenizes what changed (chat_cache.py proves the result equals a full tokenization).
    cache_key: str = ""
    allow_special_tokens: bool = False   # parse special-token text in messages as special tokens


EncodeInput = TextInput | ChatInput
# Turns one call's ids into whatever the caller wants (the servicer: a protobuf response), in the
# post thread, so that per-id conversion work stays off the event loop.
Finish = Callable[[list[list[int]]], Any]


@dataclass(frozen=True, slots=True)
class _Call:
    inputs: list[EncodeInput]
    finish: Finish | None


# Where an input's ids are: encoded as is (with or without add_special_tokens), with special-token
# text encoded as text (the same two), or ids already made (incremental or guarded chats).
_Batch = Literal["plain", "plain+", "split", "split+", "ids"]
_Slot = tuple[_Batch, int]


@dataclass(frozen=True, slots=True)
class _Encoded:
    """What the worker hands to the post thread: per call its slots (or its error), the
    tokenizers' Encodings per batch, and ids already made (incremental and guarded chats)."""

    slots: list[list[_Slot] | BaseException]
    encodings: dict[_Batch, Any]
    ids: list[list[int]]


@dataclass(frozen=True)
class EncoderLimits:
    max_batch: int = 64             # inputs per call
    batch_inputs: int = 256         # inputs encoded together (queued calls merged up to this)
    max_pending: int = 4096         # inputs queued or running before calls are rejected
    max_input_bytes: int = 4 << 20  # per input, UTF-8
    # Text queued or being encoded before calls are rejected OVERLOADED (0 = no byte limit). The
    # default is a few seconds of encoding on two cores; a call is never refused on an idle encoder.
    max_pending_bytes: int = 32 << 20
    max_input_tokens: int = 0       # per input; 0 = no limit
    # A call of at most this much text that finds the encoder idle is encoded on the event loop
    # (a few hundred µs of work instead of two thread hand-offs each way); 0 = never.
    inline_bytes: int = 4096
    # A chat's cache key is kept with its conversation's ids in the chat prefix cache.
    max_cache_key_bytes: int = 32 << 10


class Encoder:
    """The Tokenize use case; owns the batcher (start/close)."""

    def __init__(self, tokenizer: LoadedTokenizer, template: ChatTemplate | None, limits: EncoderLimits,
                 *, workers: int, chat_cache_tokens: int = 20_000_000, overlap_after: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.limits = limits
        self.pending_bytes = 0
        self.chat_cache = ChatPrefixCache(tokenizer.tokenizer, chat_cache_tokens) if chat_cache_tokens > 0 else None
        self.special_text = SpecialText(tokenizer.tokenizer)
        self.batcher: Batcher[_Call, Any] = Batcher(
            self._encode_jobs, post=self._finish_jobs, workers=workers,
            max_batch=max(limits.batch_inputs, limits.max_batch),
            max_pending=max(limits.max_pending, limits.max_batch), name="tokenize",
            overlap_after=overlap_after)
        metrics.LOAD.add_encoder(self.batcher)

    async def start(self) -> None:
        await self.batcher.start()

    async def close(self) -> None:
        await self.batcher.close()

    async def tokenize(self, inputs: Sequence[EncodeInput | None], finish: Finish | None = None) -> Any:
        """Ids per input (or `finish(ids)`); None stands for an input that carried nothing."""
        start = time.perf_counter()
        with child_span(_tracer, "tokenizer.tokenize", kind=SpanKind.SERVER,
                                           attributes={"tokenrelay.inputs": len(inputs)}), _rejections_counted():
            checked, nbytes = self._validate(inputs)
            self._admit_bytes(nbytes)
            try:
                result = await self.batcher.submit(_Call(checked, finish), size=len(checked),
                                                   inline=nbytes <= self.limits.inline_bytes)
            finally:
                self.pending_bytes -= nbytes
        metrics.TOKENIZE_SECONDS.observe(time.perf_counter() - start)
        return result

    def tokenize_now(self, inputs: Sequence[EncodeInput | None]) -> Any | None:
        """`tokenize`'s ids, here and now, when the call is one `tokenize` would encode on the loop
        (at most `inline_bytes` of text, the encoder idle); None when it would not (then `tokenize`).
        Invalid inputs raise the same typed errors."""
        start = time.perf_counter()
        with _rejections_counted():
            checked, nbytes = self._validate(inputs)
            if nbytes > self.limits.inline_bytes:
                return None
            ran = self.batcher.run_now(_Call(checked, None), size=len(checked))
        if ran is None:
            return None
        metrics.TOKENIZE_SECONDS.observe(time.perf_counter() - start)
        return ran[0]

    def _admit_bytes(self, nbytes: int) -> None:
        """Reject at once, rather than time out later, when the queued text is already too much:
        the input count alone says little when one input can be 32k tokens."""
        limit = self.limits.max_pending_bytes
        if limit and self.pending_bytes and self.pending_bytes + nbytes > limit:
            raise Reason.OVERLOADED.error(f"tokenizer overloaded: {self.pending_bytes} bytes of text queued")
        self.pending_bytes += nbytes

    def _validate(self, inputs: Sequence[EncodeInput | None]) -> tuple[list[EncodeInput], int]:
        if not inputs:
            raise Reason.EMPTY_PROMPT.error("no inputs")
        if len(inputs) > self.limits.max_batch:
            raise Reason.BATCH_TOO_LARGE.error(f"{len(inputs)} inputs in one call; at most {self.limits.max_batch}")
        checked: list[EncodeInput] = []
        total = 0
        for index, item in enumerate(inputs):
            if item is None:
                raise Reason.EMPTY_PROMPT.error(f"{_which(index, len(inputs))} has neither text nor chat")
            size = self._input_bytes(_which(index, len(inputs)), item)
            if size > self.limits.max_input_bytes:
                raise Reason.INPUT_TOO_LARGE.error(
                    f"{_which(index, len(inputs))} is {size} bytes of UTF-8; at most {self.limits.max_input_bytes}")
            checked.append(item)
            total += size
        return checked, total

    def _input_bytes(self, which: str, item: EncodeInput) -> int:
        if isinstance(item, TextInput):
            return _utf8_len(item.text)
        if not item.messages:
            raise Reason.EMPTY_PROMPT.error(f"{which}: chat has no messages")
        if _utf8_len(item.cache_key) > self.limits.max_cache_key_bytes:
            raise Reason.CACHE_KEY_TOO_LONG.error(
                f"{which}: cache_key is {_utf8_len(item.cache_key)} bytes of UTF-8; at most "
                f"{self.limits.max_cache_key_bytes}")
        if self.template is None:
            raise Reason.NO_CHAT_TEMPLATE.error("this model has no chat template (start the tokenizer with "
                                                "--chat-template)")
        return sum(_utf8_len(m.get("content") or "") + _utf8_len(m.get("role") or "") for m in item.messages)

    # ------------------------------------------------------------------ worker thread
    def _encode_jobs(self, calls: list[_Call]) -> _Encoded:
        """Render and encode every call's inputs in (at most three) encode_batch calls. The ids
        are read in `_finish_jobs`, on the batcher's post thread, while this worker (and the
        library's thread pool) goes on with the next batch."""
        start = time.perf_counter()
        try:
            return self._encode_calls(calls)
        finally:
            metrics.BUSY_SECONDS.inc(time.perf_counter() - start)

    def _encode_calls(self, calls: list[_Call]) -> _Encoded:
        texts: dict[_Batch, list[str]] = {"plain": [], "plain+": [], "split": [], "split+": []}
        plans: list[Plan] = []
        plan_slots: list[int] = []     # index in `ids` of each plan's result
        ids: list[list[int]] = []
        slots: list[list[_Slot] | BaseException] = []
        guard = self.special_text
        for call in calls:
            call_slots: list[_Slot] = []
            try:
                for item in call.inputs:
                    if isinstance(item, TextInput):
                        split = not item.allow_special_tokens and guard.found_in(item.text)
                        batch: _Batch = (("split+" if item.add_special_tokens else "split") if split
                                         else ("plain+" if item.add_special_tokens else "plain"))
                        call_slots.append((batch, len(texts[batch])))
                        texts[batch].append(item.text)
                        continue
                    assert self.template is not None
                    if not item.allow_special_tokens and guard.found_in_chat(item.messages):
                        call_slots.append(("ids", len(ids)))
                        ids.append(guard.encode_chat(self.template, item.messages, item.add_generation_prompt))
                        continue
                    text = self.template.render(item.messages, item.add_generation_prompt)
                    if self.chat_cache is not None and item.cache_key:
                        call_slots.append(("ids", len(ids)))
                        plan_slots.append(len(ids))
                        ids.append([])
                        plans.append(self.chat_cache.plan(item.cache_key, text))
                        continue
                    call_slots.append(("plain", len(texts["plain"])))
                    texts["plain"].append(text)
            except InvalidArgument as exc:
                slots.append(exc)
                continue
            slots.append(call_slots)
        # encode_batch releases the GIL and spreads the inputs over the tokenizers' own thread pool.
        encode = self.tokenizer.tokenizer.encode_batch_fast
        encodings: dict[_Batch, Any] = {}
        for batch, items in texts.items():
            if not items:
                encodings[batch] = []
            elif batch.startswith("split"):
                encodings[batch] = guard.encode_texts(items, add_special_tokens=batch.endswith("+"))
            else:
                encodings[batch] = encode(items, add_special_tokens=batch.endswith("+"))
        for index, result in zip(plan_slots, self._encode_incremental(plans), strict=True):
            ids[index] = result
        metrics.BATCH_INPUTS.observe(sum(map(len, texts.values())) + len(ids))
        return _Encoded(slots, encodings, ids)

    # ------------------------------------------------------------------ post thread
    def _finish_jobs(self, calls: list[_Call], encoded: _Encoded) -> list[Any]:
        """Per call: its ids (or error), limits checked, `finish` applied (the protobuf response)."""
        ids_of: dict[_Batch, list[list[int]]] = {
            batch: [e.ids for e in encodings] for batch, encodings in encoded.encodings.items()}
        ids_of["ids"] = encoded.ids
        results: list[Any] = []
        for call, slot in zip(calls, encoded.slots, strict=True):
            if isinstance(slot, BaseException):
                results.append(slot)
                continue
            ids = [ids_of[batch][i] for batch, i in slot]
            error = self._check(ids)
            if error is None:
                _count(call.inputs, ids)
            results.append(error or (call.finish(ids) if call.finish else ids))
        return results

    def _encode_incremental(self, plans: list[Plan]) -> list[list[int]]:
        if not plans:
            return []
        assert self.chat_cache is not None
        # Offsets are needed here (to find added tokens' positions), so not the _fast variant. One
        # plan (a lone chat, as the router's inline encodes are) is encoded on this thread: the batch
        # call hands even one input to the library's thread pool and waits, 8-23% slower (medians)
        # for a chat turn's suffix in every condition measured (docs/benchmarks.md, seventh session).
        tok = self.tokenizer.tokenizer
        batch = ([tok.encode(plans[0].suffix, add_special_tokens=False)] if len(plans) == 1
                 else tok.encode_batch([p.suffix for p in plans], add_special_tokens=False))
        out = []
        for plan, encoding in zip(plans, batch, strict=True):
            ids = self.chat_cache.complete(plan, encoding)
            if ids is None:  # the boundary guard failed: tokenize the whole text (still cached)
                metrics.CHAT_CACHE_FALLBACKS.inc()
                whole = Plan(plan.key, plan.text, plan.prefix[:0], 0, None, [])
                ids = self.chat_cache.complete(
                    whole, self.tokenizer.tokenizer.encode(plan.text, add_special_tokens=False))
                assert ids is not None
            else:
                metrics.CHAT_REUSED_TOKENS.inc(len(plan.prefix))
            out.append(ids)
        return out

    def _check(self, ids: list[list[int]]) -> TokenrelayError | None:
        limit = self.limits.max_input_tokens
        for index, seq in enumerate(ids):
            if limit and len(seq) > limit:
                return Reason.PROMPT_TOO_LONG.error(f"{_which(index, len(ids))} has {len(seq)} tokens; at most {limit}")
        return None


@contextlib.contextmanager
def _rejections_counted() -> Iterator[None]:
    """A typed refusal raised inside is counted by its reason (and raised on)."""
    try:
        yield
    except TokenrelayError as exc:
        metrics.count_rejection(exc.reason)
        raise


def _which(index: int, count: int) -> str:
    """How an error names an input: a call of one (the router sends a request's prompt alone when
    it reports an error) speaks of the prompt, a batch names the input's index (issue 14)."""
    return "the prompt" if count == 1 else f"input {index}"


def _count(inputs: list[EncodeInput], ids: list[list[int]]) -> None:
    chats = sum(1 for item in inputs if isinstance(item, ChatInput))
    if chats:
        metrics.CHAT_INPUTS.inc(chats)
    if len(inputs) > chats:
        metrics.TEXT_INPUTS.inc(len(inputs) - chats)
    metrics.TOKENS.inc(sum(len(seq) for seq in ids))


def _utf8_len(text: str) -> int:
    # Most prompts are ASCII: the char count is then the byte count and costs nothing.
    return len(text) if text.isascii() else len(text.encode("utf-8"))
