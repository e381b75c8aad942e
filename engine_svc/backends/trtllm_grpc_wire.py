"""The one edge between the `trtllm-grpc` backend and TensorRT-LLM's `TrtllmService` protobuf types.

The messages come from the published `smg-grpc-proto` package (the proto that `trtllm-serve --grpc`
serves, with its generated modules), imported lazily: the base install never needs it. Everything
here converts in one direction or the other; the backend itself sees only contract types.
"""

from __future__ import annotations

import hashlib
import importlib
from types import ModuleType
from typing import Any

import grpc

from services.errors import Reason

from .base import FinishReason, GenerationRequest
from .events import KvBlock, KvEvent, KvEventType

PACKAGE = "smg_grpc_proto"


class Wire:
    """The generated modules, loaded once (``ModuleNotFoundError`` when the extra is missing)."""

    def __init__(self) -> None:
        self.pb: ModuleType = importlib.import_module(f"{PACKAGE}.generated.trtllm_service_pb2")
        self.grpc: ModuleType = importlib.import_module(f"{PACKAGE}.generated.trtllm_service_pb2_grpc")
        self.common: ModuleType = importlib.import_module(f"{PACKAGE}.generated.common_pb2")

    def stub(self, channel: grpc.aio.Channel) -> Any:
        return self.grpc.TrtllmServiceStub(channel)

    def generate_request(self, request: GenerationRequest, wire_id: str) -> Any:
        """A streaming `GenerateRequest`: token ids in, stop ids (EOS included) emitted as tokens."""
        pb = self.pb
        sampling = pb.SamplingConfig(beam_width=1, num_return_sequences=1)
        if request.temperature > 0:
            sampling.temperature = request.temperature
            if request.top_p > 0:
                sampling.top_p = request.top_p
            if request.top_k > 0:
                sampling.top_k = request.top_k
            if request.seed is not None:
                sampling.seed = request.seed & 0xFFFFFFFFFFFFFFFF
        else:
            sampling.top_k = 1  # greedy, whatever the server's default temperature is
        message = pb.GenerateRequest(
            request_id=wire_id,
            tokenized=pb.TokenizedInput(input_token_ids=request.prompt_token_ids),
            sampling_config=sampling,
            output_config=pb.OutputConfig(exclude_input_from_output=True),
            max_tokens=request.max_tokens,
            streaming=True,
            stop_token_ids=sorted(request.stop_set()),
            ignore_eos=request.ignore_eos,
            # The contract emits the stop token (the detokenizer decides what to show).
            include_stop_token_in_output=True,
        )
        if request.cache_salt:
            message.cache_salt_id = salt_id(request.cache_salt)
        return message

    def kv_subscribe_request(self, start_sequence_number: int) -> Any:
        return self.common.SubscribeKvEventsRequest(start_sequence_number=start_sequence_number)


def salt_id(salt: str) -> int:
    """The proto's cache salt is an int64: a stable 63-bit hash of the tenant's salt string."""
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "big") >> 1


_FINISH = {
    "stop": FinishReason.STOP, "stop_word": FinishReason.STOP, "length": FinishReason.LENGTH,
    "cancelled": FinishReason.CANCELLED, "abort": FinishReason.CANCELLED,
}


def finish_reason(name: str) -> FinishReason:
    """TensorRT-LLM's finish reason; an unknown or empty one (``error``, ``timeout``) is ERROR."""
    return _FINISH.get(name.lower(), FinishReason.ERROR)


# gRPC status of a failed Generate call -> (the contract's reason, does the server look gone?)
_STATUS: dict[grpc.StatusCode, tuple[Reason, bool]] = {
    grpc.StatusCode.UNAVAILABLE: (Reason.ENGINE_UNAVAILABLE, True),
    grpc.StatusCode.CANCELLED: (Reason.ENGINE_UNAVAILABLE, True),      # server shut down under us
    grpc.StatusCode.RESOURCE_EXHAUSTED: (Reason.OVERLOADED, False),
    grpc.StatusCode.DEADLINE_EXCEEDED: (Reason.DEADLINE_EXCEEDED, False),
    grpc.StatusCode.INVALID_ARGUMENT: (Reason.INVALID_ARGUMENT, False),
}


def status_reason(code: grpc.StatusCode | None) -> tuple[Reason, bool]:
    return _STATUS.get(code, (Reason.ENGINE_ERROR, False)) if code is not None else (Reason.ENGINE_ERROR, False)


class KvEventMapper:
    """`KvEventBatch` messages -> contract `KvEvent`s, with the contract's own event ids.

    Event ids grow by one per event; a gap in the server's batch sequence numbers (batches lost
    while reconnecting) advances them by the missing batches, so subscribers see a gap too.
    ``cleared`` has no TensorRT-LLM counterpart: it becomes a ``removed`` of every block stored
    since (the mapper keeps the set of live hashes, bounded by the server's cache).
    """

    def __init__(self) -> None:
        self.next_event_id = 0
        self.last_sequence: int | None = None
        self.live: set[int] = set()

    def batch(self, message: Any) -> list[KvEvent]:
        seq = int(message.sequence_number)
        if message.HasField("load") and message.load.load_only:
            return []  # a heartbeat: it repeats the last sequence and carries no events
        if self.last_sequence is not None and seq > self.last_sequence + 1:
            self.next_event_id += seq - self.last_sequence - 1
        self.last_sequence = seq if self.last_sequence is None else max(seq, self.last_sequence)
        out: list[KvEvent] = []
        for event in message.events:
            mapped = self._event(event)
            if mapped is not None:
                out.append(mapped)
        return out

    def _event(self, event: Any) -> KvEvent | None:
        kind = event.WhichOneof("data")
        if kind == "stored":
            stored = event.stored
            blocks = tuple(KvBlock(int(b.block_hash), tuple(b.token_ids),
                                   cache_level=int(b.cache_level) if b.HasField("cache_level") else 0)
                           for b in stored.blocks)
            self.live.update(b.block_hash for b in blocks)
            parent = int(stored.parent_block_hash) if stored.HasField("parent_block_hash") else None
            return self._make(KvEventType.STORED, parent_hash=parent, blocks=blocks)
        if kind == "removed":
            hashes = tuple(int(h) for h in event.removed.block_hashes)
            self.live.difference_update(hashes)
            return self._make(KvEventType.REMOVED, block_hashes=hashes)
        if kind == "cleared":
            hashes = tuple(sorted(self.live))
            self.live.clear()
            return self._make(KvEventType.REMOVED, block_hashes=hashes)
        return None

    def _make(self, kind: KvEventType, **fields: Any) -> KvEvent:
        event = KvEvent(self.next_event_id, kind, **fields)
        self.next_event_id += 1
        return event
