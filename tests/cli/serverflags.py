"""``llmgw server FLAGS`` parsed into the ``ServerConfig`` it would run with (its
``run_server`` replaced), for the tests of the server's flags."""

from __future__ import annotations

import pytest

from llmgw.cli import serve
from llmgw.cli.main import build_parser
from llmgw.server.app import ServerConfig


def server_config(monkeypatch: pytest.MonkeyPatch, *flags: str) -> ServerConfig:
    configs: list[ServerConfig] = []

    async def fake_run_server(config: ServerConfig) -> None:
        configs.append(config)

    monkeypatch.setattr(serve, "run_server", fake_run_server)
    assert serve.run_server_command(build_parser().parse_args(["server", *flags])) == 0
    (config,) = configs
    return config
