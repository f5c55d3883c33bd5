"""What a gateway measures per model for the autoscaler (``RouterReport.models``).

Per model a client asked for (one the routing table serves or the feed names scalable;
others are not counted, so the models kept stay bounded, and at most ``MAX_MODELS``):

- ``arrivals``: requests whose body was read and named the model (routed, held or refused);
- ``answered``: answers whose first byte came from a replica (any status);
- ``ttft``: request sent to the replica → the answer's first body byte, for 200 answers.
  For a streamed answer that is its first event; for a whole (non-streamed) answer it is
  the whole answer, which is when such a client gets its first token;
- ``itl``: the gaps between a streamed 200 answer's server-sent events. An event ends with
  a blank line (``\\n\\n``; inside JSON a newline is always escaped, so the count is exact);
  when one piece read from the replica ends several events, the gap since the previous
  piece that ended one is shared evenly among them (the engine sent them that fast on
  average). Events in the answer's first piece have no gap before them: that is TTFT;
- ``in_flight``: attempts upstream now; ``waiting``: requests held now (``holding``);
- ``held_timeouts`` / ``held_answered``: held requests answered 503 after the hold limit,
  and those released to a replica once one was READY.

Histograms are cumulative in both senses, as Prometheus keeps them: counts never go down
while the gateway runs, and ``counts[i]`` is every observation ``<= LATENCY_BOUNDS_MS[i]``,
the last one ``+Inf``. The server takes differences between two reports for a window.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping

from llmgw.api.llmgw.v1 import ModelSignals

LATENCY_BOUNDS_MS: tuple[float, ...] = (
    5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 400, 500, 750,
    1000, 1500, 2000, 3000, 5000, 7500, 10000, 20000, 30000, 60000, 120000,
)  # fmt: skip
"""The histogram bounds (ms) of every model's TTFT and ITL, sent as ``latency_bounds_ms``."""

MAX_MODELS = 256
"""Models a gateway keeps signals of; a model beyond that is not counted (said once)."""

_U32 = 2**32 - 1


class _Histogram:
    """Observations per bucket of ``LATENCY_BOUNDS_MS`` (not cumulative), the last +Inf."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BOUNDS_MS) + 1)

    def observe(self, ms: float, times: int = 1) -> None:
        self.counts[bisect_left(LATENCY_BOUNDS_MS, ms)] += times

    def cumulative(self) -> list[int]:
        out: list[int] = []
        running = 0
        for count in self.counts:
            running += count
            out.append(running)
        return out


class _Model:
    __slots__ = (
        "answered",
        "arrivals",
        "held_answered",
        "held_timeouts",
        "in_flight",
        "itl",
        "ttft",
    )

    def __init__(self) -> None:
        self.arrivals = self.answered = self.in_flight = 0
        self.held_timeouts = self.held_answered = 0
        self.ttft = _Histogram()
        self.itl = _Histogram()


class ModelSignalBook:
    """Every model's signals since the gateway started (module docstring)."""

    def __init__(self, max_models: int = MAX_MODELS) -> None:
        self._max = max_models
        self._models: dict[str, _Model] = {}
        self.overflowed = False  # a model was not counted: MAX_MODELS reached

    def _of(self, model: str) -> _Model | None:
        book = self._models.get(model)
        if book is None:
            if len(self._models) >= self._max:
                self.overflowed = True
                return None
            book = self._models[model] = _Model()
        return book

    def arrived(self, model: str) -> None:
        if (book := self._of(model)) is not None:
            book.arrivals += 1

    def first_byte(self, model: str, seconds: float, ok: bool) -> None:
        """A replica's first body byte reached the client ``seconds`` after the request was
        sent; ``ok``: a 200 answer (only those are timed)."""
        if (book := self._of(model)) is not None:
            book.answered += 1
            if ok:
                book.ttft.observe(seconds * 1000)

    def gaps(self, model: str, seconds: float, events: int) -> None:
        """``events`` streamed events ended, ``seconds`` after the previous one did."""
        if events > 0 and (book := self._of(model)) is not None:
            book.itl.observe(seconds * 1000 / events, events)

    def upstream(self, model: str, delta: int) -> None:
        """An attempt went upstream (+1) or ended (-1)."""
        if (book := self._of(model)) is not None:
            book.in_flight = max(0, book.in_flight + delta)

    def held(self, model: str, outcome: str) -> None:
        """A held request ended: "ready" (released to a replica), "timeout", or another
        outcome (not counted here)."""
        if (book := self._of(model)) is not None:
            if outcome == "ready":
                book.held_answered += 1
            elif outcome == "timeout":
                book.held_timeouts += 1

    def signals(self, waiting: Mapping[str, int]) -> list[ModelSignals]:
        """Every model's signals now, sorted by model; ``waiting``: requests held per model
        (a model held for but not yet counted gets a row too)."""
        for model in waiting:
            self._of(model)
        return [
            ModelSignals(
                model=model,
                arrivals=book.arrivals,
                answered=book.answered,
                ttft_counts=book.ttft.cumulative(),
                itl_counts=book.itl.cumulative(),
                in_flight=min(book.in_flight, _U32),
                waiting=min(waiting.get(model, 0), _U32),
                held_timeouts=book.held_timeouts,
                held_answered=book.held_answered,
            )
            for model, book in sorted(self._models.items())
        ]


class StreamClock:
    """Times the events of one streamed answer as its pieces pass (module docstring)."""

    __slots__ = ("_book", "_carry", "_last", "_model")

    def __init__(self, book: ModelSignalBook, model: str) -> None:
        self._book = book
        self._model = model
        self._last: float | None = None  # when a piece last ended an event
        self._carry = False  # the previous piece ended with a newline not yet paired

    def piece(self, data: bytes, now: float) -> None:
        """One piece of the body read at ``now`` (``time.perf_counter()``)."""
        if not data:
            return
        text = b"\n" + data if self._carry else data
        ends = text.count(b"\n\n")
        trailing = len(text) - len(text.rstrip(b"\n"))
        self._carry = trailing % 2 == 1
        if not ends:
            return
        if self._last is not None:
            self._book.gaps(self._model, now - self._last, ends)
        self._last = now


__all__ = ["LATENCY_BOUNDS_MS", "MAX_MODELS", "ModelSignalBook", "StreamClock"]
