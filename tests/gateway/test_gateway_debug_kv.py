"""``GET /debug/kv_index`` (``llmgw gateway --debug-kv-index``): the index's keys per replica."""

from __future__ import annotations

import httpx

from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.table import RoutingTable
from llmgw.kvcache.mirror import block_keys

CONFIG = GatewayConfig(host="127.0.0.1", port=0, engine_poll_s=0, debug_kv_index=True)


async def _get(gateway: Gateway, path: str) -> httpx.Response:
    host, port = await gateway.start()
    async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
        return await client.get(path)


async def test_it_lists_every_replicas_keys_in_hex_and_follows_a_reset() -> None:
    index = KvIndex()
    a, b = block_keys(list(range(64)), 16), block_keys(list(range(32)) + [7] * 16, 16)
    index.apply("a", False, a, block_size=16)
    index.apply("b", False, b, block_size=16)
    index.apply("a", False, removed_keys=a[-1:])
    index.apply("b", True)  # its engine restarted: nothing left
    index.apply("b", False, b[:1], block_size=16)
    gateway = Gateway(RoutingTable(), CONFIG, kv_index=index)
    try:
        response = await _get(gateway, "/debug/kv_index")
    finally:
        await gateway.stop()
    assert response.status_code == 200
    replicas = response.json()["replicas"]
    assert set(replicas) == {"a", "b"}
    assert replicas["a"] == {"block_size": 16, "keys": [f"{k:016x}" for k in sorted(a[:-1])]}
    assert replicas["b"]["keys"] == [f"{b[0]:016x}"]


async def test_it_is_not_served_unless_asked_for() -> None:
    index = KvIndex()
    index.apply("a", False, block_keys(list(range(16)), 16), block_size=16)
    gateway = Gateway(RoutingTable(), GatewayConfig(port=0, engine_poll_s=0), kv_index=index)
    try:
        response = await _get(gateway, "/debug/kv_index")
    finally:
        await gateway.stop()
    assert response.status_code == 404
    assert "keys" not in response.text
