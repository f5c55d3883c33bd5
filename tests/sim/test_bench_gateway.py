"""scripts/bench_gateway.py: its upstream, client, measurement and verdicts, on tiny runs.

The peer routers (vllm-router, sglang-router) are not needed: the harness is checked direct to
its upstream and through our own gateway, in-process and as the benchmark starts it.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The script as a module (it imports benchkit from its own directory)."""
    spec = importlib.util.spec_from_file_location("bench_gateway", SCRIPTS / "bench_gateway.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(SCRIPTS))
        patch.setitem(sys.modules, "bench_gateway", module)  # dataclasses look it up
        spec.loader.exec_module(module)
    return module


@pytest.fixture
async def upstream(bench: ModuleType) -> AsyncIterator[tuple[Any, list[int]]]:
    """Two upstream replicas in this process: 3 SSE events 5 ms apart; render refused."""
    loop = asyncio.get_running_loop()
    shared = bench.Upstream(render=False)
    servers = [
        await loop.create_server(
            functools.partial(bench.UpstreamProtocol, bench.Replies.build(i, 3, 5.0), shared),
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


def test_prompts_share_one_system_prompt_per_group_and_are_shuffled(bench: ModuleType) -> None:
    prompts = bench.make_prompts(3, 4, 500, 100)
    assert prompts == bench.make_prompts(3, 4, 500, 100)  # the same run after run
    assert len(prompts) == 12 and Counter(p.group for p in prompts) == {0: 4, 1: 4, 2: 4}
    systems = {p.group: p.system for p in prompts}
    assert all(p.system == systems[p.group] for p in prompts)
    assert len(set(systems.values())) == 3 and len({p.user for p in prompts}) == 12
    assert all(len(p.system) >= 500 and len(p.user) >= 100 for p in prompts)
    assert [p.group for p in prompts] != sorted(p.group for p in prompts)
    body = json.loads(bench.chat_request(1, prompts[0], True).split(b"\r\n\r\n", 1)[1])
    assert body["stream"] is True and body["messages"][0]["content"] == prompts[0].system


# -- the upstream and the client ----------------------------------------------------------


async def test_upstream_answers_each_route_on_one_keep_alive_connection(
    bench: ModuleType, upstream: tuple[Any, list[int]]
) -> None:
    shared, ports = upstream
    prompt = bench.make_prompts(1, 1, 50, 20)[0]
    conn = await bench.Connection.open(ports[1])
    try:
        reply = await conn.request(bench.chat_request(ports[1], prompt, False))
        assert bench.replica_of(reply, False, 3) == 1 and math.isnan(reply.first_data)
        assert json.loads(reply.body)["object"] == "chat.completion"
        reply = await conn.request(_post(ports[1], "/v1/completions", {"prompt": "hi"}))
        assert json.loads(reply.body)["choices"][0]["text"] == "ok"
        reply = await conn.request(bench.chat_request(ports[1], prompt, True))
        assert bench.replica_of(reply, True, 3) == 1 and not reply.close
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


async def test_first_data_is_when_the_first_event_arrives(
    bench: ModuleType, upstream: tuple[Any, list[int]]
) -> None:
    _, ports = upstream
    raw = bench.chat_request(ports[0], bench.make_prompts(1, 1, 9, 9)[0], True)
    conn = await bench.Connection.open(ports[0])
    try:
        start = time.perf_counter()
        reply = await conn.request(raw)
        whole = time.perf_counter() - start
    finally:
        conn.close()
    first = reply.first_data - start
    assert 0.004 <= first < whole  # one 5 ms gap before the first event, three more after
    assert whole >= 0.015


def test_render_answers_stand_in_token_ids_only_with_scale_out_on(bench: ModuleType) -> None:
    chat = json.dumps({"messages": [{"role": "user", "content": "abcdefg"}]}).encode()
    expected = [int.from_bytes(chunk, "little") % 151_000 for chunk in (b"abcd", b"efg")]

    def answer(reply: bytes) -> tuple[bytes, Any]:
        head, body = reply.split(b"\r\n\r\n", 1)
        return head.split(b"\r\n")[0], json.loads(body)

    on, off = bench.Upstream(render=True), bench.Upstream(render=False)
    status, body = answer(on.tokenize(b"/v1/chat/completions/render", chat))
    assert status == b"HTTP/1.1 200 OK" and body["token_ids"] == expected
    status, body = answer(on.tokenize(b"/v1/completions/render", b'{"prompt": "abcdefg"}'))
    assert status == b"HTTP/1.1 200 OK" and body[0]["token_ids"] == expected
    assert answer(off.tokenize(b"/v1/chat/completions/render", chat))[0].endswith(b"403 Forbidden")
    assert answer(off.tokenize(b"/tokenize", chat))[1]["tokens"] == expected
    assert answer(on.tokenize(b"/tokenize", b"{not json"))[0].endswith(b"400 Bad Request")


def test_replica_of_refuses_what_the_upstream_would_not_send(bench: ModuleType) -> None:
    good = b'data: {"system_fingerprint":"r2"}\n\ndata: [DONE]\n\n'
    assert bench.replica_of(bench.Reply(200, good, False, 0.0), True, 1) == 2
    for reply, stream in [
        (bench.Reply(502, good, False, 0.0), True),  # an error status
        (bench.Reply(200, good[:-16], False, 0.0), True),  # no [DONE]
        (bench.Reply(200, b"{}", False, 0.0), False),  # no replica named
    ]:
        with pytest.raises(ValueError):
            bench.replica_of(reply, stream, 1)
    with pytest.raises(ValueError, match="2 events"):
        bench.replica_of(bench.Reply(200, good, False, 0.0), True, 3)


# -- cells: measured windows ---------------------------------------------------------------


def _work(bench: ModuleType, kind: str, ports: list[int], conns: int) -> Any:
    prompts = bench.make_prompts(4, 4, 300, 50)
    stream = kind == "stream"
    requests = {p: [bench.chat_request(p, x, stream) for x in prompts] for p in ports}
    return bench.Work(kind, conns, stream, 3, requests, [x.group for x in prompts])


async def test_a_direct_cell_counts_every_reply_in_its_window(
    bench: ModuleType, upstream: tuple[Any, list[int]]
) -> None:
    _, ports = upstream
    cpu = min(os.sched_getaffinity(0))
    meter = bench.Meter(None, os.getpid(), cpu, cpu)
    timing = bench.Timing(seconds=0.4, warmup_s=0.1)
    cell = await bench.run_cell("direct", ports, _work(bench, "rps", ports, 4), meter, 0, timing)
    assert cell.requests > 20 and cell.requests == len(cell.latencies_s)
    assert cell.latencies_s == sorted(cell.latencies_s) and cell.first_data_s == []
    assert 0.35 <= cell.window_s <= 0.45 and cell.rps == cell.requests / cell.window_s
    assert sum(cell.routes.values()) == cell.requests
    assert bench.busiest_share(cell.routes) == pytest.approx(0.5, abs=0.1)  # 2 conns a port
    assert math.isnan(cell.proxy_cpu_s) and math.isnan(cell.cpu_us_per_request)
    assert cell.upstream_cpu_s > 0  # here the upstream is this process


async def test_a_stream_cell_times_the_first_event_of_every_reply(
    bench: ModuleType, upstream: tuple[Any, list[int]]
) -> None:
    _, ports = upstream
    cpu = min(os.sched_getaffinity(0))
    meter = bench.Meter(None, None, cpu, cpu)
    work = _work(bench, "stream", ports[:1], 1)
    timing = bench.Timing(seconds=0.3, warmup_s=0.05)
    cell = await bench.run_cell("direct", ports[:1], work, meter, 0, timing)
    assert len(cell.first_data_s) == cell.requests >= 5
    assert cell.first_data_s[0] >= 0.004 and cell.first_data_us(0.99) < cell.latency_us(0.5)
    assert bench.busiest_share(cell.routes) == 1.0 and bench.stickiness(cell.routes) == 1.0


@pytest.mark.integration
async def test_the_gateway_as_the_benchmark_starts_it_round_robins_and_streams(
    bench: ModuleType, tmp_path: Path
) -> None:
    settings = bench.settings_from(
        bench.parse_main(
            ["--quick", "--replicas", "2", "--only", "llmgw", "--chunks", "2", "--token-ms", "1"]
        )
    )
    upstream, children = bench.start_children(settings, tmp_path)
    try:
        assert set(children) == {"llmgw round_robin", "llmgw prefix"} and len(upstream.ports) == 2
        gateway = children["llmgw round_robin"]
        prompts = bench.make_prompts(2, 4, 300, 50)
        await bench.wait_ready(gateway, bench.chat_request(gateway.ports[0], prompts[0], False))
        meter = bench.Meter(
            gateway.proc.pid, upstream.proc.pid, settings.proxy_cpu, settings.client_cpu
        )
        timing = bench.Timing(seconds=0.5, warmup_s=0.1)
        for kind, conns in (("rps", 4), ("stream", 1)):
            work = bench.make_work(kind, settings, gateway.ports, prompts)
            work = bench.Work(kind, conns, work.stream, 2, work.requests, work.groups)
            cell = await bench.run_cell("llmgw round_robin", gateway.ports, work, meter, 0, timing)
            assert cell.requests > 0 and cell.proxy_cpu_s > 0 and cell.upstream_cpu_s > 0
            assert bench.busiest_share(cell.routes) == pytest.approx(0.5, abs=0.05)
        assert len(cell.first_data_s) == cell.requests
    finally:
        for child in (*children.values(), upstream):
            child.stop()
    assert all(c.proc.returncode == 0 for c in (*children.values(), upstream))
    assert "upstream served: /v1/chat/completions" in upstream.log_tail()


# -- the report ---------------------------------------------------------------------------


def _cell(bench: ModuleType, proxy: str, kind: str, rep: int, **values: Any) -> Any:
    fields: dict[str, Any] = {
        "window_s": 1.0, "requests": 1000, "latencies_s": [0.001] * 10, "first_data_s": [],
        "proxy_cpu_s": math.nan, "client_cpu_s": 0.2, "upstream_cpu_s": 0.1,
        "others_cpu_s": 0.0, "irq_cpu_s": 0.0, "client_others_cpu_s": 0.0,
        "routes": Counter({(0, 0): 500, (1, 1): 500}),
    }  # fmt: skip
    return bench.Cell(proxy=proxy, kind=kind, rep=rep, **(fields | values))


def _run(bench: ModuleType, ours_rr_cpu: float, first_data_s: float) -> list[Any]:
    """Cells of 3 reps where vllm-router spends 100 µs (round-robin) and 400 µs (cache_aware)
    of CPU a request, and direct's first event arrives after 2 ms."""
    cpu = {"llmgw round_robin": ours_rr_cpu, "llmgw prefix": 150e-6,
           "vllm-router round_robin": 100e-6, "vllm-router cache_aware": 400e-6,
           "sglang-router round_robin": 120e-6, "sglang-router cache_aware": 130e-6}  # fmt: skip
    cells = []
    for rep in range(3):
        cells.append(_cell(bench, "direct", "rps", rep))
        cells.append(_cell(bench, "direct", "stream", rep, first_data_s=[0.002] * 10))
        for name, per_request in cpu.items():
            cells.append(
                _cell(bench, name, "rps", rep, proxy_cpu_s=1000 * per_request * (1 + rep / 100))
            )
            first = first_data_s if name.startswith("llmgw") else 0.045
            cells.append(_cell(bench, name, "stream", rep, first_data_s=[first] * 10))
    return cells


def test_verdicts_compare_with_vllm_router_and_direct_in_the_same_run(bench: ModuleType) -> None:
    settings = bench.settings_from(bench.parse_main(["--quick", "--only", "llmgw"]))
    summaries = bench.summarize(_run(bench, 140e-6, 0.0025), settings)
    cpu = summaries[f"{settings.conns} conns: proxy CPU µs/request"]
    assert cpu.median("vllm-router round_robin") == pytest.approx(101)  # the middle rep
    assert cpu.ratio("llmgw round_robin", "vllm-router round_robin") == pytest.approx(1.4)
    added = summaries["stream: added first data p50 µs"]
    assert added.median("llmgw prefix") == pytest.approx(500)
    assert added.median("sglang-router round_robin") == pytest.approx(43_000)
    verdicts = bench.verdicts(summaries, settings)
    assert [v.split(":")[0] for v in verdicts] == ["MET"] * 4
    missed = bench.verdicts(bench.summarize(_run(bench, 160e-6, 0.0035), settings), settings)
    assert [v.split(":")[0] for v in missed] == ["MISSED", "MET", "MISSED", "MISSED"]
    assert "1.60×" in missed[0] and "1,500 µs after direct's" in missed[2]
    alone = [c for c in _run(bench, 140e-6, 0.0025) if c.proxy.startswith(("direct", "llmgw"))]
    alone_verdicts = bench.verdicts(bench.summarize(alone, settings), settings)
    assert [v.split(":")[0] for v in alone_verdicts] == ["NOT MEASURED"] * 2 + ["MET"] * 2
    text = bench.render(settings, {"cpu": "test"}, _run(bench, 140e-6, 0.0025), markdown=True)
    assert "| 32 conns: proxy CPU µs/request | – | 141 (140–143) | 101 (100–102) |" in text


def test_stickiness_and_busiest_share(bench: ModuleType) -> None:
    routes = Counter({(0, 0): 9, (0, 1): 1, (1, 1): 10})
    assert bench.stickiness(routes) == pytest.approx(19 / 20)
    assert bench.busiest_share(routes) == pytest.approx(11 / 20)
    assert math.isnan(bench.stickiness(Counter())) and math.isnan(bench.busiest_share(Counter()))
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0


def test_a_py_spy_profile_is_summed_by_innermost_frame(bench: ModuleType) -> None:
    raw = (
        "run (asyncio/runners.py:86);send (llmgw/server/router/upstream.py:166) 30\n"
        "run (asyncio/runners.py:86);_route (llmgw/server/router/gateway.py:209) 10\n"
        "run (asyncio/runners.py:86);_route (llmgw/server/router/gateway.py:209);"
        "send (llmgw/server/router/upstream.py:166) 20\n"
        "run (asyncio/runners.py:86) 40\n"
    )
    profile = bench.parse_raw_profile("llmgw prefix", raw)
    assert profile.samples == 100
    assert profile.self_by_file == {
        "llmgw/server/router/upstream.py": 50,
        "asyncio/runners.py": 40,
        "llmgw/server/router/gateway.py": 10,
    }
    assert profile.self_by_function["send (llmgw/server/router/upstream.py:166)"] == 50
    lines = bench.profile_lines(profile, top=1)
    assert lines[1] == "  50.0%  llmgw/server/router/upstream.py"


def test_noise_is_read_on_the_cpu_that_matters_to_the_cell(bench: ModuleType) -> None:
    # direct uses no proxy core (others move there when the client's core is busy)
    direct = _cell(bench, "direct", "rps", 0, others_cpu_s=0.9, client_others_cpu_s=0.05)
    proxied = _cell(bench, "llmgw prefix", "rps", 0, others_cpu_s=0.2, client_others_cpu_s=0.9)
    assert direct.others_share == pytest.approx(0.05)
    assert proxied.others_share == pytest.approx(0.2)
