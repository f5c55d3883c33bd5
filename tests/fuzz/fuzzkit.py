"""Shared pieces of the fuzz suite: hypothesis settings, protobuf wire strategies, mutations,
and a memory-growth check.

Budget: the whole suite (``pytest -m fuzz``) runs in about two minutes on two cores. Each
property has its own ``max_examples``; ``deadline=None`` because a shared CI machine makes
per-example timings noisy (hangs are caught by the per-test timeout and by explicit
time bounds where a case is known to be expensive).

The wire strategies are generated from betterproto2's field metadata, so they follow the
protos as they change: ``wire_message(cls)`` draws bytes that are a *well-formed* encoding
of ``cls`` (every scalar in its type's range, strings valid UTF-8, packed and unpacked
repeated fields, map entries, unknown fields of every wire type), which the server's
decoder must accept; ``mutated(...)`` then breaks them in the ways a fuzzer does.
"""

from __future__ import annotations

import gc
import json
import struct
import tracemalloc
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final, TypeVar

import betterproto2
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

T = TypeVar("T")

FUZZ: Final = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    max_examples=200,
)
"""The base settings; tests lower or raise ``max_examples`` to fit the suite's budget."""


def examples(count: int, *, shared_fixture: bool = False) -> settings:
    """``FUZZ`` with ``count`` examples; ``shared_fixture`` when one long-lived fixture (a
    server) deliberately serves every example, which is the point of those tests."""
    checks = [HealthCheck.too_slow, HealthCheck.data_too_large]
    if shared_fixture:
        checks.append(HealthCheck.function_scoped_fixture)
    return settings(FUZZ, max_examples=count, suppress_health_check=checks)


# --- protobuf wire ------------------------------------------------------------------------


def varint(value: int) -> bytes:
    """The varint of an unsigned value (any size: overlong ones are for malformed cases)."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    return tag(number, 2) + varint(len(payload)) + payload


_U64: Final = (1 << 64) - 1


def _signed(bits: int) -> st.SearchStrategy[bytes]:
    """int32/int64/enum: negative values sign-extended to ten bytes, as protoc writes them."""
    return st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1).map(lambda v: varint(v & _U64))


def _zigzag(bits: int) -> st.SearchStrategy[bytes]:
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return st.integers(low, high).map(lambda v: varint(((v << 1) ^ (v >> (bits - 1))) & _U64))


_VARINT_VALUES: Final[dict[str, st.SearchStrategy[bytes]]] = {
    betterproto2.TYPE_BOOL: st.sampled_from([b"\x00", b"\x01"]),
    betterproto2.TYPE_INT32: _signed(32),
    betterproto2.TYPE_INT64: _signed(64),
    betterproto2.TYPE_ENUM: _signed(32),  # values no enum names included: read as unknown
    betterproto2.TYPE_UINT32: st.integers(0, (1 << 32) - 1).map(varint),
    betterproto2.TYPE_UINT64: st.integers(0, _U64).map(varint),
    betterproto2.TYPE_SINT32: _zigzag(32),
    betterproto2.TYPE_SINT64: _zigzag(64),
}
_FIXED_SIZES: Final = {
    **dict.fromkeys(betterproto2.WIRE_FIXED_32_TYPES, 4),
    **dict.fromkeys(betterproto2.WIRE_FIXED_64_TYPES, 8),
}
_WIRE_OF_SIZE: Final = {4: 5, 8: 1}
TEXT: Final = st.text(st.characters(codec="utf-8"), max_size=24)


def _scalar(proto_type: str) -> tuple[int, st.SearchStrategy[bytes]]:
    """(wire type, strategy for the encoded value) of a non-message scalar type."""
    if proto_type in _VARINT_VALUES:
        return 0, _VARINT_VALUES[proto_type]
    if proto_type in _FIXED_SIZES:
        size = _FIXED_SIZES[proto_type]
        values = st.binary(min_size=size, max_size=size)
        if proto_type in (betterproto2.TYPE_FLOAT, betterproto2.TYPE_DOUBLE):
            fmt = "<f" if size == 4 else "<d"
            values = values | st.floats(width=32 if size == 4 else 64).map(
                lambda f: struct.pack(fmt, f)
            )
        return _WIRE_OF_SIZE[size], values
    if proto_type == betterproto2.TYPE_STRING:
        return 2, TEXT.map(lambda s: _len_prefixed(s.encode("utf-8")))
    if proto_type == betterproto2.TYPE_BYTES:
        return 2, st.binary(max_size=32).map(_len_prefixed)
    raise AssertionError(f"no strategy for proto type {proto_type}")


def _len_prefixed(payload: bytes) -> bytes:
    return varint(len(payload)) + payload


def _field(
    cls: type[Any], name: str, meta: betterproto2.FieldMetadata, depth: int
) -> st.SearchStrategy[bytes]:
    """One occurrence of field ``name`` of ``cls`` (tag included), well formed."""
    if meta.proto_type == betterproto2.TYPE_MAP:
        assert meta.map_meta is not None
        key, value = meta.map_meta
        entry = st.tuples(_entry_part(key, 1, depth), _entry_part(value, 2, depth))
        return entry.map(lambda kv: length_delimited(meta.number, kv[0] + kv[1]))
    if meta.proto_type == betterproto2.TYPE_MESSAGE:
        nested = meta.unwrap() if meta.unwrap is not None else cls._betterproto.cls_by_field[name]
        return wire_message(nested, depth + 1).map(lambda b: length_delimited(meta.number, b))
    wire_type, values = _scalar(meta.proto_type)
    single = values.map(lambda v: tag(meta.number, wire_type) + v)
    if meta.repeated and wire_type != 2:  # packed: several values in one length-delimited
        packed = st.lists(values, min_size=1, max_size=6).map(
            lambda vs: length_delimited(meta.number, b"".join(vs))
        )
        return single | packed
    return single


def _entry_part(
    meta: betterproto2.FieldMetadata, number: int, depth: int
) -> st.SearchStrategy[bytes]:
    """A map entry's key (1) or value (2); sometimes left out, as protobuf allows."""
    if meta.proto_type == betterproto2.TYPE_MESSAGE:
        return st.just(b"")  # llmgw's protos have no message-valued maps
    wire_type, values = _scalar(meta.proto_type)
    return st.just(b"") | values.map(lambda v: tag(number, wire_type) + v)


