"""KV event batches, frames and replay against vLLM's golden frames (vllm_kv_golden.json)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kvcache import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    KvEventDecodeError,
    KvEventEncodeError,
    MultimodalItem,
    RequestExtraKeys,
    block_hashes,
    decode_batch,
    decode_frames,
    decode_replay_message,
    decode_replay_request,
    encode_batch,
    encode_frames,
    encode_replay_message,
    encode_replay_request,
    event_extra_keys,
    event_hash,
    replay_end_frames,
)

GOLDEN: dict[str, Any] = json.loads(
    (Path(__file__).parent.parent / "data" / "vllm_kv_golden.json").read_text()
)
EVENT_CASES: list[dict[str, Any]] = GOLDEN["event_batch_cases"]
BATCHES = [(case, batch) for case in EVENT_CASES for batch in case["expected"]["batches"]]
REPLAY_CASES = [case for case in EVENT_CASES if "replay" in case["expected"]]
VARIANT_FIRST_VERSIONS = [variant["first"] for variant in GOLDEN["format_variants"]]
SCRIPT = [
    {"op": "cache", "req": "A", "blocks": [0, 2]},
    {"op": "batch", "ts": 1700000000.5},
    {"op": "cache", "req": "A", "blocks": [2, 3]},
    {"op": "batch", "ts": 1700000001.25},
    {"op": "free", "req": "A"},
    {"op": "alloc", "n": 1},
    {"op": "batch", "ts": 1700000002.0},
    {"op": "free_other"},
    {"op": "reset"},
    {"op": "batch", "ts": 1700000003.0},
]


def _batch_id(item: tuple[dict[str, Any], dict[str, Any]]) -> str:
    case, batch = item
    return f"{case['id']}#{batch['seq']}"


def _case_id(case: dict[str, Any]) -> str:
    return str(case["id"])


def _encoding(case: dict[str, Any]) -> Any:
    return case["format_variant"]["event_encoding"]


def _as_golden(value: Any) -> Any:
    """Our decoded values in the golden file's JSON notation."""
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, tuple):
        return [_as_golden(item) for item in value]
    return value


def _event_as_golden(event: Event) -> dict[str, Any]:
    named = {"type": type(event).__name__}
    for field in dataclasses.fields(event):
        named[field.name] = _as_golden(getattr(event, field.name))
    return named


# -- decoding the golden payloads -----------------------------------------------------------


@pytest.mark.parametrize(("case", "batch"), BATCHES, ids=[_batch_id(b) for b in BATCHES])
def test_decode_matches_golden_content(case: dict[str, Any], batch: dict[str, Any]) -> None:
    decoded = decode_batch(bytes.fromhex(batch["payload_hex"]))
    expected = batch["decoded_named_all_fields"]
    assert decoded.ts == expected["ts"]
    assert decoded.data_parallel_rank == expected["data_parallel_rank"] == case["dp_rank"]
    assert len(decoded.events) == len(expected["events"])
    for ours, theirs in zip(decoded.events, expected["events"], strict=True):
        named = _event_as_golden(ours)
        assert {key: named[key] for key in theirs} == theirs
        # Fields this version does not have read as None.
        assert all(named[key] is None for key in named.keys() - theirs.keys())


@pytest.mark.parametrize(("case", "batch"), BATCHES, ids=[_batch_id(b) for b in BATCHES])
def test_hashes_decode_as_sent(case: dict[str, Any], batch: dict[str, Any]) -> None:
    decoded = decode_batch(bytes.fromhex(batch["payload_hex"]))
    hash_type = int if case["int_hashes"] else bytes
    for event in decoded.events:
        if isinstance(event, BlockStored | BlockRemoved):
            assert all(type(h) is hash_type for h in event.block_hashes)
        if isinstance(event, BlockStored) and event.parent_block_hash is not None:
            assert type(event.parent_block_hash) is hash_type


# -- encoding, byte for byte ----------------------------------------------------------------


