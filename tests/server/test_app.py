"""``llmgw server`` refuses to serve beyond loopback with authentication off (the decision)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.server.app import Listen, ServerConfig, unauthenticated_exposure

LOOPBACK = Listen("127.0.0.1", 50051)


def config(**changes: object) -> ServerConfig:
    fields: dict[str, object] = {
        "grpc_listen": LOOPBACK,
        "http_listen": Listen("localhost", 8080),
        "gateway_listen": Listen("::1", 8000),
        "db_path": Path("/var/lib/llmgw/server.db"),
        **changes,
    }
    return ServerConfig(**fields)  # type: ignore[arg-type]


def test_loopback_only_serves_without_tokens() -> None:
    assert unauthenticated_exposure(config(), auth_on=False) is None
    assert unauthenticated_exposure(config(gateway_listen=None), auth_on=False) is None


@pytest.mark.parametrize(
    ("field", "flag", "listen"),
    [
        ("grpc_listen", "--grpc-listen", Listen("0.0.0.0", 50051)),
        ("http_listen", "--http-listen", Listen("::", 8080)),
        ("gateway_listen", "--gateway-listen", Listen("10.0.0.5", 8000)),
        ("http_listen", "--http-listen", Listen("ctl.example", 8080)),  # a name may be anywhere
    ],
)
def test_beyond_loopback_without_tokens_is_refused_naming_the_flag(
    field: str, flag: str, listen: Listen
) -> None:
    message = unauthenticated_exposure(config(**{field: listen}), auth_on=False)
    assert message is not None
    assert f"{flag} {listen}" in message
    assert "llmgw token create --role admin --db /var/lib/llmgw/server.db" in message
    assert "--insecure-no-auth" in message and "\n" not in message


def test_a_token_or_insecure_no_auth_lets_it_serve_beyond_loopback() -> None:
    exposed = config(grpc_listen=Listen("0.0.0.0", 50051), http_listen=Listen("::", 8080))
    assert unauthenticated_exposure(exposed, auth_on=True) is None
    insecure = config(grpc_listen=Listen("0.0.0.0", 50051), insecure_no_auth=True)
    assert unauthenticated_exposure(insecure, auth_on=False) is None
