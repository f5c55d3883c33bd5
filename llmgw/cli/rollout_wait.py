"""Waiting until deployments are ready: ``--wait`` of ``apply``, ``start``, ``scale``,
``reprofile`` and ``rollout undo``, and ``llmgw rollout status``.

The verdict is the server's: each deployment's ``DeploymentStatus`` as Watch carries it (a
snapshot, then a ``deployment`` event whenever the server recomputes one), never a count the
CLI makes of replicas. A deployment is done when every replica it wants is available (ready
and on its current profile) and no other replica is left (``available == desired ==
replicas``, none ``retiring``), as kubectl's rollout status waits for the new replicas and
the old ones gone.

It stops early, exit 1, when the server says the deployment cannot progress
(``Progressing`` false: no place for a replica, or a crash-loop back-off) and has said so for
``STALLED_S`` seconds by the server's clock: a roll that waits a round for room does not end
the wait, a TP-16 profile on 8-GPU nodes does, naming the placement rules' reason. Otherwise it
waits up to the timeout and then names what each deployment still lacks. A deployment deleted
while waited on ends the wait too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from llmgw.api.llmgw.v1 import Deployment, DeploymentCondition, WatchEvent
from llmgw.cli.errors import CliError
from llmgw.client import ControlClient
from llmgw.printable import escape

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "STALLED_S",
    "Progress",
    "add_wait_flags",
    "duration",
    "judge",
    "wait_ready",
]

DEFAULT_TIMEOUT_S = 600.0
STALLED_S = 15.0
"""How long ``Progressing`` must have been false before a wait gives up early."""

_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?")


def duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``10m``, ``1h30m`` (argparse type)."""
    match = _DURATION.fullmatch(text.strip())
    if not text.strip() or match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 10m, 1h)")
    hours, minutes, seconds = (float(part) if part else 0.0 for part in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise argparse.ArgumentTypeError(f"a duration must be more than 0: {text!r}")
    return total


def add_wait_flags(p: argparse.ArgumentParser, *, always: bool = False) -> None:
    """``--wait`` and ``--timeout`` (``always``: the command waits anyway, only --timeout)."""
    if not always:
        p.add_argument(
            "--wait",
            action="store_true",
            help="then wait until every replica is ready on the current profile (exit 0), "
            "or print what blocks it and exit 1",
        )
    p.add_argument(
        "--timeout",
        type=duration,
        default=DEFAULT_TIMEOUT_S,
        metavar="DURATION",
        help="how long to wait, e.g. 90s, 10m (default: 10m)",
    )


@dataclass(frozen=True, slots=True)
class Progress:
    """One deployment's verdict: ``done``, ``blocked`` (with why) or waiting (``line``)."""

    done: bool
    line: str
    blocked: bool = False


def judge(name: str, deployment: Deployment | None, server_now_ms: int) -> Progress:
    """What the server's status of ``name`` says about a wait (None: it does not exist)."""
    if deployment is None:
        return Progress(False, f"deployment {name} does not exist (deleted?)", blocked=True)
    status = deployment.status
    if status is None:
        return Progress(False, f"deployment {name}: the server has not computed its status yet")
    desired = deployment.replicas
    if status.available == desired == status.replicas and not status.retiring:
        return Progress(True, f"deployment {name}: {desired} of {desired} replicas available")
    progressing = _condition(status.conditions, "Progressing")
    why = status.reason or "replicas are on their way"
    line = (
        f"deployment {name}: {status.available} of {desired} replicas available "
        f"({status.ready} ready, {status.up_to_date} up to date, {status.replicas} placed, "
        f"{status.retiring} retiring): "
        f"{why}"
    )
    if progressing is not None and not progressing.status:
        stalled_ms = server_now_ms - progressing.since_unix_ms
        if stalled_ms >= STALLED_S * 1000:
            reason = progressing.message or why
            text = f"deployment {name} cannot progress ({progressing.reason}): {reason}"
            return Progress(False, text, blocked=True)
    return Progress(False, line)


def _condition(conditions: Sequence[DeploymentCondition], kind: str) -> DeploymentCondition | None:
    return next((c for c in conditions if c.type == kind), None)


async def wait_ready(
    client: ControlClient, names: Sequence[str], timeout_s: float, out: TextIO = sys.stdout
) -> int:
    """Follow Watch until each of ``names`` is done (0), or raise CliError naming what
    blocks the first that cannot progress, or what each still lacks at the timeout."""
    wanted = list(dict.fromkeys(names))
    known: dict[str, Deployment] | None = None  # None until the first snapshot
    offset_ms = 0  # the server's wall clock minus ours, from the last snapshot
    said: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    # The stream is read by a task of its own: cancelling a wait for its next event would
    # close the stream's generator; a wait on the queue may time out each second instead.
    events: asyncio.Queue[WatchEvent | None] = asyncio.Queue()
    reader = asyncio.create_task(_pump(client, events))
    try:
        while True:
            if known is not None:
                now_ms = int(time.time() * 1000) + offset_ms
                verdicts = {name: judge(name, known.get(name), now_ms) for name in wanted}
                _say(out, said, verdicts)
                if blocked := [v.line for v in verdicts.values() if v.blocked]:
                    raise CliError("; ".join(map(escape, blocked)))
                if all(v.done for v in verdicts.values()):
                    return 0
            left = deadline - time.monotonic()
            if left <= 0:
                raise CliError(f"timed out after {timeout_s:g}s: {_lacking(said, wanted)}")
            try:
                event = await asyncio.wait_for(events.get(), min(left, 1.0))
            except TimeoutError:
                continue  # re-judge: a stall's time may have run out
            if event is None:
                await reader  # raises what ended the stream, if anything did
                raise CliError("the server ended the Watch stream")
            known, offset_ms = _take(event, known, offset_ms)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader


async def _pump(client: ControlClient, events: asyncio.Queue[WatchEvent | None]) -> None:
    stream = client.watch()
    try:
        async for event in stream:
            events.put_nowait(event)
    finally:
        events.put_nowait(None)
        await stream.aclose()  # type: ignore[attr-defined]


def _lacking(said: dict[str, str], wanted: Sequence[str]) -> str:
    lines = [said[name] for name in wanted if name in said]
    return "; ".join(map(escape, lines)) or "no status from the server"


def _take(
    event: WatchEvent, known: dict[str, Deployment] | None, offset_ms: int
) -> tuple[dict[str, Deployment] | None, int]:
    """The deployments and the clock offset after ``event``."""
    if event.snapshot is not None:
        offset_ms = event.snapshot.server_time_unix_ms - int(time.time() * 1000)
        return {d.name: d for d in event.snapshot.deployments}, offset_ms
    if known is None:
        return None, offset_ms
    if event.deployment is not None:
        known[event.deployment.name] = event.deployment
    elif event.deployment_removed:
        known.pop(event.deployment_removed, None)
    return known, offset_ms


def _say(out: TextIO, said: dict[str, str], verdicts: dict[str, Progress]) -> None:
    """Print each deployment's line when it changed (kubectl's rollout status style)."""
    for name, verdict in verdicts.items():
        if said.get(name) != verdict.line:
            said[name] = verdict.line
            out.write(escape(verdict.line) + "\n")
            out.flush()
