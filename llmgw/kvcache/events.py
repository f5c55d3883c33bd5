"""vLLM KV cache events: the msgpack batch, its ZMQ frames and the replay protocol.

A batch is the msgpack array ``[ts, events, data_parallel_rank]`` (float64 ts; two elements
in 0.9.0). Events are arrays ``[tag, field, ...]`` with every field of their version up to
vLLM 0.23, and maps ``{"type": tag, field: value, ...}`` from 0.24, where fields that have a
default are left out when they are None (spec/vllm-kv-events.md §1). `encode_batch` writes
what vLLM's msgspec encoder writes, byte for byte; `decode_batch` reads every variant from
0.9.0 to 0.33 into the frozen dataclasses below and refuses anything else with
`KvEventDecodeError`. Hashes stay as sent: an int (the default) or the digest bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import msgpack

from llmgw.kvcache.errors import KvEventDecodeError, KvEventEncodeError
from llmgw.kvcache.hashing import parse_vllm_version

__all__ = [
    "REPLAY_END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Encoding",
    "Event",
    "EventBatch",
    "ExternalBlockHash",
    "ReplayMessage",
    "decode_batch",
    "decode_frames",
    "decode_replay_message",
    "decode_replay_request",
    "encode_batch",
    "encode_frames",
    "encode_replay_message",
    "encode_replay_request",
    "replay_end_frames",
]

ExternalBlockHash = int | bytes
Encoding = Literal["map", "array"]

REPLAY_END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
"""The seq frame of the message that ends a replay (its payload is empty)."""

_END_SEQ_INT: Final = int.from_bytes(REPLAY_END_SEQ, "big")
_SEQ_LIMIT: Final = 1 << 64
_MAX_NESTING: Final = 32  # extra keys are tuples of scalars or pairs; refuse absurd depth
_V0_9_1: Final = (0, 9, 1)
_V0_24: Final = (0, 24, 0)
_V0_26: Final = (0, 26, 0)
_HASH_TYPES: Final = frozenset((int, bytes))  # exact types: a bool is no block hash
_INT_TYPE: Final = frozenset((int,))
_ABSENT: Final = object()  # a map without the field


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one request became full and cached (vLLM field names)."""

    block_hashes: tuple[ExternalBlockHash, ...]
    parent_block_hash: ExternalBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None  # 0.10.2+
    lora_name: str | None = None  # 0.14+
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None  # 0.17+, one per hash
    group_idx: int | None = None  # 0.20+
    kv_cache_spec_kind: str | None = None  # 0.22+
    kv_cache_spec_sliding_window: int | None = None  # 0.22+
    locality: str | None = None  # 0.26+
    ownership: str | None = None  # 0.29+
    session_id: str | None = None  # 0.30+
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None  # 0.33+


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted (vLLM sends one hash per event)."""

    block_hashes: tuple[ExternalBlockHash, ...]
    medium: str | None = None  # 0.10.2+
    group_idx: int | None = None  # 0.20+
    locality: str | None = None  # 0.26+
    ownership: str | None = None  # 0.29+


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: the events of one scheduler step."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


# -- field converters (decoding) ------------------------------------------------------------

_Decode = Callable[[object, str], object]


def _describe(value: object) -> str:
    # Never repr a container: msgpack nests up to ~1000 deep, past repr's recursion limit.
    if type(value) is tuple or type(value) is list:  # decoded arrays are tuples
        return f"an array of {len(value)}"
    if type(value) is dict:
        return f"a map of {len(value)}"
    text = repr(value[:40] if isinstance(value, str | bytes) else value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _bad(where: str, expected: str, value: object) -> KvEventDecodeError:
    return KvEventDecodeError(f"{where}: expected {expected}, got {_describe(value)}")


def _int(value: object, where: str) -> int:
    if type(value) is not int:
        raise _bad(where, "an int", value)
    return value


def _str(value: object, where: str) -> str:
    if type(value) is not str:
        raise _bad(where, "a string", value)
    return value


def _hash(value: object, where: str) -> ExternalBlockHash:
    if type(value) is not int and type(value) is not bytes:
        raise _bad(where, "a block hash (int or bytes)", value)
    return value


def _array(value: object, where: str) -> tuple[object, ...]:
    if type(value) is not tuple:  # msgpack arrays decode as tuples (use_list=False)
        raise _bad(where, "an array", value)
    return value


def _hash_list(value: object, where: str) -> tuple[ExternalBlockHash, ...]:
    items = _array(value, where)
    if _HASH_TYPES.issuperset(map(type, items)):  # every item checked, in C
        return items  # type: ignore[return-value]
    return tuple(_hash(item, f"{where}[{i}]") for i, item in enumerate(items))  # says which


def _int_list(value: object, where: str) -> tuple[int, ...]:
    items = _array(value, where)
    if not _INT_TYPE.issuperset(map(type, items)):  # every item checked, in C
        for i, item in enumerate(items):
            if type(item) is not int:
                raise _bad(f"{where}[{i}]", "an int", item)
    return items  # type: ignore[return-value]  # every item checked above


def _frozen(value: object, where: str, depth: int) -> object:
    if type(value) is tuple:
        if depth >= _MAX_NESTING:
            raise KvEventDecodeError(f"{where}: nested deeper than {_MAX_NESTING} arrays")
        return tuple(_frozen(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    raise _bad(where, "nil, a scalar, a string, bytes or an array", value)


def _extra_keys(value: object, where: str) -> tuple[tuple[object, ...] | None, ...]:
    out: list[tuple[object, ...] | None] = []
    for i, entry in enumerate(_array(value, where)):
        if entry is None:
            out.append(None)
        else:
            out.append(_frozen(_array(entry, f"{where}[{i}]"), f"{where}[{i}]", 1))  # type: ignore[arg-type]
    return tuple(out)


def _lookahead(value: object, where: str) -> tuple[tuple[int, ...], ...]:
    items = _array(value, where)
    return tuple(_int_list(item, f"{where}[{i}]") for i, item in enumerate(items))


def _optional(decode: _Decode) -> _Decode:
    def decode_optional(value: object, where: str) -> object:
        return None if value is None else decode(value, where)

    return decode_optional


# -- schemas --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    since: tuple[int, ...]  # first vLLM version with the field
    has_default: bool  # vLLM default None: left out of maps when None
    decode: _Decode
    required: bool = False  # the decoder refuses an event without it


_Step = tuple[str, str, _Decode, bool]  # name, its path in errors, decode, required


@dataclass(frozen=True, slots=True)
class _Schema:
    tag: str
    make: Callable[..., Event]
    fields: tuple[_Field, ...]
    steps: tuple[_Step, ...] = field(init=False)  # what decoding needs, in fields' order

    def __post_init__(self) -> None:
        steps = tuple((f.name, "." + f.name, f.decode, f.required) for f in self.fields)
        object.__setattr__(self, "steps", steps)

    def fields_of(self, version: tuple[int, ...]) -> tuple[_Field, ...]:
        return tuple(f for f in self.fields if f.since <= version)


_V0_9 = (0, 9, 0)
_OPT_INT = _optional(_int)
_OPT_STR = _optional(_str)

_STORED = _Schema(
    "BlockStored",
    BlockStored,
    (
        _Field("block_hashes", _V0_9, False, _hash_list, required=True),
        _Field("parent_block_hash", _V0_9, False, _optional(_hash), required=True),
        _Field("token_ids", _V0_9, False, _int_list, required=True),
        _Field("block_size", _V0_9, False, _int, required=True),
        _Field("lora_id", _V0_9, False, _OPT_INT),
        _Field("medium", (0, 10, 2), False, _OPT_STR),
        _Field("lora_name", (0, 14, 0), False, _OPT_STR),
        _Field("extra_keys", (0, 17, 0), True, _optional(_extra_keys)),
        _Field("group_idx", (0, 20, 0), True, _OPT_INT),
        _Field("kv_cache_spec_kind", (0, 22, 0), True, _OPT_STR),
        _Field("kv_cache_spec_sliding_window", (0, 22, 0), True, _OPT_INT),
        _Field("locality", (0, 26, 0), True, _OPT_STR),
        _Field("ownership", (0, 29, 0), True, _OPT_STR),
        _Field("session_id", (0, 30, 0), True, _OPT_STR),
        _Field("lookahead_token_ids", (0, 33, 0), True, _optional(_lookahead)),
    ),
)
_REMOVED = _Schema(
    "BlockRemoved",
    BlockRemoved,
    (
        _Field("block_hashes", _V0_9, False, _hash_list, required=True),
        _Field("medium", (0, 10, 2), False, _OPT_STR),
        _Field("group_idx", (0, 20, 0), True, _OPT_INT),
        _Field("locality", (0, 26, 0), True, _OPT_STR),
        _Field("ownership", (0, 29, 0), True, _OPT_STR),
    ),
)
_CLEARED = _Schema("AllBlocksCleared", AllBlocksCleared, ())
_SCHEMAS_BY_TAG: Final = {s.tag: s for s in (_STORED, _REMOVED, _CLEARED)}
_SCHEMAS_BY_TYPE: Final[dict[type, _Schema]] = {
    BlockStored: _STORED,
    BlockRemoved: _REMOVED,
    AllBlocksCleared: _CLEARED,
}


# -- decoding -------------------------------------------------------------------------------


def _unpack(payload: bytes) -> object:
    try:
        return msgpack.unpackb(payload, raw=False, use_list=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise KvEventDecodeError(f"payload is not a msgpack value: {exc}") from exc


def _schema_for(tag: object, where: str) -> _Schema:
    if type(tag) is not str:
        raise _bad(f"{where}.type", "an event type string", tag)
    schema = _SCHEMAS_BY_TAG.get(tag)
    if schema is None:
        known = ", ".join(_SCHEMAS_BY_TAG)
        raise KvEventDecodeError(f"{where}: unknown event type {tag!r} (known: {known})")
    return schema


def _missing(where: str, name: str) -> KvEventDecodeError:
    return KvEventDecodeError(f"{where}: missing required field {name!r}")


# Events are decoded with paths relative to the event (``.token_ids[5]``, ``: missing ...``):
# `_decode_events` puts the event's name in front of an error, so none is made otherwise.


def _event_from_array(items: tuple[object, ...]) -> Event:
    if not items:
        raise KvEventDecodeError(": empty event array (no type tag)")
    schema = _schema_for(items[0], "")
    kwargs: dict[str, object] = {}
    for (name, path, decode, _), value in zip(schema.steps, items[1:], strict=False):
        kwargs[name] = decode(value, path)
    for name, _, _, required in schema.steps[len(items) - 1 :]:  # fields not sent
        if required:
            raise _missing("", name)
    return schema.make(**kwargs)


def _event_from_map(items: dict[object, object]) -> Event:
    if "type" not in items:
        raise _missing("", "type")
    schema = _schema_for(items["type"], "")
    kwargs: dict[str, object] = {}
    for name, path, decode, required in schema.steps:
        value = items.get(name, _ABSENT)
        if value is not _ABSENT:
            kwargs[name] = decode(value, path)
        elif required:
            raise _missing("", name)
    return schema.make(**kwargs)


def _decode_event(raw: object) -> Event:
    if type(raw) is tuple:
        return _event_from_array(raw)
    if type(raw) is dict:
        return _event_from_map(raw)
    raise _bad("", "an event (array or map)", raw)


def _decode_events(raws: tuple[object, ...]) -> tuple[Event, ...]:
    """Each event in order; an error names the event (``events[3].token_ids[5]: ...``)."""
    events: list[Event] = []
    try:
        for raw in raws:
            events.append(_decode_event(raw))  # noqa: PERF401  # its length names a bad one
    except KvEventDecodeError as exc:
        raise KvEventDecodeError(f"events[{len(events)}]{exc}") from None
    return tuple(events)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one KV event batch payload of any vLLM version from 0.9.0 to 0.33.

    Unknown trailing array elements and unknown map keys (newer fields) are ignored; fields
    a version does not have are None. Anything malformed raises `KvEventDecodeError`.
    """
    raw = _unpack(payload)
    if type(raw) is not tuple or len(raw) < 2:
        raise _bad("batch", "an array [ts, events, data_parallel_rank]", raw)
    ts = raw[0]
    if type(ts) is not float and type(ts) is not int:
        raise _bad("batch.ts", "a float", ts)
    events = _array(raw[1], "batch.events")
    rank = _OPT_INT(raw[2], "batch.data_parallel_rank") if len(raw) > 2 else None
    return EventBatch(
        ts=float(ts),
        events=_decode_events(events),
        data_parallel_rank=rank,  # type: ignore[arg-type]  # checked by _OPT_INT
    )


