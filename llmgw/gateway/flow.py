"""Priority and fairness for requests waiting on saturated replicas: the pure core (issue #18).

A :class:`FlowScheduler` holds the requests of one model that wait for a free slot and says
which goes next:

- **Bands, strictly**: a request of a lower band (``KEY_PRIORITY_INTERACTIVE`` = 0) always
  goes before any of a higher one (``KEY_PRIORITY_BATCH`` = 1): interactive traffic never
  waits behind batch.
- **Tenants of one band, fairly**, by virtual token counters (VTC; Sheng et al., "Fairness
  in Serving Large Language Models", OSDI 2024): each tenant's counter is the service it
  was given, in tokens, charged with the request's estimate when it is dispatched
  (:meth:`charge`) and corrected by the difference once its answer's usage is known. The
  next request is the oldest of the backlogged tenant with the least counter. A tenant
  that becomes backlogged is lifted to the least counter of the band's backlogged tenants,
  so idling earns no credit and a newcomer cannot starve the others.
- **Bounded**: at most ``max_queued`` requests (``push`` answers False past it: the caller
  answers 503), and the counters of at most ``max_tenants`` tenants (idle ones are
  forgotten first; a forgotten tenant comes back at the least counter, as a newcomer).

:meth:`remove` takes out a request that stopped waiting (its client went away, its wait ran
past the limit) in O(1); removed requests are skipped when they reach the front. ``pop``
costs O(backlogged tenants of the band). Everything runs on one event loop: no locks; the
clock is the caller's (``FlowItem.enqueued_at``).

The gateway's dispatch around it (which replica has a free slot, the wait's bound, the 503)
is not here yet; bench/tenants_sim.py drives this core in simulated time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

DEFAULT_MAX_TENANTS = 10_000


@dataclass(slots=True, eq=False)
class FlowItem:
    """One waiting request: its tenant, band, estimated tokens, when it came, and what the
    caller needs to dispatch it (``payload``)."""

    tenant: str
    band: int
    cost: int
    enqueued_at: float
    payload: object = None
    removed: bool = field(default=False, repr=False)


class _Band:
    __slots__ = ("queues", "waiting")

    def __init__(self) -> None:
        self.queues: dict[str, deque[FlowItem]] = {}  # backlogged tenants only
        self.waiting = 0  # requests not removed


class FlowScheduler:
    """The waiting requests of one model, by band and tenant (module docstring)."""

    def __init__(self, max_queued: int, max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        if max_queued < 0 or max_tenants < 1:
            raise ValueError("max_queued must be >= 0 and max_tenants >= 1")
        self.max_queued = max_queued
        self.max_tenants = max_tenants
        self._bands: dict[int, _Band] = {}
        self._counters: dict[tuple[int, str], float] = {}
        self._waiting = 0

    def __len__(self) -> int:
        return self._waiting

    def waiting(self, band: int) -> int:
        """Requests waiting in ``band``."""
        found = self._bands.get(band)
        return found.waiting if found is not None else 0

    def counter(self, tenant: str, band: int) -> float:
        """``tenant``'s virtual token counter in ``band`` (0 when not kept)."""
        return self._counters.get((band, tenant), 0.0)

    def push(self, item: FlowItem) -> bool:
        """Queue ``item``; False when ``max_queued`` already wait (it is not queued)."""
        if self._waiting >= self.max_queued:
            return False
        band = self._bands.setdefault(item.band, _Band())
        queue = band.queues.get(item.tenant)
        if queue is None:  # becomes backlogged: lifted to the band's least counter
            key = (item.band, item.tenant)
            floor = min(
                (self._counters.get((item.band, t), 0.0) for t in band.queues), default=None
            )
            own = self._counters.get(key, 0.0)
            self._counters[key] = own if floor is None else max(own, floor)
            queue = band.queues[item.tenant] = deque()
            self._bound_counters()
        queue.append(item)
        band.waiting += 1
        self._waiting += 1
        return True

    def next_band(self) -> int | None:
        """The band whose request :meth:`pop` would give, or None when none waits."""
        bands = [b for b, band in self._bands.items() if band.waiting]
        return min(bands) if bands else None

    def pop(self) -> FlowItem | None:
        """The next request (module docstring), taken out of the queue; None when none."""
        number = self.next_band()
        if number is None:
            return None
        band = self._bands[number]
        while True:
            tenant = min(band.queues, key=lambda t: self._counters.get((number, t), 0.0))
            queue = band.queues[tenant]
            item = queue.popleft()
            if not queue:
                del band.queues[tenant]
            if not item.removed:
                band.waiting -= 1
                self._waiting -= 1
                return item

    def remove(self, item: FlowItem) -> None:
        """``item`` stops waiting (skipped when it reaches the front); idempotent."""
        if item.removed:
            return
        item.removed = True
        band = self._bands[item.band]
        band.waiting -= 1
        self._waiting -= 1
        queue = band.queues.get(item.tenant)
        while queue and queue[0].removed:  # keep a front that is live where it is cheap
            queue.popleft()
        if queue is not None and not queue:
            del band.queues[item.tenant]

    def charge(self, tenant: str, band: int, tokens: float) -> None:
        """``tenant`` was given ``tokens`` of service in ``band`` (negative: a correction)."""
        key = (band, tenant)
        self._counters[key] = self._counters.get(key, 0.0) + tokens
        self._bound_counters()

    def _bound_counters(self) -> None:
        if len(self._counters) <= self.max_tenants:
            return
        backlogged = {(n, t) for n, band in self._bands.items() for t in band.queues}
        for key in [k for k in self._counters if k not in backlogged]:
            del self._counters[key]
            if len(self._counters) <= self.max_tenants // 2:
                return


__all__ = ["DEFAULT_MAX_TENANTS", "FlowItem", "FlowScheduler"]
