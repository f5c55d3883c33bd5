"""bench/chaoskit/checks.py and bench/chaoskit/observe.py: the chaos run's verdicts from records."""

from __future__ import annotations

from typing import Any

from bench.chaoskit import checks, cluster, faults, load, observe
from llmgw.api.llmgw.v1 import (
    Cluster,
    Deployment,
    EngineProfile,
    Replica,
    Shard,
    ShardState,
    ShardStatus,
)


def _request(
    started: float,
    ended: float,
    model: str = "chat",
    ok: bool = False,
    replica: str = "",
    gateway: str = "gateway",
) -> load.RequestRecord:
    status = 200 if ok or replica else 0
    return load.RequestRecord(started, ended, model, True, ok, status, "cut", replica, gateway)


def _fault(
    kind: str, started: float, ended: float, model: str = "", replica: str = ""
) -> faults.FaultRecord:
    target = "gateway" if kind == "stop-gateway" else "x"  # the first of the load's gateways
    return faults.FaultRecord(kind, target, 42, started, ended, model=model, replica=replica)


def test_a_failure_is_explained_only_by_an_overlapping_fault_on_its_path() -> None:
    kill_chat = _fault("kill-engine", 10.0, 10.0, model="chat")
    hang_gateway = _fault("stop-gateway", 20.0, 23.0)
    kill_server = _fault("kill-server", 30.0, 32.0)
    known = [kill_chat, hang_gateway, kill_server]
    explain = checks.explaining_fault
    assert explain(_request(9.0, 10.2), known, 1.0) is kill_chat  # in flight at the kill
    assert explain(_request(10.5, 10.6), known, 1.0) is kill_chat  # within the slack
    assert explain(_request(12.0, 12.5), known, 1.0) is None  # after it
    assert explain(_request(9.0, 10.2, model="code"), known, 1.0) is None  # another model
    assert explain(_request(22.0, 25.0, model="code"), known, 1.0) is hang_gateway
    assert explain(_request(30.5, 31.0), known, 1.0) is None  # the server is not on the path


def test_a_failure_that_names_its_replica_is_explained_only_by_a_fault_there() -> None:
    kill_chat_0 = _fault("kill-engine", 10.0, 10.0, model="chat", replica="chat-0")
    hang_chat_1 = _fault("stop-engine", 20.0, 23.0, model="chat", replica="chat-1")
    hang_gateway = _fault("stop-gateway", 30.0, 33.0)
    known = [kill_chat_0, hang_chat_1, hang_gateway]
    explain = checks.explaining_fault
    assert explain(_request(9.0, 10.2, replica="chat-0"), known, 1.0) is kill_chat_0
    assert explain(_request(9.0, 10.2, replica="chat-1"), known, 1.0) is None  # not its engine
    assert explain(_request(9.0, 10.2), known, 1.0) is kill_chat_0  # no answer: by model
    assert explain(_request(21.0, 24.0, replica="chat-1"), known, 1.0) is hang_chat_1
    assert explain(_request(21.0, 24.0, replica="chat-0"), known, 1.0) is None
    assert explain(_request(31.0, 32.0, replica="chat-0"), known, 1.0) is hang_gateway
    summary = checks.check_requests([_request(9.0, 10.2, replica="chat-1")], known, 1.0)
    assert not summary.passed
    assert summary.details[0].endswith("chat stream via gateway on chat-1: cut")


def test_a_stopped_gateway_explains_only_the_failures_of_requests_through_it() -> None:
    hang_1 = faults.FaultRecord("stop-gateway", "gateway", 41, 10.0, 13.0)
    hang_2 = faults.FaultRecord("stop-gateway", "gateway-2", 42, 20.0, 23.0)
    known = [hang_1, hang_2]
    explain = checks.explaining_fault
    assert explain(_request(11.0, 14.0, gateway="gateway"), known, 1.0) is hang_1
    assert explain(_request(11.0, 14.0, gateway="gateway-2"), known, 1.0) is None
    assert explain(_request(21.0, 24.0, gateway="gateway-2"), known, 1.0) is hang_2
    assert explain(_request(21.0, 24.0, replica="chat-0"), known, 1.0) is None  # via gateway
    assert explain(_request(21.0, 24.0, gateway=""), known, 1.0) is None  # no gateway named
    failed = [_request(11.0, 14.0, gateway="gateway"), _request(21.0, 22.0, gateway="gateway")]
    verdict = checks.check_requests(failed, known, 1.0)
    assert not verdict.passed and "(1 during stop-gateway), 1 unexplained" in verdict.summary
    assert verdict.details[0].startswith("t=10.0-11.0s chat stream via gateway on no replica")


