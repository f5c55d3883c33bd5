"""Error messages repeat a client's value only in part."""

from __future__ import annotations

from llmgw.server.errors import QUOTE_LIMIT, UnknownNode, quoted


def test_short_values_are_quoted_whole() -> None:
    assert quoted("gpu-node-7") == "'gpu-node-7'"


def test_long_values_are_cut_and_their_length_named() -> None:
    text = quoted("x" * 100_000)
    assert len(text) < QUOTE_LIMIT + 40
    assert text.endswith("… (100000 characters)")
    assert len(str(UnknownNode("y" * 10_000))) < 200