@pytest.mark.parametrize(("case", "batch"), BATCHES, ids=[_batch_id(b) for b in BATCHES])
def test_reencode_is_byte_exact(case: dict[str, Any], batch: dict[str, Any]) -> None:
    payload = bytes.fromhex(batch["payload_hex"])
    decoded = decode_batch(payload)
    encoded = encode_batch(
        decoded.ts,
        decoded.events,
        decoded.data_parallel_rank,
        encoding=_encoding(case),
        vllm_version=case["version"],
    )
    assert encoded.hex() == payload.hex()


def _request_keys(request: dict[str, Any], version: str) -> RequestExtraKeys:
    lora = request.get("lora") or {}
    items = tuple(MultimodalItem(**m) for m in request.get("mm") or ())
    return RequestExtraKeys(
        lora_name=lora.get("name"),
        lora_path=lora.get("path"),
        lora_int_id=lora.get("int_id"),
        mm_items=items,
        cache_salt=request.get("cache_salt"),
        vllm_version=version,
    )


def _scripted_batches(case: dict[str, Any]) -> list[tuple[float, list[Event]]]:
    """The golden script's batches built as the simulated engine builds them."""
    version, size, request = case["version"], case["block_size"], case["requests"]["A"]
    keys = _request_keys(request, version)
    tokens = request["token_ids"]
    digests = block_hashes(
        tokens, size, algo=case["algo"], seed=case["seed"], extra_keys_fn=keys, vllm_version=version
    )
    hashes = [event_hash(d, use_int=case["int_hashes"]) for d in digests]
    lora = request.get("lora") or {}

    def stored(first: int, last: int) -> BlockStored:
        return BlockStored(
            block_hashes=tuple(hashes[first:last]),
            parent_block_hash=hashes[first - 1] if first else None,
            token_ids=tuple(tokens[first * size : last * size]),
            block_size=size,
            lora_id=lora.get("int_id"),
            medium="GPU",
            lora_name=lora.get("name"),
            extra_keys=tuple(
                event_extra_keys(keys(i * size, (i + 1) * size), version)
                for i in range(first, last)
            ),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
            session_id=request.get("session_id"),
        )

    removed = BlockRemoved(block_hashes=(hashes[2],), medium="GPU", group_idx=0)
    return [
        (1700000000.5, [stored(0, 2)]),
        (1700000001.25, [stored(2, 3)]),
        (1700000002.0, [removed]),
        (1700000003.0, [AllBlocksCleared()]),
    ]


@pytest.mark.parametrize("case", EVENT_CASES, ids=_case_id)
def test_events_built_from_hashes_encode_as_vllm_publishes(case: dict[str, Any]) -> None:
    assert case["script"] == SCRIPT  # the batches below follow this script
    expected = case["expected"]["batches"]
    for (ts, events), batch in zip(_scripted_batches(case), expected, strict=True):
        payload = encode_batch(
            ts, events, case["dp_rank"], encoding=_encoding(case), vllm_version=case["version"]
        )
        assert payload.hex() == batch["payload_hex"]
        frames = encode_frames(case["topic"], batch["seq"], payload)
        assert [frame.hex() for frame in frames] == batch["frames_hex"]


def test_map_header_is_map16_only_for_0_33_block_stored() -> None:
    # type + 7 required fields + extra_keys + group_idx = 10 entries
    event = BlockStored((1,), None, (1, 2), 2, medium="GPU", group_idx=0, extra_keys=(None,))
    events_start = 1 + 9 + 1  # array header, float64 ts, events array header
    for version, header in [("0.24.0", "8a"), ("0.30.0", "8a"), ("0.32.0", "8a")]:
        payload = encode_batch(1.0, [event], 0, vllm_version=version)
        assert payload[events_start : events_start + 1].hex() == header
    payload = encode_batch(1.0, [event], 0, vllm_version="0.33.0")
    assert payload[events_start : events_start + 3].hex() == "de000a"
    removed = encode_batch(1.0, [BlockRemoved((1,), "GPU")], 0)
    assert removed[events_start : events_start + 1].hex() == "83"  # type, hashes, medium


