"""Strings that other processes send and llmgw prints: refused where they enter, escaped where
they are shown.

A hostname, a label or a GPU name with a newline or an escape sequence, printed raw, forges
rows of ``llmgw get nodes`` (``"n1\\n\\x1b[2Knode-forged  READY"``) or drives the operator's
terminal (OSC 52 writes their clipboard). So:

- where such strings enter (an agent's ``Register``, the agent's own ``--labels``),
  :func:`text_problems` finds every string field of a message that holds a character of
  :func:`unsafe` and names the field (``node.gpus[0].name``); the server refuses the
  registration with them, and stores nothing;
- where strings are shown (``llmgw get`` tables, the console), :func:`escape` writes every
  such character as a visible escape (``\\n``, ``\\x1b``, ``\\u202e``), so that what was
  stored before the check, or arrives by another way, still prints as one line of plain
  text. ``-o json`` needs nothing: JSON escapes them.

Unsafe characters: the C0 and C1 controls and DEL (Unicode category Cc, tab included), the
line and paragraph separators (Zl, Zp) and the bidirectional embedding, override and isolate
controls (U+202A–U+202E, U+2066–U+2069), which reorder what a terminal shows.

Imports nothing of llmgw but the generated messages' runtime (the server, the agent, the
CLI and the console all use it).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Final

import betterproto2

__all__ = ["escape", "text_problem", "text_problems", "unsafe"]

# Cc is U+0000-001F and U+007F-009F; Zl and Zp are U+2028 and U+2029.
_UNSAFE: Final = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_MAX_PROBLEMS = 10


def unsafe(char: str) -> bool:
    """Whether ``char`` may change how a terminal shows the text around it."""
    return _UNSAFE.fullmatch(char) is not None


def _escaped(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` with every unsafe character written as an escape (``\\n``, ``\\x1b``).

    Text without them comes back as it is (the same object), so the common case costs
    one scan.
    """
    if _UNSAFE.search(text) is None:
        return text
    return _UNSAFE.sub(lambda found: _escaped(found[0]), text)


def text_problem(text: str) -> str | None:
    """What is wrong with ``text`` as a string that llmgw prints, or None."""
    found = _UNSAFE.search(text)
    return None if found is None else f"holds a control character ({_escaped(found[0])})"


def text_problems(message: betterproto2.Message, path: str) -> list[str]:
    """``PATH.FIELD: problem`` for every string of ``message`` (and the messages in it, map
    keys included) that :func:`text_problem` refuses; at most ten."""
    problems: list[str] = []
    for where, text in _strings(message, path):
        if why := text_problem(text):
            problems.append(f"{where} {_show(text)}: {why}")
            if len(problems) == _MAX_PROBLEMS:
                break
    return problems


def _show(text: str, limit: int = 48) -> str:
    cut = text if len(text) <= limit else text[:limit] + "…"
    return '"' + escape(cut).replace('"', '\\"') + '"'


def _strings(value: object, path: str) -> Iterator[tuple[str, str]]:
    """Every string inside ``value`` with the field path that leads to it."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, betterproto2.Message) and dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            yield from _strings(getattr(value, field.name), f"{path}.{field.name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield f"{path} key", key
            yield from _strings(item, f"{path}[{_show(str(key))}]")
