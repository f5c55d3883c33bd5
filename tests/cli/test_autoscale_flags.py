"""``llmgw server --autoscale-*``: the autoscaler's round and window, from flags to the config."""

from __future__ import annotations

import pytest
from serverflags import server_config

from llmgw.cli.main import main


def test_defaults_and_flags_reach_theserver_config(monkeypatch: pytest.MonkeyPatch) -> None:
    default = server_config(monkeypatch)
    assert (default.autoscale_interval_s, default.autoscale_window_s) == (5.0, 30.0)
    given = server_config(monkeypatch, "--autoscale-interval", "0.5", "--autoscale-window", "8")
    assert (given.autoscale_interval_s, given.autoscale_window_s) == (0.5, 8.0)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--autoscale-interval", "0"),
        ("--autoscale-interval", "601"),
        ("--autoscale-window", "-3"),
        ("--autoscale-window", "nan"),
        ("--autoscale-window", "inf"),
    ],
)
def test_a_bad_value_is_refused_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["server", flag, value]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"llmgw: {flag} must be") and "Traceback" not in err
