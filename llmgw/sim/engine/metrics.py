"""vLLM's Prometheus metrics: the counters and histograms the engine keeps, and ``/metrics``.

Names, help texts, bucket bounds and label sets are those of vLLM 0.32
(spec/vllm-0.32-metrics-sample.txt); labels are sorted and values written the way
prometheus_client writes them, so a scraper written against vLLM reads these unchanged.
The ``*_created`` gauges and the process/python collectors are left out.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw import promtext
from llmgw.promtext import go_float, label_set

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50 … up to ``limit``."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(out)
            out.append(float(value))
        exponent += 1


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram with Prometheus semantics."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.bounds, value)
        if index < len(self.counts):
            self.counts[index] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> Iterator[tuple[str, int]]:
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            running += count
            yield go_float(bound), running
        yield "+Inf", self.count


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """What a finished request contributes to the per-request histograms (seconds, tokens)."""

    reason: str
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    max_tokens: int
    preemptions: int
    queue_s: float
    prefill_s: float
    decode_s: float
    e2e_s: float


_HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    # (attribute, metric name, help)
    ("prompt_tokens_h", "vllm:request_prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens_h", "vllm:request_generation_tokens",
     "Number of generation tokens processed."),
    ("iteration_tokens", "vllm:iteration_tokens_total",
     "Histogram of number of tokens per engine_step."),
    ("max_generation_tokens", "vllm:request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens."),
    ("params_n", "vllm:request_params_n", "Histogram of the n request parameter."),
    ("params_max_tokens", "vllm:request_params_max_tokens",
     "Histogram of the max_tokens request parameter."),
    ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("tpot", "vllm:request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request."),
    ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    ("queue", "vllm:request_queue_time_seconds",
     "Histogram of time spent in WAITING phase for request."),
    ("inference", "vllm:request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request."),
    ("prefill", "vllm:request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request."),
    ("decode", "vllm:request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request."),
    ("preemptions_h", "vllm:request_num_preemptions",
     "Histogram of the number of times a request was preempted."),
    ("prefill_kv_computed", "vllm:request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens)."),
)  # fmt: skip


class EngineStats:
    """The engine's counters and histograms; updated by the scheduler, read by ``/metrics``."""

    def __init__(self, max_model_len: int) -> None:
        tokens = buckets_1_2_5(max_model_len)
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens_h = Histogram(tokens)
        self.generation_tokens_h = Histogram(tokens)
        self.iteration_tokens = Histogram(tuple(map(float, ITERATION_BUCKETS)))
        self.max_generation_tokens = Histogram(tokens)
        self.params_n = Histogram(tuple(map(float, N_BUCKETS)))
        self.params_max_tokens = Histogram(tokens)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue = Histogram(LATENCY_BUCKETS)
        self.inference = Histogram(LATENCY_BUCKETS)
        self.prefill = Histogram(LATENCY_BUCKETS)
        self.decode = Histogram(LATENCY_BUCKETS)
        self.preemptions_h = Histogram(tuple(map(float, PREEMPTION_BUCKETS)))
        self.prefill_kv_computed = Histogram(tokens)

    def record_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += queried_tokens
        self.prefix_hits += hit_tokens

    def record_new_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_prompt_tokens += cached_tokens

    def record_finished(self, done: FinishedRequest) -> None:
        self.success[done.reason] = self.success.get(done.reason, 0) + 1
        self.prompt_tokens_h.observe(done.prompt_tokens)
        self.generation_tokens_h.observe(done.generation_tokens)
        self.max_generation_tokens.observe(done.max_tokens)
        self.params_max_tokens.observe(done.max_tokens)
        self.params_n.observe(1)
        self.preemptions_h.observe(done.preemptions)
        self.prefill_kv_computed.observe(done.prompt_tokens - done.cached_tokens)
        self.e2e.observe(done.e2e_s)
        self.queue.observe(done.queue_s)
        self.prefill.observe(done.prefill_s)
        self.decode.observe(done.decode_s)
        self.inference.observe(done.prefill_s + done.decode_s)
        if done.generation_tokens > 1:
            self.tpot.observe(done.decode_s / (done.generation_tokens - 1))


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """The instantaneous values read when ``/metrics`` is scraped."""

    running: int
    waiting: int
    waiting_deferred: int
    kv_usage: float


