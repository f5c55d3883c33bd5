"""Prometheus sample lines as engines write them (llmgw.promtext), with values."""

from __future__ import annotations

import math

import pytest

from llmgw.promtext import int_label, read_sample


def test_a_sample_gives_its_name_labels_and_value() -> None:
    line = 'vllm:cache_config_info{block_size="16",model_name="a b",x="q\\"t"} 1.0 1700000000'
    assert read_sample(line) == (
        "vllm:cache_config_info",
        {"block_size": "16", "model_name": "a b", "x": 'q\\"t'},
        1.0,
    )
    assert read_sample("llamacpp:requests_processing 3") == ("llamacpp:requests_processing", {}, 3)
    assert math.isnan(read_sample("g NaN")[2])  # a number: the caller decides


@pytest.mark.parametrize("line", ["", "# HELP g a gauge", "g", 'g{a="1"} one', "1g 2"])
def test_a_line_that_is_no_sample_is_refused(line: str) -> None:
    with pytest.raises(ValueError, match="unreadable"):
        read_sample(line)


@pytest.mark.parametrize(
    ("value", "read"),
    [("364", 364), ("0", 0), ("None", None), ("", None), ("-5", None), ("1.5", None),
     (" 7", None), ("١٢", None), ("9" * 5000, None)],
)  # fmt: skip
def test_an_int_label_is_a_non_negative_integer_or_unknown(value: str, read: int | None) -> None:
    assert int_label({"n": value}, "n") == read
    assert int_label({}, "n") is None
