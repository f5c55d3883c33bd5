"""`llmgw demo --headless` as a user runs it, and the demo's workload and summary with values.

The headless run starts the whole system (server with its gateway, three simulated nodes,
simulated engines with KV events, traffic), so it proves on real processes what the
interactive demo shows in the console: every replica READY, every request answered,
decisions by tier from the gateway's /metrics, a prefix-cache hit rate from the engines,
and nothing left running afterwards. The workload and the summary's arithmetic are checked
against an in-memory transport and fixed metric texts.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.agent.process import is_running
from llmgw.agent.records import RecordStore
from llmgw.cli.demo import DEFAULT_LOAD_S, DEMO_DOCUMENT, demo_document
from llmgw.cli.demo_traffic import (
    DemoSummary,
    Workload,
    WorkloadConfig,
    WorkloadCounts,
    decisions_by_tier,
    render_summary,
)
from llmgw.promtext import metric_samples
from llmgw.server.core.profiles import parse_document

# --- the demo as a user runs it ------------------------------------------------------------


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that name ``text`` (the demo's state directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_headless_demo_serves_traffic_prints_a_summary_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    state = tmp_path / "demo"
    args = ["demo", "--headless", "--duration", "4", "--rate", "5", "--state-dir", str(state)]
    out = subprocess.run(
        [sys.executable, "-m", "llmgw", *args],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    tables, summary = out.stdout.split("llmgw demo: summary\n", 1)
    lines = tables.splitlines()
    rows = [line.split() for line in lines]
    nodes = {row[0]: row[1] for row in rows if len(row) > 2 and row[1] in ("READY", "NOT_READY")}
    assert nodes == {"dgx-1": "READY", "l4-1": "READY", "mig-1": "READY"}
    assert any("3g.40gb" in line for line in lines)  # MIG slices in the GPU table
    # by deployment, not by id: a replica refused a busy engine port (another test's engine
    # on CI) is replaced under the next id (chat-3 …), as it should be
    replicas = sorted(
        (row[1], row[3]) for row in rows if len(row) > 4 and row[1] in ("chat", "small", "tiny")
    )
    assert replicas == [("chat", "READY"), ("chat", "READY"), ("small", "READY"), ("tiny", "READY")]
    assert "replicas READY     4/4" in summary
    requests = re.search(r"(\d+) sent in \d+s: (\d+) ok, (\d+) failed", summary)
    assert requests is not None, summary
    sent, ok, failed = map(int, requests.groups())
    assert sent >= 5 and ok >= 5 and failed == 0, summary  # ~5/s for 4 s
    tiers = dict(re.findall(r"(\w+) (\d+) \(\d+ hits\)", summary))
    assert sum(map(int, tiers.values())) >= ok, summary  # every answered request was routed
    hit = re.search(r"hit rate (\d+)% \((\d+) of (\d+) prompt tokens", summary)
    assert hit is not None and int(hit.group(3)) > 0, summary
    server_log = (state / "logs" / "server.log").read_text()
    assert "node dgx-1 registered" in server_log and "Traceback" not in server_log
    assert not _processes_mentioning(str(state))  # server, agents: stopped
    for node in ("dgx-1", "mig-1", "l4-1"):
        records, _ = RecordStore(state / node / "engines").load_all()
        assert records, f"{node} ran no engine"
        assert not [r.shard_id for r in records if is_running(r.identity)]  # engines stopped


# --- the workload, against an in-memory gateway ----------------------------------------------


async def test_the_workload_shares_system_prompts_and_counts_every_outcome() -> None:
    seen: list[dict[str, Any]] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if body["messages"][1]["content"].startswith("Why"):
            return httpx.Response(503, text="no READY replica")
        return httpx.Response(200, json={"choices": [{"message": {"content": "ok"}}]})

    workload = Workload(
        "http://gateway.test", WorkloadConfig(rate=200.0), transport=httpx.MockTransport(gateway)
    )
    stop = asyncio.Event()
    runner = asyncio.create_task(workload.run(stop))
    await asyncio.sleep(0.3)
    stop.set()
    await runner
    counts = workload.counts()
    assert counts.sent == len(seen) >= 10
    assert counts.ok + counts.failed + counts.unfinished == counts.sent
    assert counts.failed == sum(b["messages"][1]["content"].startswith("Why") for b in seen) > 0
    assert workload.first_error == "HTTP 503: no READY replica"
    systems = {b["messages"][0]["content"] for b in seen}
    assert len(systems) <= 3 and all(len(s) > 500 for s in systems)  # few, long prefixes
    assert {b["model"] for b in seen} <= {"chat", "small", "tiny"}


def test_the_workload_is_reproducible_from_its_seed() -> None:
    one, two = Workload("http://x", seed=3), Workload("http://x", seed=3)
    assert [one.body() for _ in range(5)] == [two.body() for _ in range(5)]
    models = [one.body()["model"] for _ in range(300)]
    assert models.count("chat") > models.count("small") > models.count("tiny") > 0


def test_the_demo_document_is_valid_and_turns_kv_events_on() -> None:
    document = parse_document(DEMO_DOCUMENT, source="demo")
    assert set(document.deployments) == {"chat", "small", "tiny"}
    assert all(p.kv_events and p.engine == "sim" for p in document.profiles.values())
    assert document.profiles["small-mig"].gpu_class == "A100:3g.40gb"
    assert sum(d.replicas for d in document.deployments.values()) == 4


def test_every_demo_engine_loads_its_model_for_the_asked_time() -> None:
    def loads(text: str) -> set[str]:
        profiles = parse_document(text, source="demo").profiles.values()
        return {p.args[p.args.index("--sim-load-seconds") + 1] for p in profiles}

    assert loads(DEMO_DOCUMENT) == {f"{DEFAULT_LOAD_S:g}"} == {"3"}
    assert loads(demo_document(0.25)) == {"0.25"}
    assert loads(demo_document(0)) == {"0"}


@pytest.mark.parametrize("value", ["-1", "nan", "601"])
def test_a_bad_model_load_time_is_refused_naming_the_flag(value: str) -> None:
    args = ["demo", "--headless", "--model-load-seconds", value]
    out = subprocess.run(
        [sys.executable, "-m", "llmgw", *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "--model-load-seconds must be 0 to 600" in out.stderr, out
    assert "Traceback" not in out.stderr


# --- the summary, from fixed metric texts --------------------------------------------------

GATEWAY_METRICS = """\
# HELP llmgw_prefix_decisions_total Routing decisions by tier and outcome.
# TYPE llmgw_prefix_decisions_total counter
llmgw_prefix_decisions_total{tier="approximate",outcome="hit"} 7
llmgw_prefix_decisions_total{tier="approximate",outcome="guarded"} 2
llmgw_prefix_decisions_total{tier="load",outcome="miss"} 5
llmgw_prefix_decisions_total{tier="precise",outcome="hit"} 30
llmgw_prefix_decisions_total{tier="precise",outcome="miss"} 4
llmgw_router_decision_seconds_count 48
"""
ENGINE_METRICS = """\
vllm:prefix_cache_queries_total 1200.0
vllm:prefix_cache_hits_total 900.0
vllm:prompt_tokens_by_source_total{source="local_cache_hit"} 900.0
"""


def test_decisions_by_tier_sums_outcomes_and_counts_hits() -> None:
    assert decisions_by_tier(GATEWAY_METRICS) == (
        ("approximate", 9, 7),
        ("load", 5, 0),
        ("precise", 34, 30),
    )
    assert decisions_by_tier("") == ()


def test_metric_samples_reads_labels_with_escapes_and_skips_comments() -> None:
    text = 'm{a="x\\"y",b="2"} 3.5\n# m 9\nm 1\nm_total 7\nm{a="z"} NaN?\n'
    assert metric_samples(text, "m") == [({"a": 'x\\"y', "b": "2"}, 3.5), ({}, 1.0)]
    assert metric_samples(ENGINE_METRICS, "vllm:prefix_cache_hits_total") == [({}, 900.0)]


def test_render_summary_says_what_happened() -> None:
    summary = DemoSummary(
        seconds=30.2,
        replicas_ready=4,
        replicas_total=4,
        requests=WorkloadCounts(sent=90, ok=87, failed=1, unfinished=2),
        first_error="HTTP 503: no READY replica",
        decisions=decisions_by_tier(GATEWAY_METRICS),
        prefix_hit_tokens=900.0,
        prefix_query_tokens=1200.0,
        unavailable=("http://127.0.0.1:1/metrics: refused",),
    )
    text = render_summary(summary)
    assert "replicas READY     4/4" in text
    assert "90 sent in 30s: 87 ok, 1 failed, 2 cut at stop" in text
    assert "approximate 9 (7 hits), load 5 (0 hits), precise 34 (30 hits)" in text
    assert "hit rate 75% (900 of 1200 prompt tokens from cache" in text
    assert "first failure      HTTP 503: no READY replica" in text
    assert "not read           http://127.0.0.1:1/metrics: refused" in text
    empty = DemoSummary(seconds=1, replicas_ready=0, replicas_total=0, requests=WorkloadCounts())
    assert "no prompt tokens queried yet" in render_summary(empty)
    assert "none reported" in render_summary(empty)