# -- encoding -------------------------------------------------------------------------------


def _map_header(count: int, max_entries: int) -> bytes:
    # msgspec sizes a struct's map header for the most fields the struct can have and then
    # writes the real count: 16 possible entries (0.33 BlockStored) give map16 even for 11.
    if max_entries < 16:
        return bytes((0x80 | count,))
    return b"\xde" + count.to_bytes(2, "big")


def _pack(packer: msgpack.Packer, value: object, where: str) -> bytes:
    try:
        packed: bytes = packer.pack(value)
    except (OverflowError, TypeError, ValueError) as exc:
        raise KvEventEncodeError(f"{where}: cannot encode {_describe(value)}: {exc}") from exc
    return packed


def _encode_event(
    packer: msgpack.Packer, event: Event, version: tuple[int, ...], encoding: Encoding
) -> bytes:
    schema = _SCHEMAS_BY_TYPE.get(type(event))
    if schema is None:
        raise KvEventEncodeError(f"not a KV event: {_describe(event)}")
    fields = schema.fields_of(version)
    values = [(f, getattr(event, f.name)) for f in fields]
    where = schema.tag
    if encoding == "array":
        parts = [packer.pack_array_header(1 + len(fields)), packer.pack(schema.tag)]
        parts += [_pack(packer, value, f"{where}.{f.name}") for f, value in values]
        return b"".join(parts)
    written = [(f, value) for f, value in values if not (f.has_default and value is None)]
    parts = [_map_header(1 + len(written), 1 + len(fields)), packer.pack("type")]
    parts.append(packer.pack(schema.tag))
    for f, value in written:
        parts += [packer.pack(f.name), _pack(packer, value, f"{where}.{f.name}")]
    return b"".join(parts)


