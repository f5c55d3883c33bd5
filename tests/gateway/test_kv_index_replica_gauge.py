"""``llmgw_kv_index_replica_blocks{replica}``: the gateway's KV index size per replica."""

from __future__ import annotations

import re

from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.metrics import kv_index_lines
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.kvcache.mirror import block_keys

_GAUGE = re.compile(r'^llmgw_kv_index_replica_blocks\{replica="([^"]*)"\} (\S+)$', re.MULTILINE)


def _target(replica_id: str, kv_events: bool) -> Target:
    return Target(replica_id, "chat", f"http://127.0.0.1:1/{replica_id}", kv_events=kv_events)


async def test_the_gauge_follows_each_replicas_blocks_through_a_reset() -> None:
    table = RoutingTable()
    table.replace_all([_target("a", True), _target("b", True), _target("plain", False)])
    index = KvIndex()
    gateway = Gateway(table, GatewayConfig(engine_poll_s=0), kv_index=index)
    try:

        def gauges() -> dict[str, float]:
            text = gateway.metrics.render({}).decode()
            assert "# TYPE llmgw_kv_index_replica_blocks gauge" in text
            return {replica: float(value) for replica, value in _GAUGE.findall(text)}

        assert gauges() == {"a": 0, "b": 0}  # no label for a replica without KV events
        index.apply("a", False, block_keys(list(range(64)), 16), block_size=16)
        index.apply("b", False, block_keys(list(range(32)), 16), block_size=16)
        assert gauges() == {"a": 4, "b": 2}  # shared prefix blocks count for both
        index.apply("a", True)  # its engine restarted
        assert gauges() == {"a": 0, "b": 2}
        table.remove("b")
        assert gauges() == {"a": 0}
    finally:
        await gateway.stop()


def test_without_replicas_the_family_is_left_out() -> None:
    lines = kv_index_lines(KvIndex().stats())
    assert not any("replica_blocks" in line for line in lines)
    assert "llmgw_kv_index_blocks 0" in lines