def _labels(labels: Mapping[str, str]) -> str:
    return label_set(sorted(labels.items()))


class MetricsText:
    """Builds the exposition text family by family."""

    def __init__(self, base_labels: Mapping[str, str]) -> None:
        self._base = dict(base_labels)
        self._lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        promtext.family(self._lines, name, kind, help_text)

    def sample(self, name: str, value: float, **labels: str) -> None:
        self._lines.append(f"{name}{_labels({**self._base, **labels})} {go_float(value)}")

    def info(self, name: str, help_text: str, labels: Mapping[str, str]) -> None:
        """An info gauge: its own labels and ``engine`` (vLLM gives these no model_name)."""
        self.family(name, "gauge", help_text)
        engine = {"engine": self._base["engine"]}
        self._lines.append(f"{name}{_labels({**engine, **labels})} 1.0")

    def histogram(self, name: str, help_text: str, hist: Histogram) -> None:
        self.family(name, "histogram", help_text)
        for bound, running in hist.cumulative():
            self.sample(f"{name}_bucket", running, le=bound)
        self.sample(f"{name}_count", hist.count)
        self.sample(f"{name}_sum", hist.total)

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def render_metrics(
    stats: EngineStats,
    gauges: EngineGauges,
    *,
    model_name: str,
    cache_info: Mapping[str, str],
) -> str:
    """The ``/metrics`` body."""
    out = MetricsText({"engine": "0", "model_name": model_name})
    _render_gauges(out, gauges)
    _render_counters(out, stats)
    for attribute, name, help_text in _HISTOGRAMS:
        out.histogram(name, help_text, getattr(stats, attribute))
    out.info("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", cache_info)
    return out.text()


def _render_gauges(out: MetricsText, gauges: EngineGauges) -> None:
    out.family(
        "vllm:num_requests_running", "gauge", "Number of requests in model execution batches."
    )
    out.sample("vllm:num_requests_running", gauges.running)
    out.family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.")
    out.sample("vllm:num_requests_waiting", gauges.waiting)
    out.family("vllm:num_requests_waiting_by_reason", "gauge", _WAITING_HELP)
    out.sample(
        "vllm:num_requests_waiting_by_reason",
        gauges.waiting - gauges.waiting_deferred,
        reason="capacity",
    )
    out.sample("vllm:num_requests_waiting_by_reason", gauges.waiting_deferred, reason="deferred")
    out.family("vllm:engine_sleep_state", "gauge", _SLEEP_HELP)
    for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
        out.sample("vllm:engine_sleep_state", value, sleep_state=state)
    out.family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.")
    out.sample("vllm:kv_cache_usage_perc", gauges.kv_usage)


def _render_counters(out: MetricsText, stats: EngineStats) -> None:
    for name, help_text, value in _simple_counters(stats):
        out.family(name, "counter", help_text)
        out.sample(name, value)
    out.family(
        "vllm:prompt_tokens_by_source_total", "counter", "Number of prompt tokens by source."
    )
    by_source: Sequence[tuple[str, int]] = (
        ("local_compute", stats.prompt_tokens - stats.cached_prompt_tokens),
        ("local_cache_hit", stats.cached_prompt_tokens),
        ("external_kv_transfer", 0),
    )
    for source, value in by_source:
        out.sample("vllm:prompt_tokens_by_source_total", value, source=source)
    out.family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
    for reason, count in stats.success.items():
        out.sample("vllm:request_success_total", count, finished_reason=reason)


def _simple_counters(stats: EngineStats) -> Sequence[tuple[str, str, int]]:
    return (
        ("vllm:prefix_cache_queries_total",
         "Prefix cache queries, in terms of number of queried tokens.", stats.prefix_queries),
        ("vllm:prefix_cache_hits_total",
         "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_hits),
        ("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
         stats.preemptions),
        ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", stats.prompt_tokens),
        ("vllm:prompt_tokens_cached_total",
         "Number of cached prompt tokens (local + external).", stats.cached_prompt_tokens),
        ("vllm:generation_tokens_total", "Number of generation tokens processed.",
         stats.generation_tokens),
    )  # fmt: skip


_WAITING_HELP = (
    "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
    "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV "
    "transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting."
)
_SLEEP_HELP = (
    "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
    "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."
)
