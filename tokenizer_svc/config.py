"""tokenizer_svc settings: flags > TOKENRELAY_TOKENIZER_* environment > config file > defaults."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field, field_validator, model_validator

from services.config import ServerSettings, ServiceSettings, conflict, section
from services.config import load_settings as _load


class TokenizerServerSettings(ServerSettings):
    shutdown_grace: float = Field(5.0, ge=0, description="seconds in-flight calls get to finish on SIGTERM")


class TokenizerSettings(ServiceSettings):
    """tokenizer_svc: batched tokenization and multiplexed streaming detokenization over gRPC."""

    ENV_PREFIX: ClassVar[str] = "TOKENRELAY_TOKENIZER_"
    PROG: ClassVar[str] = "python -m tokenizer_svc"

    server: TokenizerServerSettings = section(TokenizerServerSettings, "server")

    tokenizer: str = Field("", validate_default=True, description="model directory or tokenizer.json "
                           "(required); tokenizer_config.json, generation_config.json and config.json are "
                           "read from the same directory")
    tokenizer_config: str = Field("", description="explicit tokenizer_config.json (default: next to tokenizer.json)")
    generation_config: str = Field("", description="explicit generation_config.json (default: next to "
                                                   "tokenizer.json)")
    # `model_config` is pydantic's own attribute: the field is model_config_file, named model_config outside.
    model_config_file: str = Field("", alias="model_config", description="explicit config.json (default: next "
                                                                         "to tokenizer.json)")
    chat_template: str = Field("", description="chat template override: a file path, one of the model's named "
                                               "templates, or a built-in name (chatml, gemma)")
    workers: int = Field(0, ge=0, description="tokenize worker threads; 0 = 2 with library parallelism (a batch "
                         "uses every core; the second covers a batch held up by one long input), else the cores "
                         "this process may run on")
    library_parallelism: bool = Field(True, description="let the tokenizers library spread each batch over its "
                                      "own thread pool, batches running one after another (best for batched "
                                      "calls, which is what the router sends); off = each worker thread encodes "
                                      "its own batch (docs/benchmarks.md)")
    library_threads: int = Field(0, ge=0, description="threads of the tokenizers library's pool (0 = the cores "
                                 "this process may run on); N replicas on one host should get a share each, as "
                                 "`tokenrelay up --tokenizers N` does (read once, at start)")
    overlap_ms: float = Field(20.0, ge=0, description="with library parallelism: a batch may start while another "
                              "runs only once that one has run this long (it is then held up by a long input "
                              "while the library's other threads idle)")
    max_batch: int = Field(64, ge=1, description="most inputs in one Tokenize call")
    batch_inputs: int = Field(256, ge=1, description="most inputs encoded together (queued calls are merged up "
                              "to this): on many cores a big batch leaves the library's threads less idle at its "
                              "end")
    max_pending: int = Field(4096, ge=0, description="inputs queued or running before Tokenize answers "
                                                     "UNAVAILABLE/OVERLOADED")
    max_pending_bytes: int = Field(32 << 20, ge=0, description="text (UTF-8 bytes) queued or being encoded "
                                   "before Tokenize answers UNAVAILABLE/OVERLOADED at once; 0 = no byte limit")
    inline_bytes: int = Field(4096, ge=0, le=1 << 20, description="a call of at most this much text (UTF-8 "
                              "bytes) that finds the encoder idle is encoded on the event loop, skipping the "
                              "worker and post threads' hand-offs (~0.3 ms of latency); 0 = never")
    max_input_bytes: int = Field(4 << 20, ge=1, description="largest input in UTF-8 bytes (INPUT_TOO_LARGE "
                                                            "beyond)")
    max_input_tokens: int = Field(0, ge=-1, description="most tokens per input (PROMPT_TOO_LONG beyond); 0 = "
                                  "the model's context length when known, else no limit; -1 = no limit")
    max_cache_key_bytes: int = Field(32 << 10, ge=1, le=1 << 20, description="longest chat cache_key in "
                                     "UTF-8 bytes (CACHE_KEY_TOO_LONG beyond; the router's longest is its "
                                     "tenant id + '/' + a session id of --max-session-id characters)")
    chat_cache_tokens: int = Field(20_000_000, ge=0, description="token budget of the per-session chat prefix "
                                   "cache (incremental chat tokenization); 0 = off")
    switch_interval_ms: float = Field(0.5, ge=0, description="Python's thread switch interval "
                                      "(sys.setswitchinterval; Python's default is 5; 0 = leave it): how long a "
                                      "worker that finished encoding may wait for the interpreter lock before it "
                                      "can start the next batch")
    detok_workers: int = Field(1, ge=1, description="threads that run large Detokenize batches off the event loop")
    max_stream_requests: int = Field(10_000, ge=1, description="most requests open at once on one Detokenize "
                                                               "stream")
    max_message_opens: int = Field(10_000, ge=1, le=1_000_000, description="most opens in one Detokenize message; "
                                   "more ends the stream with INVALID_ARGUMENT/BATCH_TOO_LARGE")
    max_message_tokens: int = Field(1 << 18, ge=1, le=1 << 26, description="most token ids (in token items) in "
                                    "one Detokenize message; more ends the stream with "
                                    "INVALID_ARGUMENT/BATCH_TOO_LARGE")
    detok_slice_tokens: int = Field(1024, ge=1, le=1 << 20, description="a Detokenize message with more work "
                                    "than this (tokens; an open counts 10) runs on a worker thread in slices of "
                                    "this much (about 2.5 ms each), so one message never holds the event loop or "
                                    "the worker for long")

    @field_validator("tokenizer")
    @classmethod
    def _required(cls, path: str) -> str:
        if not path:
            raise ValueError("is required")
        return path

    @model_validator(mode="after")
    def _batch_limits(self) -> TokenizerSettings:
        if self.max_batch > self.batch_inputs:
            raise conflict(f"a call's inputs ({self.max_batch}) must fit in one batch ({self.batch_inputs})",
                           "max_batch", "batch_inputs")
        return self

    def effective_workers(self) -> int:
        if self.workers > 0:
            return self.workers
        return 2 if self.library_parallelism else len(os.sched_getaffinity(0))

    def overlap_after(self) -> float:
        """Seconds before a second batch may join a running one (0 = whenever a worker is free)."""
        return self.overlap_ms / 1000 if self.library_parallelism else 0.0

    def library_environment(self) -> dict[str, str]:
        """The variables the tokenizers library reads (process-wide), set in one place: `TokenizerApp.start`.
        RAYON_NUM_THREADS sizes its pool when the pool starts, at the first batch;
        TOKENIZERS_PARALLELISM is read at each batch call."""
        env = {"TOKENIZERS_PARALLELISM": "true" if self.library_parallelism else "false"}
        if self.library_threads > 0:
            env["RAYON_NUM_THREADS"] = str(self.library_threads)
        return env


def load_settings(argv: Sequence[str] | None = None) -> TokenizerSettings:
    return _load(TokenizerSettings, argv)
