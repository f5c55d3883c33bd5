"""The gateway's /metrics: well-formed Prometheus text, and counters that move with traffic."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx

from llmgw.gateway.app import Gateway, GatewayConfig
from llmgw.gateway.metrics import GatewayMetrics, Histogram
from llmgw.gateway.routing.table import RoutingTable, Target

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')

Labels = frozenset[tuple[str, str]]


@dataclass
class Family:
    kind: str
    help: str
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)


def parse_exposition(text: str) -> dict[str, Family]:
    """Text format 0.0.4, strictly: HELP and TYPE before a family's samples, one family at a
    time, sample names that belong to their family's type, labels well quoted."""
    families: dict[str, Family] = {}
    current: str | None = None
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, help_ = line[7:].split(" ", 1)
            assert name not in families, f"{name} declared twice"
            families[name] = Family("", help_)
            current = name
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert name == current and kind in ("counter", "gauge", "histogram"), line
            families[name].kind = kind
        else:
            match = _SAMPLE.match(line)
            assert match is not None and current is not None, f"malformed: {line!r}"
            name, labels_text, value = match.groups()
            allowed = (
                {current}
                if families[current].kind != "histogram"
                else {f"{current}_bucket", f"{current}_sum", f"{current}_count"}
            )
            assert name in allowed, f"{name} outside its family {current}"
            labels = _labels(labels_text or "")
            families[current].samples[(name, labels)] = float(value)
    return families


def _labels(text: str) -> Labels:
    pairs = []
    while text:
        match = _LABEL.match(text)
        assert match is not None, f"malformed labels: {text!r}"
        pairs.append((match.group(1), match.group(2)))
        text = text[match.end() :]
    return frozenset(pairs)


def check_histogram(family: Family, name: str, **labels: str) -> tuple[float, float]:
    """Buckets cumulative and ending at +Inf == _count; returns (count, sum)."""
    wanted = set(labels.items())
    buckets = sorted(
        (math.inf if dict(ls)["le"] == "+Inf" else float(dict(ls)["le"]), value)
        for (n, ls), value in family.samples.items()
        if n == f"{name}_bucket" and wanted <= ls
    )
    assert buckets and buckets[-1][0] == math.inf
    counts = [value for _, value in buckets]
    assert counts == sorted(counts), "buckets must be cumulative"
    count = family.samples[(f"{name}_count", frozenset(wanted))]
    total = family.samples[(f"{name}_sum", frozenset(wanted))]
    assert counts[-1] == count
    return count, total


def test_histogram_buckets_are_cumulative_with_le_semantics() -> None:
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(value)
    lines = list(histogram.lines("h", 'model="m",'))
    assert lines == [
        'h_bucket{model="m",le="0.1"} 2',  # 0.1 falls in le=0.1
        'h_bucket{model="m",le="1.0"} 3',
        'h_bucket{model="m",le="+Inf"} 4',
        'h_sum{model="m"} 3.65',
        'h_count{model="m"} 4',
    ]


def test_render_is_valid_exposition_with_escaped_labels() -> None:
    metrics = GatewayMetrics()
    metrics.request_done(200, "m", "/v1/completions")
    metrics.request_done(200, "m", "/v1/completions")
    metrics.request_done(503, 'we"ird', "/v1/chat/completions")
    metrics.request_done(401)  # refused before its head was read
    metrics.decided("approximate", "hit", 3e-5)
    metrics.first_byte('we"ird\\model\n', 0.2)
    metrics.finished("m", 1.5)
    families = parse_exposition(metrics.render({"r1": 2, "r2": 0}).decode())
    requests = families["llmgw_requests_total"]
    assert requests.kind == "counter"
    done = frozenset({("model", "m"), ("route", "/v1/completions"), ("status", "200")})
    assert requests.samples[("llmgw_requests_total", done)] == 2
    refused = frozenset({("model", "unknown"), ("route", "unknown"), ("status", "401")})
    assert requests.samples[("llmgw_requests_total", refused)] == 1
    assert len(requests.samples) == 3  # the escaped model label parsed back as one sample
    decisions = families["llmgw_prefix_decisions_total"].samples
    key = ("llmgw_prefix_decisions_total", frozenset({("tier", "approximate"), ("outcome", "hit")}))
    assert decisions[key] == 1
    assert check_histogram(
        families["llmgw_router_decision_seconds"], "llmgw_router_decision_seconds"
    ) == (1, 3e-5)
    ttft = families["llmgw_upstream_ttft_seconds"]
    assert (
        check_histogram(ttft, "llmgw_upstream_ttft_seconds", model='we\\"ird\\\\model\\n')[0] == 1
    )
    in_flight = families["llmgw_replica_in_flight"]
    assert in_flight.kind == "gauge"
    assert in_flight.samples[("llmgw_replica_in_flight", frozenset({("replica", "r1")}))] == 2


