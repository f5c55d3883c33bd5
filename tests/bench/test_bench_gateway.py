"""bench/gateway.py and bench/gwbench: the upstream, the client, the
measurement and the verdicts, on tiny runs.

The peer routers (vllm-router, sglang-router) are not needed: the harness is checked direct to
its upstream and through our own gateway, in-process and as the benchmark starts it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench import gateway as bench_gateway
from bench import kit
from bench.gwbench import load, report
from bench.gwbench import profile as prof
from bench.gwbench import settings as cfg
from bench.gwbench import upstream as up
from bench.gwbench import workload as wl


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Any, list[int]]]:
    """Two upstream replicas in this process: 3 SSE events 5 ms apart; render refused."""
    loop = asyncio.get_running_loop()
    shared = up.Upstream(render=False)
    servers = [
        await loop.create_server(
            functools.partial(up.UpstreamProtocol, up.Replies.build(i, 3, 5.0), shared),
            "127.0.0.1",
            0,
        )
        for i in range(2)
    ]
    try:
        yield shared, [s.sockets[0].getsockname()[1] for s in servers]
    finally:
        for s in servers:
            s.close()
            await s.wait_closed()


def _get(port: int, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()


def _post(port: int, path: str, body: object) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


# -- the workload -------------------------------------------------------------------------


def test_prompts_share_one_system_prompt_per_group_and_are_shuffled() -> None:
    prompts = wl.make_prompts(3, 4, 500, 100)
    assert prompts == wl.make_prompts(3, 4, 500, 100)  # the same run after run
    assert len(prompts) == 12 and Counter(p.group for p in prompts) == {0: 4, 1: 4, 2: 4}
    systems = {p.group: p.system for p in prompts}
    assert all(p.system == systems[p.group] for p in prompts)
    assert len(set(systems.values())) == 3 and len({p.user for p in prompts}) == 12
    assert all(len(p.system) >= 500 and len(p.user) >= 100 for p in prompts)
    assert [p.group for p in prompts] != sorted(p.group for p in prompts)
    body = json.loads(wl.chat_request(1, prompts[0], True).split(b"\r\n\r\n", 1)[1])
    assert body["stream"] is True and body["messages"][0]["content"] == prompts[0].system


# -- the upstream and the client ----------------------------------------------------------


async def test_upstream_answers_each_route_on_one_keep_alive_connection(
    upstream: tuple[Any, list[int]],
) -> None:
    shared, ports = upstream
    prompt = wl.make_prompts(1, 1, 50, 20)[0]
    conn = await load.TimedConnection.open(ports[1])
    try:
        reply = await conn.request(wl.chat_request(ports[1], prompt, False))
        assert load.replica_of(reply, False, 3) == 1 and math.isnan(reply.first_data)
        assert json.loads(reply.body)["object"] == "chat.completion"
        reply = await conn.request(_post(ports[1], "/v1/completions", {"prompt": "hi"}))
        assert json.loads(reply.body)["choices"][0]["text"] == "ok"
        reply = await conn.request(wl.chat_request(ports[1], prompt, True))
        assert load.replica_of(reply, True, 3) == 1 and not reply.close
        assert reply.body.count(b"data: ") == 4 and reply.body.endswith(b"data: [DONE]\n\n")
        health = await conn.request(_get(ports[1], "/health"))
        assert (health.status, health.body) == (200, b"ok")
        tokens = await conn.request(_post(ports[1], "/tokenize", {"prompt": "abcdefgh"}))
        assert json.loads(tokens.body)["tokens"] == [1684234849 % 151_000, 1751606885 % 151_000]
        refused = await conn.request(_post(ports[1], "/v1/chat/completions/render", {}))
        assert refused.status == 403 and b"enable-scale-out" in refused.body
        missing = await conn.request(_get(ports[1], "/nowhere"))
        assert missing.status == 404
    finally:
        conn.close()
    assert shared.seen[b"/v1/chat/completions"] == 2 and shared.seen[b"/tokenize"] == 1


async def test_first_data_is_when_the_first_event_arrives(upstream: tuple[Any, list[int]]) -> None:
    _, ports = upstream
    raw = wl.chat_request(ports[0], wl.make_prompts(1, 1, 9, 9)[0], True)
    conn = await load.TimedConnection.open(ports[0])
    try:
        start = time.perf_counter()
        reply = await conn.request(raw)
        whole = time.perf_counter() - start
    finally:
        conn.close()
    first = reply.first_data - start
    assert 0.004 <= first < whole  # one 5 ms gap before the first event, three more after
    assert whole >= 0.015


def test_render_answers_stand_in_token_ids_only_with_scale_out_on() -> None:
    chat = json.dumps({"messages": [{"role": "user", "content": "abcdefg"}]}).encode()
    expected = [int.from_bytes(chunk, "little") % 151_000 for chunk in (b"abcd", b"efg")]

    def answer(reply: bytes) -> tuple[bytes, Any]:
        head, body = reply.split(b"\r\n\r\n", 1)
        return head.split(b"\r\n")[0], json.loads(body)

    on, off = up.Upstream(render=True), up.Upstream(render=False)
    status, body = answer(on.tokenize(b"/v1/chat/completions/render", chat))
    assert status == b"HTTP/1.1 200 OK" and body["token_ids"] == expected
    status, body = answer(on.tokenize(b"/v1/completions/render", b'{"prompt": "abcdefg"}'))
    assert status == b"HTTP/1.1 200 OK" and body[0]["token_ids"] == expected
    assert answer(off.tokenize(b"/v1/chat/completions/render", chat))[0].endswith(b"403 Forbidden")
    assert answer(off.tokenize(b"/tokenize", chat))[1]["tokens"] == expected
    assert answer(on.tokenize(b"/tokenize", b"{not json"))[0].endswith(b"400 Bad Request")


def test_replica_of_refuses_what_the_upstream_would_not_send() -> None:
    good = b'data: {"system_fingerprint":"r2"}\n\ndata: [DONE]\n\n'
    assert load.replica_of(kit.Reply(200, good, False, 0.0), True, 1) == 2
    for reply, stream in [
        (kit.Reply(502, good, False, 0.0), True),  # an error status
        (kit.Reply(200, good[:-16], False, 0.0), True),  # no [DONE]
        (kit.Reply(200, b"{}", False, 0.0), False),  # no replica named
    ]:
        with pytest.raises(ValueError):
            load.replica_of(reply, stream, 1)
    with pytest.raises(ValueError, match="2 events"):
        load.replica_of(kit.Reply(200, good, False, 0.0), True, 3)


async def test_the_client_reads_chunked_and_sized_replies_however_they_are_split() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    sized = b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno"
    loop = asyncio.get_running_loop()
    conn, replies = kit.Connection(), []
    conn.waiter = loop.create_future()
    raw = chunked + sized
    for byte in (raw[i : i + 1] for i in range(len(raw))):
        conn.data_received(byte)
        if conn.waiter.done():
            replies.append(conn.waiter.result())
            conn.waiter = loop.create_future()
    assert [(r.status, r.body, r.close) for r in replies] == [
        (200, b"abcde", False),
        (404, b"no", True),
    ]
    assert not conn.buf and math.isnan(replies[0].first_data)  # only TimedConnection times
    conn.data_received(b"HTTP/1.1 200 OK\r\n\r\n")  # no framing: the request fails
    with pytest.raises(ValueError, match="without framing"):
        conn.waiter.result()


async def test_a_noisy_cell_is_run_again_and_the_quietest_run_kept() -> None:
    @dataclass
    class Run:
        others_share: float
        attempts: int = 0

    def runs(*shares: float) -> Callable[[], Awaitable[Run]]:
        queue = [Run(s) for s in shares]

        async def run() -> Run:
            return queue.pop(0)

        return run

    seen: list[Run] = []
    kept = await kit.quietest(runs(0.5, 0.3, 0.4, 0.0), 3, 0.1, 0.0, seen.append)
    assert (kept.others_share, kept.attempts) == (0.3, 2) and len(seen) == 3  # 3 runs at most
    kept = await kit.quietest(runs(0.5, 0.05, 0.0), 3, 0.1, 0.0, seen.append)
    assert (kept.others_share, kept.attempts) == (0.05, 2) and len(seen) == 5  # quiet: done


def test_sigterm_cancels_the_running_benchmark_and_reads_as_ctrl_c() -> None:
    seen: list[str] = []

    def before(signum: int, frame: object) -> None:  # the sync phases' handler; stays after
        seen.append("before")

    async def bench() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(10)
        finally:
            seen.append("cleaned up")

    previous = signal.signal(signal.SIGTERM, before)
    try:
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            kit.run_interruptible(bench(), asyncio.new_event_loop)
        assert time.monotonic() - start < 5 and seen == ["cleaned up"]
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- cells: measured windows ---------------------------------------------------------------


def _work(kind: str, ports: list[int], conns: int) -> Any:
    prompts = wl.make_prompts(4, 4, 300, 50)
    stream = kind == "stream"
    requests = {p: [wl.chat_request(p, x, stream) for x in prompts] for p in ports}
    return load.Work(kind, conns, stream, 3, requests, [x.group for x in prompts])


async def test_a_direct_cell_counts_every_reply_in_its_window(
    upstream: tuple[Any, list[int]],
) -> None:
    _, ports = upstream
    cpu = min(os.sched_getaffinity(0))
    meter = load.Meter(None, os.getpid(), cpu, cpu)
    timing = cfg.Timing(seconds=0.4, warmup_s=0.1)
    cell = await load.run_cell("direct", ports, _work("rps", ports, 4), meter, 0, timing)
    assert cell.requests > 20 and cell.requests == len(cell.latencies_s)
    assert cell.latencies_s == sorted(cell.latencies_s) and cell.first_data_s == []
    assert 0.35 <= cell.window_s <= 0.45 and cell.rps == cell.requests / cell.window_s
    assert sum(cell.routes.values()) == cell.requests
    assert load.busiest_share(cell.routes) == pytest.approx(0.5, abs=0.1)  # 2 conns a port
    assert math.isnan(cell.proxy_cpu_s) and math.isnan(cell.cpu_us_per_request)
    assert cell.upstream_cpu_s > 0  # here the upstream is this process


async def test_a_stream_cell_times_the_first_event_of_every_reply(
    upstream: tuple[Any, list[int]],
) -> None:
    _, ports = upstream
    cpu = min(os.sched_getaffinity(0))
    meter = load.Meter(None, None, cpu, cpu)
    work = _work("stream", ports[:1], 1)
    timing = cfg.Timing(seconds=0.3, warmup_s=0.05)
    cell = await load.run_cell("direct", ports[:1], work, meter, 0, timing)
    assert len(cell.first_data_s) == cell.requests >= 5
    assert cell.first_data_s[0] >= 0.004 and cell.first_data_us(0.99) < cell.latency_us(0.5)
    assert load.busiest_share(cell.routes) == 1.0 and load.stickiness(cell.routes) == 1.0


@pytest.mark.integration
async def test_the_gateway_as_the_benchmark_starts_it_round_robins_and_streams(
    tmp_path: Path,
) -> None:
    settings = bench_gateway.settings_from(
        bench_gateway.parse_main(
            ["--quick", "--replicas", "2", "--only", "llmgw", "--chunks", "2", "--token-ms", "1"]
        )
    )
    upstream, children = bench_gateway.start_children(settings, tmp_path)
    try:
        assert (
            set(children) == {"llmgw round_robin", "llmgw prefix", "llmgw prefix keyed"}
            and len(upstream.ports) == 2
        )
        gateway = children["llmgw round_robin"]
        prompts = wl.make_prompts(2, 4, 300, 50)
        await bench_gateway.wait_ready(
            gateway, wl.chat_request(gateway.ports[0], prompts[0], False)
        )
        meter = load.Meter(
            gateway.proc.pid, upstream.proc.pid, settings.proxy_cpu, settings.client_cpu
        )
        timing = cfg.Timing(seconds=0.5, warmup_s=0.1)
        for kind, conns in (("rps", 4), ("stream", 1)):
            work = load.make_work(kind, settings, gateway.ports, prompts)
            work = load.Work(kind, conns, work.stream, 2, work.requests, work.groups)
            cell = await load.run_cell("llmgw round_robin", gateway.ports, work, meter, 0, timing)
            assert cell.requests > 0 and cell.proxy_cpu_s > 0 and cell.upstream_cpu_s > 0
            assert load.busiest_share(cell.routes) == pytest.approx(0.5, abs=0.05)
        assert len(cell.first_data_s) == cell.requests
    finally:
        for child in (*children.values(), upstream):
            child.stop()
    assert all(c.proc.returncode == 0 for c in (*children.values(), upstream))
    assert "upstream served: /v1/chat/completions" in upstream.log_tail()


# -- the report ---------------------------------------------------------------------------


def _cell(proxy: str, kind: str, rep: int, **values: Any) -> Any:
    fields: dict[str, Any] = {
        "window_s": 1.0, "requests": 1000, "latencies_s": [0.001] * 10, "first_data_s": [],
        "proxy_cpu_s": math.nan, "client_cpu_s": 0.2, "upstream_cpu_s": 0.1,
        "others_cpu_s": 0.0, "irq_cpu_s": 0.0, "client_others_cpu_s": 0.0,
        "routes": Counter({(0, 0): 500, (1, 1): 500}),
    }  # fmt: skip
    return load.Cell(proxy=proxy, kind=kind, rep=rep, **(fields | values))


def _run(ours_rr_cpu: float, first_data_s: float) -> list[Any]:
    """Cells of 3 reps where vllm-router spends 100 µs (round-robin) and 400 µs (cache_aware)
    of CPU a request, and direct's first event arrives after 2 ms."""
    cpu = {"llmgw round_robin": ours_rr_cpu, "llmgw prefix": 150e-6,
           "vllm-router round_robin": 100e-6, "vllm-router cache_aware": 400e-6,
           "sglang-router round_robin": 120e-6, "sglang-router cache_aware": 130e-6}  # fmt: skip
    cells = []
    for rep in range(3):
        cells.append(_cell("direct", "rps", rep))
        cells.append(_cell("direct", "stream", rep, first_data_s=[0.002] * 10))
        for name, per_request in cpu.items():
            cells.append(_cell(name, "rps", rep, proxy_cpu_s=1000 * per_request * (1 + rep / 100)))
            first = first_data_s if name.startswith("llmgw") else 0.045
            cells.append(_cell(name, "stream", rep, first_data_s=[first] * 10))
    return cells


