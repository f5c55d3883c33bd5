"""Errors raised by `llmgw.kvcache`.

The tree::

    KvCacheError                        base of everything this package raises on purpose
    ├── KvEventDecodeError              a payload, frame list or replay message that is not a
    │                                   valid vLLM KV event message; says what and where
    │   └── MirrorOverflowError         events that store more blocks in one mirror than
    │                                   its bound (`BlockMirror` ``max_blocks``)
    ├── KvEventEncodeError              an event the wire format cannot carry (an int hash
    │                                   beyond 64 bits, a value msgpack cannot pack)
    ├── UnsupportedVllmVersionError     a vLLM version string we cannot parse, or one whose
    │                                   behaviour we do not reproduce (before 0.10.2 hashing)
    └── HashAlgorithmError              about a prefix-caching hash algorithm
        ├── UnsupportedHashAlgorithmError   unknown name, or not offered by that vLLM version
        └── HashAlgorithmUnavailableError   needs an optional package that is not installed

Errors that describe bad input also derive from `ValueError`, so a caller that only knows
the standard library still catches them. Foreign exceptions (msgpack, cbor2, UnicodeDecodeError)
are mapped to these at the one place they can occur, with ``raise ... from exc``.
"""

from __future__ import annotations

__all__ = [
    "HashAlgorithmError",
    "HashAlgorithmUnavailableError",
    "KvCacheError",
    "KvEventDecodeError",
    "KvEventEncodeError",
    "MirrorOverflowError",
    "UnsupportedHashAlgorithmError",
    "UnsupportedVllmVersionError",
]


class KvCacheError(Exception):
    """Base of every error `llmgw.kvcache` raises on purpose."""


class KvEventDecodeError(KvCacheError, ValueError):
    """A KV event payload, frame list or replay message is malformed."""


class MirrorOverflowError(KvEventDecodeError):
    """A batch would make a `~llmgw.kvcache.mirror.BlockMirror` hold more blocks than its
    bound: more than any engine caches, so the events are not what an engine sends."""


class KvEventEncodeError(KvCacheError, ValueError):
    """An event holds a value the msgpack wire format cannot carry."""


class UnsupportedVllmVersionError(KvCacheError, ValueError):
    """A vLLM version string is unparsable or outside what we reproduce."""


class HashAlgorithmError(KvCacheError):
    """Base of errors about a prefix-caching hash algorithm."""


class UnsupportedHashAlgorithmError(HashAlgorithmError, ValueError):
    """The algorithm name is unknown, or that vLLM version does not offer it."""


class HashAlgorithmUnavailableError(HashAlgorithmError):
    """The algorithm needs an optional package (``xxhash``) that is not installed."""
