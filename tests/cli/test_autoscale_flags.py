"""``llmgw server --autoscale-*``: the autoscaler's round and window, from flags to the config."""

from __future__ import annotations

import pytest

from llmgw.cli import serve
from llmgw.cli.main import build_parser, main
from llmgw.server.app import ServerConfig


def _config(monkeypatch: pytest.MonkeyPatch, *flags: str) -> ServerConfig:
    configs: list[ServerConfig] = []

    async def fake_run_server(config: ServerConfig) -> None:
        configs.append(config)

    monkeypatch.setattr(serve, "run_server", fake_run_server)
    assert serve.run_server_command(build_parser().parse_args(["server", *flags])) == 0
    (config,) = configs
    return config


def test_defaults_and_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    default = _config(monkeypatch)
    assert (default.autoscale_interval_s, default.autoscale_window_s) == (5.0, 30.0)
    given = _config(monkeypatch, "--autoscale-interval", "0.5", "--autoscale-window", "8")
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
