"""The chaos run's verdicts, as pure functions of what was recorded.

1. **Desired state**: the deployments and profiles the server holds at the end equal the
   ones applied (no deployment, count, profile or profile field lost or changed).
2. **Never two copies**: no sample saw one replica rank running twice (as two shards in
   the server's report, or as two live engine processes), and no engine process that no
   agent record names outlived ``orphan_grace_s`` (nor was left at the end).
3. **Back at count**: every deployment had its count of READY replicas within
   ``bound_s`` after the last fault ended, and kept it (measured on the sampler's record).
4. **Failed requests**: each one overlapped (within ``slack_s``) a fault on a process on
   its path: the gateway it went through (hung; a fault on another gateway explains
   nothing), or an engine (killed or hung) of the replica that answered
   it (the gateway's ``x-llmgw-replica``), or of its model when no answer came (the gateway
   may have tried several). The server and the agents are not on a request's path: a fault
   there explains nothing.
5. **KV index**: each gateway's index equals each KV-events engine's own cache.
6. **State disk**: after each time the server's state disk was filled (``fill-disk``), the
   server's ``/healthz`` was 200 again (it takes writes again by itself) within the bound.
7. **Duplicate agents refused**: every duplicate agent (a copy of a registered agent's
   state dir and node id) was refused by the server naming the holder, and never registered.
8. **One leader at a time** (several servers): no sample saw two servers say they lead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.chaoskit.faults import FaultRecord
from bench.chaoskit.load import RequestRecord
from bench.chaoskit.observe import Sample
from llmgw.api.llmgw.v1 import Deployment, EngineProfile

ON_PATH_KINDS = frozenset({"kill-engine", "stop-engine", "stop-gateway"})
GATEWAY_KINDS = frozenset({"stop-gateway"})  # their record's target: the gateway's name


@dataclass(frozen=True, slots=True)
class Check:
    """One verdict: a name, pass or fail, one line, and the evidence."""

    name: str
    passed: bool
    summary: str
    details: tuple[str, ...] = ()


def _deployment_fields(d: Deployment) -> tuple[object, ...]:
    return (d.name, d.profile, d.replicas, d.pool, tuple(sorted(d.labels.items())))


def _profile_fields(p: EngineProfile) -> dict[str, object]:
    return p.to_dict()


def check_desired(
    applied: tuple[Sequence[Deployment], Sequence[EngineProfile]],
    held: tuple[Sequence[Deployment], Sequence[EngineProfile]] | None,
) -> Check:
    name = "desired state kept"
    if held is None:
        return Check(name, False, "the server did not answer at the end")
    want_d = {d.name: _deployment_fields(d) for d in applied[0]}
    got_d = {d.name: _deployment_fields(d) for d in held[0]}
    want_p = {p.name: _profile_fields(p) for p in applied[1]}
    got_p = {p.name: _profile_fields(p) for p in held[1] if p.name in want_p}
    details = [
        f"deployment {n}: applied {want_d.get(n)}, held {got_d.get(n)}"
        for n in sorted(want_d.keys() | got_d.keys())
        if want_d.get(n) != got_d.get(n)
    ]
    details += [
        f"profile {n}: applied {want_p[n]}, held {got_p.get(n)}"
        for n in sorted(want_p)
        if want_p[n] != got_p.get(n)
    ]
    summary = f"{len(want_d)} deployments and {len(want_p)} profiles" + (
        " as applied" if not details else f": {len(details)} differ"
    )
    return Check(name, not details, summary, tuple(details))


def check_duplicates(logs: Mapping[str, str]) -> Check:
    """Each duplicate agent's log (by its name): refused as a duplicate, never registered."""
    details = []
    for name, text in sorted(logs.items()):
        if "registered with" in text:
            details.append(f"{name} registered: it took its node over")
        elif "ALREADY_EXISTS" not in text or "held by a live agent" not in text:
            details.append(f"{name} was not refused as a duplicate")
    summary = (
        f"{len(logs)} duplicate agents, each refused naming the holder"
        if not details
        else f"{len(details)} of {len(logs)} duplicate agents not refused"
    )
    return Check("duplicate agents refused", not details, summary, tuple(details))


def check_copies(samples: Sequence[Sample], orphan_grace_s: float) -> Check:
    twins = [(s.at, t) for s in samples for t in (*s.server_twins, *s.process_twins)]
    first_seen: dict[int, float] = {}
    lingering: dict[int, float] = {}
    for s in samples:
        for pid in s.orphans:
            age = s.at - first_seen.setdefault(pid, s.at)
            if age > orphan_grace_s:
                lingering[pid] = age
    left = samples[-1].orphans if samples else ()
    start = samples[0].at if samples else 0.0
    details = [f"t={at - start:.1f}s: {what}" for at, what in twins[:20]]
    details += [f"engine pid {pid}: no agent record names it for {age:.0f}s+"
                for pid, age in sorted(lingering.items())]  # fmt: skip
    details += [f"engine pid {pid}: unmanaged at the end" for pid in left]
    reachable = sum(s.reachable for s in samples)
    summary = (
        f"{len(samples)} samples ({reachable} with the server's view): "
        f"{len({t for _, t in twins})} duplicate replica ranks, {len(lingering)} unmanaged engines"
    )
    return Check("never two copies", not details, summary, tuple(details))


def _at_count(sample: Sample, counts: Mapping[str, int]) -> bool:
    return sample.reachable and dict(sample.ready) == dict(counts)


