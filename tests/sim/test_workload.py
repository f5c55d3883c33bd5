"""llmgw.sim.workload: the prompt sets, the request bodies and the Poisson arrivals that the
demo's workload and the chaos run's load share."""

from __future__ import annotations

import asyncio
import random

from llmgw.sim.workload import CHAOS_PROMPTS, DEMO_PROMPTS, TEAMS, Arrivals, chat_body


def test_every_team_has_one_long_system_prompt_shared_by_its_requests() -> None:
    for prompts in (DEMO_PROMPTS, CHAOS_PROMPTS):
        assert len(prompts.system) == len(TEAMS) and len(prompts.questions) == 7
        assert all(team in text for team, text in zip(TEAMS, prompts.system, strict=True))
        assert min(map(len, prompts.system)) > 10 * max(map(len, prompts.questions))


def test_a_body_is_drawn_from_the_seed_model_then_system_prompt_then_question() -> None:
    body = chat_body(random.Random(7), DEMO_PROMPTS, ("a", "b"), (0.5, 0.5))
    rng = random.Random(7)
    model = rng.choices(("a", "b"), (0.5, 0.5))[0]
    system, question = rng.choice(DEMO_PROMPTS.system), rng.choice(DEMO_PROMPTS.questions)
    assert body == {
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    }


async def test_arrivals_skip_while_the_requests_in_flight_are_at_the_bound() -> None:
    stop, release = asyncio.Event(), asyncio.Event()
    arrivals = Arrivals(rate=1000.0, max_in_flight=2, rng=random.Random(1))

    async def request() -> None:
        await release.wait()

    def start() -> asyncio.Task[None]:
        return asyncio.create_task(request())

    asyncio.get_running_loop().call_later(0.2, stop.set)  # ~200 arrivals at 1,000 a second
    await asyncio.wait_for(arrivals.run(stop, start), 10)
    assert len(arrivals.pending) == 2 and arrivals.skipped >= 5
    release.set()
    await asyncio.wait(arrivals.pending)
    await asyncio.sleep(0)
    assert not arrivals.pending  # a finished request leaves `pending` by itself
