"""Block hashing against vLLM's own golden vectors (tests/data/vllm_kv_golden.json)."""

from __future__ import annotations

import hashlib
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kvcache import (
    HashAlgorithmUnavailableError,
    MultimodalItem,
    PrefixHashes,
    RequestExtraKeys,
    UnsupportedHashAlgorithmError,
    UnsupportedVllmVersionError,
    block_hashes,
    event_extra_keys,
    event_hash,
    external_hash,
    extra_keys_for_block,
    hash_block,
    hash_function,
    hash_prefix,
    hashing,
    none_hash,
    parse_vllm_version,
)

GOLDEN: dict[str, Any] = json.loads(
    (Path(__file__).parent.parent / "data" / "vllm_kv_golden.json").read_text()
)
HASH_CASES = GOLDEN["hash_cases"]
EVENT_CASES = GOLDEN["event_batch_cases"]


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples vLLM hashes."""
    if isinstance(value, list):
        return tuple(_tuples(item) for item in value)
    return value


def _request_keys(request: dict[str, Any], version: str) -> RequestExtraKeys:
    lora = request.get("lora") or {}
    items = tuple(
        MultimodalItem(m["identifier"], m["offset"], m["length"]) for m in request.get("mm") or ()
    )
    return RequestExtraKeys(
        lora_name=lora.get("name"),
        lora_path=lora.get("path"),
        lora_int_id=lora.get("int_id"),
        mm_items=items,
        cache_salt=request.get("cache_salt"),
        vllm_version=version,
    )


def _case_id(case: dict[str, Any]) -> str:
    return str(case["id"])


# -- golden hash cases ----------------------------------------------------------------------


@pytest.mark.parametrize("case", HASH_CASES, ids=_case_id)
def test_none_hash_matches_vllm(case: dict[str, Any]) -> None:
    expected = case["expected"]
    root = none_hash(case["algo"], case["seed"], case["version"])
    assert root.hex() == expected["none_hash_hex"]
    assert root == hash_function(case["algo"])(expected["none_hash_seed"])


@pytest.mark.parametrize("case", HASH_CASES, ids=_case_id)
def test_block_hashes_match_vllm(case: dict[str, Any]) -> None:
    expected = case["expected"]
    hashes = block_hashes(
        case["token_ids"],
        case["block_size"],
        algo=case["algo"],
        seed=case["seed"],
        extra_keys_fn=_request_keys(case, case["version"]),
        vllm_version=case["version"],
    )
    blocks = expected["blocks"]
    assert len(hashes) == expected["num_full_blocks"] == len(blocks)
    assert [h.hex() for h in hashes] == [b["block_hash_hex"] for b in blocks]
    assert [external_hash(h) for h in hashes] == [b["event_hash_int"] for b in blocks]
    assert [external_hash(h).to_bytes(8, "big").hex() for h in hashes] == [
        b["event_hash_int_hex"] for b in blocks
    ]
    assert [event_hash(h, use_int=False) for h in hashes] == [
        bytes.fromhex(b["event_hash_bytes_hex"]) for b in blocks
    ]
    assert [event_hash(h) for h in hashes] == [b["event_hash_int"] for b in blocks]


@pytest.mark.parametrize("case", HASH_CASES, ids=_case_id)
def test_extra_keys_match_vllm(case: dict[str, Any]) -> None:
    keys = _request_keys(case, case["version"])
    blocks = case["expected"]["blocks"]
    hash_inputs = [keys(*b["token_range"]) for b in blocks]
    assert hash_inputs == [_tuples(b["hash_input_extra_keys"]) for b in blocks]
    assert tuple(event_extra_keys(k, case["version"]) for k in hash_inputs) == _tuples(
        case["expected"]["event_extra_keys"]
    )


@pytest.mark.parametrize("case", HASH_CASES, ids=_case_id)
def test_hash_block_chain_matches_vllm(case: dict[str, Any]) -> None:
    """hash_block, fed block by block from the root, gives the golden chain."""
    parent = bytes.fromhex(case["expected"]["none_hash_hex"])
    for block in case["expected"]["blocks"]:
        start, end = block["token_range"]
        keys = _tuples(block["hash_input_extra_keys"])
        parent = hash_block(parent, case["token_ids"][start:end], keys, case["algo"])
        assert parent.hex() == block["block_hash_hex"]


@pytest.mark.parametrize("case", EVENT_CASES, ids=_case_id)
def test_event_case_request_hashes_match_vllm(case: dict[str, Any]) -> None:
    for name, request in case["requests"].items():
        hashes = block_hashes(
            request["token_ids"],
            case["block_size"],
            algo=case["algo"],
            seed=case["seed"],
            extra_keys_fn=_request_keys(request, case["version"]),
            vllm_version=case["version"],
        )
        assert [h.hex() for h in hashes] == case["expected"]["block_hashes_by_request"][name]


def test_hash_serialisations_are_what_vllm_feeds_the_digest() -> None:
    obj = (b"\x01" * 32, (1, 2, 300), ("lora", "a", "/p"))
    assert hash_function("sha256")(obj) == hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()
    assert (
        hash_function("sha256_cbor")(obj)
        == hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
    )
    assert len(hash_function("xxhash")(obj)) == len(hash_function("xxhash_cbor")(obj)) == 16
    assert hash_function("xxhash")(obj) != hash_function("xxhash_cbor")(obj)


# -- roots without a seed, versions, algorithms ---------------------------------------------


def test_unseeded_sha256_root_is_the_fixed_string_from_0_29() -> None:
    for algo in ("sha256", "sha256_cbor"):
        assert none_hash(algo, None, "0.29.0") == hash_function(algo)("vllm-none-hash")
        assert none_hash(algo, None) == none_hash(algo, None, "0.33.0")


def test_unseeded_xxhash_root_is_random_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "_process_roots", {})
    monkeypatch.setattr("llmgw.kvcache.hashing.os.urandom", lambda n: b"\x07" * n)
    root = none_hash("xxhash_cbor", None, "0.33.0")
    assert root == hash_function("xxhash_cbor")((b"\x07" * 32).hex())
    monkeypatch.setattr("llmgw.kvcache.hashing.os.urandom", lambda n: b"\x08" * n)
    assert none_hash("xxhash_cbor", None, "0.33.0") == root  # fixed for the process


def test_unseeded_root_before_0_29_is_urandom_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "_process_roots", {})
    monkeypatch.setattr("llmgw.kvcache.hashing.os.urandom", lambda n: b"\x09" * n)
    assert none_hash("sha256_cbor", None, "0.28.0") == b"\x09" * 32
    assert none_hash("xxhash", None, "0.13.0") == b"\x09" * 32
    # Seeded roots are the same across eras (spec §3.5).
    assert none_hash("sha256_cbor", "0", "0.10.2") == none_hash("sha256_cbor", "0", "0.33.0")


def test_seed_random_is_a_literal_string() -> None:
    assert none_hash("sha256", "random") == hash_function("sha256")("random")


@pytest.mark.parametrize(
    ("algo", "version", "error"),
    [
        ("sha256", "0.10.1.1", UnsupportedVllmVersionError),
        ("xxhash_cbor", "0.12.0", UnsupportedHashAlgorithmError),
        ("builtin", "0.33.0", UnsupportedHashAlgorithmError),
        ("sha256", "latest", UnsupportedVllmVersionError),
    ],
)
def test_unsupported_algorithms_and_versions_are_refused(
    algo: str, version: str, error: type[Exception]
) -> None:
    with pytest.raises(error):
        none_hash(algo, "0", version)


def test_missing_xxhash_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "_hash_fns", {})
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(HashAlgorithmUnavailableError, match="'xxhash' package"):
        hash_block(b"\x00" * 16, [1, 2], None, "xxhash_cbor")
    assert len(hash_block(b"\x00" * 32, [1, 2], None, "sha256_cbor")) == 32


def test_parse_vllm_version() -> None:
    assert parse_vllm_version("0.33.0") == (0, 33, 0)
    assert parse_vllm_version("0.10.1.1") == (0, 10, 1, 1) < (0, 10, 2)
    assert parse_vllm_version("v0.11.0rc1+cpu") == (0, 11, 0)
    assert parse_vllm_version("0.24") == (0, 24, 0)


# -- extra keys by version ------------------------------------------------------------------


def test_multimodal_keys_by_version() -> None:
    items = (MultimodalItem("img-a", 5, 20), MultimodalItem("img-b", 30, 4))
    # Block [16, 32) holds the tail of img-a and the head of img-b.
    assert extra_keys_for_block(16, 32, mm_items=items, vllm_version="0.18.0") == (
        "img-a",
        "img-b",
    )
    assert extra_keys_for_block(16, 32, mm_items=items, vllm_version="0.30.0") == (
        ("img-a", -11),
        ("img-b", 14),
    )
    assert extra_keys_for_block(32, 48, mm_items=items) == (("mm", "img-b", -2),)
    assert extra_keys_for_block(48, 64, mm_items=items) is None
    # An item that ends exactly where a block starts is not in that block.
    boundary = (MultimodalItem("img-c", 5, 11),)
    assert extra_keys_for_block(0, 16, mm_items=boundary) == (("mm", "img-c", 5),)
    assert extra_keys_for_block(16, 32, mm_items=boundary) is None


def test_lora_salt_and_embeds_keys_by_version() -> None:
    kwargs: dict[str, Any] = {
        "lora_name": "sql",
        "lora_path": "/a/sql",
        "lora_int_id": 3,
        "cache_salt": "s",
    }
    assert extra_keys_for_block(0, 16, vllm_version="0.11.0", **kwargs) == (3, "s")
    assert extra_keys_for_block(0, 16, vllm_version="0.11.1", **kwargs) == ("sql", "s")
    assert extra_keys_for_block(16, 32, vllm_version="0.30.0", **kwargs) == ("sql",)
    tagged = extra_keys_for_block(0, 16, prompt_embeds_key=b"\x01", **kwargs)
    assert tagged == (("lora", "sql", "/a/sql"), ("cache_salt", "s"), ("prompt_embeds", b"\x01"))
    assert event_extra_keys(tagged) == ("sql", "s", b"\x01")
    assert event_extra_keys(("sql", "s"), "0.30.0") == ("sql", "s")
    with pytest.raises(ValueError, match="lora_path"):
        RequestExtraKeys(lora_name="sql")


def test_request_extra_keys_refuses_unsorted_items() -> None:
    with pytest.raises(ValueError, match="sorted"):
        RequestExtraKeys(mm_items=(MultimodalItem("b", 30, 2), MultimodalItem("a", 1, 2)))


# -- incremental hashing --------------------------------------------------------------------


def _chat_tokens(n: int, salt: int = 0) -> list[int]:
    return [(i * 7919 + salt) % 151_000 for i in range(n)]


def test_extend_equals_full_hashing_for_a_continued_chat() -> None:
    turn1 = _chat_tokens(5000)
    turn2 = turn1 + _chat_tokens(1000, salt=3)
    prefix = hash_prefix(turn1, 16, algo="sha256_cbor", seed="0")
    extended = prefix.extend(turn2)
    assert list(extended.hashes) == block_hashes(turn2, 16, algo="sha256_cbor", seed="0")
    assert extended.hashes[: len(prefix.hashes)] == prefix.hashes
    assert len(extended.hashes) == 6000 // 16
    assert extended.token_ids == tuple(turn2[: 375 * 16])


def test_extend_hashes_only_the_new_blocks() -> None:
    calls: list[int] = []

    def counting_keys(start: int, end: int) -> tuple[object, ...] | None:
        calls.append(start)
        return ("sql",)

    turn1 = _chat_tokens(100)
    prefix = hash_prefix(turn1, 16, algo="sha256_cbor", seed="0", extra_keys_fn=counting_keys)
    assert calls == [0, 16, 32, 48, 64, 80]
    calls.clear()
    extended = prefix.extend(turn1 + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    # Tokens 96..111 complete block 6; the six earlier blocks are reused, not rehashed.
    assert calls == [96]
    assert list(extended.hashes) == block_hashes(
        extended.token_ids, 16, algo="sha256_cbor", seed="0", extra_keys_fn=counting_keys
    )


def test_extend_rehashes_from_the_first_changed_block() -> None:
    tokens = _chat_tokens(200)
    prefix = hash_prefix(tokens, 16, algo="sha256", seed="1")
    edited = list(tokens)
    edited[70] += 1  # inside block 4
    extended = prefix.extend(edited)
    assert extended.hashes[:4] == prefix.hashes[:4]
    assert extended.hashes[4] != prefix.hashes[4]
    assert list(extended.hashes) == block_hashes(edited, 16, algo="sha256", seed="1")
    shorter = prefix.extend(tokens[:40])
    assert shorter.hashes == prefix.hashes[:2]


@settings(max_examples=60, deadline=None)
@given(
    base=st.lists(st.integers(0, 200_000), max_size=80),
    keep=st.integers(0, 80),
    tail=st.lists(st.integers(0, 200_000), max_size=40),
    block_size=st.sampled_from([1, 4, 16]),
    salt=st.sampled_from([None, "tenant"]),
)
def test_extend_always_equals_full_hashing(
    base: list[int], keep: int, tail: list[int], block_size: int, salt: str | None
) -> None:
    keys = RequestExtraKeys(cache_salt=salt)
    prefix = hash_prefix(base, block_size, algo="sha256_cbor", seed="0", extra_keys_fn=keys)
    new = base[:keep] + tail
    expected = block_hashes(new, block_size, algo="sha256_cbor", seed="0", extra_keys_fn=keys)
    assert list(prefix.extend(new).hashes) == expected


def test_prefix_hashes_keeps_a_given_root() -> None:
    root = b"\x11" * 16
    prefix = hash_prefix([1] * 32, 16, algo="xxhash_cbor", seed=None, root=root)
    assert isinstance(prefix, PrefixHashes)
    assert prefix.root == root
    assert prefix.hashes[0] == hash_block(root, [1] * 16, None, "xxhash_cbor")
    with pytest.raises(ValueError, match="block_size"):
        hash_prefix([1], 0, algo="sha256", seed="0")