def test_verdicts_compare_with_vllm_router_and_direct_in_the_same_run() -> None:
    settings = bench_gateway.settings_from(bench_gateway.parse_main(["--quick", "--only", "llmgw"]))
    summaries = report.summarize(_run(140e-6, 0.0025), settings)
    cpu = summaries[f"{settings.conns} conns: proxy CPU µs/request"]
    assert cpu.median("vllm-router round_robin") == pytest.approx(101)  # the middle rep
    assert cpu.ratio("llmgw round_robin", "vllm-router round_robin") == pytest.approx(1.4)
    added = summaries["stream: added first data p50 µs"]
    assert added.median("llmgw prefix") == pytest.approx(500)
    assert added.median("sglang-router round_robin") == pytest.approx(43_000)
    verdicts = report.verdicts(summaries, settings)
    assert [v.split(":")[0] for v in verdicts] == ["MET"] * 4
    missed = report.verdicts(report.summarize(_run(160e-6, 0.0035), settings), settings)
    assert [v.split(":")[0] for v in missed] == ["MISSED", "MET", "MISSED", "MISSED"]
    assert "1.60×" in missed[0] and "1,500 µs after direct's" in missed[2]
    alone = [c for c in _run(140e-6, 0.0025) if c.proxy.startswith(("direct", "llmgw"))]
    alone_verdicts = report.verdicts(report.summarize(alone, settings), settings)
    assert [v.split(":")[0] for v in alone_verdicts] == ["NOT MEASURED"] * 2 + ["MET"] * 2
    text = report.render(settings, {"cpu": "test"}, _run(140e-6, 0.0025), markdown=True)
    assert "| 32 conns: proxy CPU µs/request | – | 141 (140–143) | 101 (100–102) |" in text


