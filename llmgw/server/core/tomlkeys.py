"""Reading and writing TOML tables by key path: what ``llmgw.server.core.profiles`` and
``llmgw.server.core.deployment_keys`` share.

:class:`Table` reads one table with typed getters that record every problem under its key
path (``profiles."chat.v2".tp: must be …``) instead of raising, so a document is refused
whole with all its problems named. :func:`render_table` and :func:`toml_value` write the
values back as TOML that reads to the same values.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ALIASES", "BARE_KEY", "NAME", "NAME_MAX", "NAME_RULE", "Table", "bad_text", "key_path",
    "not_text", "render_table", "show", "toml_string", "toml_value", "unknown_key",
]  # fmt: skip

NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
NAME_MAX = 63
NAME_RULE = (
    'lower-case letters, digits, "-" and "." only, starting and ending with a letter or '
    f"digit, at most {NAME_MAX} characters"
)
BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
# Spellings from other tools that difflib would not match to ours.
ALIASES = {
    "tensor_parallel_size": "tp", "tensor_parallel": "tp", "tensor-parallel-size": "tp",
    "pipeline_parallel_size": "pp", "pipeline_parallel": "pp", "pipeline-parallel-size": "pp",
    "model": "model_path", "path": "model_path", "threads": "cpu_threads",
    "gpu": "gpu_class", "gpu_type": "gpu_class", "lora_modules": "adapters",
    "loras": "adapters", "lora": "adapters", "environment": "env", "count": "replicas",
    "num_nodes": "nodes", "nnodes": "nodes", "min_gpu_memory_bytes": "min_gpu_memory",
}  # fmt: skip


def key_path(*parts: str | int) -> str:
    """A key path as TOML writes it: ``profiles."chat.v2".tp``, ``….adapters[0].name``."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            key = part if BARE_KEY.fullmatch(part) else toml_string(part)
            out += f".{key}" if out else key
    return out


def show(value: object, limit: int = 64) -> str:
    """A value as an error message repeats it: TOML-like, cut to ``limit`` characters."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        cut = value if len(value) <= limit else value[:limit] + "…"
        return toml_string(cut.encode("utf-8", "backslashreplace").decode())
    if isinstance(value, int | float):
        return str(value)[:limit]
    if isinstance(value, list | dict):
        return "an array" if isinstance(value, list) else "a table"
    return f"a {type(value).__name__}"  # a date or time


def unknown_key(
    key: str, known: tuple[str, ...], value: object, path: tuple[str | int, ...]
) -> str:
    if key in ALIASES and ALIASES[key] in known:
        return f'unknown key; did you mean "{ALIASES[key]}"?'
    if close := difflib.get_close_matches(key, known, n=1, cutoff=0.6):
        return f'unknown key; did you mean "{close[0]}"?'
    if isinstance(value, dict) and len(path) == 2:  # [profiles.chat.v2] nests a table
        dotted = f"{path[1]}.{key}"
        return f"unknown key; to name one {show(dotted)}, quote it: [{key_path(path[0], dotted)}]"
    return f"unknown key (known: {', '.join(known)})"


def bad_text(value: str) -> str | None:
    """Why a string cannot reach a process or a message, or None."""
    if "\0" in value:
        return "must not contain a NUL character"
    if any("\ud800" <= c <= "\udfff" for c in value):
        return "must be valid Unicode (it holds a lone surrogate)"
    return None


def not_text(value: object) -> str | None:
    """Why ``value`` is not a string a process can take, or None."""
    return bad_text(value) if isinstance(value, str) else f"must be a string, got {show(value)}"


@dataclass(slots=True)
class Table:
    """One TOML table being read: typed getters that record problems by key path."""

    data: dict[str, Any]
    path: tuple[str | int, ...]
    problems: list[str]

    def problem(self, key: str | int, message: str, *more: str | int) -> None:
        self.problems.append(f"{key_path(*self.path, key, *more)}: {message}")

    def check_keys(self, known: tuple[str, ...]) -> None:
        for key, value in self.data.items():
            if key not in known:
                self.problem(key, unknown_key(key, known, value, self.path))

    def string(self, key: str, *, default: str | None = None) -> str | None:
        value = self.data.get(key, default)
        if value is None:
            self.problem(key, "required")
        elif not isinstance(value, str) or value == "":
            self.problem(key, f"must be a non-empty string, got {show(value)}")
        elif why := bad_text(value):
            self.problem(key, why)
        else:
            return value
        return None

    def integer(self, key: str, low: int, high: int, default: int) -> int | None:
        value = self.data.get(key, default)
        if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
            return value
        kind = "a positive integer" if low == 1 else f"an integer from {low}"
        self.problem(key, f"must be {kind} up to {high:,}, got {show(value)}")
        return None

    def strings(self, key: str) -> list[str] | None:
        value = self.data.get(key, [])
        if not isinstance(value, list):
            self.problem(key, f"must be an array of strings, got {show(value)}")
            return None
        before = len(self.problems)
        for i, item in enumerate(value):
            if why := not_text(item):
                self.problem(key, why, i)
        return value if len(self.problems) == before else None

    def string_table(
        self, key: str, check_key: Callable[[str], str | None]
    ) -> dict[str, str] | None:
        """A table of strings; ``check_key`` says what is wrong with a key, or None."""
        value = self.data.get(key, {})
        if not isinstance(value, dict):
            self.problem(key, f"must be a table of strings, got {show(value)}")
            return None
        before = len(self.problems)
        for name, item in value.items():
            if why := check_key(name) or not_text(item):
                self.problem(key, why, name)
        return value if len(self.problems) == before else None


def render_table(header: tuple[str, ...], fields: list[tuple[str, object]]) -> str:
    """One table: its ``[header]`` line, then a ``key = value`` line per field."""
    lines = [f"[{key_path(*header)}]"]
    lines += [f"{key_path(key)} = {toml_value(value)}" for key, value in fields]
    return "\n".join(lines) + "\n"


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        body = ", ".join(f"{key_path(k)} = {toml_value(v)}" for k, v in value.items())
        return "{ " + body + " }" if body else "{}"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, and TOML escapes DEL too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")