def test_the_request_check_fails_on_an_unexplained_failure_and_counts_by_cause() -> None:
    known = [_fault("kill-engine", 10.0, 10.0, model="chat")]
    records = [_request(0.0, 1.0, ok=True), _request(9.5, 10.1)]
    verdict = checks.check_requests(records, known, 1.0)
    assert verdict.passed and "1 during kill-engine" in verdict.summary
    verdict = checks.check_requests([*records, _request(40.0, 41.0)], known, 1.0)
    assert not verdict.passed and "1 unexplained" in verdict.summary
    assert len(verdict.details) == 1 and "cut" in verdict.details[0]


def _sample(at: float, **kw: Any) -> observe.Sample:
    fields = {"reachable": True, "ready": (), "server_twins": (), "process_twins": ()}
    return observe.Sample(at=at, orphans=kw.pop("orphans", ()), engines=5, **{**fields, **kw})


def test_copies_fail_on_any_twin_and_on_an_engine_unmanaged_too_long() -> None:
    calm = [_sample(t) for t in range(10)]
    assert checks.check_copies(calm, 15.0).passed
    twin = [*calm, _sample(10, process_twins=("chat-1 rank 0: pid 1@a, pid 2@b",))]
    assert not checks.check_copies(twin, 15.0).passed
    brief = [_sample(t, orphans=(7,)) for t in range(5)] + [_sample(6)]
    assert checks.check_copies(brief, 15.0).passed  # an engine between spawn and record
    lasting = [_sample(t, orphans=(7,)) for t in range(20)] + [_sample(21)]
    assert not checks.check_copies(lasting, 15.0).passed
    assert not checks.check_copies([*calm, _sample(11, orphans=(7,))], 15.0).passed  # at the end


def test_convergence_is_measured_from_the_last_fault_against_the_bound() -> None:
    assert checks.check_convergence(100.0, 130.0, 60.0).passed
    assert not checks.check_convergence(100.0, 170.0, 60.0).passed
    assert not checks.check_convergence(100.0, None, 60.0).passed


def test_desired_state_must_come_back_as_applied() -> None:
    profile = EngineProfile(name="p", engine="sim", gpu_class="H100", tp=1, kv_events=True)
    applied = ([Deployment(name="chat", profile="p", replicas=3)], [profile])
    held = ([Deployment(name="chat", profile="p", replicas=3, updated_unix_ms=5)], [profile])
    assert checks.check_desired(applied, held).passed
    fewer = ([Deployment(name="chat", profile="p", replicas=2)], [profile])
    assert not checks.check_desired(applied, fewer).passed
    changed = EngineProfile(name="p", engine="sim", gpu_class="H100", tp=1, kv_events=False)
    assert not checks.check_desired(applied, (held[0], [changed])).passed
    assert not checks.check_desired(applied, ([], [profile])).passed
    assert not checks.check_desired(applied, None).passed


def test_twins_in_the_servers_report_and_among_processes() -> None:
    def shard(shard_id: str, node: str, state: ShardState) -> Shard:
        status = ShardStatus(shard_id=shard_id, replica_id="chat-1", rank=0, state=state)
        return Shard(shard_id=shard_id, replica_id="chat-1", node_id=node, status=status)

    one = Cluster(shards=[shard("chat-1.0", "a", ShardState.READY)])
    assert observe.server_twins(one) == []
    two = Cluster(shards=[*one.shards, shard("chat-1.0b", "b", ShardState.LOADING)])
    assert observe.server_twins(two) == ["chat-1 rank 0: chat-1.0@a, chat-1.0b@b"]
    gone = Cluster(shards=[*one.shards, shard("chat-1.0b", "b", ShardState.STOPPED)])
    assert observe.server_twins(gone) == []
    engine = cluster.EngineProc
    procs = [engine(1, "a", "chat-1.0", "chat-1", 0, "chat", False),
             engine(2, "b", "chat-1.0", "chat-1", 0, "chat", True),
             engine(3, "", "", "", -1, "chat", False)]  # fmt: skip
    assert observe.process_twins(procs) == ["chat-1 rank 0: pid 1@a, pid 2@b"]
    assert observe.process_twins(procs[::2]) == []


