"""Hypothesis strategies built from protobuf descriptors: valid-shaped messages with edge values, and
malformed bytes.

`messages(descriptor)` fills each field (or leaves it unset) with values drawn from its wire type:
integers at their type's bounds and small values (token ids, counts), floats with NaN / ±inf /
-0.0 / subnormals, strings empty / long / huge / unicode / control tokens, huge repeated fields,
unknown enum numbers; one member per oneof; nested messages to a bounded depth. `near(seeds)` takes a
valid message and sets a few of its fields (nested ones too) to such values. `malformed(...)`
gives bytes that usually do not decode: random bytes, or a generated message truncated, with a
byte flipped, with an unterminated varint appended, or with invalid UTF-8 spliced into a string.
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

F = FieldDescriptor

_INT_BOUNDS = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1), F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}

# Strings a service may treat specially: limits (128 / 256 characters), control tokens of the byte-level
# tokenizer, text that is not what it looks like.
EDGE_TEXT = [
    "", " ", "hello", "user", "system", "assistant", "r1", "s1", "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "hi <|endoftext|> there", "\x00", "\x00" * 64, "\n\n", "\u202e\u200b", "é" * 3, "🙂" * 40, "\ufeff",
    "a" * 128, "a" * 129, "a" * 256, "a" * 257, "{{ 7*7 }}", "{% for x in range(10**9) %}{% endfor %}",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "traceparent", "-1", "NaN",
]
HUGE_TEXT_CHARS = (5_000, 70_000, 1_100_000)   # over the router's 1,000,000-character bound at the top


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({lo, hi, 0, 1, 2, 255, 256, 258, 259, 260, 4096, 8192, hi - 1, max(lo, -1), min(hi, 2**31)})
    return st.one_of(st.integers(0, 300), st.sampled_from([e for e in edges if lo <= e <= hi]),
                     st.integers(lo, hi))


def _floats(width: int) -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([0.0, -0.0, 0.5, 1.0, 1.5, 100.0, 100.5, -1.0, math.nan, math.inf, -math.inf,
                                      1e-45, 3.4e38]),
                     st.floats(width=width))


def _texts() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(EDGE_TEXT), st.text(max_size=24),
                     st.tuples(st.sampled_from(["x", "é", "<|endoftext|>", "🙂"]), st.sampled_from(HUGE_TEXT_CHARS))
                     .map(lambda t: (t[0] * t[1])[: t[1]]))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_BOUNDS:
        return _ints(*_INT_BOUNDS[t])
    if t == F.TYPE_FLOAT:
        return _floats(32)
    if t == F.TYPE_DOUBLE:
        return _floats(64)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return _texts()
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.sampled_from([-1, max(numbers) + 1, 2**31 - 1]))
    raise AssertionError(f"no strategy for {field.full_name} (type {t})")


def _repeated(element: st.SearchStrategy[Any], cheap: bool) -> st.SearchStrategy[list[Any]]:
    small = st.lists(element, max_size=4)
    if not cheap:
        return small
    # Huge lists (of numbers only) as one value repeated: 50,000 drawn values would be slow to generate.
    return st.one_of(small, st.tuples(element, st.sampled_from([1_000, 10_001, 50_000])).map(lambda t: [t[0]] * t[1]))


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if _is_map(field):
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(_scalar(key), _value(value, depth), max_size=3)
    element = messages(field.message_type, depth + 1) if field.type == F.TYPE_MESSAGE else _scalar(field)
    if field.is_repeated:
        return _repeated(element, cheap=field.type not in (F.TYPE_MESSAGE, F.TYPE_STRING, F.TYPE_BYTES))
    return element


def _set(msg: Message, field: FieldDescriptor, value: Any) -> None:
    if _is_map(field):
        target = getattr(msg, field.name)
        for k, v in value.items():
            if field.message_type.fields_by_name["value"].type == F.TYPE_MESSAGE:
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif field.is_repeated:
        getattr(msg, field.name).extend(value)
    elif field.type == F.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


_CACHE: dict[tuple[str, int], st.SearchStrategy[Message]] = {}


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``'s type; below depth 3 nested messages are left empty."""
    key = (descriptor.full_name, depth)
    if key in _CACHE:
        return _CACHE[key]
    cls = message_factory.GetMessageClass(descriptor)
    if depth >= 3:
        return st.just(cls())
    plain = [f for f in descriptor.fields if f.containing_oneof is None or f.containing_oneof.name.startswith("_")]
    oneofs = [o for o in descriptor.oneofs if not o.name.startswith("_")]   # "_x": proto3 `optional x`
    fields = {f.name: st.one_of(st.none(), _value(f, depth)) for f in plain}
    choices = {o.name: st.one_of(st.none(), *(st.tuples(st.just(f), _value(f, depth)) for f in o.fields))
               for o in oneofs}

    def build(values: dict[str, Any], chosen: dict[str, Any]) -> Message:
        msg = cls()
        for name, value in values.items():
            if value is not None:
                _set(msg, descriptor.fields_by_name[name], value)
        for pick in chosen.values():
            if pick is not None:
                _set(msg, pick[0], pick[1])
        return msg

    strategy = st.builds(build, st.fixed_dictionaries(fields), st.fixed_dictionaries(choices))
    _CACHE[key] = strategy
    return strategy


