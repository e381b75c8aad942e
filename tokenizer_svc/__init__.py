"""tokenizer_svc: batched tokenization (chat templates included) and exact, multiplexed streaming
detokenization with stop strings, served over gRPC (tokenrelay.v1.Tokenizer).

The domain (loader, chat templates, encoder, incremental decoder, stop strings, multiplexed
streams, metrics) is in `services.tokenization`, which the router's opt-in local (de)tokenization
runs too; this package is the service around it: `servicer` / `app` / `config` / `__main__`.
The names below are re-exported from there.
"""

from services.tokenization.chat_template import BUILTIN_TEMPLATES, ChatTemplate, resolve_template
from services.tokenization.detok_stream import Detokenizer, DetokStream, OpenRequest, Output, StreamBatch, TokenBatch
from services.tokenization.detokenizer import IncrementalDecoder
from services.tokenization.encoder import ChatInput, Encoder, EncoderLimits, TextInput
from services.tokenization.loader import LoadedTokenizer, TokenizerFiles, load_tokenizer
from services.tokenization.stop_strings import StopMatcher

__all__ = [
    "BUILTIN_TEMPLATES", "ChatInput", "ChatTemplate", "DetokStream", "Detokenizer", "Encoder",
    "EncoderLimits", "IncrementalDecoder", "LoadedTokenizer", "OpenRequest", "Output", "StopMatcher",
    "StreamBatch", "TextInput", "TokenBatch", "TokenizerFiles", "load_tokenizer", "resolve_template",
]