def test_ready_counts_and_kv_differences() -> None:
    found = Cluster(
        deployments=[Deployment(name="chat"), Deployment(name="code")],
        replicas=[Replica(replica_id="chat-1", deployment="chat", state=ShardState.READY),
                  Replica(replica_id="chat-2", deployment="chat", state=ShardState.LOADING)],
    )  # fmt: skip
    assert observe.ready_by_deployment(found) == {"chat": 1, "code": 0}
    same = observe.KvReading({"chat-1": {"a", "b"}}, {"gw": {"chat-1": {"a", "b"}}})
    assert same.differences() == []
    short = observe.KvReading({"chat-1": {"a", "b"}}, {"gw": {"chat-1": {"a"}, "old": {"c"}}})
    assert short.differences() == [
        "gw: chat-1: 1 of the engine's 2 blocks missing from the index, 0 indexed blocks not "
        "in the engine",
        "gw: old: 1 blocks indexed for a replica with no READY KV engine",
    ]
    assert observe.KvReading({"chat-1": None}, {"gw": None}).differences() == [
        "chat-1: the engine's cache could not be read",
        "gw: its index could not be read",
    ]
    verdict = checks.check_kv(same.differences(), {"chat-1": 2}, ("gateway", "gateway-2"))
    assert verdict.passed and "(2 gateways: gateway, gateway-2): each index" in verdict.summary
    two = observe.KvReading({"chat-1": {"a"}}, {"gw": {"chat-1": {"a"}}, "gw-2": {}})
    assert two.differences() == [
        "gw-2: chat-1: 1 of the engine's 1 blocks missing from the index, 0 indexed blocks not "
        "in the engine"
    ]  # a second gateway's index is held to the engines too
    assert not checks.check_kv(two.differences(), {"chat-1": 1}, tuple(two.indexes)).passed


def test_convergence_time_is_where_the_last_run_at_count_begins() -> None:
    counts = {"chat": 3}
    at, short = (("chat", 3),), (("chat", 2),)
    samples = [_sample(0, ready=at), _sample(1, ready=short), _sample(2, ready=at),
               _sample(3, ready=short), _sample(4, reachable=False), _sample(5, ready=at),
               _sample(6, ready=at)]  # fmt: skip
    assert checks.converged_at(samples, 0.5, counts) == 5
    assert checks.converged_at(samples, 5.5, counts) == 6
    assert checks.converged_at(samples[:4], 0.5, counts) is None  # not at count at the end


def test_recovery_is_timed_for_faults_that_took_a_deployment_below_its_count() -> None:
    counts = {"chat": 3}
    at, short = (("chat", 3),), (("chat", 2),)
    known = [_fault("kill-engine", 1.0, 1.0), _fault("stop-server", 3.0, 5.0)]
    samples = [_sample(1.2, ready=at), _sample(1.5, ready=short), _sample(2.0, ready=at),
               _sample(4.0, ready=at), _sample(5.5, ready=short)]  # fmt: skip
    assert checks.recovery_times(known, samples, counts) == [1.0, None]  # 2nd: not back yet
    later = [*samples, _sample(7.0, ready=at)]
    assert checks.recovery_times(known, later, counts) == [1.0, 2.0]
    assert checks.recovery_times(known[:1], samples[:1], counts) == [None]  # never below
    unanswered = [_sample(1.2, reachable=False), _sample(1.7, ready=at)]
    assert checks.recovery_times(known[:1], unanswered, counts) == [None]  # no view: no dip
