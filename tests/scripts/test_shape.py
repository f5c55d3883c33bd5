"""scripts/shape.py: import cycles, function and module sizes, and the limits CI keeps."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SHAPE = Path(__file__).resolve().parents[2] / "scripts" / "shape.py"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")


def _shape(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SHAPE), "--report", "", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _long_function(lines: int) -> str:
    body = "".join(f"    x{n} = {n}\n" for n in range(lines - 2))
    return f'def long():\n    """Docstring lines count."""\n{body}'


def test_a_cycle_and_a_long_function_are_reported_and_fail(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": '"""A package."""\n',
            "pkg/a.py": "from pkg.b import thing\n",
            "pkg/b.py": "from . import c\nthing = 1\n",
            "pkg/c.py": "import pkg.a\n",
            "pkg/d.py": "from pkg import a\n",  # imports into the cycle, not part of it
            "pkg/big.py": _long_function(61),
        },
    )
    result = _shape(tmp_path, "pkg")
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "import cycles: 1" in out
    assert "cycle 1 (3 modules): pkg.a, pkg.b, pkg.c" in out
    assert "pkg.a -> pkg.b  (pkg/a.py:1)" in out
    assert "pkg.b -> pkg.c  (pkg/b.py:1)" in out
    assert "pkg.c -> pkg.a  (pkg/c.py:1)" in out
    assert "pkg.d ->" not in out
    assert "61  pkg/big.py:1  long" in out
    assert "function pkg/big.py:1 long: 61 lines > 60" in out
    assert "import cycle among pkg.a, pkg.b, pkg.c" in out


def test_a_clean_tree_passes_and_prints_its_figures(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import thing\n\n\ndef f():\n    return thing\n",
            "pkg/b.py": "thing = 1\n",
            "pkg/big.py": _long_function(60),
            "flat/tool.py": "import helper\n",  # a folder without __init__.py, like scripts/
            "flat/helper.py": "import sys\n",
        },
    )
    result = _shape(tmp_path, "pkg", "flat")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "import cycles: none" in out
    assert "functions: 2, median 31 lines, p90 60 lines; modules: 6" in out
    assert "60  pkg/big.py:1  long" in out
    assert out.rstrip().endswith("== within the limits")


def test_a_long_module_fails_unless_the_allow_file_names_it(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "flat/long.py": "x = 1\n" * 11,
            "flat/a.py": "import b\n\n\ndef f():\n" + "    pass\n" * 5,
            "flat/b.py": "import a\n",
        },
    )
    failed = _shape(tmp_path, "flat", "--max-module", "10", "--max-function", "5")
    assert failed.returncode == 1
    assert "module flat/long.py: 11 lines > 10" in failed.stdout
    assert "function flat/a.py:4 f: 6 lines > 5" in failed.stdout
    assert "import cycle among a, b" in failed.stdout
    allow = tmp_path / "allow"
    allow.write_text("# exceptions\nflat/long.py  # a table\nflat/a.py::f\ncycle  b\n")
    passed = _shape(
        tmp_path, "flat", "--max-module", "10", "--max-function", "5", "--allow", "allow"
    )
    assert passed.returncode == 0, passed.stdout
    assert "cycle 1 (2 modules): a, b" in passed.stdout  # still printed, only not failed
    assert "exceptions no longer needed" not in passed.stdout
    allow.write_text("flat/long.py\nflat/a.py::f\ncycle b\nflat/b.py\nflat/a.py::gone\n")
    stale = _shape(
        tmp_path, "flat", "--max-module", "10", "--max-function", "5", "--allow", "allow"
    )
    assert stale.returncode == 0, stale.stdout
    assert "== 2 exceptions no longer needed (delete them from --allow)" in stale.stdout
    assert "  flat/a.py::gone\n  flat/b.py\n" in stale.stdout


def test_reported_roots_are_measured_but_never_fail(tmp_path: Path) -> None:
    _write(tmp_path, {"pkg/__init__.py": "", "tests/test_x.py": _long_function(70)})
    result = subprocess.run(
        [sys.executable, str(SHAPE), "pkg", "--report", "tests"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout
    assert "== tests (reported, not gated)" in result.stdout
    assert "70  tests/test_x.py:1  long" in result.stdout


def test_a_missing_root_is_an_error(tmp_path: Path) -> None:
    result = _shape(tmp_path, "nowhere")
    assert result.returncode == 2
    assert "no such root: nowhere" in result.stderr