def recovery_times(
    faults: Sequence[FaultRecord], samples: Sequence[Sample], counts: Mapping[str, int]
) -> list[float | None]:
    """For each fault that took a deployment below its count (a sample of the server's
    view not at count, from its start until the next fault's), the seconds from its end
    until a sample at count again (0.0 when that came before its end); None for a fault that
    took none below (or whose cluster did not come back before the next fault). Samples
    without the server's view say nothing either way."""
    out: list[float | None] = []
    for i, fault in enumerate(faults):
        limit = faults[i + 1].started if i + 1 < len(faults) else float("inf")
        window = [s for s in samples if fault.started <= s.at <= limit and s.reachable]
        dip = next((j for j, s in enumerate(window) if not _at_count(s, counts)), None)
        back = None if dip is None else next(
            (s.at for s in window[dip:] if _at_count(s, counts)), None
        )  # fmt: skip
        out.append(None if back is None else max(0.0, back - fault.ended))
    return out


def converged_at(
    samples: Sequence[Sample], since: float, counts: Mapping[str, int]
) -> float | None:
    """When the last unbroken run of samples at count (every deployment with its count of
    READY replicas, as the server said) began, after ``since``; None if the last is not."""
    start: float | None = None
    for sample in samples:
        if sample.at < since:
            continue
        if not _at_count(sample, counts):
            start = None
        elif start is None:
            start = sample.at
    return start


def check_convergence(last_fault_end: float, converged_at: float | None, bound_s: float) -> Check:
    name = "back at count"
    if converged_at is None:
        return Check(name, False, f"not every deployment was at its count within {bound_s:g}s")
    took = max(0.0, converged_at - last_fault_end)
    verdict = "within" if took <= bound_s else "over"
    return Check(
        name,
        took <= bound_s,
        f"{took:.1f}s after the last fault ({verdict} the {bound_s:g}s bound)",
    )


def explaining_fault(
    request: RequestRecord, faults: Sequence[FaultRecord], slack_s: float
) -> FaultRecord | None:
    """The fault on ``request``'s path that it overlapped, if any."""
    for fault in faults:
        if fault.kind not in ON_PATH_KINDS:
            continue
        if not _on_path(request, fault):
            continue
        if request.started <= fault.ended + slack_s and request.ended >= fault.started:
            return fault
    return None


def _on_path(request: RequestRecord, fault: FaultRecord) -> bool:
    """A gateway fault: on the gateway the request went through; an engine fault: on the
    replica that answered it, or (no answer came) on an engine of its model."""
    if fault.kind in GATEWAY_KINDS:
        return fault.target == request.gateway
    if request.replica:
        return fault.replica == request.replica
    return fault.model == request.model


def check_requests(
    records: Sequence[RequestRecord], faults: Sequence[FaultRecord], slack_s: float
) -> Check:
    failed = [r for r in records if not r.ok]
    causes: Counter[str] = Counter()
    unexplained: list[RequestRecord] = []
    for request in failed:
        fault = explaining_fault(request, faults, slack_s)
        if fault is None:
            unexplained.append(request)
        else:
            causes[fault.kind] += 1
    start = min((r.started for r in records), default=0.0)
    details = [
        f"t={r.started - start:.1f}-{r.ended - start:.1f}s {r.model} "
        f"{'stream' if r.stream else 'whole'} via {r.gateway or 'no gateway'} "
        f"on {r.replica or 'no replica'}: {r.error}"
        for r in unexplained[:20]
    ]
    explained = ", ".join(f"{n} during {kind}" for kind, n in sorted(causes.items()))
    summary = (
        f"{len(records)} sent, {len(failed)} failed"
        + (f" ({explained})" if explained else "")
        + f", {len(unexplained)} unexplained"
    )
    return Check(
        "only requests on a faulted process failed", not unexplained, summary, tuple(details)
    )


def check_disk(faults: Sequence[FaultRecord], bound_s: float) -> Check:
    fills = [f for f in faults if f.kind == "fill-disk"]
    late = [f for f in fills if f.healthy_again_s is None or f.healthy_again_s > bound_s]
    seen = sum(f.healthz_503 > 0 for f in fills)
    worst = max((f.healthy_again_s or 0.0 for f in fills), default=0.0)
    if late:
        summary = f"{len(late)} of {len(fills)} fills without /healthz 200 within {bound_s:g}s"
    elif fills:
        summary = (
            f"{len(fills)} fills ({seen} seen by the server: /healthz 503), "
            f"writable again after each within {worst:.1f}s"
        )
    else:
        summary = "no fill-disk fault in this run"
    details = tuple(f"fill-disk at t={f.started:.1f}: {f.note}" for f in late)
    return Check("state disk writable again", not late, summary, details)


def check_kv(
    differences: Sequence[str], replicas: Mapping[str, int], gateways: Sequence[str] = ()
) -> Check:
    """``gateways``: the names of those whose index was read (said in the summary)."""
    blocks = sum(replicas.values())
    read = f" ({len(gateways)} gateways: {', '.join(gateways)})" if gateways else ""
    summary = f"{len(replicas)} KV-events replicas, {blocks} cached blocks{read}: " + (
        "each index equals every engine's cache" if not differences else "differences"
    )
    return Check("KV index = engines' caches", not differences and bool(replicas), summary,
                 tuple(differences))  # fmt: skip


def check_one_leader(samples: Sequence[Sample]) -> Check:
    """No sample in which two servers said ``llmgw_leader 1`` (a split brain)."""
    start = samples[0].at if samples else 0.0
    both = [(s.at, s.leaders) for s in samples if len(s.leaders) > 1]
    led = sum(1 for s in samples if len(s.leaders) == 1)
    details = tuple(f"t={at - start:.1f}s: {', '.join(names)} lead" for at, names in both[:20])
    summary = (
        f"{len(samples)} samples: {led} with one leader, {len(both)} with two or more, "
        f"{len(samples) - led - len(both)} with none"
    )
    return Check("no two servers said they lead at once", not both, summary, details)
