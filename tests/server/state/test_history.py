"""The event history and profile revisions: bounded, pruned, kept across reopens, held in
memory while the disk is full; on SQLite and on PostgreSQL (``db``: tests/pgcluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.api.llmgw.v1 import Deployment, EngineProfile, Shard, ShardState, ShardStatus
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.errors import StoreUnwritable
from llmgw.server.state.history import ACTING, PENDING_MAX, History, affected, revise
from llmgw.server.state.store import Store
from llmgw.server.state.storehistory import REVISIONS_KEPT
from llmgw.server.state.storeschema import AuditRecord, RevisionRecord, StoredDeployment


async def test_events_are_pruned_to_the_newest_and_survive_reopen(db: Path | str) -> None:
    async with Store(db) as store:
        history = History(store, keep=5)
        for i in range(8):
            history.note("shard/a", f"S{i}", f"step {i}", actor="node/n1")
        await history.flush()
        assert await store.count_events() == 5
        history.note("node/n2", "NOT_READY", "no heartbeat", actor="server", warning=True)
        await history.flush()
        assert await store.count_events() == 5
    async with Store(db) as store:
        events = await History(store).recent(["shard/a", "node/n2"])
        assert [e.reason for e in events] == ["S4", "S5", "S6", "S7", "NOT_READY"]
        assert events[-1].warning and not events[0].warning


async def test_recent_reads_the_audit_log_and_the_buffer_newest_limit(db: Path | str) -> None:
    async with Store(db) as store:
        await store.append_audits(
            [
                AuditRecord(1, "alice", "scale", "deployment/web", "ok: scaled"),
                AuditRecord(2, "reconciler", "unplaceable", "deployment/web", "no GPUs"),
                AuditRecord(3, "bob", "drain", "replica/other-1", "refused: no"),
            ]
        )
        history = History(store)
        history.note("web-1.0", "READY", "serving", actor="node/n1")  # not flushed yet
        events = await history.recent(["deployment/web", "web-1.0"])
        assert [(e.actor, e.reason) for e in events] == [
            ("alice", "scale"),
            ("reconciler", "unplaceable"),
            ("node/n1", "READY"),
        ]
        assert [e.warning for e in events] == [False, True, False]
        assert [e.reason for e in await history.recent(["deployment/web"], limit=1)] == [
            "unplaceable"
        ]


async def test_a_full_disk_keeps_events_bounded_in_memory_until_it_takes_writes(
    db: Path | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Store(db) as store:
        history = History(store)
        real = store.append_events

        async def full(*args: object, **kwargs: object) -> None:
            raise StoreUnwritable("state database full/read-only: database or disk is full")

        monkeypatch.setattr(store, "append_events", full)
        for i in range(PENDING_MAX + 7):
            history.note("shard/a", "READY", str(i), actor="node/n1")
        await history.flush(now=True)  # refused: nothing lost but the overflow, nothing raised
        assert history.dropped == 7
        assert await store.count_events() == 0
        assert len(await history.recent(["shard/a"], limit=PENDING_MAX * 2)) == PENDING_MAX
        monkeypatch.setattr(store, "append_events", real)
        await history.flush(now=True)
        assert await store.count_events() == PENDING_MAX
        newest = await history.recent(["shard/a"], limit=1)
        assert newest[0].message == str(PENDING_MAX + 6)


async def test_a_shard_is_noted_when_its_state_changes_only() -> None:
    history = History(None)  # type: ignore[arg-type]  # note() never touches the store

    def shard(state: ShardState, reason: str = "") -> Shard:
        status = ShardStatus(shard_id="web-1.0", state=state, reason=reason)
        return Shard(shard_id="web-1.0", node_id="n1", status=status)

    history.shard_changed("n1", None, shard(ShardState.STARTING))
    history.shard_changed("n1", shard(ShardState.STARTING), shard(ShardState.STARTING, "x"))
    history.shard_changed("n1", shard(ShardState.STARTING), shard(ShardState.FAILED, "exit 1"))
    noted = list(history._pending)
    assert [(e.reason, e.message, e.warning) for e in noted] == [
        ("STARTING", "on node n1", False),
        ("FAILED", "exit 1", True),
    ]
    assert all(e.actor == "node/n1" for e in noted)


def _profile(name: str, *args: str) -> EngineProfile:
    return EngineProfile(name=name, engine="sim", gpu_class="H100", tp=1, args=list(args))


def test_revise_records_a_new_profile_or_new_content_only() -> None:
    a, a2, b = _profile("a"), _profile("a", "--x"), _profile("b")
    web = Deployment(name="web", profile="a", replicas=1)
    token = ACTING.set(("alice", "apply"))
    try:
        (first,) = revise({}, [web], {"a": a}, at_ms=5)
        assert (first.revision, first.profile, first.actor, first.cause) == (
            1,
            "a",
            "alice",
            "apply",
        )
        assert first.fingerprint == profile_fingerprint(a)
        assert EngineProfile.parse(first.content) == a
        assert revise({"web": first}, [web], {"a": a}, at_ms=6) == []
        (second,) = revise({"web": first}, [web], {"a": a2}, at_ms=7)
        assert second.revision == 2 and second.fingerprint == profile_fingerprint(a2)
        moved = Deployment(name="web", profile="b", replicas=1)
        (third,) = revise({"web": second}, [moved], {"a": a2, "b": b}, at_ms=8)
        assert (third.revision, third.profile) == (3, "b")
    finally:
        ACTING.reset(token)


def test_affected_adds_the_stored_deployments_of_a_changed_profile() -> None:
    web = Deployment(name="web", profile="a")
    api = Deployment(name="api", profile="b")
    other = Deployment(name="other", profile="c")
    stored = {"web": web, "api": api, "other": other}
    assert [d.name for d in affected([], ["b"], stored)] == ["api"]
    assert [d.name for d in affected([web], ["a"], stored)] == ["web"]


async def test_revisions_keep_the_newest_per_deployment_and_go_with_it(db: Path | str) -> None:
    async with Store(db) as store:
        for n in range(1, REVISIONS_KEPT + 4):
            record = RevisionRecord("web", n, "a", f"fp{n}", b"", n, "op", "apply")
            await store.save_desired([], [], revisions=[record])
        await store.save_desired(
            [], [], revisions=[RevisionRecord("api", 1, "b", "f", b"", 1, "op", "apply")]
        )
    async with Store(db) as store:
        kept = await store.load_revisions("web")
        assert [r.revision for r in kept] == list(range(4, REVISIONS_KEPT + 4))
        await store.save_desired([], [_stored("web")])
        assert await store.delete_deployment("web")
        assert await store.load_revisions("web") == []
        assert [r.deployment for r in await store.load_revisions()] == ["api"]


def _stored(name: str) -> StoredDeployment:
    return StoredDeployment(name, bytes(Deployment(name=name)), 1)
