"""``--hold-queue``/``--hold-timeout`` (gateway) and ``--gateway-hold-queue``/
``--gateway-hold-timeout`` (server): how many requests a gateway holds per scalable model
and for how long, from the flag to the gateway's config; bad values name the flag."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from serverflags import server_config

from llmgw.cli import gateway as gateway_cli
from llmgw.cli.main import build_parser, main
from llmgw.gateway import GatewayConfig, HoldConfig
from llmgw.server import app


def test_the_server_flags_reach_the_in_server_gateway(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    db = ["--db", str(tmp_path / "s.db")]
    flags = ("--gateway-hold-queue", "3", "--gateway-hold-timeout", "9.5", *db)
    config = server_config(monkeypatch, *flags)
    served: list[GatewayConfig] = []
    monkeypatch.setattr(app, "serve_gateway", lambda plane, gateway: served.append(gateway))
    app._gateway(config, plane=None, tls=None)  # type: ignore[arg-type]
    assert served[0].hold == HoldConfig(max_per_model=3, timeout_s=9.5)
    assert server_config(monkeypatch, *db).gateway_hold == HoldConfig()


def test_the_gateway_flags_reach_its_config(monkeypatch: pytest.MonkeyPatch) -> None:
    configs: list[GatewayConfig] = []

    def fake_run(server: Any, config: GatewayConfig, *rest: Any) -> None:
        configs.append(config)

    monkeypatch.setattr(gateway_cli, "_run_on_uvloop", fake_run)
    for flags, wanted in (
        ((), HoldConfig()),
        (("--hold-queue", "0"), HoldConfig(max_per_model=0)),
        (("--hold-timeout", "30"), HoldConfig(timeout_s=30.0)),
    ):
        assert gateway_cli.run_gateway_command(build_parser().parse_args(["gateway", *flags])) == 0
        assert configs.pop().hold == wanted


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["gateway", "--hold-queue", "-1"], "--hold-queue must be 0 to 100000, not -1"),
        (["gateway", "--hold-timeout", "0"], "--hold-timeout must be above 0"),
        (["gateway", "--hold-timeout", "nan"], "--hold-timeout must be above 0"),
        (["server", "--gateway-hold-timeout", "4000"], "--gateway-hold-timeout must be above"),
        (["server", "--gateway-hold-queue", "100001"], "--gateway-hold-queue must be 0 to"),
    ],
)
def test_bad_values_name_the_flag(
    flags: list[str], words: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    if flags[0] == "server":
        flags = [*flags, "--db", str(tmp_path / "s.db")]
    assert main(flags) != 0
    assert words in capsys.readouterr().err
