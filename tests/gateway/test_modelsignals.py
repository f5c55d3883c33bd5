"""The gateway's signals per model for the autoscaler (llmgw.gateway.modelsignals): the
book's counters and cumulative histograms, the stream clock's event gaps, and the figures
a real gateway measures in front of a simulated engine that decodes at a known pace."""

from __future__ import annotations

import httpx
import pytest
from simserve import sim_engine

from llmgw.api.llmgw.v1 import ModelSignals
from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.modelsignals import LATENCY_BOUNDS_MS, ModelSignalBook, StreamClock
from llmgw.gateway.routing.table import RoutingTable, Target
from llmgw.gateway.stats import model_signals


def bucket_of(ms: float) -> int:
    """The index of the first bound >= ms (len(bounds): +Inf)."""
    return next((i for i, b in enumerate(LATENCY_BOUNDS_MS) if ms <= b), len(LATENCY_BOUNDS_MS))


def observations(counts: list[int]) -> list[int]:
    """Per-bucket counts back from cumulative ones."""
    return [c - (counts[i - 1] if i else 0) for i, c in enumerate(counts)]


def only(book: ModelSignalBook, waiting: dict[str, int] | None = None) -> ModelSignals:
    (signals,) = book.signals(waiting or {})
    return signals


def test_counts_are_cumulative_per_bucket_with_le_semantics() -> None:
    book = ModelSignalBook()
    book.arrived("m")
    book.first_byte("m", 0.010, ok=True)  # exactly a bound: falls in it
    book.first_byte("m", 0.011, ok=True)
    book.first_byte("m", 500.0, ok=True)  # beyond the last bound: +Inf
    book.first_byte("m", 0.001, ok=False)  # an error answer: answered, not timed
    signals = only(book)
    assert signals.arrivals == 1 and signals.answered == 4
    assert len(signals.ttft_counts) == len(LATENCY_BOUNDS_MS) + 1
    assert signals.ttft_counts == sorted(signals.ttft_counts)  # cumulative
    assert signals.ttft_counts[-1] == 3
    per = observations(signals.ttft_counts)
    assert per[bucket_of(10)] == 1 and per[bucket_of(11)] == 1 and per[-1] == 1
    assert signals.itl_counts == [0] * (len(LATENCY_BOUNDS_MS) + 1)


def test_in_flight_waiting_and_held_outcomes() -> None:
    book = ModelSignalBook()
    book.upstream("m", +1)
    book.upstream("m", +1)
    book.upstream("m", -1)
    book.held("m", "ready")
    book.held("m", "timeout")
    book.held("m", "timeout")
    book.held("m", "gone")  # counted by the gateway's metrics, not here
    signals = only(book, {"m": 4})
    assert (signals.in_flight, signals.waiting) == (1, 4)
    assert (signals.held_answered, signals.held_timeouts) == (1, 2)


def test_a_model_only_held_for_gets_a_row_and_models_stay_bounded() -> None:
    book = ModelSignalBook(max_models=2)
    book.arrived("a")
    rows = book.signals({"b": 3})
    assert [(r.model, r.waiting) for r in rows] == [("a", 0), ("b", 3)]
    book.arrived("c")  # one model too many: not counted
    assert [r.model for r in book.signals({})] == ["a", "b"]
    assert book.overflowed


def test_the_stream_clock_shares_a_pieces_gap_among_its_events() -> None:
    book = ModelSignalBook()
    clock = StreamClock(book, "m")
    clock.piece(b'data: {"a": 1}\n\n', 1.000)  # the first event: TTFT's, no gap
    clock.piece(b'data: {"a": 2}\n\ndata: {"a": 3}\n\n', 1.080)  # two events in 80 ms
    clock.piece(b'data: {"a": "x\\n\\ny"}\n', 1.100)  # escaped newlines; not ended yet
    clock.piece(b"\n", 1.120)  # ...ended here, split between two pieces: 40 ms
    clock.piece(b"", 1.2)
    per = observations(only(book).itl_counts)
    assert per[bucket_of(40)] == 3  # 80 ms / 2 twice, then 40 ms (the 30-50 ms bucket)
    assert sum(per) == 3


@pytest.mark.parametrize("stream", [True, False])
async def test_a_gateway_measures_ttft_and_itl_of_a_paced_engine(stream: bool) -> None:
    flags = ("--sim-prefill-ms-per-token", "0", "--sim-decode-ms-per-token", "40")
    async with sim_engine("m", *flags) as url:
        gateway = Gateway(RoutingTable([Target("r1", "m", url)]), GatewayConfig(port=0))
        host, port = await gateway.start()
        try:
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
                body = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": stream}
                for _ in range(2):
                    reply = await client.post("/v1/completions", json=body)
                    assert reply.status_code == 200
                nope = await client.post("/v1/completions", json={"model": "x", "prompt": "y"})
                assert nope.status_code == 404
            (signals,) = model_signals(gateway)  # the unknown model is not counted
        finally:
            await gateway.stop()
    assert (signals.model, signals.arrivals, signals.answered) == ("m", 2, 2)
    assert signals.in_flight == 0 and signals.ttft_counts[-1] == 2
    itl = observations(signals.itl_counts)
    if not stream:
        assert sum(itl) == 0
        assert signals.ttft_counts[bucket_of(200)] == 0  # a whole answer: 8 tokens x 40 ms
        return
    assert sum(itl) >= 2 * 6  # at least the gaps between 8 tokens, per request
    at_least_20ms = sum(itl[bucket_of(20) + 1 :])
    assert at_least_20ms >= 0.8 * sum(itl)  # paced at 40 ms, not read all at once
    assert signals.itl_counts[bucket_of(1000)] == signals.itl_counts[-1]
