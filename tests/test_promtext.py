"""The Prometheus text format in one place (llmgw/promtext.py): what is written reads back."""

from __future__ import annotations

import pytest

from llmgw.promtext import family, go_float, label_set, metric_samples, parse_sample, quote_label


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
