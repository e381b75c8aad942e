"""Wire the tokenizer service: load the tokenizer, build encoder + detokenizer, serve (with
tracing and optional /metrics), shut down.

Shutdown (SIGTERM/SIGINT): health goes NOT_SERVING, in-flight calls get `shutdown_grace`
seconds, then the encoder's and detokenizer's thread pools are closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

from services import gcstats
from services.grpc_util import GrpcServer, wait_for_shutdown_signal, write_port_file
from services.logging import get_logger
from services.metrics import start_metrics_server
from services.proto.tokenrelay.v1 import tokenizer_pb2_grpc
from services.tokenization.chat_template import ChatTemplate, resolve_template
from services.tokenization.detok_stream import Detokenizer
from services.tokenization.encoder import Encoder, EncoderLimits
from services.tokenization.loader import LoadedTokenizer, TokenizerFiles, load_tokenizer, template_stop_ids
from services.tracing import ServerTracingInterceptor, configure_tracing
from tokenizer_svc.config import TokenizerSettings
from tokenizer_svc.servicer import SERVICE_NAME, TokenizerServicer

log = get_logger(__name__)


def load_domain(settings: TokenizerSettings) -> tuple[LoadedTokenizer, ChatTemplate | None]:
    """The tokenizer and its chat template (None when there is none); raises on bad files."""
    files = TokenizerFiles.discover(settings.tokenizer, tokenizer_config=settings.tokenizer_config,
                                    generation_config=settings.generation_config,
                                    model_config=settings.model_config_file)
    loaded = load_tokenizer(files)
    chosen = resolve_template(settings.chat_template, loaded.chat_templates)
    template = None if chosen is None else ChatTemplate(chosen[1], chosen[0], loaded.special_tokens)
    if chosen is not None and chosen[0] != "default":
        # An override's end-of-turn ends a reply too (the loader added the model's own template's).
        extra = template_stop_ids(loaded.tokenizer, loaded.special_tokens, chosen[1])
        ids = tuple(dict.fromkeys((*loaded.eos_token_ids, *(i for i in extra if 0 <= i < loaded.vocab_size))))
        loaded = dataclasses.replace(loaded, eos_token_ids=ids)
    return loaded, template


def encoder_limits(settings: TokenizerSettings, loaded: LoadedTokenizer) -> EncoderLimits:
    max_tokens = settings.max_input_tokens
    if max_tokens == 0:
        max_tokens = loaded.max_context
    return EncoderLimits(max_batch=settings.max_batch, batch_inputs=settings.batch_inputs,
                         max_pending=settings.max_pending,
                         max_input_bytes=settings.max_input_bytes, max_input_tokens=max(0, max_tokens),
                         max_pending_bytes=settings.max_pending_bytes, inline_bytes=settings.inline_bytes,
                         max_cache_key_bytes=settings.max_cache_key_bytes)


class TokenizerApp:
    """The running service; `start()` then `stop()`. Tests use it in-process on port 0."""

    def __init__(self, settings: TokenizerSettings) -> None:
        self.settings = settings
        self.encoder: Encoder | None = None
        self.detokenizer: Detokenizer | None = None
        self.server: GrpcServer | None = None

    @property
    def address(self) -> str:
        assert self.server is not None, "not started"
        return self.server.address

    async def start(self) -> None:
        s = self.settings
        os.environ.update(s.library_environment())   # read by the tokenizers library (process-wide)
        # Parsing a large tokenizer.json takes a while: keep the loop free (signals, health).
        loaded, template = await asyncio.to_thread(load_domain, s)
        self.encoder = Encoder(loaded, template, encoder_limits(s, loaded), workers=s.effective_workers(),
                               chat_cache_tokens=s.chat_cache_tokens, overlap_after=s.overlap_after())
        await self.encoder.start()
        self.detokenizer = Detokenizer(loaded, workers=max(1, s.detok_workers),
                                       max_requests_per_stream=s.max_stream_requests,
                                       slice_tokens=s.detok_slice_tokens, max_message_opens=s.max_message_opens,
                                       max_message_tokens=s.max_message_tokens)
        await self.detokenizer.start()
        self.server = GrpcServer(s.server.host, s.server.port, [SERVICE_NAME], [ServerTracingInterceptor()],
                                 security=s.security)
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(
            TokenizerServicer(self.encoder, self.detokenizer), self.server.server)
        await self.server.start()
        write_port_file(s.server.port_file, self.server.port)
        log.info("tokenizer_serving", address=self.server.address, tokenizer=loaded.name,
                 chat_template=template.name if template else None, workers=s.effective_workers())

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(self.settings.server.shutdown_grace)
        if self.encoder is not None:
            await self.encoder.close()
        if self.detokenizer is not None:
            await self.detokenizer.close()
        log.info("tokenizer_stopped")


async def serve(settings: TokenizerSettings) -> None:
    telemetry = settings.telemetry
    configure_tracing("tokenizer_svc", telemetry.otlp_endpoint, trace_file=telemetry.trace_file)
    # Metrics first: /metrics answers while a large tokenizer.json loads.
    write_port_file(telemetry.metrics_port_file, start_metrics_server(settings.server.host, telemetry.metrics_port))
    app = TokenizerApp(settings)
    try:
        await app.start()
    except (ValueError, OSError) as exc:  # bad files or template, port taken: say so, no traceback
        await app.stop()
        raise SystemExit(f"tokenizer_svc: cannot start: {exc}") from exc
    log.info("gc_settled", frozen=gcstats.settle())   # the tokenizer's objects out of the collector's way
    await wait_for_shutdown_signal()
    log.info("tokenizer_shutting_down")
    await app.stop()
