"""Settings of the tokenizer service (flags, TOKENRELAY_TOKENIZER_* environment, defaults)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.config import parse_settings, setting

ENV_PREFIX = "TOKENRELAY_TOKENIZER_"


@dataclass
class TokenizerSettings:
    """tokenizer_svc: batched tokenization and multiplexed streaming detokenization over gRPC."""

    tokenizer: str = setting("", "model directory or tokenizer.json (required); tokenizer_config.json, "
                                 "generation_config.json and config.json are read from the same directory")
    tokenizer_config: str = setting("", "explicit tokenizer_config.json (default: next to tokenizer.json)")
    generation_config: str = setting("", "explicit generation_config.json (default: next to tokenizer.json)")
    model_config: str = setting("", "explicit config.json (default: next to tokenizer.json)")
    chat_template: str = setting("", "chat template override: a file path, one of the model's named "
                                     "templates, or a built-in name (chatml, gemma)")
    workers: int = setting(0, "tokenize worker threads; 0 = 2 with library parallelism (a batch uses every "
                              "core; the second covers a batch held up by one long input), else the cores this "
                              "process may run on")
    library_parallelism: bool = setting(True, "let the tokenizers library spread each batch over its own "
                                             "thread pool, batches running one after another (best for "
                                             "batched calls, which is what the router sends); off = each worker "
                                             "thread encodes its own batch (docs/benchmarks.md)")
    library_threads: int = setting(0, "threads of the tokenizers library's pool (0 = the cores this process may "
                                      "run on); N replicas on one host should get a share each, as "
                                      "`tokenrelay up --tokenizers N` does (read once, at start)")
    overlap_ms: float = setting(20.0, "with library parallelism: a batch may start while another runs only "
                                      "once that one has run this long (it is then held up by a long input "
                                      "while the library's other threads idle)")
    max_batch: int = setting(64, "most inputs in one Tokenize call")
    batch_inputs: int = setting(256, "most inputs encoded together (queued calls are merged up to this): on many "
                                     "cores a big batch leaves the library's threads less idle at its end")
    max_pending: int = setting(4096, "inputs queued or running before Tokenize answers UNAVAILABLE/OVERLOADED")
    max_pending_bytes: int = setting(32 << 20, "text (UTF-8 bytes) queued or being encoded before Tokenize "
                                               "answers UNAVAILABLE/OVERLOADED at once; 0 = no byte limit")
    max_input_bytes: int = setting(4 << 20, "largest input in UTF-8 bytes (INPUT_TOO_LARGE beyond)")
    max_input_tokens: int = setting(0, "most tokens per input (PROMPT_TOO_LONG beyond); 0 = the model's "
                                       "context length when known, else no limit; -1 = no limit")
    chat_cache_tokens: int = setting(20_000_000, "token budget of the per-session chat prefix cache "
                                     "(incremental chat tokenization); 0 = off")
    switch_interval_ms: float = setting(0.5, "Python's thread switch interval (sys.setswitchinterval; Python's "
                                              "default is 5): how long a worker that finished encoding may "
                                              "wait for the interpreter lock before it can start the next batch")
    detok_workers: int = setting(1, "threads that run large Detokenize batches off the event loop")
    max_stream_requests: int = setting(10_000, "most requests open at once on one Detokenize stream")
    metrics_port: int = setting(-1, "Prometheus /metrics port (0 = ephemeral, -1 = off)")
    metrics_port_file: str = setting("", "write the bound metrics port here")
    otlp_endpoint: str = setting("", "OTLP gRPC endpoint for traces (empty = no export)")
    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(0, "port to bind (0 = ephemeral)")
    port_file: str = setting("", "once serving, write the bound port here (atomically)")
    log_level: str = setting("INFO", "log level")
    log_format: str = setting("json", "log format: json or console")
    shutdown_grace: float = setting(5.0, "seconds in-flight calls get to finish on shutdown")

    def effective_workers(self) -> int:
        if self.workers > 0:
            return self.workers
        return 2 if self.library_parallelism else len(os.sched_getaffinity(0))

    def overlap_after(self) -> float:
        """Seconds before a second batch may join a running one (0 = whenever a worker is free)."""
        return self.overlap_ms / 1000 if self.library_parallelism else 0.0


def load_settings(argv: list[str] | None = None) -> TokenizerSettings:
    settings = parse_settings(TokenizerSettings, argv, prog="python -m tokenizer_svc", env_prefix=ENV_PREFIX)
    if not settings.tokenizer:
        raise SystemExit("python -m tokenizer_svc: --tokenizer (or TOKENRELAY_TOKENIZER_TOKENIZER) is required")
    return settings
