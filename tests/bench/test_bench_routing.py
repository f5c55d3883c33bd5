"""bench/routing*.py: the routing benchmark's replay, figures, bounds."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from bench import routing as bench_routing
from bench import routing_fleet as fleet
from bench import routing_sim as sim


@pytest.fixture(scope="module")
def quick() -> Any:
    config = replace(fleet.BenchConfig(), **bench_routing.QUICK)
    return bench_routing.run_bench(config)


def _tiny(**overrides: Any) -> Any:
    fields: dict[str, Any] = {
        "engines": 2,
        "groups": 1,
        "users": 2,
        "turns": 2,
        "system_tokens": 200,
    }
    fields |= {"question_tokens": 40, "rate": 0.02, "think_s": 1.0, "kv_blocks": 256}
    return replace(fleet.BenchConfig(), **(fields | overrides))


def test_every_policy_replays_every_request_and_reports_its_figures(quick: Any) -> None:
    names = [r.policy for r in quick.results]
    assert names == ["prefix", "round_robin", "least_load", "session", "oracle"]
    for r in quick.results:
        assert r.requests == quick.facts.requests == 6 * 6 * 3
        assert sum(r.per_engine) == r.requests == sum(r.decisions.values())
        assert 0.0 < r.hit_rate < 1.0 and 0.0 < r.prompt_cached_share < 1.0
        assert 0.0 < r.ttft_p50_s <= r.ttft_p90_s <= r.ttft_p99_s
        assert r.imbalance_max_mean >= 1.0 and r.imbalance_cv >= 0.0
        assert 0.0 < r.utilization_mean <= r.utilization_max <= 1.0
    assert set(quick.ratios()) == {"default_hit_rate_over_oracle", "rr_ttft_p90_over_default"}
    assert quick.targets_met() in (True, False)


def test_no_policy_beats_the_reuse_ceiling(quick: Any) -> None:
    # The ceiling (one unbounded cache, any arrival order) bounds every policy's cached
    # share at first admission, the oracle's included; the oracle itself is no bound: it
    # scores exact caches against load and cannot see requests still queued.
    ceiling = quick.facts.reuse_ceiling
    assert 0.5 < ceiling < 1.0
    for r in quick.results:
        assert r.prompt_cached_share <= ceiling, r.policy


def test_cache_aware_policies_hit_far_more_than_cache_blind_ones(quick: Any) -> None:
    rates = {r.policy: r.hit_rate for r in quick.results}
    blind = max(rates["round_robin"], rates["least_load"], rates["session"])
    assert rates["prefix"] > 2 * blind
    assert rates["oracle"] > 2 * blind


def test_the_replay_is_deterministic() -> None:
    config = _tiny(users=3, rate=2.0)
    first = bench_routing.run_bench(config, ["prefix", "oracle"])
    again = bench_routing.run_bench(config, ["prefix", "oracle"])
    assert first.results == again.results


def test_reusable_tokens_match_a_brute_force_over_the_token_sequences() -> None:
    config = _tiny(users=3, turns=3)
    workload = sim.build_workload(config)
    size = config.block_size
    whole = [
        workload.prompt(c, c.turns[-1]) + list(c.turns[-1].answer) for c in workload.conversations
    ]
    expected = []
    for i, conv in enumerate(workload.conversations):
        others = max(_common(whole[i], whole[j]) for j in range(len(whole)) if j != i)
        earlier = 0
        for turn in conv.turns:
            usable = (turn.prompt_len - 1) // size
            expected.append(min(max(others // size, earlier), usable) * size)
            earlier = (turn.prompt_len + len(turn.answer)) // size
    assert bench_routing.reusable_tokens(workload, size) == expected
    assert expected[1] > expected[0] > 0  # a second turn reuses its own first turn


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_oracle_reads_the_engines_exact_caches() -> None:
    # Two conversations of one group, far apart in time, on two idle engines: the first
    # goes by load to engine-00; the oracle then sees the shared system prompt there.
    config = _tiny(turns=1)
    workload = sim.build_workload(config)
    result = bench_routing.replay(config, workload, "oracle")
    assert result.decisions == {"approximate/hit": 1, "load/miss": 1}
    assert result.per_engine == (2, 0)
    reusable = bench_routing.reusable_tokens(workload, config.block_size)
    prompts = [c.turns[0].prompt_len for c in workload.conversations]
    assert result.prompt_cached_share == pytest.approx(max(reusable) / sum(prompts))
    assert result.exact_chosen_share == result.exact_best_share == result.prompt_cached_share
    blind = bench_routing.replay(config, workload, "least_load")
    assert blind.per_engine == (1, 1) and blind.prompt_cached_share == 0.0


def test_the_prefix_policy_is_told_each_engines_kv_capacity_in_characters() -> None:
    config = _tiny(kv_blocks=300)
    workload = sim.build_workload(config)
    per_token = workload.chars_per_token
    texts = [workload.text(c, t) for c in workload.conversations for t in c.turns]
    tokens = [t.prompt_len for c in workload.conversations for t in c.turns]
    assert per_token == pytest.approx(sum(map(len, texts)) / sum(tokens))
    for hint in (1.0, 0.5):
        told = round(hint * 300 * config.block_size * per_token)
        replay = sim.Replay(replace(config, kv_hint=hint), workload, "prefix")
        tree = replay.chooser._policy.tree(fleet.MODEL)  # type: ignore[attr-defined]
        assert [tree.replica_limit(rid) for rid in replay.engines] == [told, told]
    untold = sim.Replay(replace(config, kv_hint=0.0), workload, "prefix")
    tree = untold.chooser._policy.tree(fleet.MODEL)  # type: ignore[attr-defined]
    assert tree.replica_limit("engine-00") == config.prefix.max_chars_per_replica


def test_a_tree_sized_to_the_kv_claims_what_the_engines_hold() -> None:
    # Told nothing, the tree remembers every prefix it routed and claims far more than the
    # small engines still hold; sized to their KV, its claims match what they hold.
    config = replace(fleet.BenchConfig(), **bench_routing.QUICK)
    workload = sim.build_workload(config)
    sized = bench_routing.replay(config, workload, "prefix")
    untold = bench_routing.replay(replace(config, kv_hint=0.0), workload, "prefix")
    assert abs(sized.predicted_share - sized.exact_chosen_share) < 0.05
    assert untold.predicted_share - untold.exact_chosen_share > 0.15


def test_a_conversation_larger_than_an_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="raise --kv-blocks"):
        bench_routing.run_bench(_tiny(kv_blocks=8), ["round_robin"])


def test_the_command_prints_json_and_refuses_unknown_policies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = bench_routing.main(
        ["--quick", "--users", "2", "--json", "--policies", "prefix,round_robin"]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == (0 if out["ratios"]["rr_ttft_p90_over_default"] >= 2 else 1)
    assert out["config"]["users"] == 2 and out["targets_met"] is None
    assert [r["policy"] for r in out["results"]] == ["prefix", "round_robin"]
    with pytest.raises(SystemExit, match="unknown policies"):
        bench_routing.main(["--quick", "--policies", "prefix,nope"])
