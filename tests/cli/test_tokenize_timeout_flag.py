"""``--gateway-tokenize-timeout`` (server) and ``--tokenize-timeout`` (gateway): the precise
tier's bound on a replica's ``/tokenize``, from the flag to the gateway's config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from serverflags import server_config

from llmgw.cli import gateway as gateway_cli
from llmgw.cli.main import build_parser, main
from llmgw.gateway.app import TOKENIZE_TIMEOUT_S, GatewayConfig
from llmgw.server import app
from llmgw.server.app import Listen, ServerConfig


def _in_server_gateway(config: ServerConfig, monkeypatch: pytest.MonkeyPatch) -> GatewayConfig:
    served: list[GatewayConfig] = []

    def fake_serve_gateway(plane: Any, gateway: GatewayConfig) -> None:
        served.append(gateway)

    monkeypatch.setattr(app, "serve_gateway", fake_serve_gateway)
    app._gateway(config, plane=None, tls=None)  # type: ignore[arg-type]
    (gateway,) = served
    return gateway


def test_the_server_flag_reaches_the_in_server_gateway(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    db = ["--db", str(tmp_path / "s.db")]
    given = server_config(monkeypatch, "--gateway-tokenize-timeout", "0.4", *db)
    assert given.gateway_tokenize_timeout_s == 0.4
    assert _in_server_gateway(given, monkeypatch).tokenize_timeout_s == 0.4
    default = server_config(monkeypatch, *db)
    assert default.gateway_tokenize_timeout_s == TOKENIZE_TIMEOUT_S
    assert _in_server_gateway(default, monkeypatch).tokenize_timeout_s == TOKENIZE_TIMEOUT_S
    bare = ServerConfig(Listen("127.0.0.1", 1), Listen("127.0.0.1", 2), tmp_path / "s.db")
    assert bare.gateway_tokenize_timeout_s == GatewayConfig().tokenize_timeout_s


def test_the_gateway_flag_reaches_its_config(monkeypatch: pytest.MonkeyPatch) -> None:
    configs: list[GatewayConfig] = []

    def fake_run(server: Any, config: GatewayConfig, *rest: Any) -> None:
        configs.append(config)

    monkeypatch.setattr(gateway_cli, "_run_on_uvloop", fake_run)
    for flags, wanted in (((), TOKENIZE_TIMEOUT_S), (("--tokenize-timeout", "1.5"), 1.5)):
        args = build_parser().parse_args(["gateway", *flags])
        assert gateway_cli.run_gateway_command(args) == 0
        assert configs.pop().tokenize_timeout_s == wanted


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
@pytest.mark.parametrize(
    ("command", "flag"),
    [("server", "--gateway-tokenize-timeout"), ("gateway", "--tokenize-timeout")],
)
def test_a_bound_that_is_not_positive_is_one_clear_line(
    command: str, flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "s.db"
    extra = ["--db", str(db)] if command == "server" else []
    assert main([command, flag, value, *extra]) == 1
    assert (
        capsys.readouterr().err.strip()
        == f"llmgw: {flag} must be a positive number of seconds, not {float(value)}"
    )
    assert not db.exists()


@pytest.mark.parametrize(
    ("command", "flag"),
    [("server", "--gateway-tokenize-timeout"), ("gateway", "--tokenize-timeout")],
)
def test_the_help_states_the_real_default(
    command: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert flag in text
    assert f"instead (default: {TOKENIZE_TIMEOUT_S:g})" in text
