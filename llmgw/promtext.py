"""Prometheus text exposition, read one sample line at a time.

Engines (vLLM, SGLang, llama.cpp, the simulated engine) tell their figures on ``/metrics``
in this format: ``name{label="value",...} value [timestamp]``. The agent (requests in
flight, an engine's KV block count) and the gateway (prefix-cache counters, cache config)
read them with `read_sample` and `int_label`; a top-level module every room may import.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["int_label", "read_sample"]

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(?<!\w)(\w+)="((?:[^"\\]|\\.)*)"')  # anchored: linear on long runs


def read_sample(line: str) -> tuple[str, dict[str, str], float]:
    """``name{labels} value [timestamp]`` → (name, labels, value); label values may hold
    spaces. ValueError for a line that is no sample or whose value is no number (NaN and
    infinities are numbers: the caller decides)."""
    match = _SAMPLE.match(line)
    if match is None:
        raise ValueError(f"unreadable sample {line[:120]!r}")
    try:
        value = float(match.group(3))
    except ValueError as exc:
        raise ValueError(f"unreadable value in {line[:120]!r}") from exc
    return match.group(1), dict(_LABEL.findall(match.group(2) or "")), value


def int_label(labels: Mapping[str, str], name: str) -> int | None:
    """The label as a non-negative integer; None when missing or anything else ("None")."""
    text = labels.get(name, "")
    if not (text.isascii() and text.isdigit()):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than int() converts
        return None
