"""tokenizer_svc: batched tokenization (chat templates included) and exact, multiplexed streaming
detokenization with stop strings, served over gRPC (tokenrelay.v1.Tokenizer).

Modules: `loader` (tokenizer + metadata), `chat_template` (sandboxed rendering), `batcher`
(batches of concurrent calls on a bounded pool), `encoder` (Tokenize), `detokenizer` (one exact
incremental decoder), `stop_strings` (hold-back and matching), `detok_stream` (a multiplexed
stream), `servicer` / `app` / `config` / `__main__` (the service).
"""

from tokenizer_svc.chat_template import BUILTIN_TEMPLATES, ChatTemplate, resolve_template
from tokenizer_svc.detok_stream import Detokenizer, DetokStream, OpenRequest, Output, StreamBatch, TokenBatch
from tokenizer_svc.detokenizer import IncrementalDecoder
from tokenizer_svc.encoder import ChatInput, Encoder, EncoderLimits, TextInput
from tokenizer_svc.loader import LoadedTokenizer, TokenizerFiles, load_tokenizer
from tokenizer_svc.stop_strings import StopMatcher

__all__ = [
    "BUILTIN_TEMPLATES", "ChatInput", "ChatTemplate", "DetokStream", "Detokenizer", "Encoder",
    "EncoderLimits", "IncrementalDecoder", "LoadedTokenizer", "OpenRequest", "Output", "StopMatcher",
    "StreamBatch", "TextInput", "TokenBatch", "TokenizerFiles", "load_tokenizer", "resolve_template",
]
