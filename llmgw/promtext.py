"""The Prometheus text exposition format (0.0.4): written and read in one place.

Writing: :func:`family` (a family's ``# HELP`` and ``# TYPE`` lines), :func:`quote_label`
(a label value quoted and escaped), :func:`label_set` (``{a="x",b="y"}``) and
:func:`go_float` (a value the way prometheus_client writes it: ``79.0``, ``1.7e+09``,
``+Inf``). The gateway's and the control server's ``/metrics`` and the simulated vLLM's are
built on these.

Reading: :func:`parse_sample` (one ``name{labels} value`` line), :func:`int_label` (a label
that must be a count) and :func:`metric_samples` (every sample of one family in a page), for
the gateway's engine poller, the agent's probe (requests in flight, an engine's KV block
count) and the demo's figures.

Standard library only: every room may import it, and it imports nothing of llmgw
(import-linter holds it).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Mapping
from typing import Final

__all__ = [
    "CONTENT_TYPE",
    "family",
    "go_float",
    "int_label",
    "label_set",
    "metric_samples",
    "parse_sample",
    "quote_label",
]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

_SAMPLE: Final = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL: Final = re.compile(r'(?<!\w)(\w+)="((?:[^"\\]|\\.)*)"')  # anchored: linear on long runs


# -- writing --------------------------------------------------------------------------------


def family(out: list[str], name: str, kind: str, help_: str) -> None:
    """A family's HELP and TYPE lines."""
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} {kind}")


def quote_label(value: str) -> str:
    """A label value, quoted and escaped as the text exposition format wants."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def label_set(pairs: Iterable[tuple[str, str]]) -> str:
    """``{a="x",b="y"}`` in the order given (the caller sorts when it wants them sorted)."""
    return "{" + ",".join(f"{key}={quote_label(value)}" for key, value in pairs) + "}"


def go_float(value: float) -> str:
    """prometheus_client's ``floatToGoString``: ``79.0``, ``1.7959674973e+09``, ``+Inf``."""
    value = float(value)
    if value == float("inf"):
        return "+Inf"
    if value == float("-inf"):
        return "-Inf"
    if value != value:
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


# -- reading --------------------------------------------------------------------------------


def parse_sample(line: str) -> tuple[str, dict[str, str], float]:
    """``name{labels} value [timestamp]`` → (name, labels, value); ValueError when the line
    is no sample or its value no number."""
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


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of ``name`` in a Prometheus text exposition, with their labels; lines
    that cannot be read are skipped (for figures shown to a person, not routed on)."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        with contextlib.suppress(ValueError):
            sample, labels, value = parse_sample(line)
            if sample == name:
                out.append((labels, value))
    return out