def encode_batch(
    ts: float,
    events: Sequence[Event],
    data_parallel_rank: int | None,
    *,
    encoding: Encoding = "map",
    vllm_version: str = "0.33.0",
) -> bytes:
    """The payload vLLM ``vllm_version`` publishes for this batch, byte for byte.

    vLLM itself uses ``"array"`` up to 0.23 and ``"map"`` from 0.24; the other pairings give
    what msgspec would write for that version's fields in that shape. Fields the version does
    not have are not written. ``ts`` is always written as a float64.
    """
    if encoding not in ("map", "array"):
        raise ValueError(f"encoding must be 'map' or 'array', got {encoding!r}")
    version = parse_vllm_version(vllm_version)
    packer = msgpack.Packer(use_bin_type=True, use_single_float=False, autoreset=True)
    with_rank = version >= _V0_9_1
    parts = [packer.pack_array_header(3 if with_rank else 2), packer.pack(float(ts))]
    parts.append(packer.pack_array_header(len(events)))
    parts += [_encode_event(packer, event, version, encoding) for event in events]
    if with_rank:
        parts.append(_pack(packer, data_parallel_rank, "batch.data_parallel_rank"))
    return b"".join(parts)


# -- frames and replay ----------------------------------------------------------------------


def _seq_bytes(seq: int) -> bytes:
    if not 0 <= seq < _SEQ_LIMIT:
        raise ValueError(f"seq must fit in 8 unsigned bytes, got {seq}")
    return seq.to_bytes(8, "big")