def test_stickiness_and_busiest_share() -> None:
    routes = Counter({(0, 0): 9, (0, 1): 1, (1, 1): 10})
    assert load.stickiness(routes) == pytest.approx(19 / 20)
    assert load.busiest_share(routes) == pytest.approx(11 / 20)
    assert math.isnan(load.stickiness(Counter())) and math.isnan(load.busiest_share(Counter()))
    assert kit.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert kit.percentile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0


def test_a_py_spy_profile_is_summed_by_innermost_frame() -> None:
    raw = (
        "run (asyncio/runners.py:86);send (llmgw/server/router/upstream.py:166) 30\n"
        "run (asyncio/runners.py:86);_route (llmgw/server/router/gateway.py:209) 10\n"
        "run (asyncio/runners.py:86);_route (llmgw/server/router/gateway.py:209);"
        "send (llmgw/server/router/upstream.py:166) 20\n"
        "run (asyncio/runners.py:86) 40\n"
    )
    profile = prof.parse_raw_profile("llmgw prefix", raw)
    assert profile.samples == 100
    assert profile.self_by_file == {
        "llmgw/server/router/upstream.py": 50,
        "asyncio/runners.py": 40,
        "llmgw/server/router/gateway.py": 10,
    }
    assert profile.self_by_function["send (llmgw/server/router/upstream.py:166)"] == 50
    lines = prof.profile_lines(profile, top=1)
    assert lines[1] == "  50.0%  llmgw/server/router/upstream.py"


def test_noise_is_read_on_the_cpu_that_matters_to_the_cell() -> None:
    # direct uses no proxy core (others move there when the client's core is busy)
    direct = _cell("direct", "rps", 0, others_cpu_s=0.9, client_others_cpu_s=0.05)
    proxied = _cell("llmgw prefix", "rps", 0, others_cpu_s=0.2, client_others_cpu_s=0.9)
    assert direct.others_share == pytest.approx(0.05)
    assert proxied.others_share == pytest.approx(0.2)
