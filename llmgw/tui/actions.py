"""The console's operator actions, pure: what a verb does to what, and what it costs.

A key (``d``, ``s``, ``p``, ``C``, ``U``, ``D``; ``llmgw.tui.registry``) names a target (the
selected replica, deployment or node); a ``plan_*`` function turns it into an
``Operation`` against a ``ConsoleSnapshot``, the whole model and not the rows a filter
leaves on screen: the exact targets in words and the impact (the READY capacity it takes,
the in-flight requests that finish first, the replicas that move, and where a node drain
would move them: the server's own dry run of it, never a count made here). The confirmation
(``llmgw.tui.modals``) shows it; ``send`` makes the one RPC it stands for. The server
decides: what it refuses comes back as its message, and its audit record arrives through
Watch like every other change.

What the server does for each verb (``llmgw.server.wire.actions``): drain scales the replica's
deployment down by one and retires that replica; start scales a deployment up by one;
reprofile points the whole deployment at another profile and replaces its replicas one at
a time (surge of one); drain-node cordons the node and replaces each replica on it
elsewhere before retiring it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from llmgw.api.llmgw.v1 import ActionResult, EngineProfile, NodeState, ShardState
from llmgw.client import ControlClient
from llmgw.tui.model import ConsoleSnapshot
from llmgw.tui.rows import NodeRow, ReplicaRow

__all__ = [
    "ActionUnavailable",
    "DrainPlacement",
    "Operation",
    "ProfileChoice",
    "Verb",
    "drain_placement",
    "plan_cordon",
    "plan_drain",
    "plan_drain_node",
    "plan_reprofile",
    "same_model",
    "plan_start",
    "plan_uncordon",
    "profile_choice",
    "send",
]

_READY = ShardState.READY
_GONE = (ShardState.DRAINING, ShardState.STOPPED)  # on their way out: nothing to move


class Verb(enum.Enum):
    """What an operation asks the server to do."""

    DRAIN = "drain"  # retire a replica; its deployment scales down by one
    START = "start"  # one more replica of a deployment
    REPROFILE = "reprofile"  # a deployment moves to another profile, rolling
    CORDON = "cordon"  # nothing new is placed on a node
    UNCORDON = "uncordon"  # a node takes new replicas again
    DRAIN_NODE = "drain-node"  # cordon, and move every replica on the node elsewhere


class ActionUnavailable(Exception):
    """The console cannot plan the action (its target is gone, nothing to change);
    ``why`` says so in words. Nothing was sent."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@dataclass(frozen=True, slots=True)
class Operation:
    """One planned action: what to send and what to tell the operator before sending it."""

    verb: Verb
    target: str  # the id sent: a replica, a deployment or a node
    title: str  # "Drain replica chat-3"
    targets: tuple[str, ...]  # each thing it changes, in words
    impact: tuple[str, ...]  # what it costs, sentence by sentence
    confirm: str  # the confirming button's word
    profile: str = ""  # REPROFILE: the profile chosen


@dataclass(frozen=True, slots=True)
class ProfileChoice:
    """A stored engine profile as the reprofile list shows it."""

    name: str
    engine: str
    gpu_class: str
    gpus: int  # per replica; 0 for a CPU profile
    summary: str  # "sim · 2×H100 · tp 2 · chat · --max-model-len 4096"
    model: str = ""  # the model name it serves (served_model_name)