def test_all_blocks_cleared_bytes_as_annotated_in_the_spec() -> None:
    cleared = encode_batch(1700000003.0, [AllBlocksCleared()], 0)
    assert cleared == bytes.fromhex("93cb41d954fc40c000009181a474797065b0") + (
        b"AllBlocksCleared\x00"
    )
    array = encode_batch(1700000003.0, [AllBlocksCleared()], 0, encoding="array")
    assert array == bytes.fromhex("93cb41d954fc40c000009191b0") + b"AllBlocksCleared\x00"


def test_ts_is_always_float64_and_dp_rank_may_be_nil() -> None:
    payload = encode_batch(1700000000, [], None)
    assert payload.hex() == "93cb41d954fc4000000090c0"
    assert decode_batch(payload) == EventBatch(1700000000.0, (), None)


def test_0_9_0_batch_has_no_dp_rank_and_five_stored_fields() -> None:
    event = BlockStored((-5,), None, (1, 2), 2, medium="GPU", lora_name="x")
    payload = encode_batch(1.5, [event], 0, encoding="array", vllm_version="0.9.0")
    assert msgpack.unpackb(payload) == [1.5, [["BlockStored", [-5], None, [1, 2], 2, None]]]
    assert decode_batch(payload) == EventBatch(1.5, (BlockStored((-5,), None, (1, 2), 2),), None)


def test_unencodable_values_raise_encode_error() -> None:
    with pytest.raises(KvEventEncodeError, match="block_hashes"):
        encode_batch(1.0, [BlockRemoved((1 << 64,), "GPU")], 0)
    with pytest.raises(KvEventEncodeError, match="not a KV event"):
        encode_batch(1.0, ["BlockStored"], 0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="encoding"):
        encode_batch(1.0, [], 0, encoding="json")  # type: ignore[arg-type]


# -- frames and replay ----------------------------------------------------------------------


@pytest.mark.parametrize(("case", "batch"), BATCHES, ids=[_batch_id(b) for b in BATCHES])
def test_frames_round_trip(case: dict[str, Any], batch: dict[str, Any]) -> None:
    frames = [bytes.fromhex(frame) for frame in batch["frames_hex"]]
    topic, seq, payload = decode_frames(frames)
    assert (topic, seq, payload.hex()) == (case["topic"], batch["seq"], batch["payload_hex"])
    assert encode_frames(topic, seq, payload) == frames


@pytest.mark.parametrize(
    "frames",
    [
        [b"", b"\x00" * 8],
        [b"", b"\x00" * 7, b"\x90"],
        [b"\xff", b"\x00" * 8, b"\x90"],
        [b"", b"\x00" * 8, b"\x90", b""],
    ],
)
def test_bad_frames_are_refused(frames: list[bytes]) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_frames(frames)


def test_frame_seq_must_fit_eight_bytes() -> None:
    with pytest.raises(ValueError, match="seq"):
        encode_frames("", 1 << 64, b"")
    assert encode_frames("kv", (1 << 64) - 1, b"x")[1] == REPLAY_END_SEQ


@pytest.mark.parametrize("case", REPLAY_CASES, ids=_case_id)
def test_replay_messages_match_golden(case: dict[str, Any]) -> None:
    replay = case["expected"]["replay"]
    start = case["replay_from"]
    request = encode_replay_request(start)
    assert [frame.hex() for frame in request] == replay["request_frames_hex_sent_by_DEALER"]
    assert decode_replay_request([b"client-1", *request]) == (b"client-1", start)

    version = case["version"]
    sent = [
        encode_replay_message(
            case["topic"], b["seq"], bytes.fromhex(b["payload_hex"]), vllm_version=version
        )
        for b in case["expected"]["batches"]
        if b["seq"] >= start
    ]
    sent.append(replay_end_frames(vllm_version=version))
    assert [[frame.hex() for frame in message] for message in sent] == replay[
        "received_messages_hex"
    ]


