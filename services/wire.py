"""Meanings of wire values shared by every service and client, each in one table.

- finish reasons: the proto enum ↔ the names used in domain code, logs and metrics;
- engine error reasons (in-band on a multiplexed engine stream) → the typed error a caller raises;
- packed token ids (little-endian uint32, 4 bytes each): `pack_ids` / `unpack_ids`.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable

from services.errors import Internal, InvalidArgument, TokenrelayError, Unavailable
from services.proto.tokenrelay.v1 import common_pb2

FINISH_NAMES: dict[common_pb2.FinishReason, str] = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
    common_pb2.FINISH_REASON_ERROR: "error",
}
FINISH_CODES: dict[str, common_pb2.FinishReason] = {name: code for code, name in FINISH_NAMES.items()}

# Engine reasons that are the caller's fault; everything else is the mesh's.
ENGINE_CLIENT_ERRORS = frozenset({"EMPTY_PROMPT", "CONTEXT_LENGTH_EXCEEDED", "INVALID_MAX_TOKENS",
                                  "UNSUPPORTED_SAMPLING", "DUPLICATE_REQUEST_ID", "INVALID_TOKEN_ID",
                                  "INVALID_SAMPLING"})


def engine_error(reason: str, message: str) -> TokenrelayError:
    """The typed error for a request the engine finished with `error_reason`."""
    if reason in ENGINE_CLIENT_ERRORS:
        return InvalidArgument(message or reason, reason)
    if reason == "ENGINE_OVERLOADED":
        return Unavailable(message or "engine overloaded", reason, retry_after=1.0)
    return Internal(message or "engine error", reason or "ENGINE_ERROR")


def _id_array(ids: Iterable[int] = ()) -> array.array[int]:
    out = array.array("I", ids)
    if out.itemsize != 4:  # pragma: no cover - "I" is 4 bytes on every platform Python runs on here
        out = array.array("L", ids)
    return out


def pack_ids(ids: Iterable[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (~4 ns per id, against ~22 for a repeated field)."""
    out = _id_array(ids)
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        out.byteswap()
    return out.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    """The inverse of `pack_ids`; a length that is not a multiple of 4 is a ValueError."""
    if len(data) % 4:
        raise ValueError(f"packed ids of {len(data)} bytes: not a multiple of 4")
    out = _id_array()
    out.frombytes(data)
    if sys.byteorder != "little":  # pragma: no cover
        out.byteswap()
    return out.tolist()
