"""Windowed rates and ratios of counters, robust to counter resets (pure, no I/O).

A counter only grows, except when the process that holds it restarts and counts again from
zero. Between two samples, a counter that went down was reset, and its increase is the new
value itself (what it counted since the restart), never a negative number: Prometheus's
``increase()``. A reset followed by counting past the old value between two samples cannot
be told from plain growth; sampling every few seconds keeps that window small.

Rates are increases over elapsed monotonic time; a hit rate is Δhits / Δqueries over the
same window, None when nothing was queried (no traffic is not a 0 % hit rate).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["CounterSample", "CounterWindow", "counter_increase"]


def counter_increase(before: int, after: int) -> int:
    """How much a counter counted between two readings; a drop means it was reset."""
    return after - before if after >= before else after


@dataclass(frozen=True, slots=True)
class CounterSample:
    """Counters read at one monotonic instant; a counter absent from ``values`` is 0."""

    at_s: float
    values: Mapping[str, int]

    def get(self, name: str) -> int:
        return self.values.get(name, 0)


class CounterWindow:
    """The samples of the last ``window_s`` seconds, and one just before as the baseline."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 600) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, not {window_s}")
        self.window_s = window_s
        self._samples: deque[CounterSample] = deque(maxlen=max_samples)

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, at_s: float, values: Mapping[str, int]) -> None:
        """Record a reading; a reading older than the newest is ignored."""
        if self._samples and at_s <= self._samples[-1].at_s:
            return
        self._samples.append(CounterSample(at_s, MappingProxyType(dict(values))))
        start = at_s - self.window_s
        while len(self._samples) > 2 and self._samples[1].at_s <= start:
            self._samples.popleft()

    def clear(self) -> None:
        self._samples.clear()

    def latest(self) -> CounterSample | None:
        return self._samples[-1] if self._samples else None

    def names(self) -> list[str]:
        """Every counter name seen in the window, sorted."""
        return sorted({name for s in self._samples for name in s.values})

    def span_s(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        return self._samples[-1].at_s - self._samples[0].at_s

    def increase(self, names: Iterable[str]) -> int:
        """The summed increase of ``names`` over the window, resets included."""
        wanted = tuple(names)
        total = 0
        for before, after in _pairs(self._samples):
            total += sum(counter_increase(before.get(n), after.get(n)) for n in wanted)
        return total

    def rate(self, names: Iterable[str]) -> float | None:
        """Per second over the window; None until there are two samples."""
        span = self.span_s()
        return self.increase(names) / span if span > 0 else None

    def ratio(self, numerator: Iterable[str], denominator: Iterable[str]) -> float | None:
        """Δnumerator / Δdenominator over the window; None when the denominator is flat."""
        below = self.increase(denominator)
        return self.increase(numerator) / below if below > 0 else None

    def rate_series(self, names: Iterable[str]) -> tuple[float, ...]:
        """The rate between each pair of neighbouring samples, oldest first (sparklines)."""
        wanted = tuple(names)
        return tuple(
            sum(counter_increase(b.get(n), a.get(n)) for n in wanted) / (a.at_s - b.at_s)
            for b, a in _pairs(self._samples)
        )

    def ratio_series(
        self, numerator: Iterable[str], denominator: Iterable[str]
    ) -> tuple[float, ...]:
        """The ratio between neighbouring samples; an interval with no queries repeats the
        previous value (0 before any), so a sparkline does not drop to zero when idle."""
        top, bottom = tuple(numerator), tuple(denominator)
        out: list[float] = []
        for before, after in _pairs(self._samples):
            below = sum(counter_increase(before.get(n), after.get(n)) for n in bottom)
            above = sum(counter_increase(before.get(n), after.get(n)) for n in top)
            out.append(above / below if below > 0 else (out[-1] if out else 0.0))
        return tuple(out)


def _pairs(samples: deque[CounterSample]) -> Iterable[tuple[CounterSample, CounterSample]]:
    items = list(samples)
    return zip(items, items[1:], strict=False)