@pytest.mark.parametrize("case", REPLAY_CASES, ids=_case_id)
def test_replay_messages_decode_in_both_eras(case: dict[str, Any]) -> None:
    received = case["expected"]["replay"]["received_messages_hex"]
    messages = [decode_replay_message([bytes.fromhex(f) for f in m]) for m in received]
    batches = [b for b in case["expected"]["batches"] if b["seq"] >= case["replay_from"]]
    assert [m.seq for m in messages[:-1]] == [b["seq"] for b in batches]
    assert [m.payload.hex() for m in messages[:-1]] == [b["payload_hex"] for b in batches]
    assert not any(m.is_end for m in messages[:-1])
    assert messages[-1].is_end
    has_topic = case["version"] >= "0.26"
    assert all((m.topic is not None) == has_topic for m in messages)


def test_replay_end_marker_and_topic_frames_by_era() -> None:
    assert REPLAY_END_SEQ == b"\xff" * 8
    assert replay_end_frames(vllm_version="0.25.1") == [b"", REPLAY_END_SEQ, b""]
    assert replay_end_frames(vllm_version="0.26.0") == [b"", b"", REPLAY_END_SEQ, b""]
    new = encode_replay_message("kv@x", 7, b"p", vllm_version="0.26.0")
    assert new == [b"", b"kv@x", (7).to_bytes(8, "big"), b"p"]
    assert decode_replay_message(new).topic == "kv@x"
    with pytest.raises(KvEventDecodeError, match="replay request"):
        decode_replay_request([b"", (1).to_bytes(8, "big")])
    with pytest.raises(KvEventDecodeError, match="replay message"):
        decode_replay_message([b"x", (1).to_bytes(8, "big"), b""])


# -- what the decoder accepts and refuses ---------------------------------------------------


def _pack(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value)
    return packed


def test_unknown_newer_fields_are_ignored() -> None:
    event_map = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "tier": "x"}
    event_array = ["BlockRemoved", [7], "GPU", 0, None, None, "future", [1]]
    decoded = decode_batch(_pack([2.0, [event_map, event_array], 1, "future-batch-field"]))
    assert decoded.events == (
        BlockRemoved((7,), "GPU"),
        BlockRemoved((7,), "GPU", group_idx=0),
    )


def test_missing_optional_fields_read_as_none() -> None:
    event: dict[str, object] = {"type": "BlockStored", "block_hashes": [b"\x01"]}
    event |= {"parent_block_hash": None}
    event |= {"token_ids": [1], "block_size": 1}
    decoded = decode_batch(_pack([1.0, [event]]))
    assert decoded.events == (BlockStored((b"\x01",), None, (1,), 1),)
    assert decoded.data_parallel_rank is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1.0, [{"type": "BlockTouched"}], 0], "unknown event type 'BlockTouched'"),
        ([1.0, [{"type": "BlockRemoved"}], 0], "events[0]: missing required field 'block_hashes'"),
        ([1.0, [["BlockStored", [1], None, [1, "2"], 2]], 0], "events[0].token_ids[1]"),
        ([1.0, [["BlockStored", [1], None, [1, 2], True]], 0], "events[0].block_size"),
        ([1.0, [["BlockRemoved", [1.5]]], 0], "events[0].block_hashes[0]"),
        ([1.0, [["BlockStored", [1], None, [1]]], 0], "missing required field 'block_size'"),
        ([1.0, [[]], 0], "empty event array"),
        ([1.0, [7], 0], "events[0]: expected an event"),
        ([1.0, {}, 0], "batch.events"),
        (["now", [], 0], "batch.ts"),
        ([1.0, [], "0"], "batch.data_parallel_rank"),
        ({"ts": 1.0}, "batch: expected an array"),
        ([1.0, [{"type": "AllBlocksCleared"}, {"type": 3}], 0], "events[1].type"),
        ([1.0, [["BlockRemoved", [7, False]]], 0], "events[0].block_hashes[1]"),  # bool
    ],
)
def test_malformed_batches_say_what_is_wrong(value: Any, message: str) -> None:
    with pytest.raises(KvEventDecodeError) as info:
        decode_batch(_pack(value))
    assert message in str(info.value)


