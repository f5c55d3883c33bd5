"""BlockMirror: vLLM's golden batches in, net deltas and our own block keys out."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kvcache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    event_extra_keys,
    external_hash,
    extra_keys_for_block,
)
from llmgw.kvcache import mirror as mirror_module
from llmgw.kvcache.mirror import (
    ROOT_KEY,
    UNKNOWN_KEY,
    BlockMirror,
    MirrorDelta,
    apply_delta,
    block_key,
    block_keys,
    normalize_hash,
)

GOLDEN: dict[str, Any] = json.loads(
    (Path(__file__).parent.parent / "data" / "vllm_kv_golden.json").read_text()
)
EVENT_CASES: list[dict[str, Any]] = GOLDEN["event_batch_cases"]


def _batches(case: dict[str, Any]) -> list[EventBatch]:
    return [decode_batch(bytes.fromhex(b["payload_hex"])) for b in case["expected"]["batches"]]


def _request_hashes(case: dict[str, Any]) -> list[int]:
    """The event values of request A's three blocks, from vLLM's own digests."""
    return [
        external_hash(bytes.fromhex(h)) for h in case["expected"]["block_hashes_by_request"]["A"]
    ]


def _gateway_keys(case: dict[str, Any]) -> list[int]:
    """Request A's keys as a gateway computes them: tokens plus the event form of extra keys."""
    request = case["requests"]["A"]
    lora = request.get("lora") or {}
    version = case["version"]

    def extra(start: int, end: int) -> tuple[object, ...] | None:
        keys = extra_keys_for_block(
            start,
            end,
            lora_name=lora.get("name"),
            lora_path=lora.get("path"),
            cache_salt=request.get("cache_salt"),
            vllm_version=version,
        )
        return event_extra_keys(keys, version)

    return block_keys(request["token_ids"], case["block_size"], extra_keys_fn=extra)


def _stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    *,
    size: int = 2,
    medium: str = "GPU",
    group: int = 0,
) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        block_size=size,
        medium=medium,
        group_idx=group,
    )


def _removed(*hashes: int, medium: str = "GPU", group: int = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)


def _batch(*events: BlockStored | BlockRemoved | AllBlocksCleared, ts: float = 1.0) -> EventBatch:
    return EventBatch(ts=ts, events=events, data_parallel_rank=0)


# -- vLLM's own batches -------------------------------------------------------------------


@pytest.mark.parametrize("case", EVENT_CASES, ids=lambda c: c["id"])
def test_golden_batches_give_the_engines_blocks_as_net_deltas(case: dict[str, Any]) -> None:
    h0, h1, h2 = _request_hashes(case)
    keys = _gateway_keys(case)
    mirror = BlockMirror()
    stored, evicted, cleared, cleared_again = _batches(case)

    mirror.apply(stored)
    first = mirror.take_delta()
    assert first.reset and first.stored == (h0, h1) and first.removed == ()
    assert first.stored_keys == tuple(keys[:2]) and first.oldest_event_ts == 1700000000.5

    mirror.apply(evicted)
    assert mirror.take_delta() == MirrorDelta(
        False, (h2,), (keys[2],), oldest_event_ts=1700000001.25
    )
    assert mirror.block_size == case["block_size"] == 4

    mirror.apply(cleared)  # block 2 evicted for another allocation
    assert mirror.take_delta() == MirrorDelta(
        False, removed=(h2,), removed_keys=(keys[2],), oldest_event_ts=1700000002.0
    )
    assert mirror.blocks() == {h0: keys[0], h1: keys[1]}

    mirror.apply(cleared_again)  # reset_prefix_cache
    assert mirror.take_delta() == MirrorDelta(True, oldest_event_ts=1700000003.0)
    assert len(mirror) == 0 and mirror.clears == 1 and mirror.take_delta().empty


def _keys_by_case() -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for case in EVENT_CASES:
        mirror = BlockMirror()
        for batch in _batches(case)[:2]:
            mirror.apply(batch)
        out[case["id"]] = tuple(mirror.key_of(h) or UNKNOWN_KEY for h in _request_hashes(case))
    return out


def test_our_keys_ignore_the_seed_hash_algorithm_and_version_but_not_lora_or_salt() -> None:
    keys = _keys_by_case()
    plain = keys["e-0.33-map-int-basic"]
    assert keys["e-0.23-last-array-speckind"] == keys["e-0.11-array-medium-int"] == plain
    # LoRA: 0.14 publishes only lora_name, 0.33 extra_keys with bytes hashes; one key set.
    assert keys["e-0.14-array-lora-name"] == keys["e-0.33-map-bytes-lora-session"]
    assert keys["e-0.17-array-extra-keys-salt"] == keys["e-0.24-first-map-dp2"]
    distinct = {plain, keys["e-0.14-array-lora-name"], keys["e-0.17-array-extra-keys-salt"]}
    assert len(distinct) == 3 and UNKNOWN_KEY not in {k for ks in distinct for k in ks}
    # The salt goes into block 0 only, but every later key chains through it.
    assert plain[0] == block_key(ROOT_KEY, [100, 101, 102, 103])
    assert keys["e-0.17-array-extra-keys-salt"][0] == block_key(
        ROOT_KEY, [100, 101, 102, 103], ("tenant-a",)
    )


