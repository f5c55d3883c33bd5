"""vLLM-compatible prefix-cache block hashing and KV event encoding/decoding.

Pure functions and frozen dataclasses; imports nothing else of llmgw. The simulated engine
publishes with `encode_batch`/`encode_frames` and hashes with `block_hashes`; the gateway
decodes with `decode_batch`/`decode_frames` and hashes prompts with `hash_prefix` and
`PrefixHashes.extend`. Reference: spec/vllm-kv-events.md and spec/vllm_kv_golden.json.
The agent mirrors an engine's blocks with our block keys (``mirror``); those keys cross the
wire in one form (``keys.pack_keys``/``unpack_keys``) and the control server holds each
replica's in a ``keys.KeySet``.
"""

from llmgw.kvcache.errors import (
    HashAlgorithmError,
    HashAlgorithmUnavailableError,
    KvCacheError,
    KvEventDecodeError,
    KvEventEncodeError,
    MirrorOverflowError,
    UnsupportedHashAlgorithmError,
    UnsupportedVllmVersionError,
)
from llmgw.kvcache.events import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Encoding,
    Event,
    EventBatch,
    ExternalBlockHash,
    ReplayMessage,
    decode_batch,
    decode_frames,
    decode_replay_message,
    decode_replay_request,
    encode_batch,
    encode_frames,
    encode_replay_message,
    encode_replay_request,
    replay_end_frames,
)
from llmgw.kvcache.hashing import (
    HASH_ALGOS,
    NONE_HASH_DEFAULT_SEED,
    ExtraKeysFn,
    MultimodalItem,
    PrefixHashes,
    RequestExtraKeys,
    block_hashes,
    event_extra_keys,
    event_hash,
    external_hash,
    extra_keys_for_block,
    hash_block,
    hash_function,
    hash_prefix,
    none_hash,
    parse_vllm_version,
)

__all__ = [
    "HASH_ALGOS",
    "NONE_HASH_DEFAULT_SEED",
    "REPLAY_END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Encoding",
    "Event",
    "EventBatch",
    "ExternalBlockHash",
    "ExtraKeysFn",
    "HashAlgorithmError",
    "HashAlgorithmUnavailableError",
    "KvCacheError",
    "KvEventDecodeError",
    "KvEventEncodeError",
    "MirrorOverflowError",
    "MultimodalItem",
    "PrefixHashes",
    "ReplayMessage",
    "RequestExtraKeys",
    "UnsupportedHashAlgorithmError",
    "UnsupportedVllmVersionError",
    "block_hashes",
    "decode_batch",
    "decode_frames",
    "decode_replay_message",
    "decode_replay_request",
    "encode_batch",
    "encode_frames",
    "encode_replay_message",
    "encode_replay_request",
    "event_extra_keys",
    "event_hash",
    "external_hash",
    "extra_keys_for_block",
    "hash_block",
    "hash_function",
    "hash_prefix",
    "none_hash",
    "parse_vllm_version",
    "replay_end_frames",
]