def test_an_error_names_the_event_field_and_item_exactly() -> None:
    stored: dict[str, object] = {"type": "BlockStored", "block_hashes": [1]}
    stored |= {"parent_block_hash": None}
    stored |= {"token_ids": [1, 2, True], "block_size": 3}  # a bool is no token id
    fine = {"type": "BlockRemoved", "block_hashes": [1]}
    cases = [
        ([1.0, [fine, fine, stored], 0], "events[2].token_ids[2]: expected an int, got bool True"),
        ([1.0, [fine, {"type": "BlockRemoved"}], 0],
         "events[1]: missing required field 'block_hashes'"),
        ([1.0, [["BlockStored", [1], None]], 0], "events[0]: missing required field 'token_ids'"),
        ([1.0, [fine, "x"], 0], "events[1]: expected an event (array or map), got str 'x'"),
        ([1.0, [[]], 0], "events[0]: empty event array (no type tag)"),
        ([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": [2]}], 0],
         "events[0].parent_block_hash: expected a block hash (int or bytes), got an array of 1"),
        ([1.0, [["BlockStored", [1], None, [1], 1, None, "GPU", None, [None, ["s", {}]]]], 0],
         "events[0].extra_keys[1][1]: expected nil, a scalar, a string, bytes or an array, "
         "got a map of 0"),
    ]  # fmt: skip
    for value, message in cases:
        with pytest.raises(KvEventDecodeError) as info:
            decode_batch(_pack(value))
        assert str(info.value) == message


def test_bad_msgpack_is_a_decode_error() -> None:
    good = _pack([1.0, [], 0])
    for payload in (good + b"\x00", good[:-1], b"\xc1", b"\xa2\xff\xfe", b""):
        with pytest.raises(KvEventDecodeError, match="msgpack"):
            decode_batch(payload)


def _nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


def test_deeply_nested_extra_keys_are_refused() -> None:
    event = ["BlockStored", [1], None, [1], 1, None, "GPU", None, [_nested(200)]]
    with pytest.raises(KvEventDecodeError, match="nested deeper"):
        decode_batch(_pack([1.0, [event], 0]))


@pytest.mark.parametrize(
    "value",
    [
        [1.0, [[_nested(1020)]], 0],
        [1.0, [_nested(1020)], 0],
        [_nested(1020), [], 0],
        [1.0, [], _nested(1020)],
        [1.0, [["BlockStored", _nested(1020)]], 0],
        [1.0, [["BlockStored", [1], None, [1], 1, None, "GPU", None, [_nested(1020)]]], 0],
    ],
)
def test_nesting_at_msgpack_limit_is_a_decode_error(value: Any) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_batch(_pack(value))


# -- property tests -------------------------------------------------------------------------


def _decodes_or_refuses(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except KvEventDecodeError:
        return
    assert isinstance(batch, EventBatch)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_decode_error(payload: bytes) -> None:
    _decodes_or_refuses(payload)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([bytes.fromhex(b["payload_hex"]) for _, b in BATCHES]),
    st.data(),
)
def test_mutated_golden_payloads_decode_or_raise_decode_error(payload: bytes, data: Any) -> None:
    index = data.draw(st.integers(0, len(payload) - 1))
    mutated = bytearray(payload[: data.draw(st.integers(index, len(payload)))])
    if index < len(mutated):
        mutated[index] = data.draw(st.integers(0, 255))
    _decodes_or_refuses(bytes(mutated))


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELD_NAMES = [f.name for f in dataclasses.fields(BlockStored)]
_EVENTISH = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"])},
        optional=dict.fromkeys(_FIELD_NAMES, _VALUES),
    ),
    st.tuples(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"])).flatmap(
        lambda tag: st.lists(_VALUES, max_size=16).map(lambda rest: [tag[0], *rest])
    ),
    _VALUES,
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(_VALUES, max_size=4).flatmap(
        lambda head: st.lists(_EVENTISH, max_size=3).map(lambda events: [1.0, events, *head])
    )
)
def test_structured_garbage_decodes_or_raises_decode_error(value: Any) -> None:
    _decodes_or_refuses(_pack(value))


