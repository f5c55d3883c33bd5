"""What the agent reads from an engine's ``/metrics``: requests in flight and its KV blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.probe import has_kv_connector, parse_in_flight, parse_kv_blocks
from llmgw.sim.engine.metrics import EngineGauges, EngineStats, render_metrics

SAMPLE = Path("/work/shared/spec/vllm-0.32-metrics-sample.txt")
if not SAMPLE.exists():  # the copy the simulated engine's tests keep
    SAMPLE = Path(__file__).resolve().parents[1] / "sim" / "vllm-0.32-metrics-sample.txt"
REAL = SAMPLE.read_text()


def info(**labels: str) -> str:
    """A ``vllm:cache_config_info`` sample, labels in vLLM's (sorted) order."""
    body = ",".join(f'{name}="{value}"' for name, value in sorted(labels.items()))
    return f"vllm:cache_config_info{{{body}}} 1.0\n"


def test_the_real_vllm_page_tells_its_gpu_blocks_and_requests_in_flight() -> None:
    assert 'num_gpu_blocks="364"' in REAL and 'num_cpu_blocks="None"' in REAL
    assert parse_kv_blocks(REAL) == 364  # CPU blocks "None", no offloading size: GPU only
    assert parse_in_flight(REAL) == 0
    busy = REAL.replace(
        'vllm:num_requests_running{engine="0",model_name="smollm2-135m"} 0.0',
        'vllm:num_requests_running{engine="0",model_name="smollm2-135m"} 4.0',
    )
    assert parse_in_flight(busy) == 4


def test_the_simulated_engines_page_tells_its_blocks() -> None:
    gauges = EngineGauges(running=0, waiting=0, waiting_deferred=0, kv_usage=0.0)
    cache = {"block_size": "16", "num_gpu_blocks": "500", "num_cpu_blocks": "None"}
    page = render_metrics(EngineStats(4096), gauges, model_name="m", cache_info=cache)
    assert parse_kv_blocks(page) == 500


@pytest.mark.parametrize(
    ("page", "blocks"),
    [
        (info(block_size="16", num_gpu_blocks="1000", num_cpu_blocks="250"), 1250),
        (info(block_size="16", num_gpu_blocks="1000", num_cpu_blocks="0"), 1000),
        # a CPU tier whose blocks vLLM tells
        (info(num_gpu_blocks="1000", num_cpu_blocks="4000", kv_offloading_size="8.0"), 5000),
        (info(num_gpu_blocks="1000", num_cpu_blocks="None", kv_offloading_size="None"), 1000),
        # a hybrid model hashing at 16 tokens in blocks of 64: 4 hashes per block
        (info(block_size="64", hash_block_size="16", num_gpu_blocks="100"), 400),
        (info(block_size="128", hash_block_size="None", num_gpu_blocks="100"), 100),
        # data-parallel ranks: a mirror is one rank's, so the largest
        (info(engine="0", num_gpu_blocks="300") + info(engine="1", num_gpu_blocks="320"), 320),
    ],
)
def test_blocks_add_the_cpu_tier_and_count_hashes(page: str, blocks: int) -> None:
    assert parse_kv_blocks(page) == blocks


@pytest.mark.parametrize(
    "page",
    [
        "",
        'vllm:num_requests_running{engine="0"} 1.0\n',  # no cache_config_info (llama.cpp)
        info(block_size="16", num_gpu_blocks="None"),  # before the profiling run
        info(block_size="16"),
        info(num_gpu_blocks="0"),
        info(num_gpu_blocks="-5"),
        info(num_gpu_blocks="12.5"),
        info(num_gpu_blocks="lots"),
        info(num_gpu_blocks="1" * 5000),  # more digits than int() takes
        info(num_gpu_blocks="١٢٣"),  # digits, but not ASCII ones
        # a CPU tier of 8 GiB whose blocks are not told
        info(num_gpu_blocks="1000", num_cpu_blocks="None", kv_offloading_size="8.0"),
        # one rank that does not tell: unknown, not the other rank's
        info(engine="0", num_gpu_blocks="300") + info(engine="1", num_gpu_blocks="None"),
        'vllm:cache_config_info{num_gpu_blocks="300"} one\n',
        'vllm:cache_config_info{num_gpu_blocks="300"\n',
    ],
)
def test_a_page_that_does_not_tell_its_blocks_gives_unknown(page: str) -> None:
    assert parse_kv_blocks(page) is None


@given(st.text())
def test_any_label_value_reads_as_a_count_or_unknown(value: str) -> None:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    page = REAL.replace('num_gpu_blocks="364"', f'num_gpu_blocks="{escaped}"')
    blocks = parse_kv_blocks(page)
    assert blocks is None or blocks > 0


@given(st.text())
def test_any_page_reads_as_a_count_or_unknown(page: str) -> None:
    blocks = parse_kv_blocks("vllm:cache_config_info" + page)
    assert blocks is None or blocks > 0


@pytest.mark.parametrize(
    ("argv", "connector"),
    [
        (("vllm", "serve", "m", "--enable-prefix-caching"), False),
        (("vllm", "serve", "m", "--kv-transfer-config", '{"kv_connector":"LMCache"}'), True),
        (("vllm", "serve", "m", '--kv-transfer-config={"kv_connector":"LMCache"}'), True),
        (("vllm", "serve", "m", "--kv_transfer_config", "{}"), True),
        (("vllm", "serve", "m", "--kv-events-config", "{}"), False),
    ],
)
def test_a_kv_connector_is_seen_in_the_command(argv: tuple[str, ...], connector: bool) -> None:
    assert has_kv_connector(argv) is connector
