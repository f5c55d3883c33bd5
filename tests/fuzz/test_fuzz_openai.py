"""Fuzzing the text the gateway and the agent read from outside, past the JSON-document
properties of tests/gateway/test_gateway_openai.py: OpenAI request bodies as *text* (mutated
JSON, nesting, number and string edge cases), what the precise tier makes of them
(``tokenize_input``), ``/tokenize`` answers (``parse_tokens``), and engines' ``/metrics``
pages as the gateway's poller and the agent's drain probe read them.

What must hold: a request parses or is refused with ``BadRequest`` (a 400, never a 500);
``tokenize_input`` and ``parse_tokens`` answer (a body, tokens, or the reason why not) and
never raise; a metrics page gives a sample or ``ValueError`` ("malformed"), and folding any
sample into a replica's window never raises.

Crashes it found in ``tokenize.py`` (JSON nested past the recursion limit, integers past
Python's 4,300-digit limit, a lone surrogate escape) and ``engines.py`` (a NaN or infinite
counter, a quadratic label regex) are fixed and kept as regressions here.
"""

from __future__ import annotations

import json
import math
import time

import pytest
from fuzzkit import examples, openai_bodies
from hypothesis import example, given
from hypothesis import strategies as st

from llmgw.agent.probe import IN_FLIGHT_GAUGES, parse_in_flight
from llmgw.gateway.engines import (
    CACHE_INFO,
    HITS,
    QUERIES,
    ReuseWindow,
    parse_engine_metrics,
)
from llmgw.gateway.errors import BadRequest
from llmgw.gateway.openai import CHAT_PATH, COMPLETIONS_PATH, parse_request
from llmgw.gateway.routing.load import LoadTracker
from llmgw.gateway.routing.policy import RouteRequest, make_policy
from llmgw.gateway.routing.table import Target
from llmgw.gateway.tokenize import parse_tokens, tokenize_input

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(120)]

PATHS = [CHAT_PATH, COMPLETIONS_PATH, "/v1/embeddings"]
DEEP = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HUGE = b'{"model": "m", "prompt": [' + b"7" * 5000 + b"]}"
SURROGATE = b'{"model": "m", "user": "\\ud800", "prompt": "a\\udfff",' \
            b' "messages": [{"role": "user", "content": "\\ud800"}]}'  # fmt: skip

# --- request bodies as text ----------------------------------------------------------------


@examples(500)
@given(st.sampled_from(PATHS), openai_bodies() | st.binary(max_size=64))
@example(COMPLETIONS_PATH, DEEP)
@example(COMPLETIONS_PATH, HUGE)
@example(CHAT_PATH, b'{"model": "m", "messages": [{"role": "u"}], "stream": NaN}')
def test_regression_any_body_parses_or_is_a_400(path: str, body: bytes) -> None:
    """Found by this suite: JSON nested past the recursion limit raised RecursionError and
    an integer of more than 4,300 digits a bare ValueError; the gateway answered 500."""
    try:
        parsed = parse_request(path, body, {})
    except BadRequest as exc:
        assert exc.status == 400 and exc.message and len(exc.message) < 4096
        return
    assert isinstance(parsed.model, str) and parsed.model
    assert isinstance(parsed.text, str) and isinstance(parsed.stream, bool)


def test_regression_the_nesting_and_digit_limits_name_the_fault() -> None:
    with pytest.raises(BadRequest, match="nested too deeply"):
        parse_request(COMPLETIONS_PATH, DEEP, {})
    with pytest.raises(BadRequest, match="number with too many digits"):
        parse_request(COMPLETIONS_PATH, HUGE, {})


def test_regression_a_lone_surrogate_user_routes_by_session() -> None:
    """Found by this suite: ``"user": "\\ud800"`` (valid JSON) made the session policy's
    rendezvous hash raise UnicodeEncodeError: a 500 for a well-formed request."""
    parsed = parse_request(COMPLETIONS_PATH, SURROGATE, {})
    assert parsed.session == "\ud800"
    policy = make_policy("session")
    targets = (Target("r1", "m", "http://127.0.0.1:1"), Target("r2", "m", "http://127.0.0.1:2"))
    route = RouteRequest(parsed.model, parsed.text, parsed.session)
    first = policy.choose(route, targets, LoadTracker())
    assert first is not None
    assert policy.choose(route, targets, LoadTracker()).target == first.target  # type: ignore[union-attr]


# --- what the precise tier tokenizes ------------------------------------------------------


@examples(400)
@given(st.sampled_from(PATHS), openai_bodies())
def test_any_parsed_request_gives_a_tokenize_input(path: str, body: bytes) -> None:
    try:
        model = parse_request(path, body, {}).model
    except BadRequest:
        return
    if _holds_a_lone_surrogate(body):
        return  # the open crash: test_regression_tokenize_input_never_raises[surrogate]
    wanted = tokenize_input(path, body, model)
    if wanted.unsupported:
        assert not wanted.body and wanted.tokens is None
    elif wanted.tokens is None:
        assert json.loads(wanted.body)["model"] == model
    else:
        assert all(0 <= t < 2**32 for t in wanted.tokens)


def _holds_a_lone_surrogate(body: bytes) -> bool:
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


@pytest.mark.parametrize("body", [DEEP, HUGE, SURROGATE], ids=["deep", "huge-int", "surrogate"])
def test_regression_tokenize_input_never_raises(body: bytes) -> None:
    for path in (CHAT_PATH, COMPLETIONS_PATH):
        tokenize_input(path, body, "m")


# --- /tokenize answers ---------------------------------------------------------------------