_HASHES = st.integers(0, 2**64 - 1) | st.binary(min_size=16, max_size=32)
_OPT_STR = st.none() | st.text(max_size=10)
_OPT_INT = st.none() | st.integers(0, 1000)
_EXTRA_KEY = (
    st.none()
    | st.tuples(st.text(max_size=6))
    | st.tuples(st.text(max_size=6), st.integers(-50, 50))
)
_STORED = st.builds(
    BlockStored,
    block_hashes=st.lists(_HASHES, min_size=1, max_size=3).map(tuple),
    parent_block_hash=st.none() | _HASHES,
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=20).map(tuple),
    block_size=st.integers(1, 64),
    lora_id=_OPT_INT,
    medium=_OPT_STR,
    lora_name=_OPT_STR,
    extra_keys=st.none() | st.lists(_EXTRA_KEY, max_size=3).map(tuple),
    group_idx=_OPT_INT,
    kv_cache_spec_kind=_OPT_STR,
    kv_cache_spec_sliding_window=_OPT_INT,
    locality=_OPT_STR,
    ownership=_OPT_STR,
    session_id=_OPT_STR,
    lookahead_token_ids=st.none()
    | st.lists(st.lists(st.integers(0, 9), max_size=3).map(tuple), max_size=2).map(tuple),
)
_REMOVED = st.builds(
    BlockRemoved,
    block_hashes=st.lists(_HASHES, min_size=1, max_size=2).map(tuple),
    medium=_OPT_STR,
    group_idx=_OPT_INT,
    locality=_OPT_STR,
    ownership=_OPT_STR,
)
_EVENTS = st.lists(_STORED | _REMOVED | st.just(AllBlocksCleared()), max_size=4)


def _as_version_sees_it(event: Event, version: str) -> Event:
    """The event with the fields ``version`` does not have set to None."""
    since = {"medium": "0.10.2", "lora_name": "0.14.0", "extra_keys": "0.17.0"}
    since |= {"group_idx": "0.20.0", "kv_cache_spec_kind": "0.22.0"}
    since |= {"kv_cache_spec_sliding_window": "0.22.0", "locality": "0.26.0"}
    since |= {"ownership": "0.29.0", "session_id": "0.30.0", "lookahead_token_ids": "0.33.0"}

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split("."))

    dropped = {
        f.name: None
        for f in dataclasses.fields(event)
        if f.name in since and key(since[f.name]) > key(version)
    }
    return dataclasses.replace(event, **dropped)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    ts=st.floats(allow_nan=False),
    events=_EVENTS,
    rank=_OPT_INT,
    encoding=st.sampled_from(["map", "array"]),
    version=st.sampled_from(VARIANT_FIRST_VERSIONS),
)
def test_encode_then_decode_gives_the_events_back(
    ts: float, events: list[Event], rank: int | None, encoding: Any, version: str
) -> None:
    payload = encode_batch(ts, events, rank, encoding=encoding, vllm_version=version)
    decoded = decode_batch(payload)
    assert decoded.ts == ts
    assert decoded.events == tuple(_as_version_sees_it(e, version) for e in events)
    assert decoded.data_parallel_rank == (None if version == "0.9.0" else rank)