def test_block_keys_extend_a_shorter_prompts_keys() -> None:
    tokens = list(range(1000, 1037))
    whole = block_keys(tokens, 8)
    head = block_keys(tokens[:20], 8)
    assert len(whole) == 4 and whole[:2] == head
    assert whole[2:] == block_keys(tokens, 8, parent=head[-1], first_block=2)
    with pytest.raises(ValueError, match="block_size"):
        block_keys(tokens, 0)
    with pytest.raises(ValueError, match="64 unsigned bits"):
        block_key(ROOT_KEY, [-1])


# -- the key itself, recomputed by hand ------------------------------------------------------


def _key_by_hand(parent: int, tokens: list[int], extra_keys: tuple[object, ...] | None) -> int:
    """`block_key` as its docstring defines it, with nothing but hashlib and cbor2."""
    message = parent.to_bytes(8, "big")
    if extra_keys:
        blob = cbor2.dumps(extra_keys, canonical=True)
        message += b"\x01" + len(blob).to_bytes(4, "big") + blob
    else:
        message += b"\x00"
    message += b"".join(token.to_bytes(8, "little") for token in tokens)
    digest = hashlib.blake2b(message, digest_size=8, person=b"llmgw-block-v1").digest()
    return int.from_bytes(digest, "big") or 1


