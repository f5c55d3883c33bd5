"""RoutingTable: READY-only candidates per model, versions, removal callbacks; LoadTracker."""

from __future__ import annotations

import logging

import pytest

from llmgw.gateway import LoadTracker, RoutingTable, Target


def target(replica_id: str, model: str = "m", *, ready: bool = True) -> Target:
    return Target(replica_id, model, f"http://127.0.0.1:{9000 + len(replica_id)}", ready=ready)


def watch(table: RoutingTable) -> list[str]:
    removed: list[str] = []
    table.on_removed(removed.append)
    return removed


def test_candidates_are_ready_targets_of_the_model_sorted_by_id() -> None:
    table = RoutingTable(
        [target("r3"), target("r1"), target("r2", ready=False), target("x1", "other")]
    )
    assert [t.replica_id for t in table.candidates("m")] == ["r1", "r3"]
    assert [t.replica_id for t in table.candidates("other")] == ["x1"]
    assert table.candidates("unknown") == ()
    assert table.models() == ("m", "other")
    assert [t.replica_id for t in table.targets()] == ["r1", "r2", "r3", "x1"]


def test_candidates_is_a_precomputed_tuple() -> None:
    table = RoutingTable([target("r1"), target("r2")])
    assert table.candidates("m") is table.candidates("m")


def test_models_lists_only_models_with_a_ready_replica() -> None:
    table = RoutingTable([target("r1", "a", ready=False), target("r2", "b")])
    assert table.models() == ("b",)
    table.upsert(target("r1", "a"))
    assert table.models() == ("a", "b")


def test_upsert_and_remove_update_lookups_and_bump_version() -> None:
    table = RoutingTable()
    assert table.version == 0
    table.upsert(target("r1"))
    assert table.version == 1
    assert table.get("r1") == target("r1")
    table.upsert(target("r1"))  # unchanged: no new version
    assert table.version == 1
    table.upsert(target("r1", ready=False))
    assert table.version == 2
    assert table.candidates("m") == ()
    table.remove("r1")
    assert table.version == 3
    assert table.get("r1") is None
    table.remove("r1")
    assert table.version == 3


def test_on_removed_fires_for_removal() -> None:
    table = RoutingTable([target("r1"), target("r2")])
    removed = watch(table)
    table.remove("r1")
    assert removed == ["r1"]


def test_on_removed_fires_when_ready_becomes_not_ready() -> None:
    table = RoutingTable([target("r1"), target("r2")])
    removed = watch(table)
    table.upsert(target("r2", ready=False))
    assert removed == ["r2"]
    assert [t.replica_id for t in table.candidates("m")] == ["r1"]
    table.upsert(target("r2", ready=False))
    table.upsert(target("r2"))  # back to READY: nothing removed
    assert removed == ["r2"]


def test_on_removed_fires_when_a_replica_changes_model() -> None:
    table = RoutingTable([target("r1", "a")])
    removed = watch(table)
    table.upsert(target("r1", "b"))
    assert removed == ["r1"]


def test_on_removed_does_not_fire_for_url_change_or_new_replica() -> None:
    table = RoutingTable([target("r1")])
    removed = watch(table)
    table.upsert(Target("r1", "m", "http://127.0.0.1:1"))
    table.upsert(target("r2"))
    assert removed == []


def test_replace_all_reports_every_replica_gone_and_sees_state_after_change() -> None:
    table = RoutingTable([target("r1"), target("r2"), target("r3")])
    seen: list[tuple[str, tuple[str, ...]]] = []
    table.on_removed(
        lambda rid: seen.append((rid, tuple(t.replica_id for t in table.candidates("m"))))
    )
    table.replace_all([target("r2"), target("r4")])
    assert seen == [("r1", ("r2", "r4")), ("r3", ("r2", "r4"))]


def test_a_failing_callback_does_not_stop_the_table_or_other_callbacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    table = RoutingTable([target("r1")])

    def broken(replica_id: str) -> None:
        raise RuntimeError("listener bug")

    table.on_removed(broken)
    removed = watch(table)
    with caplog.at_level(logging.ERROR):
        table.remove("r1")
    assert removed == ["r1"]
    assert table.get("r1") is None
    assert "on_removed callback failed" in caplog.text


def test_load_tracker_counts_in_flight() -> None:
    load = LoadTracker()
    load.acquire("r1")
    load.acquire("r1")
    load.acquire("r2")
    assert load.in_flight("r1") == 2
    assert load.snapshot() == {"r1": 2, "r2": 1}
    load.release("r1")
    load.release("r2")
    assert load.snapshot() == {"r1": 1}
    assert load.in_flight("r2") == 0


def test_load_tracker_ignores_release_without_acquire(caplog: pytest.LogCaptureFixture) -> None:
    load = LoadTracker()
    with caplog.at_level(logging.WARNING):
        load.release("r1")
    assert load.in_flight("r1") == 0
    assert load.snapshot() == {}
    assert "release without acquire" in caplog.text


def test_scalable_models_are_replaced_whole_and_changes_are_told() -> None:
    table = RoutingTable([Target("r1", "m", "http://h:1", ready=False)])
    told: list[tuple[bool, tuple[str, ...]]] = []
    table.on_changed(lambda: told.append((table.scalable("m"), tuple(table.models()))))
    table.set_scalable(["m", "n"])
    table.set_scalable(["n", "m"])  # the same set: nothing changed, nothing told
    assert table.scalable("m") and table.scalable("n") and not table.scalable("x")
    table.upsert(Target("r1", "m", "http://h:1", ready=True))
    table.upsert(Target("r1", "m", "http://h:1", ready=True))  # unchanged: not told
    table.set_scalable([])
    assert table.scalable_models() == frozenset()
    assert told == [(True, ()), (True, ("m",)), (False, ("m",))]  # each after the change
