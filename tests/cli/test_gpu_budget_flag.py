"""``llmgw server --gpu-budget POOL=N``: repeated, checked, on the server's config."""

from __future__ import annotations

import pytest
from serverflags import server_config

from llmgw.cli.main import main


def _budgets(monkeypatch: pytest.MonkeyPatch, *flags: str) -> dict[str, int]:
    return server_config(monkeypatch, *flags).gpu_budgets


def test_none_by_default_and_one_per_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _budgets(monkeypatch) == {}
    given = _budgets(monkeypatch, "--gpu-budget", "gpu-a=8", "--gpu-budget", "h100.eu=16")
    assert given == {"gpu-a": 8, "h100.eu": 16}


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("gpu-a", "is not POOL=N"),
        ("=4", "is not POOL=N"),
        ("GPU_A=4", "is not POOL=N"),
        ("gpu-a=0", "N must be a whole number of GPUs from 1 to 1,000,000"),
        ("gpu-a=-2", "N must be a whole number"),
        ("gpu-a=1.5", "N must be a whole number"),
        ("gpu-a=²", "N must be a whole number"),
        ("gpu-a=2000000", "N must be a whole number"),
    ],
)
def test_a_bad_value_is_refused_naming_the_flag(
    value: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["server", "--gpu-budget", value]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"llmgw: --gpu-budget {value!r}") and why in err
    assert "Traceback" not in err


def test_a_pool_given_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["server", "--gpu-budget", "a=1", "--gpu-budget", "a=2"]) == 1
    assert "--gpu-budget gives pool a twice (1 and 2)" in capsys.readouterr().err