async def _fixed_upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request: JSON, or two server-sent events when the body asks to stream."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = json.loads(await reader.readexactly(length))
            if body.get("stream"):
                events = b"data: {}\n\ndata: [DONE]\n\n"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                    % (len(events), events)
                )
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@asynccontextmanager
async def gateway_with_upstream() -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    upstream = await asyncio.start_server(_fixed_upstream, "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]
    targets = [
        Target("r1", "m", f"http://127.0.0.1:{port}"),
        Target("r2", "other", "http://127.0.0.1:9", ready=False),
    ]
    gateway = Gateway(RoutingTable(targets), GatewayConfig(port=0, policy="prefix"))
    host, gw_port = await gateway.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://{host}:{gw_port}") as client:
            yield gateway, client
    finally:
        await gateway.stop()
        upstream.close()
        await upstream.wait_closed()


async def test_metrics_move_with_traffic() -> None:
    async with gateway_with_upstream() as (_, client):
        prompt = "A long shared system prompt. " * 10
        for index in range(3):
            reply = await client.post(
                "/v1/completions", json={"model": "m", "prompt": prompt + str(index)}
            )
            assert reply.status_code == 200
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        assert (
            await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        ).status_code == 404
        reply = await client.get("/metrics")
    assert reply.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = parse_exposition(reply.text)
    requests = {
        tuple(sorted(dict(labels).items())): value
        for (_, labels), value in families["llmgw_requests_total"].samples.items()
    }

    def labels(model: str, route: str, status: str) -> tuple[tuple[str, str], ...]:
        return (("model", model), ("route", route), ("status", status))

    assert requests == {
        labels("m", "/v1/completions", "200"): 3,
        labels("m", "/v1/chat/completions", "200"): 1,
        labels("unknown", "/v1/completions", "404"): 1,  # "nope": no replica serves it
    }
    decisions = families["llmgw_prefix_decisions_total"].samples
    by_tier = {
        tuple(sorted(dict(labels).items())): value for (_, labels), value in decisions.items()
    }
    assert by_tier[(("outcome", "miss"), ("tier", "load"))] == 2  # the first prompt, the chat
    assert by_tier[(("outcome", "hit"), ("tier", "approximate"))] == 2  # the shared prefix
    count, total = check_histogram(
        families["llmgw_router_decision_seconds"], "llmgw_router_decision_seconds"
    )
    assert count == 4 and 0 < total < 1
    ttft = families["llmgw_upstream_ttft_seconds"]
    assert check_histogram(ttft, "llmgw_upstream_ttft_seconds", model="m")[0] == 1  # the stream
    latency = families["llmgw_upstream_latency_seconds"]
    assert check_histogram(latency, "llmgw_upstream_latency_seconds", model="m")[0] == 4
    in_flight = families["llmgw_replica_in_flight"].samples
    assert in_flight == {
        ("llmgw_replica_in_flight", frozenset({("replica", "r1")})): 0,
        ("llmgw_replica_in_flight", frozenset({("replica", "r2")})): 0,
    }
