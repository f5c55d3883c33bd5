"""``llmgw server --grpc-*``: the native port's connection limits, from flags to the config."""

from __future__ import annotations

import pytest
from serverflags import server_config

from llmgw.cli.main import main
from llmgw.server.wire.grpcport import ConnectionLimits


def _limits(monkeypatch: pytest.MonkeyPatch, *flags: str) -> ConnectionLimits:
    return server_config(monkeypatch, *flags).grpc_limits


def test_defaults_and_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _limits(monkeypatch) == ConnectionLimits(10.0, 300.0, 16384, 1024)
    given = _limits(
        monkeypatch,
        *("--grpc-handshake-timeout", "2", "--grpc-idle-timeout", "30"),
        *("--grpc-max-connections", "100", "--grpc-max-connections-per-peer", "5"),
    )
    assert given == ConnectionLimits(2.0, 30.0, 100, 5)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--grpc-handshake-timeout", "0"),
        ("--grpc-idle-timeout", "inf"),
        ("--grpc-idle-timeout", "nan"),
        ("--grpc-max-connections", "0"),
        ("--grpc-max-connections-per-peer", "-1"),
    ],
)
def test_a_bad_value_is_refused_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["server", flag, value]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"llmgw: {flag} must be") and "Traceback" not in err
