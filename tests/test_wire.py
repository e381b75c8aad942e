"""Packed token ids (services/wire.py): the byte layout other languages must match."""

from __future__ import annotations

import struct

import pytest

from services.wire import pack_ids, unpack_ids


def test_packed_ids_are_little_endian_uint32_and_round_trip() -> None:
    ids = [0, 1, 255, 256, 65_535, 151_643, 2**32 - 1]
    data = pack_ids(ids)
    assert data == struct.pack("<7I", *ids)
    assert unpack_ids(data) == ids
    assert pack_ids([]) == b"" and unpack_ids(b"") == []


def test_unpack_refuses_a_torn_buffer() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        unpack_ids(b"\x01\x00\x00")


def test_ids_out_of_uint32_range_are_refused() -> None:
    with pytest.raises(OverflowError):
        pack_ids([2**32])
    with pytest.raises(OverflowError):
        pack_ids([-1])