def _seq_from(frame: bytes, where: str) -> int:
    if len(frame) != 8:
        raise KvEventDecodeError(f"{where}: expected an 8-byte seq, got {len(frame)} bytes")
    return int.from_bytes(frame, "big")


def _topic_from(frame: bytes, where: str) -> str:
    try:
        return frame.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KvEventDecodeError(f"{where}: topic is not UTF-8: {exc}") from exc


def encode_frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The three frames of a published message: topic, seq (8 bytes big-endian), payload."""
    return [topic.encode("utf-8"), _seq_bytes(seq), payload]


def decode_frames(frames: Sequence[bytes]) -> tuple[str, int, bytes]:
    """``[topic, seq8, payload]`` → ``(topic, seq, payload)``; the payload is not decoded."""
    if len(frames) != 3:
        raise KvEventDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = (bytes(frame) for frame in frames)
    return _topic_from(topic, "frames[0]"), _seq_from(seq, "frames[1]"), payload


@dataclass(frozen=True, slots=True)
class ReplayMessage:
    """One reply message on the replay socket, as a DEALER receives it."""

    seq: int
    payload: bytes
    topic: str | None  # None from vLLM 0.9–0.25, whose replies carry no topic frame

    @property
    def is_end(self) -> bool:
        """True for the end-of-replay marker."""
        return self.seq == _END_SEQ_INT and not self.payload


def encode_replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch from ``start_seq`` on."""
    return [b"", _seq_bytes(start_seq)]