def _unknown_field(known: Iterable[int]) -> st.SearchStrategy[bytes]:
    """A field a newer peer might send: any number the schema does not use, any wire type."""
    taken = set(known)
    gaps = sorted(set(range(1, max(taken, default=0) + 1)) - taken)
    numbers = st.integers(max(taken, default=0) + 1, (1 << 29) - 1)
    if gaps:
        numbers = numbers | st.sampled_from(gaps)
    values = st.one_of(
        st.tuples(st.just(0), st.integers(0, _U64).map(varint)),
        st.tuples(st.just(1), st.binary(min_size=8, max_size=8)),
        st.tuples(st.just(2), st.binary(max_size=16).map(_len_prefixed)),
        st.tuples(st.just(5), st.binary(min_size=4, max_size=4)),
    )
    return st.tuples(numbers, values).map(lambda nv: tag(nv[0], nv[1][0]) + nv[1][1])


_MAX_DEPTH: Final = 3
_cache: dict[tuple[type[Any], int], st.SearchStrategy[bytes]] = {}


def wire_message(cls: type[Any], depth: int = 0) -> st.SearchStrategy[bytes]:
    """Well-formed encodings of ``cls``: some of its fields in any order, repeats included."""
    key = (cls, depth)
    if key not in _cache:
        metas = cls._betterproto.meta_by_field_name
        if depth >= _MAX_DEPTH:
            _cache[key] = st.just(b"")
        else:
            fields = [_field(cls, name, meta, depth) for name, meta in metas.items()]
            fields.append(_unknown_field(m.number for m in metas.values()))
            size = 6 if depth == 0 else 3
            _cache[key] = st.lists(st.one_of(fields), max_size=size).map(b"".join)
    return _cache[key]


# --- mutations ---------------------------------------------------------------------------


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[bytes]) -> bytes:
    """``base`` bytes broken by one to three fuzzer-style mutations."""
    data = bytearray(draw(base))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "dup"]))
        at = draw(st.integers(0, len(data)))
        if kind == "insert" or not data:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "flip":
            data[min(at, len(data) - 1)] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[min(at, len(data) - 1)] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF]))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif kind == "truncate":
            del data[at:]
        else:
            end = min(len(data), at + draw(st.integers(1, 16)))
            data[at:at] = data[at:end]
    return bytes(data)


# --- OpenAI request bodies ----------------------------------------------------------------

_VALID = [
    {"model": "m", "prompt": "The capital of France is", "max_tokens": 4},
    {"model": "m", "prompt": [[1, 2, 3], [4]], "stream": True, "user": "u1"},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False},
    {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image_url", "image_url": {"url": "x"}},
                ],
            }
        ],
        "cache_salt": "s",
    },  # fmt: skip
]
_PIECES = st.sampled_from(
    [b"{", b"}", b"[", b"]", b'"', b",", b":", b"\\", b"\\u", b"\\ud800", b"\\udc00", b"NaN",
     b"-Infinity", b"1e999", b"-0", b"1" * 40, b"null", b"true", b"\x00", b"\xff", b"\xc3",
     b'"model"', b'"m"', b'"prompt"', b'"messages"', b'"stream"', b"[" * 50, b" " * 10]
)  # fmt: skip


@st.composite
def openai_bodies(draw: st.DrawFn) -> bytes:
    """A real request's JSON with fuzzer-style pieces spliced in."""
    text = json.dumps(draw(st.sampled_from(_VALID))).encode()
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(text)))
        kind = draw(st.sampled_from(["insert", "delete", "replace"]))
        piece = draw(_PIECES | st.binary(max_size=4))
        if kind == "insert":
            text = text[:at] + piece + text[at:]
        elif kind == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 8)) :]
        else:
            text = text[:at] + piece + text[at + len(piece) :]
    return text


# --- memory ------------------------------------------------------------------------------


def growth(run: Callable[[], object], rounds: int = 2) -> int:
    """Bytes still allocated after ``run()`` that were not before, measured once a warm-up
    run has filled caches; the smallest of ``rounds`` measurements (noise only adds)."""
    run()
    smallest = None
    tracemalloc.start()
    try:
        for _ in range(rounds):
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            run()
            gc.collect()
            grew = tracemalloc.get_traced_memory()[0] - before
            smallest = grew if smallest is None else min(smallest, grew)
    finally:
        tracemalloc.stop()
    assert smallest is not None
    return smallest


async def async_growth(run: Callable[[], Awaitable[object]], rounds: int = 2) -> int:
    """`growth` of a coroutine function."""
    await run()
    smallest = None
    tracemalloc.start()
    try:
        for _ in range(rounds):
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            await run()
            gc.collect()
            grew = tracemalloc.get_traced_memory()[0] - before
            smallest = grew if smallest is None else min(smallest, grew)
    finally:
        tracemalloc.stop()
    assert smallest is not None
    return smallest
