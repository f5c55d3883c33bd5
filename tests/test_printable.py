"""Strings from the wire, refused where they enter and escaped where they are shown
(llmgw/printable.py), and the CLI's tables that use it."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.api.llmgw.v1 import Gpu, HostFacts, NodeInfo
from llmgw.cli.tables import render_table
from llmgw.printable import escape, text_problem, text_problems, unsafe

FORGED = "n1\n\x1b[2Knode-forged  READY"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (FORGED, "n1\\n\\x1b[2Knode-forged  READY"),
        ("a\rb\tc", "a\\rb\\tc"),
        ("\x7f\x85\x9b", "\\x7f\\x85\\x9b"),
        ("abc\u202etxt.exe", "abc\\u202etxt.exe"),
        ("line\u2028sep", "line\\u2028sep"),
        ("H100 80GB é 🙂 [red]x[/] C:\\path", "H100 80GB é 🙂 [red]x[/] C:\\path"),
    ],
)
def test_escape_writes_each_unsafe_character_visibly(text: str, shown: str) -> None:
    assert escape(text) == shown


def test_unsafe_is_exactly_cc_zl_zp_and_the_bidi_controls() -> None:
    bidi = {*range(0x202A, 0x202F), *range(0x2066, 0x206A)}
    for code in [*range(0x3000), *range(0xFE00, 0x10000)]:
        if 0xD800 <= code < 0xE000:
            continue
        char = chr(code)
        expected = unicodedata.category(char) in ("Cc", "Zl", "Zp") or code in bidi
        assert unsafe(char) is expected, hex(code)


@given(st.text())
def test_escaped_text_is_safe_and_safe_text_is_unchanged(text: str) -> None:
    out = escape(text)
    assert text_problem(out) is None
    assert "\n" not in out
    if text_problem(text) is None:
        assert out is text


def test_text_problems_name_every_field_map_keys_included() -> None:
    node = NodeInfo(
        node_id="n1",
        hostname=FORGED,
        labels={"zone": "eu\x1b", "ra\nck": "1"},
        gpus=[Gpu(uuid="GPU-1", name="H100"), Gpu(uuid="GPU-2", name="H100\r")],
        host=HostFacts(kernel="6.8\x00"),
        features=["a", "b\x07"],
    )
    problems = text_problems(node, "Register.node")
    assert [p.split(" ", 1)[0] for p in problems] == [
        "Register.node.hostname",
        'Register.node.labels["zone"]',
        "Register.node.labels",
        "Register.node.features[1]",
        "Register.node.host.kernel",
        "Register.node.gpus[1].name",
    ]
    assert problems[0] == (
        'Register.node.hostname "n1\\n\\x1b[2Knode-forged  READY": holds a control character (\\n)'
    )
    assert problems[2].startswith('Register.node.labels key "ra\\nck"')
    assert text_problems(NodeInfo(node_id="n1", hostname="h", labels={"a": "b"}), "n") == []


def test_at_most_ten_problems_are_named() -> None:
    node = NodeInfo(node_id="n1", labels={f"k{i}": "\n" for i in range(50)})
    assert len(text_problems(node, "node")) == 10


def test_cli_tables_escape_every_cell_so_no_row_is_forged() -> None:
    table = render_table([["NODE", "LABELS"], ["n1", f"zone={FORGED}"], ["n2", "-"]])
    assert table.splitlines() == [
        "NODE  LABELS",
        "n1    zone=n1\\n\\x1b[2Knode-forged  READY",
        "n2    -",
    ]
