"""Synthetic prompts of a requested length: filler text for the mesh, random token ids for an engine.

Text lengths are approximate by design: chars-per-token is calibrated once against the target's
own tokenizer (`calibrate_chars_per_token`), and the report uses the prompt token counts the
server returns, never these estimates.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

# Plain English prose (written for this tool) so byte-level and SentencePiece tokenizers see
# ordinary words, not the pathological strings that random characters would be.
FILLER = (
    "The harbour town woke slowly that spring morning. Fishermen checked their nets along the stone "
    "quay while the baker opened his shutters and set out the first loaves of the day. A small girl "
    "walked her dog past the market stalls, stopping to watch the gulls argue over a crust of bread. "
    "Far out at sea a cargo ship moved across the horizon, so slowly that it seemed not to move at all. "
    "In the library on the hill the old clock struck seven, and the librarian unlocked the heavy door, "
    "as she had done every weekday for thirty years. She liked the quiet hour before the readers came, "
    "when the dust hung in the light from the tall windows and every book was in its place. Down by the "
    "river two brothers were arguing about the best way to repair a wooden boat; one wanted new planks, "
    "the other swore that the old ones only needed tar and patience. Their mother called them in for "
    "breakfast, and for a while the argument was forgotten over bread, butter and strong black tea. "
)
_WORDS = FILLER.split()


def nonce(rng: random.Random) -> str:
    """A short unique marker put first in a prompt so no prefix cache can match across sessions."""
    return f"[{rng.getrandbits(48):012x}]"


class TextSynth:
    """Text of roughly ``tokens`` tokens, starting at a random word of the filler."""

    def __init__(self, chars_per_token: float) -> None:
        if chars_per_token <= 0:
            raise ValueError("chars_per_token must be > 0")
        self.chars_per_token = chars_per_token

    def text(self, tokens: int, rng: random.Random) -> str:
        want = max(1, round(tokens * self.chars_per_token))
        i = rng.randrange(len(_WORDS))
        out: list[str] = []
        size = 0
        while size < want:
            word = _WORDS[i % len(_WORDS)]
            out.append(word)
            size += len(word) + 1
            i += 1
        return " ".join(out)[:want].rstrip()


class IdSynth:
    """Uniform random token ids in [reserved, vocab_size) (low ids are often BOS/EOS/PAD)."""

    def __init__(self, vocab_size: int, reserved: int = 3) -> None:
        if vocab_size <= reserved:
            raise ValueError(f"vocab size must exceed {reserved}")
        self.vocab_size = vocab_size
        self.reserved = reserved

    def ids(self, n: int, rng: random.Random) -> list[int]:
        lo, hi = self.reserved, self.vocab_size - 1
        return [rng.randint(lo, hi) for _ in range(n)]


CALIBRATION_CHARS = (200, 800)


async def calibrate_chars_per_token(prompt_tokens: Callable[[str], Awaitable[int]],
                                    sizes: tuple[int, int] = CALIBRATION_CHARS) -> float:
    """Chars per token of the target's tokenizer, from the token counts of two filler texts.

    Two lengths cancel fixed overhead (BOS, templates): the slope is what prompt sizing needs.
    """
    synth = TextSynth(1.0)
    rng = random.Random(0)
    short, long = synth.text(sizes[0], rng), synth.text(sizes[1], rng)
    t_short, t_long = await prompt_tokens(short), await prompt_tokens(long)
    if t_long <= t_short:
        return 4.0
    return (len(long) - len(short)) / (t_long - t_short)
