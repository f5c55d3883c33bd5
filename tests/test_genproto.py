"""The generated code in llmgw/api is exactly what scripts/genproto makes from protos/."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tree(root: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(root)): p
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    out = tmp_path / "api"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    subprocess.run(
        [str(ROOT / "scripts" / "genproto"), str(out)], check=True, env=env, capture_output=True
    )
    fresh, committed = _tree(out), _tree(ROOT / "llmgw" / "api")
    assert sorted(fresh) == sorted(committed), "run scripts/genproto: files differ"
    stale = [name for name in fresh if not filecmp.cmp(fresh[name], committed[name], shallow=False)]
    assert not stale, f"llmgw/api is stale, run scripts/genproto: {stale}"
