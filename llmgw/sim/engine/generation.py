"""Deterministic output: what the simulated model "says" after a prompt.

The continuation is a function of the prompt's token ids and the seeds only, so two
processes (or two replicas) given the same prompt answer the same. Words come from a fixed
list; an answer ends with EOS after a prompt-dependent natural length of 8 to 64 tokens,
unless ``ignore_eos`` is set or ``max_tokens`` (or the model length) ends it first, as
vLLM's ``check_stop`` decides.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.sim.engine.tokenizer import EOS_TOKEN_ID, SimTokenizer

WORDS = (
    " the", " model", " answer", " is", " a", " simulated", " token", " stream", " from",
    " an", " engine", " that", " reads", " your", " prompt", " and", " writes", " words",
    " in", " order", ",", ".", " cache", " block", " prefix", " reuse", " makes", " it",
    " fast", " when", " requests", " share", " their", " start", " with", " another",
    " replica", " router", " picks", " best", " GPU", " memory", " holds", " keys",
    " values", " for", " each", " layer",
)  # fmt: skip
MIN_NATURAL_LENGTH = 8
MAX_NATURAL_LENGTH = 64
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """The sampling parameters the simulation honours."""

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class OutputPlan:
    """The deterministic answer to one prompt, token by token."""

    __slots__ = ("_state", "_word_ids", "natural_length", "spec")

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        spec: SamplingSpec,
        word_ids: Sequence[int],
        engine_seed: int = 0,
    ) -> None:
        seed = spec.seed if spec.seed is not None else engine_seed
        material = array("q", prompt_token_ids).tobytes() + seed.to_bytes(8, "big", signed=True)
        digest = hashlib.blake2b(material, digest_size=16).digest()
        self._state = int.from_bytes(digest[:8], "big")
        span = MAX_NATURAL_LENGTH - MIN_NATURAL_LENGTH + 1
        self.natural_length = MIN_NATURAL_LENGTH + int.from_bytes(digest[8:], "big") % span
        self._word_ids = word_ids
        self.spec = spec

    def token(self, index: int) -> int:
        """The ``index``-th output token (0-based)."""
        stops = not self.spec.ignore_eos and index + 1 >= self.spec.min_tokens
        if stops and index + 1 >= self.natural_length:
            return EOS_TOKEN_ID
        pick = _splitmix64(self._state ^ index) % len(self._word_ids)
        return self._word_ids[pick]

    def finish_reason(self, num_output: int, num_tokens: int, max_model_len: int) -> str | None:
        """``"length"``, ``"stop"`` or None after the ``num_output``-th token, like vLLM."""
        if num_output >= self.spec.max_tokens or num_tokens >= max_model_len:
            return "length"
        if num_output < self.spec.min_tokens or self.spec.ignore_eos:
            return None
        return "stop" if num_output >= self.natural_length else None


def word_token_ids(tokenizer: SimTokenizer) -> tuple[int, ...]:
    """The ids of the answer words, registered with ``tokenizer`` so they detokenize."""
    return tuple(tokenizer.encode(word)[0] for word in WORDS)
