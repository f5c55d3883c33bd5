"""Block keys on the wire and in memory (llmgw/kvcache/keys.py): the one codec of KvDelta
and KvBlocks, and KeySet equal to a plain Python set through bucket splits and merges."""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kvcache.keys import KeySet, pack_keys, unpack_keys

_RNG = random.Random(6)
POOL = [_RNG.getrandbits(64) | 1 for _ in range(4000)]  # blake2b-like: spread over 64 bits


# --- packing -------------------------------------------------------------------------------


def test_pack_keys_is_the_kvdelta_wire_form() -> None:
    keys = [1, 2**64 - 1, 0x0102030405060708]
    wire = b"".join(key.to_bytes(8, "big") for key in keys)  # the agent's packing, big-endian
    assert pack_keys(keys) == wire
    assert pack_keys(array("Q", keys)) == wire
    assert list(unpack_keys(pack_keys(keys))) == keys
    assert pack_keys([]) == b"" and list(unpack_keys(b"")) == []
    with pytest.raises(ValueError, match="not a multiple of 8"):
        unpack_keys(b"\x00" * 12)


# --- KeySet --------------------------------------------------------------------------------


def test_keyset_grows_and_shrinks_its_buckets_and_stays_sorted() -> None:
    keys = KeySet()
    assert all(keys.add(k) for k in POOL)
    assert not keys.add(POOL[0]) and not keys.add(0) and not keys.add(2**64)
    assert keys._bits >= 3  # several bucket doublings happened
    assert list(keys) == sorted(POOL) and len(keys) == len(POOL)
    assert POOL[5] in keys and 2 not in keys and -1 not in keys and "x" not in keys
    assert keys.difference_update(POOL[:3900] + [2, 0]) == 3900
    assert keys._bits <= 1 and list(keys) == sorted(POOL[3900:])
    assert keys.to_array() == array("Q", sorted(POOL[3900:]))


def test_keyset_bulk_update_counts_only_new_keys() -> None:
    keys = KeySet(POOL[:100])
    assert keys.update(POOL[50:3000] + [0]) == 2900  # the bulk path (one sort)
    assert len(keys) == 3000 and list(keys) == sorted(POOL[:3000])
    assert keys.update(POOL[:10]) == 0  # the per-key path


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(("add", "discard", "update", "difference")),
            st.lists(st.integers(0, len(POOL) - 1), max_size=1500),
        ),
        max_size=12,
    )
)
def test_keyset_equals_a_set(ops: list[tuple[str, list[int]]]) -> None:
    keys, truth = KeySet(), set[int]()
    for op, picks in ops:
        batch = [POOL[i] for i in picks]
        if op == "add":
            assert (
                [keys.add(k) for k in batch[:50]]
                == [
                    k not in truth and not truth.add(k)  # type: ignore[func-returns-value]
                    for k in batch[:50]
                ]
            )
        elif op == "discard":
            for k in batch[:50]:
                assert keys.discard(k) == (k in truth)
                truth.discard(k)
        elif op == "update":
            assert keys.update(batch) == len(set(batch) - truth)
            truth.update(batch)
        else:
            assert keys.difference_update(batch) == len(set(batch) & truth)
            truth.difference_update(batch)
        assert len(keys) == len(truth)
    assert list(keys) == sorted(truth)


def test_packed_hashes_round_trip_big_endian() -> None:
    values = (0, 1, (1 << 64) - 1, 0x0102030405060708)
    packed = pack_keys(values)
    assert packed[-8:] == bytes(range(1, 9)) and len(packed) == 32
    assert tuple(unpack_keys(packed)) == values and tuple(unpack_keys(b"")) == ()
    with pytest.raises(ValueError, match="multiple of 8"):
        unpack_keys(b"\0" * 9)
