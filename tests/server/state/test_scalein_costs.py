"""What retiring each replica costs (llmgw/server/state/scalein.py): unique blocks from the
KV block store, in-flight requests from the gateways, only for deployments with a surplus;
and a record's ``was_ready`` mark kept by the store's JSON."""

from __future__ import annotations

import json
import random
from array import array

from test_kvblocks import PROFILE, _decoded

from llmgw.api.llmgw.v1 import Deployment
from llmgw.server.core.plan import ReplicaPlan, ShardPlan
from llmgw.server.core.reconcile_state import Lifecycle, ReplicaRecord, ScaleInCost
from llmgw.server.state.kvblocks import UNIQUE_SAMPLE_KEYS, DecodedKvDelta, KvBlocks
from llmgw.server.state.replicajson import decode_replica, encode_replica
from llmgw.server.state.scalein import no_in_flight, scale_in_costs


def record(replica_id: str, life: Lifecycle = Lifecycle.ACTIVE) -> ReplicaRecord:
    deployment, _, serial = replica_id.rpartition("-")
    shard = ShardPlan(f"{replica_id}.0", "n1", 0, (), 20000 + int(serial))
    plan = ReplicaPlan(replica_id, deployment, "chat-p", "fp", (shard,))
    return ReplicaRecord(plan, PROFILE, life, int(serial))


def blocks_of(held: dict[str, list[int]]) -> KvBlocks:
    blocks = KvBlocks()
    for replica_id, keys in held.items():
        blocks.apply("n1", replica_id, _decoded(keys, shard_id=f"{replica_id}.0"))
    return blocks


def test_unique_blocks_count_only_what_no_other_replica_of_the_group_holds() -> None:
    blocks = blocks_of({"a-1": [1, 2, 3, 4], "a-2": [3, 4, 5], "a-3": [4, 9], "b-1": [1, 2]})
    assert blocks.unique_blocks(["a-1", "a-2", "a-3"]) == {"a-1": 2, "a-2": 1, "a-3": 1}
    assert blocks.unique_blocks(["a-1", "b-1"]) == {"a-1": 2, "b-1": 0}
    assert blocks.unique_blocks(["a-2"]) == {"a-2": 3}  # alone: everything is its own
    assert blocks.unique_blocks(["a-1", "gone"]) == {"a-1": 4, "gone": 0}


def test_every_rank_of_a_replica_counts_as_the_replica() -> None:
    blocks = blocks_of({"a-1": [1, 2], "a-2": [2]})
    blocks.apply("n1", "a-2", _decoded([1, 7], shard_id="a-2.0", rank=1))
    assert blocks.unique_blocks(["a-1", "a-2"]) == {"a-1": 0, "a-2": 1}


def test_past_the_sample_limit_unique_blocks_are_estimated_from_a_share_of_the_keys() -> None:
    rng = random.Random(16)

    def keys(count: int) -> list[int]:
        return [rng.getrandbits(64) | 1 for _ in range(count)]

    shared = keys(40_000)
    held = {"a-1": shared + keys(30_000), "a-2": shared + keys(3_000), "a-3": keys(12_000)}
    assert sum(map(len, held.values())) > UNIQUE_SAMPLE_KEYS  # sampled: half the key space
    blocks = KvBlocks()
    for replica_id, replica_keys in held.items():
        delta = DecodedKvDelta(f"{replica_id}.0", 0, True, array("Q", replica_keys), array("Q"))
        blocks.apply("n1", replica_id, delta)
    counted = blocks.unique_blocks(list(held))
    truth = {"a-1": 30_000, "a-2": 3_000, "a-3": 12_000}
    assert all(abs(counted[r] - n) <= 0.1 * n for r, n in truth.items()), counted
    assert sorted(counted, key=counted.__getitem__) == ["a-2", "a-3", "a-1"]


def test_costs_are_computed_only_for_deployments_with_a_surplus() -> None:
    records = {r.replica_id: r for r in map(record, ["a-1", "a-2", "a-3", "b-1", "b-2"])}
    records["a-4"] = record("a-4", Lifecycle.RETIRING)  # leaving: not an "other" holder
    blocks = blocks_of({"a-1": [1, 2, 3], "a-2": [3], "a-4": [1, 2], "b-1": [8], "b-2": [8]})
    deployments = {
        "a": Deployment(name="a", profile="chat-p", replicas=2),
        "b": Deployment(name="b", profile="chat-p", replicas=2),
    }
    asked: list[int] = []

    def in_flight() -> dict[str, int]:
        asked.append(1)
        return {"a-1": 4, "a-3": 2, "b-1": 9}

    costs = scale_in_costs(deployments, records, blocks, in_flight)
    assert costs == {
        "a-1": ScaleInCost(unique_blocks=2, in_flight=4),
        "a-2": ScaleInCost(unique_blocks=0, in_flight=0),
        "a-3": ScaleInCost(unique_blocks=0, in_flight=2),
    }
    assert asked == [1]
    # at its count (or deleted: the reconciler retires all of it), nothing is asked
    at_count = {**deployments, "a": Deployment(name="a", profile="chat-p", replicas=3)}
    assert scale_in_costs(at_count, records, blocks, in_flight) == {}
    assert scale_in_costs({}, records, blocks, in_flight) == {}
    assert asked == [1]
    assert scale_in_costs(deployments, records, blocks, no_in_flight)["a-1"].in_flight == 0


def test_a_record_keeps_its_ready_mark_and_an_older_one_reads_as_never_ready() -> None:
    marked = ReplicaRecord(record("a-1").plan, PROFILE, Lifecycle.RETIRED, 1, was_ready=True)
    assert decode_replica(encode_replica(marked)) == marked
    older = json.loads(encode_replica(marked))
    del older["was_ready"]
    assert decode_replica(json.dumps(older)).was_ready is False
    older["was_ready"] = "yes"  # only a JSON true marks it
    assert decode_replica(json.dumps(older)).was_ready is False