def profile_choice(profile: EngineProfile) -> ProfileChoice:
    nodes = max(1, profile.nodes)
    per_node = profile.gpus_per_node or max(1, profile.tp * profile.pp // nodes)
    gpus = 0 if profile.gpu_class == "cpu" else per_node * nodes
    parts = [profile.engine, f"{gpus}×{profile.gpu_class}" if gpus else "CPU"]
    parts.append(f"tp {max(1, profile.tp)}" + (f" pp {profile.pp}" if profile.pp > 1 else ""))
    if nodes > 1:
        parts.append(f"{nodes} nodes")
    parts.append(profile.served_model_name or profile.model_path)
    if profile.args:
        parts.append(" ".join(profile.args))
    summary = " · ".join(p for p in parts if p)
    model = profile.served_model_name
    return ProfileChoice(profile.name, profile.engine, profile.gpu_class, gpus, summary, model)


def same_model(profiles: Sequence[ProfileChoice], current: str) -> list[ProfileChoice]:
    """The profiles that serve the model ``current`` serves (``current`` among them): a
    reprofile to another model is refused by the server unless asked for explicitly."""
    model = next((p.model for p in profiles if p.name == current), None)
    if model is None:
        return list(profiles)
    return [p for p in profiles if p.model == model]


# --- words ---------------------------------------------------------------------------------


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _names(ids: Iterable[str]) -> str:
    return ", ".join(ids)


def _replicas_of(snapshot: ConsoleSnapshot, deployment: str) -> list[ReplicaRow]:
    rows = (r for r in snapshot.replicas.values() if r.deployment == deployment)
    return sorted(rows, key=lambda r: r.replica_id)


def _ready(rows: Iterable[ReplicaRow]) -> int:
    return sum(1 for r in rows if r.state is _READY)


def _replica(snapshot: ConsoleSnapshot, replica_id: str) -> ReplicaRow:
    row = snapshot.replicas.get(replica_id)
    if row is None:
        raise ActionUnavailable(f"replica {replica_id} is not in the cluster any more")
    return row


def _node(snapshot: ConsoleSnapshot, node_id: str) -> NodeRow:
    row = snapshot.nodes.get(node_id)
    if row is None:
        raise ActionUnavailable(f"node {node_id} is not in the cluster any more")
    return row


def _devices(snapshot: ConsoleSnapshot, row: ReplicaRow) -> str:
    """``2 GPUs``, ``1 MIG slice``: what the replica's shards hold, slices apart."""
    shards = set(row.shard_ids)
    held = [g for g in snapshot.gpus.values() if g.shard_id in shards]
    slices = sum(1 for g in held if g.info.is_mig)
    if not held:
        return _count(row.gpus, "GPU")
    if slices == len(held):
        return _count(slices, "MIG slice")
    whole = _count(len(held) - slices, "GPU")
    return whole if not slices else f"{whole} and {_count(slices, 'MIG slice')}"


def _replica_words(row: ReplicaRow) -> str:
    where = f"on {_names(row.nodes)}, {_count(row.gpus, 'GPU')}" if row.nodes else "not placed"
    return (
        f"replica {row.replica_id}: {row.state.name}, deployment {row.deployment}, "
        f"profile {row.profile}, {where}"
    )


def _node_words(row: NodeRow) -> str:
    state = "CORDONED" if row.cordoned else row.state.name
    return f"node {row.node_id}: {state}, {row.gpu_words}"


def _is_open(row: NodeRow) -> bool:
    """Whether placement may put something new on the node."""
    return row.state is NodeState.READY and not row.cordoned


def _deployment_count(snapshot: ConsoleSnapshot, deployment: str, replicas: int) -> int:
    row = snapshot.deployments.get(deployment)
    return row.replicas if row is not None else replicas


# --- replicas ------------------------------------------------------------------------------


def plan_drain(snapshot: ConsoleSnapshot, replica_id: str) -> Operation:
    """Drain one replica: what it serves, what finishes first, what its deployment becomes."""
    row = _replica(snapshot, replica_id)
    siblings = _replicas_of(snapshot, row.deployment)
    ready = _ready(siblings)
    live = [r for r in siblings if r.state not in _GONE]
    count = _deployment_count(snapshot, row.deployment, len(live))
    impact = [_serving(snapshot, row, ready)]
    deployment = snapshot.deployments.get(row.deployment)
    scaler = deployment.autoscale if deployment is not None else None
    if scaler is not None and scaler.mode == "act":  # the server keeps the count
        impact.append(
            f"Deployment {row.deployment} is autoscaled and keeps {_count(count, 'replica')}: "
            f"a replacement for {replica_id} is placed."
        )
    else:
        impact.append(
            f"Deployment {row.deployment} scales down from {_count(count, 'replica')} to "
            f"{max(0, count - 1)}; nothing replaces {replica_id}."
        )
    if row.gpus:
        impact.append(f"Frees {_devices(snapshot, row)} on {_names(row.nodes)}.")
    return Operation(
        Verb.DRAIN,
        replica_id,
        f"Drain replica {replica_id}",
        (_replica_words(row),),
        tuple(impact),
        "Drain",
    )


def _serving(snapshot: ConsoleSnapshot, row: ReplicaRow, ready: int) -> str:
    """What a drained replica takes away."""
    if row.state is not _READY:
        return (
            f"{row.replica_id} is {row.state.name}: it serves no requests; READY replicas "
            f"of deployment {row.deployment} stay at {ready}."
        )
    in_flight = "" if row.in_flight is None else f" ({row.in_flight} in flight now)"
    text = (
        f"{row.replica_id} serves 1 of {ready} READY replicas of deployment "
        f"{row.deployment}; its in-flight requests finish first{in_flight}."
    )
    others = sum(
        1
        for r in snapshot.replicas.values()
        if r.model == row.model and r.state is _READY and r.replica_id != row.replica_id
    )
    if not others:
        text += f" No READY replica of model {row.model} is left after it."
    return text


def plan_start(snapshot: ConsoleSnapshot, deployment: str) -> Operation:
    """One more replica of ``deployment``; unavailable when the autoscaler owns its count
    (the server would refuse it)."""
    siblings = _replicas_of(snapshot, deployment)
    known = snapshot.deployments.get(deployment)
    if known is None and not siblings:
        raise ActionUnavailable(f"deployment {deployment} is not in the cluster any more")
    if known is not None and known.autoscale is not None and known.autoscale.mode == "act":
        raise ActionUnavailable(
            f"deployment {deployment} is autoscaled ({known.autoscale.min} to "
            f"{known.autoscale.max} replicas): the autoscaler sets its count; change "
            'autoscale.min/max in its file, or set autoscale.mode = "advise"'
        )
    live = [r for r in siblings if r.state not in _GONE]
    count = _deployment_count(snapshot, deployment, len(live))
    profile = known.profile if known is not None else siblings[0].profile
    model = f", model {siblings[0].model}" if siblings else ""
    impact = (
        f"Deployment {deployment} scales up from {_count(count, 'replica')} to {count + 1}; "
        f"placement picks the GPUs of the new one, which serves once READY.",
        f"READY now: {_ready(siblings)} of {count}. Nothing running stops.",
    )
    return Operation(
        Verb.START,
        deployment,
        f"Start a replica of deployment {deployment}",
        (f"deployment {deployment}: profile {profile}{model}",),
        impact,
        "Start",
    )


def plan_reprofile(
    snapshot: ConsoleSnapshot, deployment: str, current: str, chosen: ProfileChoice
) -> Operation:
    """Move ``deployment`` from profile ``current`` to ``chosen``: every replica is replaced."""
    if chosen.name == current:
        raise ActionUnavailable(f"deployment {deployment} uses profile {current} already")
    live = [r for r in _replicas_of(snapshot, deployment) if r.state not in _GONE]
    ready = _ready(live)
    replaced = (
        f"replicas replaced: {_names(r.replica_id for r in live)}"
        if live
        else "no replica runs yet: new ones start with the new profile"
    )
    gpus = f"{_count(chosen.gpus, 'GPU')} ({chosen.gpu_class})" if chosen.gpus else "no GPU"
    impact = (
        f"One at a time, a replica with profile {chosen.name} starts and becomes READY, "
        f"then an old one drains (its in-flight requests finish first): READY stays at "
        f"{ready}.",
        f"Meanwhile one extra replica needs {gpus}. New profile: {chosen.summary}.",
    )
    return Operation(
        Verb.REPROFILE,
        deployment,
        f"Reprofile deployment {deployment}",
        (f"deployment {deployment}: profile {current} → {chosen.name}", replaced),
        impact,
        "Reprofile",
        profile=chosen.name,
    )


# --- nodes ---------------------------------------------------------------------------------


def _running_on(snapshot: ConsoleSnapshot, node_id: str) -> list[str]:
    """Replicas with a shard holding GPUs (or running) on the node, not already leaving."""
    ids = {s.replica_id for s in snapshot.shards.values() if s.node_id == node_id and s.holds_gpus}
    rows = (snapshot.replicas.get(i) for i in ids)
    return sorted(r.replica_id for r in rows if r is not None and r.state not in _GONE)


def _open_nodes(snapshot: ConsoleSnapshot) -> tuple[int, int]:
    nodes = snapshot.nodes.values()
    return sum(1 for n in nodes if _is_open(n)), len(nodes)


def plan_cordon(snapshot: ConsoleSnapshot, node_id: str) -> Operation:
    row = _node(snapshot, node_id)
    running = _running_on(snapshot, node_id)
    open_now, total = _open_nodes(snapshot)
    if row.cordoned:
        impact: tuple[str, ...] = (f"{node_id} is cordoned already: nothing changes.",)
    else:
        keeps = f"keeps running: {_names(running)}" if running else "no replica runs there"
        after = open_now - 1 if _is_open(row) else open_now
        impact = (
            f"Nothing new is placed on {node_id}; what runs there {keeps}.",
            f"Nodes open for placement: {open_now} → {after} of {total}.",
        )
    return Operation(
        Verb.CORDON, node_id, f"Cordon node {node_id}", (_node_words(row),), impact, "Cordon"
    )


def plan_uncordon(snapshot: ConsoleSnapshot, node_id: str) -> Operation:
    row = _node(snapshot, node_id)
    open_now, total = _open_nodes(snapshot)
    if not row.cordoned:
        impact: tuple[str, ...] = (f"{node_id} is not cordoned: nothing changes.",)
    else:
        after = open_now + 1 if row.state is not NodeState.NOT_READY else open_now
        impact = (
            f"New replicas may be placed on {node_id} again; nothing running moves.",
            f"Nodes open for placement: {open_now} → {after} of {total}.",
        )
        if running := _running_on(snapshot, node_id):
            stay = "stays on {} under its id" if len(running) == 1 else "stay on {} under their ids"
            impact += (
                f"A drain of {node_id} not finished yet is cancelled: {_names(running)} "
                f"{stay.format(node_id)}.",
            )
    return Operation(
        Verb.UNCORDON,
        node_id,
        f"Uncordon node {node_id}",
        (_node_words(row),),
        impact,
        "Uncordon",
    )


@dataclass(frozen=True, slots=True)
class DrainPlacement:
    """Where a node drain would move each replica: the server's dry run of it
    (``DrainNode`` with ``dry_run``, computed by its placement rules), or why there is none."""

    lines: tuple[str, ...] = ()  # one per replica, as the server words it
    unknown: str = ""  # why the server's answer is missing ("" when it answered)


def drain_placement(message: str) -> DrainPlacement:
    """The server's dry-run answer (a head line, then one line per replica)."""
    return DrainPlacement(tuple(line for line in message.splitlines()[1:] if line.strip()))


def plan_drain_node(
    snapshot: ConsoleSnapshot, node_id: str, placement: DrainPlacement | None = None
) -> Operation:
    """Cordon the node and move each replica on it elsewhere: which, and where the server's
    placement would put each now (``placement``; the console guesses no room itself)."""
    row = _node(snapshot, node_id)
    moving = _running_on(snapshot, node_id)
    targets = [_node_words(row)]
    impact = [f"{node_id} is cordoned: nothing new is placed on it."]
    if not moving:
        impact.append(f"No replica runs on {node_id}: nothing moves.")
    else:
        targets.append(f"replicas moving: {_names(moving)}")
        impact.append(
            f"Each of {_names(moving)} is replaced elsewhere, one at a time: its replacement "
            f"starts and becomes READY before it drains, and its in-flight requests finish "
            f"first."
        )
        impact.extend(_where(placement or DrainPlacement(unknown="not asked")))
    return Operation(
        Verb.DRAIN_NODE,
        node_id,
        f"Drain node {node_id}",
        tuple(targets),
        tuple(impact),
        "Drain node",
    )


def _where(placement: DrainPlacement) -> list[str]:
    if placement.unknown or not placement.lines:
        why = placement.unknown or "the server named none"
        return [f"Where they would go is not known ({why}): the server places them."]
    head = "Where the server's placement would put them now (a dry run, nothing changed):"
    return [head, *placement.lines]


# --- sending -------------------------------------------------------------------------------


async def send(operation: Operation, client: ControlClient) -> ActionResult:
    """The RPC ``operation`` stands for. Raises ``llmgw.client.ClientError`` (a refusal by
    the server is ``RpcError``; a read-only client refuses before sending)."""
    target = operation.target
    match operation.verb:
        case Verb.DRAIN:
            return await client.drain_replica(target)
        case Verb.START:
            return await client.start_replica(target)
        case Verb.REPROFILE:
            return await client.reprofile_replica("", deployment=target, profile=operation.profile)
        case Verb.CORDON:
            return await client.cordon_node(target)
        case Verb.UNCORDON:
            return await client.uncordon_node(target)
        case Verb.DRAIN_NODE:
            return await client.drain_node(target)
