"""Profiles and deployments as operators write them: parsing, refusal, rendering, fingerprint."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw import engineinput
from llmgw.api.llmgw.v1 import Deployment, EngineProfile, LoraAdapter
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.core.profiles import (
    ENGINES,
    MAX_REPLICAS,
    Document,
    parse_document,
    render_document,
)
from llmgw.server.errors import ProfileError, ServerError

DATA = Path(__file__).parents[2] / "data" / "profiles"
GOOD = sorted(DATA.glob("good-*.toml"))
BAD = sorted(DATA.glob("bad-*.toml"))
ISSUE_EXAMPLE = (DATA / "good-issue-example.toml").read_text()


def problems_of(text: str) -> tuple[str, ...]:
    with pytest.raises(ProfileError) as caught:
        parse_document(text)
    return caught.value.problems


def gpu_profile(**extra: str) -> str:
    """A valid GPU profile ``p`` with ``extra`` keys (raw TOML values) added or replaced."""
    keys = {"engine": '"vllm"', "gpu_class": '"H100"', "model_path": '"/models/m"'} | extra
    return "[profiles.p]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())


# -- the issue's form ----------------------------------------------------------------------


def test_the_issue_example_reads_to_exactly_these_messages() -> None:
    doc = parse_document(ISSUE_EXAMPLE)
    assert doc.profiles == {
        "chat-tp2": EngineProfile(
            name="chat-tp2",
            engine="sim",
            gpu_class="H100",
            tp=2,
            pp=1,
            gpus_per_node=2,
            nodes=1,
            model_path="/models/chat",
            served_model_name="chat",
            kv_events=True,
            args=["--max-model-len", "8192"],
            env={"VLLM_LOGGING_LEVEL": "INFO"},
        )
    }
    assert doc.deployments == {"chat": Deployment(name="chat", profile="chat-tp2", replicas=2)}


def test_defaults_are_filled_in() -> None:
    doc = parse_document(gpu_profile() + '[deployments.d]\nprofile = "p"\n')
    p = doc.profiles["p"]
    assert (p.tp, p.pp, p.nodes, p.gpus_per_node) == (1, 1, 1, 1)
    assert (p.served_model_name, p.kv_events, p.cpu_threads, p.min_gpu_memory_bytes) == (
        "m",
        False,
        0,
        0,
    )
    assert (p.args, p.env, p.adapters) == ([], {}, [])
    d = doc.deployments["d"]
    assert (d.replicas, d.pool, d.labels) == (1, "", {})


def test_gpus_per_node_defaults_to_the_world_split_over_nodes() -> None:
    p = parse_document(gpu_profile(tp="8", pp="2", nodes="4")).profiles["p"]
    assert (p.tp, p.pp, p.nodes, p.gpus_per_node) == (8, 2, 4, 4)


def test_an_empty_document_is_an_empty_document() -> None:
    doc = parse_document("# nothing yet\n")
    assert dict(doc.profiles) == {} and dict(doc.deployments) == {}


def test_the_fleet_example_uses_every_key() -> None:
    doc = parse_document((DATA / "good-fleet.toml").read_text())
    llama = doc.profiles["llama-405b"]
    assert (llama.tp, llama.pp, llama.nodes, llama.gpus_per_node) == (8, 2, 2, 8)
    assert llama.min_gpu_memory_bytes == 80 * 10**9
    assert doc.profiles["support"].served_model_name == "Qwen2.5-7B-Instruct"
    assert doc.profiles["support"].min_gpu_memory_bytes == 40 << 30
    assert [a.name for a in doc.profiles["support"].adapters] == ["support-en", "support-de"]
    assert doc.profiles["sql"].adapters == [
        LoraAdapter(name="sql-pg", path="/loras/sql-pg"),
        LoraAdapter(name="sql-mysql", path="/loras/sql-mysql"),
    ]
    cpu = doc.profiles["tiny-cpu"]
    assert (cpu.gpu_class, cpu.tp, cpu.pp, cpu.nodes, cpu.gpus_per_node) == ("cpu", 1, 1, 1, 0)
    assert cpu.cpu_threads == 8
    assert doc.deployments["llama"].labels == {
        "fabric": "ib-east",
        "topology.llmgw.io/rack": "r12",
    }
    assert doc.deployments["llama"].pool == "training-b"
    assert doc.deployments["sql"].replicas == 0
    assert doc.deployments["tiny"].replicas == 1
    assert doc.deployments["smol.v2"].profile == "smol.v2"
    assert list(doc.profiles) == ["llama-405b", "support", "sql", "tiny-cpu", "smol.v2"]


def test_both_adapter_forms_read_the_same() -> None:
    short = parse_document(gpu_profile(adapters='{ a = "/la", b = "/lb" }'))
    long = parse_document(
        gpu_profile() + '[[profiles.p.adapters]]\nname = "a"\npath = "/la"\n'
        '[[profiles.p.adapters]]\nname = "b"\npath = "/lb"\n'
    )
    assert short == long
    assert short.profiles["p"].adapters == [LoraAdapter("a", "/la"), LoraAdapter("b", "/lb")]


@pytest.mark.parametrize(
    ("written", "size"),
    [
        ("42", 42),
        ('"40GiB"', 40 << 30),
        ('"80GB"', 80 * 10**9),
        ('"512 MiB"', 512 << 20),
        ('"1.5GiB"', 3 << 29),
        ('"2tb"', 2 * 10**12),
        ('"1B"', 1),
    ],
)
def test_min_gpu_memory_takes_bytes_or_a_size(written: str, size: int) -> None:
    doc = parse_document(gpu_profile(min_gpu_memory=written))
    assert doc.profiles["p"].min_gpu_memory_bytes == size


@pytest.mark.parametrize("written", ['"40"', '"GiB"', '"1.3B"', "-1", '"2PiB"', "1.5", "true"])
def test_min_gpu_memory_refuses_what_is_not_a_size(written: str) -> None:
    (problem,) = problems_of(gpu_profile(min_gpu_memory=written))
    assert problem.startswith("profiles.p.min_gpu_memory: must be bytes or a size")


def test_the_document_is_read_only() -> None:
    doc = parse_document(ISSUE_EXAMPLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        doc.profiles = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        doc.profiles["x"] = EngineProfile()  # type: ignore[index]


# -- refusal -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_each_bad_example_names_exactly_its_problems(path: Path) -> None:
    text = path.read_text()
    expected = [
        line.removeprefix("# expect: ")
        for line in text.splitlines()
        if line.startswith("# expect: ")
    ]
    assert expected, "a bad example lists its problems"
    assert sorted(problems_of(text)) == sorted(expected)


def test_the_error_lists_every_problem_one_per_line_prefixed_by_source() -> None:
    text = (DATA / "bad-types.toml").read_text()
    with pytest.raises(ProfileError) as caught:
        parse_document(text, source="fleet.toml")
    err = caught.value
    assert isinstance(err, ServerError)
    assert err.source == "fleet.toml"
    assert len(err.problems) == 10
    assert str(err).splitlines() == [f"fleet.toml: {p}" for p in err.problems]


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"tp": "0"}, "profiles.p.tp: must be a positive integer up to 1,024, got 0"),
        ({"tp": "true"}, "profiles.p.tp: must be a positive integer up to 1,024, got true"),
        ({"pp": '"2"'}, 'profiles.p.pp: must be a positive integer up to 1,024, got "2"'),
        ({"nodes": "2000"}, "profiles.p.nodes: must be a positive integer up to 1,024, got 2000"),
        ({"args": '"--x"'}, 'profiles.p.args: must be an array of strings, got "--x"'),
        ({"args": '["a\\u0000b"]'}, "profiles.p.args[0]: must not contain a NUL character"),
        ({"env": '"A=1"'}, 'profiles.p.env: must be a table of strings, got "A=1"'),
        ({"engine": '""'}, 'profiles.p.engine: must be a non-empty string, got ""'),
        (
            {"gpu_class": '" H100"'},
            'profiles.p.gpu_class: must be a GPU class such as "H100", got " H100"',
        ),
        (
            {"served_model_name": '"my model"'},
            "profiles.p.served_model_name: must be printable, no spaces, at most 256 characters, "
            'got "my model"',
        ),
        (
            {"tp": "128"},
            "profiles.p.nodes: tp × pp = 128 GPUs do not split over 1 node(s), 64 at most on each",
        ),
        ({"model": '"/m"'}, 'profiles.p.model: unknown key; did you mean "model_path"?'),
        (
            {"zzz": "1"},
            "profiles.p.zzz: unknown key (known: engine, gpu_class, tp, pp, gpus_per_node, nodes, "
            "model_path, served_model_name, kv_events, args, env, adapters, cpu_threads, "
            "min_gpu_memory)",
        ),
        ({"adapters": "3"}, "profiles.p.adapters: must be a table or an array of tables, got 3"),
    ],
)
def test_one_bad_key_gives_one_problem(extra: dict[str, str], problem: str) -> None:
    assert problems_of(gpu_profile(**extra)) == (problem,)


def test_names_are_dns_labels_of_at_most_63_characters() -> None:
    ok = "a" * 63
    assert ok in parse_document(gpu_profile().replace("profiles.p", f"profiles.{ok}")).profiles
    for bad in ("a" * 64, "-a", "a-", "A", "a_b", '"a b"', '""'):
        (problem,) = problems_of(gpu_profile().replace("profiles.p", f"profiles.{bad}"))
        assert ": not a valid name: lower-case letters" in problem, bad


def test_replicas_bounds() -> None:
    head = gpu_profile() + '[deployments.d]\nprofile = "p"\n'
    assert parse_document(head + f"replicas = {MAX_REPLICAS}\n").deployments["d"].replicas == (
        MAX_REPLICAS
    )
    assert problems_of(head + f"replicas = {MAX_REPLICAS + 1}\n")


def test_a_missing_profile_lists_the_known_ones_or_none() -> None:
    (problem,) = problems_of('[deployments.d]\nprofile = "chat"\n')
    assert problem == 'deployments.d.profile: no profile named "chat" (known: none)'


def test_a_reference_to_a_bad_profile_is_not_reported_twice() -> None:
    problems = problems_of(gpu_profile(tp='"x"') + '[deployments.d]\nprofile = "p"\n')
    assert problems == ('profiles.p.tp: must be a positive integer up to 1,024, got "x"',)


@pytest.mark.parametrize(
    "text",
    ["profiles = 3\n", "[profiles]\np = 1\n", "deployments = []\n"],
)
def test_sections_and_entries_must_be_tables(text: str) -> None:
    (problem,) = problems_of(text)
    assert "must be a table, got" in problem


def test_syntax_errors_name_line_and_column() -> None:
    (problem,) = problems_of('[profiles.p]\nengine = "sim"\ntp = = 2\n')
    assert problem == "TOML syntax: Invalid value (at line 3, column 6)"


@pytest.mark.parametrize(
    "text",
    ["a = " + "[" * 100_000, "a = " + "9" * 5000, 'a = "\\ud800"', "a = 1\na = 2\n"],
    ids=["deep", "huge-int", "surrogate-escape", "duplicate-key"],
)
def test_inputs_tomllib_chokes_on_are_syntax_problems(text: str) -> None:
    (problem,) = problems_of(text)
    assert problem.startswith("TOML syntax: ")


def test_a_raw_lone_surrogate_is_refused_and_can_be_printed() -> None:
    problems = problems_of(gpu_profile(model_path='"/m/\ud800"'))
    assert problems == ("profiles.p.model_path: must be valid Unicode (it holds a lone surrogate)",)
    quoted = problems_of(gpu_profile(tp='"\ud800"'))
    assert str(ProfileError(quoted)).encode()  # no UnicodeEncodeError


# -- rendering -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_good_examples_round_trip(path: Path) -> None:
    doc = parse_document(path.read_text())
    text = render_document(doc)
    assert parse_document(text) == doc
    assert render_document(parse_document(text)) == text


def test_render_writes_resolved_fields_and_quotes_dotted_names() -> None:
    text = render_document(parse_document((DATA / "good-fleet.toml").read_text()))
    assert '[profiles."smol.v2"]\n' in text
    assert 'min_gpu_memory = "40GiB"\n' in text
    assert "min_gpu_memory = 80000000000\n" in text
    assert 'served_model_name = "Qwen2.5-7B-Instruct"\n' in text
    tiny = text.split("[profiles.tiny-cpu]\n")[1].split("\n\n")[0]
    assert "tp =" not in tiny and "gpus_per_node" not in tiny and "cpu_threads = 8" in tiny


# -- fingerprint ---------------------------------------------------------------------------


def base_profile() -> EngineProfile:
    return EngineProfile(
        name="chat",
        engine="vllm",
        gpu_class="H100",
        tp=2,
        pp=1,
        gpus_per_node=2,
        nodes=1,
        args=["--a", "1", "--b"],
        env={"X": "1", "Y": "2"},
        model_path="/models/chat",
        served_model_name="chat",
        adapters=[LoraAdapter("l1", "/l1"), LoraAdapter("l2", "/l2")],
        kv_events=True,
        cpu_threads=4,
        min_gpu_memory_bytes=1 << 30,
    )


INCLUDED: dict[str, Any] = {
    "engine": "sglang",
    "gpu_class": "A100",
    "tp": 4,
    "pp": 2,
    "gpus_per_node": 1,
    "nodes": 2,
    "args": ["--a", "2", "--b"],
    "env": {"X": "1", "Y": "3"},
    "model_path": "/models/other",
    "served_model_name": "other",
    "adapters": [LoraAdapter("l1", "/l1-v2"), LoraAdapter("l2", "/l2")],
    "kv_events": False,
    "cpu_threads": 8,
}
EXCLUDED: dict[str, Any] = {"name": "renamed", "min_gpu_memory_bytes": 2 << 30}


def test_included_fields_are_every_field_but_the_excluded() -> None:
    fields = {f.name for f in dataclasses.fields(EngineProfile)}
    assert set(INCLUDED) | set(EXCLUDED) == fields
    assert not set(INCLUDED) & set(EXCLUDED)


@pytest.mark.parametrize(("field", "value"), INCLUDED.items(), ids=list(INCLUDED))
def test_changing_an_included_field_changes_the_fingerprint(field: str, value: Any) -> None:
    changed = base_profile()
    setattr(changed, field, value)
    assert profile_fingerprint(changed) != profile_fingerprint(base_profile())


@pytest.mark.parametrize(("field", "value"), EXCLUDED.items(), ids=list(EXCLUDED))
def test_changing_an_excluded_field_keeps_the_fingerprint(field: str, value: Any) -> None:
    changed = base_profile()
    setattr(changed, field, value)
    assert profile_fingerprint(changed) == profile_fingerprint(base_profile())


def test_the_fingerprint_is_pinned() -> None:
    # A change here restarts every engine in every fleet on upgrade: make it on purpose.
    (profile,) = parse_document(ISSUE_EXAMPLE).profiles.values()
    assert profile_fingerprint(profile) == "fp-c63d3faf34f8b084"
    assert re.fullmatch(r"fp-[0-9a-f]{16}", profile_fingerprint(base_profile()))


def test_orders_that_mean_nothing_do_not_count() -> None:
    reordered = base_profile()
    reordered.env = {"Y": "2", "X": "1"}
    reordered.adapters = list(reversed(reordered.adapters))
    assert profile_fingerprint(reordered) == profile_fingerprint(base_profile())


def test_unset_sizes_hash_as_their_defaults() -> None:
    from_api = EngineProfile(engine="sim", gpu_class="H100", model_path="/models/chat")
    from_file = parse_document(gpu_profile(engine='"sim"', model_path='"/models/chat"'))
    assert profile_fingerprint(from_api) == profile_fingerprint(from_file.profiles["p"])


# -- properties ----------------------------------------------------------------------------

TEXT = st.text(st.characters(exclude_categories=("Cs", "Cc")), max_size=12)
WORD = TEXT.filter(lambda t: not t.startswith("-"))  # an argument that is not a flag
MODEL_NAME = st.text(
    st.characters(categories=("L", "N", "P", "S")), min_size=1, max_size=12
).filter(lambda t: not t.startswith("-"))
NAME = st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,20}[a-z0-9])?", fullmatch=True)
ENV_KEY = st.builds(
    str.__add__,
    st.sampled_from([*engineinput.ENV_FAMILIES, *engineinput.ENV_NAMES]),
    st.from_regex(r"[A-Z0-9_]{0,8}", fullmatch=True),
).filter(lambda k: engineinput.env_problem(k, "", kv_events=True) is None)
LABEL_KEY = st.from_regex(r"[A-Za-z0-9]([-A-Za-z0-9_./]{0,10}[A-Za-z0-9])?", fullmatch=True)


@st.composite
def shapes(draw: st.DrawFn, engine: str) -> tuple[str, int, int, int, int, int, int]:
    """gpu_class, tp, pp, gpus_per_node, nodes, cpu_threads, min_gpu_memory_bytes."""
    if draw(st.booleans()):
        return "cpu", 1, 1, 0, 1, draw(st.integers(1, 4096)), 0
    gpu_class = draw(st.sampled_from(["H100", "A100", "L4", "RTX 4090", "GB200"]))
    tp, pp, nodes = 1, 1, 1
    if engine != "llamacpp":
        tp, pp = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2]))
        nodes = draw(st.sampled_from([n for n in (1, 2, 4) if tp * pp % n == 0]))
    memory = draw(
        st.one_of(st.just(0), st.integers(1, 1 << 50), st.integers(1, 999).map(lambda g: g << 30))
    )
    return gpu_class, tp, pp, tp * pp // nodes, nodes, draw(st.integers(0, 64)), memory


@st.composite
def valid_profiles(draw: st.DrawFn, name: str) -> EngineProfile:
    engine = draw(st.sampled_from(sorted(ENGINES)))
    gpu_class, tp, pp, per_node, nodes, threads, memory = draw(shapes(engine))
    served = draw(MODEL_NAME)
    names = draw(st.lists(MODEL_NAME.filter(lambda n: n != served), max_size=3, unique=True))
    llamacpp = engine == "llamacpp"  # what the engine cannot do: engineinput.engine_problems
    model_path = draw(WORD.filter(bool)) + (".gguf" if llamacpp else "")
    names = [] if llamacpp else names
    return EngineProfile(
        name=name,
        engine=engine,
        gpu_class=gpu_class,
        tp=tp,
        pp=pp,
        gpus_per_node=per_node,
        nodes=nodes,
        args=draw(st.lists(WORD, max_size=4)),
        env=draw(st.dictionaries(ENV_KEY, TEXT, max_size=3)),
        model_path=model_path,
        served_model_name=served,
        adapters=[LoraAdapter(n, draw(WORD.filter(bool))) for n in names],
        kv_events=draw(st.booleans()) and engine in ("vllm", "sim"),
        cpu_threads=threads,
        min_gpu_memory_bytes=memory,
    )


@st.composite
def valid_documents(draw: st.DrawFn) -> Document:
    names = draw(st.lists(NAME, min_size=1, max_size=3, unique=True))
    profiles = {n: draw(valid_profiles(n)) for n in names}
    deployments = {
        n: Deployment(
            name=n,
            profile=draw(st.sampled_from(names)),
            replicas=draw(st.integers(0, MAX_REPLICAS)),
            pool=draw(st.just("") | NAME),
            labels=draw(st.dictionaries(LABEL_KEY, TEXT, max_size=2)),
        )
        for n in draw(st.lists(NAME, max_size=3, unique=True))
    }
    return Document(profiles, deployments)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_documents())
def test_valid_documents_round_trip(doc: Document) -> None:
    text = render_document(doc)
    again = parse_document(text)
    assert again == doc
    assert render_document(again) == text


def toml_inline(value: object) -> str:
    """A test-local TOML writer, so the property below does not trust render_document."""
    if isinstance(value, dict):
        return (
            "{ "
            + ", ".join(f"{toml_inline(k)} = {toml_inline(v)}" for k, v in value.items())
            + " }"
        )
    if isinstance(value, list):
        return "[" + ", ".join(toml_inline(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return repr(value)


KEYS = st.sampled_from(
    ["engine", "gpu_class", "tp", "pp", "gpus_per_node", "nodes", "model_path", "args", "env",
     "served_model_name", "kv_events", "adapters", "cpu_threads", "min_gpu_memory", "name",
     "path", "profile", "replicas", "pool", "labels", "tensor_parallel", "p", "chat"]
) | st.text(max_size=4)  # fmt: skip
SCALARS = (
    st.booleans()
    | st.integers(-(2**65), 2**65)
    | st.floats(allow_nan=False)
    | st.sampled_from(["sim", "vllm", "llamacpp", "cpu", "H100", "/m/x", "40GiB", "p", "", "Z"])
    | st.text(max_size=6)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=8,
)
SECTION = st.dictionaries(
    NAME | st.text(max_size=3), st.dictionaries(KEYS, VALUES, max_size=8), max_size=3
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["profiles", "deployments", "profile"]), SECTION))
def test_any_structure_gives_a_document_or_a_profile_error(data: dict[str, Any]) -> None:
    text = "".join(f"{k} = {toml_inline(v)}\n" for k, v in data.items())
    try:
        doc = parse_document(text)
    except ProfileError as err:
        assert err.problems and all(isinstance(p, str) and p for p in err.problems)
    else:
        assert parse_document(render_document(doc)) == doc


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_text_gives_a_document_or_a_profile_error(text: str) -> None:
    try:
        parse_document(text)
    except ProfileError as err:
        assert err.problems


@settings(max_examples=100, deadline=None)
@given(valid_profiles("a"), NAME, st.randoms(use_true_random=False))
def test_fingerprint_ignores_name_and_env_order(
    profile: EngineProfile, name: str, rng: Any
) -> None:
    items = list(profile.env.items())
    rng.shuffle(items)
    other = EngineProfile().from_dict(profile.to_dict())
    other.name, other.env = name, dict(items)
    assert profile_fingerprint(other) == profile_fingerprint(profile)


@settings(max_examples=100, deadline=None)
@given(valid_profiles("a"), st.lists(TEXT, min_size=2, max_size=5, unique=True))
def test_fingerprint_counts_args_order(profile: EngineProfile, args: list[str]) -> None:
    profile.args = args
    swapped = EngineProfile().from_dict(profile.to_dict())
    swapped.args = [*args[1:], args[0]]
    assert profile_fingerprint(swapped) != profile_fingerprint(profile)
