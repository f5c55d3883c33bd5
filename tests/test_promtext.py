"""The Prometheus text format in one place (llmgw/promtext.py): what is written reads back,
and sample lines as engines write them read with their labels and values."""

from __future__ import annotations

import math

import pytest

from llmgw.promtext import (
    family,
    go_float,
    int_label,
    label_set,
    metric_samples,
    parse_sample,
    quote_label,
)


def test_written_lines_read_back() -> None:
    out: list[str] = []
    family(out, "m", "gauge", "A gauge.")
    labels = label_set([("a", 'x"y'), ("b", "line\nbreak")])
    out.append("m" + labels + " " + go_float(3.5))
    out.append("m " + go_float(float("inf")))
    assert out[:2] == ["# HELP m A gauge.", "# TYPE m gauge"]
    # label values come back as written (escaped), values as numbers
    assert metric_samples("\n".join(out), "m") == [
        ({"a": 'x\\"y', "b": "line\\nbreak"}, 3.5),
        ({}, float("inf")),
    ]


def test_quote_label_escapes_backslash_quote_and_newline() -> None:
    assert quote_label('a\\b"c\nd') == '"a\\\\b\\"c\\nd"'


def test_go_float_writes_values_as_prometheus_client_does() -> None:
    values = [go_float(v) for v in (79, 1795967497.3, float("-inf"), float("nan"))]
    assert values == ["79.0", "1.7959674973e+09", "-Inf", "NaN"]


def test_parse_sample_refuses_what_is_no_sample() -> None:
    assert parse_sample('x_total{k="v"} 2 1700000000000') == ("x_total", {"k": "v"}, 2.0)
    with pytest.raises(ValueError, match="unreadable sample"):
        parse_sample("# HELP x")
    with pytest.raises(ValueError, match="unreadable value"):
        parse_sample("x abc")


def test_a_sample_gives_its_name_labels_and_value() -> None:
    line = 'vllm:cache_config_info{block_size="16",model_name="a b",x="q\\"t"} 1.0 1700000000'
    assert parse_sample(line) == (
        "vllm:cache_config_info",
        {"block_size": "16", "model_name": "a b", "x": 'q\\"t'},
        1.0,
    )
    assert parse_sample("llamacpp:requests_processing 3") == ("llamacpp:requests_processing", {}, 3)
    assert math.isnan(parse_sample("g NaN")[2])  # a number: the caller decides


@pytest.mark.parametrize("line", ["", "# HELP g a gauge", "g", 'g{a="1"} one', "1g 2"])
def test_a_line_that_is_no_sample_is_refused(line: str) -> None:
    with pytest.raises(ValueError, match="unreadable"):
        parse_sample(line)


@pytest.mark.parametrize(
    ("value", "read"),
    [("364", 364), ("0", 0), ("None", None), ("", None), ("-5", None), ("1.5", None),
     (" 7", None), ("١٢", None), ("9" * 5000, None)],
)  # fmt: skip
def test_an_int_label_is_a_non_negative_integer_or_unknown(value: str, read: int | None) -> None:
    assert int_label({"n": value}, "n") == read
    assert int_label({}, "n") is None
