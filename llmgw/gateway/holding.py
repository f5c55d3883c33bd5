"""Scale from zero at the gateway: requests held for a model while none of its replicas is READY.

The router feed names the **scalable** models (``ScalableModels``: those of deployments the
autoscaler owns, in mode "act"; ``RoutingTable.scalable``). A request for one of them that
finds no READY replica is not answered 404 or 503 at once: it waits in its model's queue,
and the gateway's reports tell the server how many wait (``ModelSignals.waiting``), so the
planner starts a replica at once (scale from zero). A held request ends:

- ``ready``: a replica of its model became READY; the request is routed as usual (it
  joined the queue first, so requests go in their order of arrival as far as routing goes);
- ``timeout``: none was READY within ``HoldConfig.timeout_s``: 503 with ``Retry-After``;
- ``full``: its model already had ``HoldConfig.max_per_model`` requests held: 503 with
  ``Retry-After`` at once, never queued (what a full queue costs is bounded);
- ``gone``: its client went away (or the request ran past the gateway's request timeout):
  it leaves the queue at once;
- ``withdrawn``: the model stopped being scalable (its deployment was deleted or set to
  mode "advise"): the request goes on as any other, 404 or 503.

Limits: at most ``max_per_model`` held per model (default 128), for at most ``timeout_s``
(default 120 s, within the gateway's whole-request timeout); a held request holds its
connection and its body, which the gateway's limits already bound (``httplimits``). The
scalable models come from the server, so the queues are as many as its autoscaled
deployments. Every gateway holds its own queues.

Everything runs on the gateway's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from llmgw.gateway.errors import HoldRefused
from llmgw.gateway.metrics import labelled
from llmgw.gateway.routing.table import RoutingTable
from llmgw.promtext import family, label_set

log = logging.getLogger(__name__)

OUTCOMES = ("ready", "timeout", "full", "gone", "withdrawn")
"""How a held request ends (module docstring)."""

DEFAULT_MAX_HELD = 128
DEFAULT_HOLD_TIMEOUT_S = 120.0
MAX_HOLD_TIMEOUT_S = 3600.0
MAX_HELD_LIMIT = 100_000


@dataclass(frozen=True, slots=True)
class HoldConfig:
    """How many requests a gateway holds per model, and for how long."""

    max_per_model: int = DEFAULT_MAX_HELD  # 0: hold none (503 at once, as without autoscaling)
    timeout_s: float = DEFAULT_HOLD_TIMEOUT_S
    retry_after_s: int = 5  # the Retry-After of a 503 after a hold

    def __post_init__(self) -> None:
        if not 0 <= self.max_per_model <= MAX_HELD_LIMIT:
            raise ValueError(f"max_per_model must be 0 to {MAX_HELD_LIMIT}")
        if not 0 < self.timeout_s <= MAX_HOLD_TIMEOUT_S:
            raise ValueError(f"timeout_s must be above 0 and at most {MAX_HOLD_TIMEOUT_S:g}")
        if self.retry_after_s < 1:
            raise ValueError("retry_after_s must be at least 1")


Outcome = Callable[[str, str], None]
"""Told ``(model, outcome)`` when a held request ends (the gateway's signals)."""


class HoldingQueues:
    """A bounded queue per scalable model (module docstring)."""

    def __init__(
        self, table: RoutingTable, config: HoldConfig = HoldConfig(), *, on_end: Outcome
    ) -> None:
        self.config = config
        self._table = table
        self._on_end = on_end
        self._queues: dict[str, dict[asyncio.Future[str], None]] = {}  # insertion-ordered
        self.ended: dict[tuple[str, str], int] = {}  # (model, outcome) → held requests
        table.on_changed(self._wake)

    def should_hold(self, model: str) -> bool:
        """Whether a request for ``model`` waits here: scalable, and no READY replica."""
        return self._table.scalable(model) and not self._table.candidates(model)

    def waiting(self) -> dict[str, int]:
        """Requests held now, per model (only models with some)."""
        return {model: len(queue) for model, queue in self._queues.items()}

    async def hold(self, model: str) -> None:
        """Wait until a replica of ``model`` is READY (or it is no longer scalable); then
        the caller routes as usual. HoldRefused when the queue is full or the hold limit
        passed; CancelledError (the client left) leaves the queue at once."""
        queue = self._queues.setdefault(model, {})
        if len(queue) >= self.config.max_per_model:
            if not queue:
                del self._queues[model]
            self._end(model, "full")
            waits = (
                f"{len(queue)} requests already wait for one (the limit, --hold-queue)"
                if self.config.max_per_model
                else "this gateway holds no requests (--hold-queue 0)"
            )
            raise HoldRefused(
                f"no replica of model `{model}` is ready yet and {waits}; retry later",
                retry_after_s=self.config.retry_after_s,
            )
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        queue[waiter] = None
        outcome = "gone"
        try:
            async with asyncio.timeout(self.config.timeout_s):
                outcome = await waiter
        except TimeoutError:
            outcome = "timeout"
            raise HoldRefused(
                f"no replica of model `{model}` became ready within "
                f"{self.config.timeout_s:g} s (--hold-timeout); retry later",
                retry_after_s=self.config.retry_after_s,
            ) from None
        finally:
            self._leave(model, waiter)
            self._end(model, outcome)

    def _leave(self, model: str, waiter: asyncio.Future[str]) -> None:
        queue = self._queues.get(model)
        if queue is not None:
            queue.pop(waiter, None)
            if not queue:
                del self._queues[model]

    def _end(self, model: str, outcome: str) -> None:
        key = (model, outcome)
        self.ended[key] = self.ended.get(key, 0) + 1
        self._on_end(model, outcome)

    def _wake(self) -> None:
        """After a change of the table: release the queues whose model has a READY replica
        now, or is no longer scalable."""
        for model, queue in list(self._queues.items()):
            if self._table.candidates(model):
                outcome = "ready"
            elif not self._table.scalable(model):
                outcome = "withdrawn"
            else:
                continue
            log.info("%d requests held for %s go on (%s)", len(queue), model, outcome)
            for waiter in queue:
                if not waiter.done():
                    waiter.set_result(outcome)

    def lines(self) -> Iterable[str]:
        """The held requests' metric families (a ``GatewayMetrics`` collector)."""
        out: list[str] = []
        labelled(
            out,
            "llmgw_held_requests",
            "gauge",
            "Requests held now for a scalable model with no READY replica.",
            "model",
            self.waiting(),
        )
        family(
            out,
            "llmgw_held_requests_total",
            "counter",
            "Held requests by how they ended: ready, timeout, full, gone, withdrawn.",
        )
        out.extend(
            f"llmgw_held_requests_total{label_set([('model', model), ('outcome', outcome)])} "
            f"{count}"
            for (model, outcome), count in sorted(self.ended.items())
        )
        return out


__all__ = [
    "DEFAULT_HOLD_TIMEOUT_S",
    "DEFAULT_MAX_HELD",
    "MAX_HELD_LIMIT",
    "MAX_HOLD_TIMEOUT_S",
    "OUTCOMES",
    "HoldConfig",
    "HoldingQueues",
]