_token_values = st.one_of(
    st.integers(0, 2**32 - 1), st.integers(), st.booleans(), st.floats(), st.text(max_size=3),
    st.none(), st.lists(st.integers(0, 9), max_size=2),
)  # fmt: skip
_answers = st.fixed_dictionaries(
    {},
    optional={
        "tokens": st.lists(st.integers(0, 2**32 - 1), max_size=20)
        | st.lists(_token_values, max_size=6) | _token_values,
        "count": st.integers(-1, 30) | _token_values,
        "max_model_len": st.integers(),
        "token_strs": st.none() | st.lists(st.text(max_size=3), max_size=3),
    },
).map(lambda d: json.dumps(d).encode())  # fmt: skip


@examples(400)
@given(_answers | openai_bodies() | st.binary(max_size=40), st.integers(1, 25))
def test_any_tokenize_answer_gives_tokens_or_none(answer: bytes, max_tokens: int) -> None:
    tokens = parse_tokens(answer, max_tokens)
    if tokens is not None:
        document = json.loads(answer)
        assert list(tokens) == document["tokens"] and len(tokens) <= max_tokens
        assert all(type(t) is int and 0 <= t < 2**32 for t in document["tokens"])


@pytest.mark.parametrize(
    "answer",
    [b"[" * 100_000, b'{"tokens": [' + b"1" * 5000 + b"]}"],
    ids=["deep", "huge-int"],
)
def test_regression_parse_tokens_never_raises(answer: bytes) -> None:
    assert parse_tokens(answer, 10) is None


# --- /metrics pages ------------------------------------------------------------------------

_NAMES = st.sampled_from([QUERIES, HITS, CACHE_INFO, *sorted(IN_FLIGHT_GAUGES), "x", "# HELP"])
_LABELS = st.sampled_from(
    ['', '{engine="0"}', '{engine="1"}', '{engine="0",block_size="16",num_gpu_blocks="100"}',
     '{block_size="None"}', '{block_size="-4",num_gpu_blocks="1e9"}', '{a="}"}', '{', '{}}',
     '{engine="\\"x\\\\"}', '{block_size="' + "9" * 5000 + '"}']
)  # fmt: skip
_VALUES = st.sampled_from(
    ["0", "1", "1e308", "-1e308", "NaN", "+Inf", "-Inf", "nan", "1_000", "0x10", "", "x"]
) | st.floats().map(repr) | st.integers().map(str)  # fmt: skip
_LINES = st.tuples(_NAMES, _LABELS, _VALUES, st.sampled_from(["", " 1700000000000", "  "]))
_PAGES = st.lists(_LINES.map(lambda t: f"{t[0]}{t[1]} {t[2]}{t[3]}"), max_size=8).map("\n".join)


@examples(400)
@given(_PAGES | st.text(max_size=80))
@example("vllm:num_requests_running 1e308\nvllm:num_requests_waiting 1e308\n")
@example("vllm:num_requests_running -1e308\nvllm:num_requests_waiting -1e308\n")
def test_regression_any_page_gives_an_in_flight_count_or_none(page: str) -> None:
    """Found by this suite: finite gauges summing past the largest float made
    ``round(inf)`` raise OverflowError in the agent's drain."""
    count = parse_in_flight(page)
    assert count is None or isinstance(count, int)


@examples(400)
@given(st.lists(_PAGES, min_size=1, max_size=4))
def test_any_page_gives_a_sample_or_a_malformed_verdict(pages: list[str]) -> None:
    for page in pages:
        try:
            sample = parse_engine_metrics(page)
        except ValueError:
            continue
        assert sample.block_size >= 0 and sample.kv_tokens >= 0


@pytest.mark.parametrize(
    "values", [["NaN"], ["+Inf"], ["-Inf"], ["1e308", "1e308"]], ids=["nan", "inf", "-inf", "sum"]
)
def test_regression_a_non_finite_counter_is_malformed_or_harmless(values: list[str]) -> None:
    """The last case: two finite series whose increments sum past the largest float."""
    window = ReuseWindow(60.0)
    baseline = f'{QUERIES}{{engine="0"}} 0\n{QUERIES}{{engine="1"}} 0\n'
    window.update(parse_engine_metrics(baseline), 0.0)
    page = "".join(f'{QUERIES}{{engine="{i}"}} {v}\n' for i, v in enumerate(values))
    try:
        sample = parse_engine_metrics(page)
    except ValueError:
        return  # refused as malformed: the fix
    queried, hit = window.update(sample, 1.0)
    assert queried >= 0 and hit >= 0


@examples(300)
@given(st.lists(_PAGES, min_size=1, max_size=5))
def test_finite_pages_fold_into_a_window_without_raising(pages: list[str]) -> None:
    window = ReuseWindow(60.0)
    for now, page in enumerate(pages):
        try:
            sample = parse_engine_metrics(page)
        except ValueError:
            continue
        values = [*sample.queries.values(), *sample.hits.values()]
        if not all(math.isfinite(v) and abs(v) < 1e300 for v in values):
            continue  # the open crash above (non-finite values, or sums past the largest float)
        queried, hit = window.update(sample, float(now))
        # (a negative counter gives a negative increment: reported, not asserted here)
        assert isinstance(queried, int) and isinstance(hit, int)
        ratio = window.ratio()
        assert ratio is None or isinstance(ratio, float)


def test_regression_a_long_label_line_is_read_in_linear_time() -> None:
    """Found by this suite's time bound: 20,000 word characters inside braces took ~2 s."""
    line = "vllm:cache_config_info{" + "x" * 20_000 + "} 1\n"
    started = time.perf_counter()
    parse_engine_metrics(line)
    assert time.perf_counter() - started < 0.2