def decode_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int]:
    """A request as the publisher's ROUTER receives it → ``(client identity, start_seq)``.

    Like vLLM: exactly three frames, the middle one is not checked, and start_seq is
    unsigned big-endian of any length.
    """
    if len(frames) != 3:
        raise KvEventDecodeError(
            f"invalid replay request: expected 3 frames [identity, b'', start_seq], "
            f"got {len(frames)}"
        )
    return bytes(frames[0]), int.from_bytes(bytes(frames[2]), "big")


def _has_topic_frame(vllm_version: str) -> bool:
    return parse_vllm_version(vllm_version) >= _V0_26


def encode_replay_message(
    topic: str, seq: int, payload: bytes, *, vllm_version: str = "0.33.0"
) -> list[bytes]:
    """A replayed batch as the DEALER sees it (the ROUTER prepends the client identity)."""
    if _has_topic_frame(vllm_version):
        return [b"", topic.encode("utf-8"), _seq_bytes(seq), payload]
    return [b"", _seq_bytes(seq), payload]


def replay_end_frames(*, vllm_version: str = "0.33.0") -> list[bytes]:
    """The end-of-replay marker as the DEALER sees it (empty topic frame from 0.26)."""
    if _has_topic_frame(vllm_version):
        return [b"", b"", REPLAY_END_SEQ, b""]
    return [b"", REPLAY_END_SEQ, b""]


def decode_replay_message(frames: Sequence[bytes]) -> ReplayMessage:
    """A replay reply of either era: ``[b"", seq8, payload]`` or ``[b"", topic, seq8, payload]``."""
    parts = [bytes(frame) for frame in frames]
    if len(parts) not in (3, 4) or parts[0]:
        raise KvEventDecodeError(
            "invalid replay message: expected [b'', seq, payload] or "
            f"[b'', topic, seq, payload], got {len(parts)} frames"
        )
    topic = _topic_from(parts[1], "replay topic") if len(parts) == 4 else None
    return ReplayMessage(seq=_seq_from(parts[-2], "replay seq"), payload=parts[-1], topic=topic)
