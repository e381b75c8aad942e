"""Streaming detokenization in the router's own process (`--detokenize local`).

The default sends every request's new token ids to a tokenizer replica over the multiplexed
Detokenize stream and reads the text back: one more hop on every token's way to the client, and
router CPU spent building, sending and reading those messages. Turning ids into text is cheap
beside that (a few µs per token, measured in docs/benchmarks.md), so with `--detokenize local`
the router does it where the ids arrive: the engine stage's `send` decodes on the spot and the
text lands in the request's inbox, waking the delta loop once per burst, as the remote path
does. Prompts are still tokenized by the tokenizer service, which stays the scaled-out home of
the expensive part (encoding long prompts).

The decoding itself is the tokenizer service's own code (`services.tokenization.detok_stream`: the
incremental decoder, stop strings, special tokens, vocabulary checks), over the same tokenizer
files (`--tokenizer-files`); `app.py` compares them with the tokenizer service's `Info` at start
and refuses to start on a mismatch (another vocabulary would garble every reply).
"""

from __future__ import annotations

from services.errors import Reason
from services.mux import Inbox, StreamBroken
from services.tokenization.detok_stream import DetokRequest, DetokStream, OpenRequest, Output, TokenBatch
from services.tokenization.loader import LoadedTokenizer, TokenizerFiles, load_tokenizer

from .tokenizer_upstream import _detok_merge, _detok_out
from .types import DetokOut, TokenizerMeta

# Requests open at once in one router process; past it a request fails OVERLOADED (the router's
# own --max-requests-in-flight bounds it far below this).
MAX_OPEN = 1_000_000


class LocalDetokSession:
    """One request's detokenization (`ports.DetokSessionPort`), applied as its ids arrive."""

    __slots__ = ("_closed", "_fast", "_inbox", "_plain", "_stream", "request_id")

    def __init__(self, stream: DetokStream, request_id: str) -> None:
        self._stream = stream
        self.request_id = request_id
        self._inbox: Inbox[DetokOut] = Inbox()
        self._closed = False
        self._plain: DetokRequest | None = None   # its state while one id at a time may skip the batch path
        self._fast = 0                         # ids applied that way, not counted in DETOK_TOKENS yet

    def start(self, stop: list[str], include_stop: bool, prefix_ids: list[int],
              trace_context: dict[str, str]) -> None:
        error = self._stream.open(OpenRequest(self.request_id, tuple(stop), include_stop, True, prefix_ids,
                                              trace_context))
        if error:
            self._put(Output(self.request_id, finished=error != Reason.DUPLICATE_REQUEST_ID, error=error))
        else:
            self._plain = self._stream.plain(self.request_id)

    def send(self, token_ids: list[int], final: bool) -> None:
        plain = self._plain
        if plain is not None and not final and len(token_ids) == 1:
            # One id, not the last, no stop strings (a one-token delta: the relay's commonest case
            # under light load and with a slow step): straight into the decoder and the inbox.
            done = self._stream.feed_one(self.request_id, plain, token_ids[0])
            if type(done) is str:
                self._fast += 1     # applied: counted in DETOK_TOKENS at close (an id refused is not)
                if done:
                    self._put_text(done, plain.consumed)
                return
            self._plain = None
            self._put(done)         # type: ignore[arg-type]   # the error that ended it
            return
        self._count()
        out = self._stream.feed(TokenBatch(self.request_id, token_ids, final))
        if out is not None and (out.text or out.finished or out.error):
            if out.finished:
                self._plain = None
            self._put(out)

    def _count(self) -> None:
        if self._fast:
            self._stream.count(self._fast)
            self._fast = 0

    def _put_text(self, text: str, consumed: int) -> None:
        inbox = self._inbox
        pending = inbox.last()
        if type(pending) is DetokOut and not (pending.finished or pending.error):
            pending.text += text        # folded into the output not taken yet (as `_detok_merge`)
            pending.tokens_consumed = consumed
        elif inbox.append(DetokOut(text, False, "", consumed, "")):
            inbox.wake()

    def _put(self, out: Output) -> None:
        inbox = self._inbox
        pending = inbox.last()
        if isinstance(pending, DetokOut) and _detok_merge(pending, out):   # type: ignore[arg-type]
            return      # folded into the output not taken yet (its consumer is already woken)
        if inbox.append(_detok_out(out)):   # type: ignore[arg-type]   # the same fields as the wire's
            inbox.wake()

    async def next_ready(self) -> list[DetokOut | StreamBroken]:
        return await self._inbox.get_ready()

    def fail(self, error: Exception) -> None:
        self._inbox.put_nowait(StreamBroken(error))  # type: ignore[arg-type]

    def close(self, flushed: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._plain = None
        self._count()
        if not flushed:
            self._stream.discard(self.request_id)


class LocalDetokenize:
    """`ports.Detokenize` in this process, over one tokenizer loaded from its files."""

    def __init__(self, tokenizer: LoadedTokenizer, max_open: int = MAX_OPEN) -> None:
        self.tokenizer = tokenizer
        self._stream = DetokStream(tokenizer, max_requests=max_open)

    def detokenizer(self, request_id: str) -> LocalDetokSession:
        return LocalDetokSession(self._stream, request_id)

    @property
    def open_requests(self) -> int:
        return self._stream.open_requests

    def close(self) -> None:
        self._stream.close()


# Tokenized by both at start: the same ids from the same text means the same vocabulary and merges.
PROBE = "tokenrelay compares tokenizers: The quick brown fox jumps over 13 lazy dogs, naïvely. 世界"


def mismatch(local: LoadedTokenizer, remote: TokenizerMeta, remote_probe_ids: list[int]) -> str:
    """Why the router's tokenizer files are not the tokenizer service's ("" when they agree)."""
    problems = []
    if local.vocab_size != remote.vocab_size:
        problems.append(f"vocabulary {local.vocab_size} here, {remote.vocab_size} at the tokenizer service")
    # The service adds a chat template override's end-of-turn ids to the model's: the model's must be there.
    if not set(local.eos_token_ids) <= set(remote.eos_token_ids):
        problems.append(f"end-of-sequence ids {sorted(local.eos_token_ids)} here, "
                        f"{sorted(remote.eos_token_ids)} at the tokenizer service")
    here = local.tokenizer.encode(PROBE, add_special_tokens=True).ids
    if here != remote_probe_ids:
        problems.append(f"a probe text encodes to {len(here)} ids here and {len(remote_probe_ids)} at the "
                        "tokenizer service" + (" (different ids)" if len(here) == len(remote_probe_ids) else ""))
    return "; ".join(problems)


def load_files(path: str) -> LoadedTokenizer:
    """The tokenizer at `path` (a model directory or tokenizer.json); OSError / ValueError if bad."""
    return load_tokenizer(TokenizerFiles.discover(path))
