"""A deterministic tokenizer: the same text gives the same token ids in every process.

Text is split GPT-2 style into pieces (a word with its leading space, a run of digits,
punctuation, whitespace); each piece maps to an id by a stable hash (BLAKE2b, never
Python's salted ``hash()``) into ``[FIRST_HASHED_ID, VOCAB_SIZE)``. The special tokens of a
ChatML template (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``) have fixed small ids, as
in SmolLM2. Detokenizing inverts every id this process has produced or read; an id never
seen here (two pieces can also share an id) comes back as ``<|id:N|>``.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

VOCAB_SIZE = 49_152
FIRST_HASHED_ID = 256
ENDOFTEXT, IM_START, IM_END = 0, 1, 2
SPECIAL_TOKENS: Mapping[str, int] = {
    "<|endoftext|>": ENDOFTEXT,
    "<|im_start|>": IM_START,
    "<|im_end|>": IM_END,
}
EOS_TOKEN_ID = IM_END
_REVERSE_LIMIT = 1 << 20

_PIECE = re.compile(
    r"<\|endoftext\|>|<\|im_start\|>|<\|im_end\|>"
    r"| ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+|_+"
)


@functools.lru_cache(maxsize=1 << 16)
def piece_id(piece: str) -> int:
    """The token id of one piece: fixed for specials, a stable hash otherwise."""
    special = SPECIAL_TOKENS.get(piece)
    if special is not None:
        return special
    digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=8).digest()
    return FIRST_HASHED_ID + int.from_bytes(digest, "big") % (VOCAB_SIZE - FIRST_HASHED_ID)


def split_pieces(text: str) -> list[str]:
    """The pieces of ``text``; joining them gives ``text`` back."""
    return _PIECE.findall(text)


class SimTokenizer:
    """Text ↔ token ids, deterministic across processes; remembers pieces to invert them."""

    def __init__(self) -> None:
        self._pieces: dict[int, str] = {v: k for k, v in SPECIAL_TOKENS.items()}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS is added, as SmolLM2's tokenizer adds none)."""
        ids: list[int] = []
        remember = self._pieces
        for piece in split_pieces(text):
            token = piece_id(piece)
            ids.append(token)
            if token not in remember:
                self._remember(token, piece)
        return ids

    def piece(self, token: int) -> str:
        """The text of one id; ``<|id:N|>`` for an id this process never produced."""
        text = self._pieces.get(token)
        return text if text is not None else f"<|id:{token}|>"

    def decode(self, tokens: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        specials = SPECIAL_TOKENS.values() if skip_special_tokens else ()
        return "".join(self.piece(t) for t in tokens if t not in specials)

    def _remember(self, token: int, piece: str) -> None:
        if len(self._pieces) >= _REVERSE_LIMIT:
            self._pieces = {v: k for k, v in SPECIAL_TOKENS.items()}
        self._pieces[token] = piece


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """ChatML without a default system prompt; raises ValueError for a malformed message."""
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    parts: list[str] = []
    for index, message in enumerate(messages):
        role, content = _role_and_content(message, index)
        last = index == len(messages) - 1
        end = "" if (last and continue_final_message) else "<|im_end|>\n"
        parts.append(f"<|im_start|>{role}\n{content}{end}")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _role_and_content(message: Mapping[str, Any], index: int) -> tuple[str, str]:
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] is not an object")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{index}].role must be a non-empty string")
    content = message.get("content")
    if content is None:
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list):
        return role, "".join(_text_part(part, index) for part in content)
    raise ValueError(f"messages[{index}].content must be a string or a list of parts")


def _text_part(part: Any, index: int) -> str:
    if (
        isinstance(part, Mapping)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    ):
        return str(part["text"])
    raise ValueError(f"messages[{index}].content: only text parts are supported")