def _chain_by_hand(
    tokens: list[int], size: int, extra: list[tuple[object, ...] | None], parent: int = ROOT_KEY
) -> list[int]:
    keys = []
    for i in range(len(tokens) // size):
        parent = _key_by_hand(parent, tokens[i * size : (i + 1) * size], extra[i])
        keys.append(parent)
    return keys


def test_a_block_key_is_one_blake2b_of_parent_extra_keys_and_tokens() -> None:
    # Pinned: blake2b(00*8 ‖ 00 ‖ 100..103 as uint64 LE, 8 bytes, person "llmgw-block-v1").
    assert block_key(ROOT_KEY, [100, 101, 102, 103]) == 0x935551D3845423A8
    cases: list[tuple[int, list[int], tuple[object, ...] | None]] = [
        (ROOT_KEY, [100, 101, 102, 103], None),
        (0x935551D3845423A8, [7, 0, (1 << 64) - 1, 128_000], None),
        (ROOT_KEY, [100, 101, 102, 103], ("tenant-a",)),
        (12345, [1, 2], ("sql-lora", ("mm-hash", 3), b"\x00\x01", 2.5, None, True)),
        ((1 << 64) - 1, [], None),
    ]
    for parent, tokens, extra in cases:
        assert block_key(parent, tokens, extra) == _key_by_hand(parent, tokens, extra)
    assert block_key(5, [1], ()) == block_key(5, [1]) == _key_by_hand(5, [1], None)
    # Each input counts: parent, token order, extra keys (and their type: 1 is not True).
    keys = {block_key(p, t, e) for p, t, e in cases[:4]}
    keys |= {block_key(1, [100, 101, 102, 103]), block_key(ROOT_KEY, [101, 100, 102, 103])}
    keys |= {block_key(ROOT_KEY, [1, 2], (1,)), block_key(ROOT_KEY, [1, 2], (True,))}
    assert len(keys) == 8


_EXTRA = st.one_of(
    st.none(),
    st.tuples(st.text(max_size=8)),
    st.tuples(st.text(max_size=4), st.tuples(st.binary(max_size=4), st.integers(0, 99))),
)


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, (1 << 64) - 1), max_size=40),
    size=st.integers(1, 8),
    extra=st.lists(_EXTRA, min_size=40, max_size=40),
    parent=st.integers(0, (1 << 64) - 1),
)
def test_block_keys_and_the_mirror_chain_keys_exactly_as_by_hand(
    tokens: list[int], size: int, extra: list[tuple[object, ...] | None], parent: int
) -> None:
    want = _chain_by_hand(tokens, size, extra, parent)
    by_fn = block_keys(tokens, size, extra_keys_fn=lambda s, _: extra[s // size], parent=parent)
    assert by_fn == want
    assert block_keys(tokens, size, parent=parent) == _chain_by_hand(
        tokens, size, [None] * 40, parent
    )
    blocks = len(want)
    mirror = BlockMirror()  # the agent's side: a stored event with its extra keys
    event = BlockStored(
        tuple(range(1, blocks + 1)), None, tuple(tokens[: blocks * size]), size,
        extra_keys=tuple(extra[:blocks]),
    )  # fmt: skip
    mirror.apply(_batch(event))
    assert [mirror.key_of(h) for h in event.block_hashes] == _chain_by_hand(tokens, size, extra)  # type: ignore[arg-type]


class _ZeroDigest:
    """A blake2b stand-in whose digest is all zeros, recording what it was fed."""

    def __init__(self, fed: list[bytes]) -> None:
        self.fed = fed

    def copy(self) -> _ZeroDigest:
        return self

    def update(self, data: bytes) -> None:
        self.fed.append(bytes(data))

    def digest(self) -> bytes:
        return bytes(8)


def test_a_zero_digest_is_key_1_and_the_next_block_chains_from_key_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fed: list[bytes] = []
    monkeypatch.setattr(mirror_module, "_KEY_HASH", _ZeroDigest(fed))
    assert block_keys([5, 6, 7, 8], 2) == [1, 1]  # never UNKNOWN_KEY
    assert fed[1][:9] == (1).to_bytes(8, "big") + b"\x00"  # the parent's bytes are key 1's


def test_hashes_normalize_to_the_events_uint64() -> None:
    digest = bytes(range(32))
    assert normalize_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert normalize_hash(-1) == (1 << 64) - 1  # a legacy signed Python hash()
    assert normalize_hash(12345) == 12345


# -- net changes --------------------------------------------------------------------------


def test_a_block_stored_and_removed_within_one_window_is_no_change() -> None:
    mirror = BlockMirror()
    mirror.apply(_batch(_stored([1], None, [5, 6])))
    mirror.take_delta()
    mirror.apply(_batch(_stored([2], 1, [7, 8]), _removed(2)))
    assert not mirror.pending  # nothing kept for it: memory stays bounded by the blocks
    assert mirror.take_delta().empty
    mirror.apply(_batch(_removed(1), _stored([1], None, [5, 6])))  # evicted and cached again
    assert mirror.take_delta().empty and 1 in mirror


def test_a_block_leaves_only_when_the_last_place_holding_it_removes_it() -> None:
    mirror = BlockMirror()
    mirror.apply(_batch(_stored([1], None, [5, 6]), _stored([1], None, [5, 6], medium="CPU")))
    mirror.apply(_batch(_stored([1], None, [5, 6], group=1)))
    mirror.take_delta()
    mirror.apply(_batch(_removed(1), _removed(1, group=1), _removed(1, medium="STORAGE")))
    assert mirror.take_delta().empty and 1 in mirror  # the CPU tier still holds it
    mirror.apply(_batch(_removed(1, medium="CPU")))
    assert mirror.take_delta().removed == (1,) and 1 not in mirror


def test_past_64_places_a_block_is_kept_rather_than_dropped_wrongly() -> None:
    mirror = BlockMirror()
    stored = _stored([1], None, [5, 6], medium="CPU")
    for tier in range(70):  # KV-connector tiers (ownership) beyond the 64 tracked places
        mirror.apply(_batch(dataclasses.replace(stored, ownership=f"tier-{tier}")))
    for tier in range(70):
        mirror.apply(_batch(BlockRemoved((1,), medium="CPU", ownership=f"tier-{tier}")))
    assert 1 in mirror  # the shared place cannot tell when its last holder left
    mirror.apply(_batch(AllBlocksCleared()))
    assert 1 not in mirror


def test_keys_are_unknown_without_the_parent_and_known_once_it_is_seen() -> None:
    mirror = BlockMirror()
    mirror.apply(_batch(_stored([2], 1, [7, 8])))  # parent cached before we subscribed
    mirror.apply(_batch(_stored([3], None, [1, 2, 3])))  # not one block_size per hash
    assert mirror.key_of(2) == UNKNOWN_KEY and mirror.key_of(3) == UNKNOWN_KEY
    mirror.take_delta()
    mirror.apply(_batch(_stored([1], None, [5, 6]), _stored([2], 1, [7, 8])))  # full report
    key1 = block_key(ROOT_KEY, [5, 6])
    delta = mirror.take_delta()
    assert delta.removed == (2,) and delta.removed_keys == (UNKNOWN_KEY,)
    assert dict(zip(delta.stored, delta.stored_keys, strict=True)) == {
        1: key1,
        2: block_key(key1, [7, 8]),
    }


def test_without_keys_every_key_is_unknown() -> None:
    mirror = BlockMirror(compute_keys=False)
    mirror.apply(_batch(_stored([1, 2], None, [5, 6, 7, 8])))
    assert mirror.take_delta().stored_keys == (UNKNOWN_KEY, UNKNOWN_KEY)


def test_a_snapshot_changes_nothing_and_take_snapshot_starts_a_window() -> None:
    mirror = BlockMirror()
    mirror.apply(_batch(_stored([1, 2], None, [5, 6, 7, 8])))
    mirror.take_delta()
    mirror.apply(_batch(_removed(2)))
    assert mirror.snapshot().stored == (1,) and mirror.pending
    assert mirror.take_snapshot() == MirrorDelta(
        True, (1,), (block_key(ROOT_KEY, [5, 6]),), oldest_event_ts=1.0
    )
    assert not mirror.pending and mirror.take_delta().empty


# -- property: deltas applied to an index reproduce the mirror ----------------------------

_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"),
            st.integers(0, 30),  # first hash
            st.integers(1, 3),  # blocks
            st.integers(-1, 30),  # parent (-1: none)
            st.sampled_from([("GPU", 0), ("GPU", 1), ("CPU", 0)]),
        ),
        st.tuples(st.just("remove"), st.integers(0, 33), st.sampled_from([("GPU", 0), ("CPU", 0)])),
        st.just(("clear",)),
        st.just(("take",)),
        st.just(("reset",)),
    ),
    max_size=60,
)


