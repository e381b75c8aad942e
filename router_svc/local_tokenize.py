"""Short prompts tokenized in the router's own process (`--tokenize-local-bytes N`).

The Tokenize round trip is the largest piece of the time the mesh adds to a request's first token
at light load (3.3–4.2 ms at p50 on quiet cores, against 0.7 ms of encoding in the tokenizer's own
span: docs/benchmarks.md), and a short prompt costs less to encode than that call costs the router
in CPU. With this option, a prompt of at most N bytes (a text, or a chat's roles and contents) is
encoded here by the tokenizer service's own encoder (`services.tokenization.encoder.Encoder`: the chat
template, special-token text kept as text unless the tenant may send control tokens, the chat
prefix cache per session, the same limits and typed errors), on the event loop when it finds the
encoder idle, else on one worker thread (the library's `encode_batch` releases the GIL). Longer
prompts go to the tokenizer service, which stays the scaled-out home of the expensive part.

The files are the tokenizer service's (`--tokenizer-files`, and `--tokenizer-chat-template` when
the service runs with a `--chat-template` override). At start a probe text, and a probe chat when
the service has a chat template, are tokenized by both: different ids refuse the start (the engine
would be fed other ids than the tokenizer service would have given it).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from services.errors import Reason, TokenrelayError
from services.logging import get_logger
from services.tokenization.chat_template import ChatTemplate, resolve_template
from services.tokenization.encoder import ChatInput, Encoder, EncoderLimits, TextInput
from services.tokenization.loader import LoadedTokenizer

from .local_detok import PROBE
from .metrics import CHAT_PREFETCH

log = get_logger(__name__)

# Chat sessions' token prefixes kept for incremental tokenization (ids as uint32 plus their text:
# ~8 bytes per token, ~16 MB at most; the tokenizer service keeps 20M tokens by default).
CHAT_CACHE_TOKENS = 2_000_000
PROBE_CHAT = [("system", "You are a careful assistant."), ("user", PROBE), ("assistant", "Noted."),
              ("user", "And <b>again</b>?")]


def template_of(tokenizer: LoadedTokenizer, override: str) -> ChatTemplate | None:
    """The chat template the tokenizer service uses with `--chat-template override` ("" = the model's)."""
    chosen = resolve_template(override, tokenizer.chat_templates)
    return None if chosen is None else ChatTemplate(chosen[1], chosen[0], tokenizer.special_tokens)


class LocalTokenize:
    """The router's tokenizer port: prompts of at most `max_bytes` here, the rest at `remote`
    (a `TokenizerUpstream`, whose metadata and Detokenize sessions this passes through)."""

    def __init__(self, remote: Any, tokenizer: LoadedTokenizer, template: ChatTemplate | None,
                 max_bytes: int) -> None:
        self.remote = remote
        self.max_bytes = max_bytes
        # Inline for anything it takes: a call that finds the encoder busy goes to its one worker.
        limits = EncoderLimits(max_input_tokens=tokenizer.max_context, inline_bytes=max_bytes)
        self.encoder = Encoder(tokenizer, template, limits, workers=1, chat_cache_tokens=CHAT_CACHE_TOKENS)
        self.local_calls = 0

    @property
    def meta(self) -> Any:
        return self.remote.meta

    def detokenizer(self, request_id: str) -> Any:
        return self.remote.detokenizer(request_id)

    async def start(self) -> None:
        await self.encoder.start()

    async def close(self) -> None:
        await self.encoder.close()

    def _here(self, text: str | None, messages: list[tuple[str, str]] | None, cache_key: str,
              allow_special_tokens: bool) -> TextInput | ChatInput | None:
        """The encoder's input for a prompt this process tokenizes; None for one the service does."""
        size = (len((text or "").encode()) if messages is None
                else sum(len(r.encode()) + len(c.encode()) for r, c in messages))
        chat_here = messages is None or (self.encoder.template is not None and self.remote.meta is not None
                                         and self.remote.meta.has_chat_template)
        if size > self.max_bytes or not chat_here:
            return None
        return (TextInput(text or "", True, allow_special_tokens) if messages is None else
                ChatInput([{"role": r, "content": c} for r, c in messages], True, cache_key, allow_special_tokens))

    def tokenize_now(self, *, text: str | None = None, messages: list[tuple[str, str]] | None = None,
                     cache_key: str = "", allow_special_tokens: bool = False) -> list[int] | None:
        """The prompt's ids without a loop turn, when it is one this process encodes and its encoder
        is idle; None otherwise (then `tokenize`). For a request nothing else is started for (no
        early ENQUEUE to overlap): a refusal decided on its ids is then decided in one turn."""
        item = self._here(text, messages, cache_key, allow_special_tokens)
        if item is None:
            return None
        ran = self.encoder.tokenize_now([item])
        if ran is None:
            return None
        self.local_calls += 1
        return list(ran[0])

    async def tokenize(self, *, text: str | None = None, messages: list[tuple[str, str]] | None = None,
                       timeout: float | None = None, cache_key: str = "",
                       allow_special_tokens: bool = False) -> list[int]:
        item = self._here(text, messages, cache_key, allow_special_tokens)
        if item is None:
            return list(await self.remote.tokenize(text=text, messages=messages, timeout=timeout,
                                                   cache_key=cache_key, allow_special_tokens=allow_special_tokens))
        self.local_calls += 1
        # An encode may run on the loop itself, holding it: the request's Redis calls go out before
        # it, so Redis answers while the CPU encodes. router_svc/pipeline.py starts the early ENQUEUE
        # and the id claim first; each writes in its first step while its connection is idle, and
        # otherwise its sender (the admission batcher's flush, the cluster pipeline's task) writes in
        # the next loop turn, which this one yield lets come first (woken in this turn, a sender runs
        # in the next; without the yield the encode, due in this same turn, would hold it back).
        await asyncio.sleep(0)
        try:
            async with asyncio.timeout(timeout):
                (ids,) = await self.encoder.tokenize([item])
        except TimeoutError:
            raise Reason.TOKENIZE_TIMEOUT.error("tokenization did not finish in time") from None
        return list(ids)

    def prefetch(self, *, messages: list[tuple[str, str]], cache_key: str,
                 allow_special_tokens: bool = False) -> bool:
        """A finished chat turn's conversation, its reply last, tokenized now (no generation prompt)
        under `cache_key`, so that the prefix cache holds it when the next turn comes: that turn then
        encodes only the text past the reply (`router_svc/pipeline.py`, `Router._prefetch`). Whether
        it ran: only on an idle encoder, here and now (`tokenize_now`), so a request's own encode never
        waits behind a prefetch; a conversation this process would not tokenize (too long, no chat
        template here) or without a key is left alone, and an encoder refusal is counted, never raised."""
        item = self._here(None, messages, cache_key, allow_special_tokens) if cache_key else None
        if not isinstance(item, ChatInput):
            CHAT_PREFETCH.labels("not_here").inc()
            return False
        try:
            ran = self.encoder.tokenize_now([dataclasses.replace(item, add_generation_prompt=False)])
        except TokenrelayError as exc:
            CHAT_PREFETCH.labels("failed").inc()
            log.debug("chat_prefetch_failed", reason=exc.reason, message=exc.message)
            return False
        CHAT_PREFETCH.labels("busy" if ran is None else "done").inc()
        return ran is not None

    async def check(self, text_ids: list[int]) -> str:
        """Why this process's tokenizer is not the tokenizer service's ("" when the probes agree);
        `text_ids`: the service's ids of PROBE (the start check has them already)."""
        remote, local = self.remote, self.encoder
        (here,) = await local.tokenize([TextInput(PROBE)])
        if list(here) != list(text_ids):
            return "a probe text encodes to other ids here than at the tokenizer service"
        if remote.meta is not None and remote.meta.has_chat_template:
            if local.template is None:
                return "the tokenizer service has a chat template and these files have none"
            chat_ids = await remote.tokenize(messages=PROBE_CHAT)
            (here,) = await local.tokenize([ChatInput([{"role": r, "content": c} for r, c in PROBE_CHAT])])
            if list(here) != list(chat_ids):
                return ("a probe chat encodes to other ids here than at the tokenizer service (does it run "
                        "with a --chat-template override? give the router the same --tokenizer-chat-template)")
        return ""