def _paths(descriptor: Descriptor, depth: int = 0) -> list[tuple[FieldDescriptor, ...]]:
    """Every field reachable through singular message fields, to depth 3."""
    paths: list[tuple[FieldDescriptor, ...]] = []
    for f in descriptor.fields:
        paths.append((f,))
        if f.type == F.TYPE_MESSAGE and not f.is_repeated and depth < 2:
            paths += [(f, *sub) for sub in _paths(f.message_type, depth + 1)]
    return paths


def _patched(seed: Message, changes: list[tuple[tuple[FieldDescriptor, ...], Any]]) -> Message:
    msg = type(seed)()
    msg.CopyFrom(seed)
    for path, value in changes:
        target = msg
        for f in path[:-1]:
            target = getattr(target, f.name)
        field = path[-1]
        if field.is_repeated or _is_map(field):
            target.ClearField(field.name)
        _set(target, field, value)
    return msg


def near(seeds: list[Message]) -> st.SearchStrategy[Message]:
    """A valid ``seeds`` message with up to three fields, nested ones included, set to generated values:
    requests that get past the first checks, so the deeper paths of a service run too."""
    paths = _paths(seeds[0].DESCRIPTOR)
    if not paths:
        return st.sampled_from(seeds)
    change = st.one_of(*(st.tuples(st.just(path), _value(path[-1], len(path))) for path in paths))
    return st.builds(_patched, st.sampled_from(seeds), st.lists(change, max_size=3))


def _mutate(data: bytes, how: str, at: int, byte: int) -> bytes:
    i = at % (len(data) + 1)
    if how == "truncate":
        return data[:i] if i < len(data) else data[:-1]
    if how == "flip":
        return data[:i] + bytes([byte]) + data[i + 1:] if data else bytes([byte])
    if how == "varint":
        return data + b"\x08" + b"\xff" * 10           # field 1, a varint that never ends
    if how == "utf8":
        return data + b"\x0a\x02\xc3\x28"              # field 1 as a string holding invalid UTF-8
    return data + b"\x0b"                              # a group start (wire type 3) that is never closed


def malformed(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """Bytes for ``descriptor``'s RPC that mostly do not decode (some do: that is fine too)."""
    mutated = st.builds(_mutate, messages(descriptor).map(lambda m: m.SerializeToString()),
                        st.sampled_from(["truncate", "flip", "varint", "utf8", "group"]),
                        st.integers(0, 1 << 20), st.integers(0, 255))
    return st.one_of(st.binary(min_size=1, max_size=128), mutated)