class _Reference:
    """The engine's block set the slow way: hash → the places holding it, with how many
    blocks of each place hold it (vLLM stores one hash in two blocks and removes it once per
    block: test_a_hash_cached_in_two_blocks_of_one_place_leaves_with_its_last_copy)."""

    def __init__(self) -> None:
        self.places: dict[int, Counter[tuple[str, int]]] = {}

    def store(self, hashes: list[int], place: tuple[str, int]) -> None:
        for block in hashes:
            self.places.setdefault(block, Counter())[place] += 1

    def remove(self, block: int, place: tuple[str, int]) -> None:
        held = self.places.get(block)
        if held is not None and held[place] > 0:
            held[place] -= 1
            if held[place] == 0:
                del held[place]
            if not held:
                del self.places[block]


def _run(op: tuple[Any, ...], mirror: BlockMirror, ref: _Reference, index: dict[int, int]) -> None:
    if op[0] == "store":
        _, first, count, parent, place = op
        hashes = list(range(first, first + count))
        tokens = [h * 10 + t for h in hashes for t in range(2)]
        event = _stored(
            hashes, None if parent < 0 else parent, tokens, medium=place[0], group=place[1]
        )
        mirror.apply(_batch(event))
        ref.store(hashes, place)
    elif op[0] == "remove":
        mirror.apply(_batch(_removed(op[1], medium=op[2][0], group=op[2][1])))
        ref.remove(op[1], op[2])
    elif op[0] == "clear":
        mirror.apply(_batch(AllBlocksCleared()))
        ref.places.clear()
    elif op[0] == "reset":
        mirror.reset()  # the subscriber's reset: the engine's blocks are unknown from here
        ref.places.clear()
    else:
        apply_delta(index, mirror.take_delta())


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_net_deltas_applied_to_an_index_reproduce_the_mirror(ops: list[tuple[Any, ...]]) -> None:
    mirror, ref = BlockMirror(), _Reference()
    index: dict[int, int] = {}
    for op in ops:
        _run(op, mirror, ref, index)
        assert set(mirror.blocks()) == set(ref.places)
    apply_delta(index, mirror.take_delta())
    assert index == mirror.blocks()
    assert not mirror.pending and mirror.take_delta().empty


def test_a_hash_cached_in_two_blocks_of_one_place_leaves_with_its_last_copy() -> None:
    """vLLM stores one hash in two blocks (requests computed it side by side) and removes
    it once per block: the mirror holds it until both are gone, in each place apart."""
    mirror = BlockMirror()
    stored = BlockStored((7,), None, (1, 2, 3, 4), 4, medium="GPU")
    cpu = BlockStored((7,), None, (1, 2, 3, 4), 4, medium="CPU")
    removed = BlockRemoved(block_hashes=(7,), medium="GPU")
    mirror.apply(EventBatch(ts=0.0, events=(stored, stored, cpu)))
    mirror.apply(EventBatch(ts=0.0, events=(removed,)))
    assert 7 in mirror  # one GPU block and the CPU copy still hold it
    mirror.apply(EventBatch(ts=0.0, events=(removed, BlockRemoved((7,), medium="CPU"))))
    assert 7 not in mirror
    mirror.apply(EventBatch(ts=0.0, events=(stored, stored, AllBlocksCleared())))
    mirror.apply(EventBatch(ts=0.0, events=(stored, removed)))
    assert 7 not in mirror  # a clear forgets the copies too
