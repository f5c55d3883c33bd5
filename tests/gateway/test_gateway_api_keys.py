"""Client API keys on the gateway (llmgw.gateway.apikeys, ``--api-key-file``).

The gateway runs on 127.0.0.1:0 in front of a tiny recording upstream: /v1 needs one of the
keys (401 in OpenAI's error shape otherwise), /healthz and /metrics stay open, a request
with a good key is routed and reaches the replica with the replica's key and never the
client's, and no key reaches a log. The CLI side reads key files and the environment.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from llmgw.cli.apikeys import ENV, gateway_api_keys
from llmgw.cli.errors import CliError
from llmgw.cli.main import build_parser
from llmgw.gateway.apikeys import API_KEY_ENV, UNAUTHORIZED_BODY, ApiKeys, parse_key_file
from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.routing.table import RoutingTable, Target

KEYS = ("sk-client-one-6f1d2c", "sk-client-two-93ab47")
REPLICA_KEY = "sk-replica-r1-0c7e55"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# --- the pure parts ------------------------------------------------------------------------


def test_key_file_skips_comments_and_blank_lines() -> None:
    text = "# clients\n\n  sk-client-one-6f1d2c  \n#sk-old\nsk-client-two-93ab47\n"
    assert parse_key_file(text) == KEYS


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "holds no key"),
        ("# only a comment\n\n", "holds no key"),
        ("sk-ok\nsk bad-with-space\n", "line 2: a key must be printable ASCII without spaces"),
        ("sk-caf\u00e9\n", "line 1: a key must be printable ASCII"),
    ],
)
def test_a_bad_key_file_is_refused_without_repeating_the_key(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as caught:
        parse_key_file(text)
    assert "bad-with-space" not in str(caught.value) and "caf" not in str(caught.value)


@pytest.mark.parametrize(
    ("header", "allowed"),
    [
        (b"Bearer sk-client-one-6f1d2c", True),
        (b"bearer sk-client-two-93ab47", True),  # the scheme is case-insensitive
        (b"  Bearer   sk-client-two-93ab47  ", True),
        (b"Bearer sk-client-one-6f1d2", False),  # a prefix of a key is not the key
        (b"Bearer sk-client-one-6f1d2c-and-more", False),
        (b"Basic sk-client-one-6f1d2c", False),
        (b"sk-client-one-6f1d2c", False),
        (b"Bearer ", False),
        (None, False),
    ],
)
def test_allows_only_a_bearer_of_one_of_the_keys(header: bytes | None, allowed: bool) -> None:
    assert ApiKeys.of(KEYS).allows(header) is allowed


def test_only_digests_are_kept_and_no_repr_shows_a_key() -> None:
    keys = ApiKeys.of(KEYS)
    assert len(keys.digests) == 2 and all(len(d) == 32 for d in keys.digests)
    config = GatewayConfig(api_keys=keys)
    for text in (repr(keys), repr(config)):
        assert not [k for k in KEYS if k in text]
    assert "ApiKeys(2 key(s))" in repr(config)


def test_which_paths_need_a_key() -> None:
    keys = ApiKeys.of(KEYS)
    assert [p for p in ("/v1/models", "/v1/chat/completions", "/v1", "/v1x") if keys.guards(p)]
    assert not [p for p in ("/healthz", "/metrics", "/debug/kv_index") if keys.guards(p)]
    assert not ApiKeys().guards("/v1/models")  # no keys: open, as vLLM without --api-key


def test_the_401_body_has_openais_error_shape() -> None:
    error = json.loads(UNAUTHORIZED_BODY)["error"]
    assert error["type"] == "AuthenticationError" and error["code"] == 401
    assert error["param"] is None and "Authorization: Bearer" in error["message"]


# --- the gateway over loopback -------------------------------------------------------------


class Upstream:
    """A replica stand-in that answers a chat completion and records the headers it got."""

    def __init__(self) -> None:
        self.authorizations: list[str] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in head[1:] if ": " in line)
        await reader.readexactly(int(headers.get("content-length", "0")))
        self.authorizations.append(headers.get("authorization", ""))
        body = b'{"object":"chat.completion","choices":[]}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    try:
        yield up
    finally:
        await up.stop()


async def serve(upstream: Upstream, keys: ApiKeys) -> tuple[Gateway, str]:
    table = RoutingTable([Target("r1", "m", await upstream.start(), api_key=REPLICA_KEY)])
    config = GatewayConfig(port=0, policy="round_robin", engine_poll_s=0, api_keys=keys)
    gateway = Gateway(table, config)
    host, port = await gateway.start()
    return gateway, f"http://{host}:{port}"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_v1_needs_a_key_and_health_and_metrics_stay_open(
    upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    gateway, url = await serve(upstream, ApiKeys.of(KEYS))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            refused = [
                await http.get("/v1/models"),
                await http.get("/v1/models", headers=bearer("sk-wrong")),
                await http.post("/v1/chat/completions", json=CHAT),
                await http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-wrong")),
                await http.get("/v1/no-such-route"),  # refused before routing, as in vLLM
            ]
            assert [r.status_code for r in refused] == [401] * 5
            assert all(r.content == UNAUTHORIZED_BODY for r in refused)
            assert upstream.authorizations == []  # nothing reached the replica
            assert (await http.get("/healthz")).status_code == 200
            metrics = await http.get("/metrics")
            assert metrics.status_code == 200
            counted = 'llmgw_requests_total{model="unknown",route="unknown",status="401"} 5'
            assert counted in metrics.text

            models = await http.get("/v1/models", headers=bearer(KEYS[1]))
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"
            chat = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(KEYS[0]))
            assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    finally:
        await gateway.stop()
    assert upstream.authorizations == [f"bearer {REPLICA_KEY}"]  # never the client's key
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert not [k for k in (*KEYS, "sk-wrong", REPLICA_KEY) if k in logged]


async def test_without_keys_the_gateway_is_open(upstream: Upstream) -> None:
    gateway, url = await serve(upstream, ApiKeys())
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            assert (await http.get("/v1/models")).status_code == 200
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
    finally:
        await gateway.stop()


# --- the command line ----------------------------------------------------------------------


def test_env_name_agrees() -> None:
    assert ENV == API_KEY_ENV == "LLMGW_GATEWAY_API_KEY"


def test_keys_from_a_file_else_the_environment_else_none(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# two clients\n" + "\n".join(KEYS) + "\n")
    env = {ENV: "sk-from-env-1c2d"}
    from_file = gateway_api_keys(path, "--api-key-file", env)
    assert from_file == ApiKeys.of(KEYS)  # the file wins over the environment
    assert from_file.allows(b"Bearer " + KEYS[0].encode())
    from_env = gateway_api_keys(None, "--api-key-file", env)
    assert from_env.allows(b"Bearer sk-from-env-1c2d") and len(from_env.digests) == 1
    assert gateway_api_keys(None, "--api-key-file", {}) == ApiKeys()
    assert gateway_api_keys(None, "--api-key-file", {ENV: "  "}) == ApiKeys()


def test_a_bad_key_file_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(CliError, match=r"--api-key-file .*/missing: cannot read it"):
        gateway_api_keys(tmp_path / "missing", "--api-key-file", {})
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    with pytest.raises(CliError, match=r"--gateway-api-key-file .*/empty: it holds no key"):
        gateway_api_keys(empty, "--gateway-api-key-file", {})
    with pytest.raises(CliError, match=rf"\${ENV}: line 1: a key must be printable"):
        gateway_api_keys(None, "--api-key-file", {ENV: "two words"})


def test_server_and_gateway_take_the_flag(tmp_path: Path) -> None:
    parser = build_parser()
    server = parser.parse_args(["server", "--gateway-api-key-file", str(tmp_path / "k")])
    assert server.gateway_api_key_file == tmp_path / "k"
    gateway = parser.parse_args(["gateway", "--api-key-file", str(tmp_path / "k")])
    assert gateway.api_key_file == tmp_path / "k"
    assert parser.parse_args(["gateway"]).api_key_file is None
