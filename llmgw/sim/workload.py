"""Chat traffic through a gateway: the prompt sets and the Poisson arrivals.

``llmgw demo``'s background workload and the chaos run's load (``bench.chaoskit.load``) send
chat completions the same way: Poisson arrivals at a rate, an arrival skipped (not queued)
while too many requests are in flight, each request a model picked by weight, one of a few long
system prompts (shared prefixes, so the KV caches and the prefix routing have something to
find) and a short question. This module holds what they share; each caller keeps its own
rate, models, token counts and what it records of a request. Both draw from one
``random.Random`` in a fixed order (the body, then the wait), so a seed gives the same traffic.

The two prompt sets differ only in length and wording, as they did when each caller had its
own copy: the chaos run's recorded figures (BENCHMARKS.md) were measured with the shorter one.
Imports nothing of llmgw.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

TEAMS: Final = ("the storage team", "the billing team", "the GPU platform team")


@dataclass(frozen=True, slots=True)
class Prompts:
    """System prompts (the shared prefixes) and the questions asked after one of them."""

    system: tuple[str, ...]
    questions: tuple[str, ...]


def on_call_prompts(policy: str, repeat: int, questions: tuple[str, ...]) -> Prompts:
    """One on-call assistant's system prompt per team: its introduction, then ``policy``
    ``repeat`` times (the long shared part)."""
    system = tuple(f"You are the on-call assistant of {team}. " + policy * repeat for team in TEAMS)
    return Prompts(system, questions)


DEMO_PROMPTS: Final = on_call_prompts(
    "Answer in plain words and keep answers short. Quote the exact command a user should "
    "run, never a paraphrase of it. When a question mentions a GPU, name its node, its "
    "index and its memory. When you are not sure, say which log file would tell, and where "
    "it lives. Never invent a metric: if the number is not in the context, say so. ",
    4,
    (
        "Why is my job pending?", "Which node runs the chat model?", "How do I drain a replica?",
        "What does STALE mean in the console?", "How much GPU memory is free on dgx-1?",
        "Summarise the last incident in one line.", "Who cordoned mig-1, and why?",
    ),
)  # fmt: skip
"""``llmgw demo``'s prompts."""

CHAOS_PROMPTS: Final = on_call_prompts(
    "Answer in plain words and keep answers short. Quote the exact command a user should "
    "run, never a paraphrase of it. When a question names a GPU, give its node, its index "
    "and its memory. When you are not sure, say which log would tell, and where it lives. ",
    3,
    (
        "Why is my job pending?", "Which node runs the chat model?", "How do I drain a replica?",
        "What does STALE mean in the console?", "How much GPU memory is free on node-a?",
        "Summarise the last incident in one line.", "Who cordoned node-b, and why?",
    ),
)  # fmt: skip
"""The chaos run's prompts (``python -m bench.chaos``)."""


def chat_body(
    rng: random.Random, prompts: Prompts, models: Sequence[str], weights: Sequence[float]
) -> dict[str, Any]:
    """A chat completion's model (by weight) and messages (a system prompt, a question),
    drawn from ``rng`` in that order; callers add their own fields after."""
    return {
        "model": rng.choices(models, weights)[0],
        "messages": [
            {"role": "system", "content": rng.choice(prompts.system)},
            {"role": "user", "content": rng.choice(prompts.questions)},
        ],
    }


class Arrivals:
    """Poisson arrivals at ``rate`` per second; at each, a request starts unless
    ``max_in_flight`` are running (then it is skipped and counted, not queued)."""

    def __init__(self, rate: float, max_in_flight: int, rng: random.Random) -> None:
        self.rate = rate
        self.max_in_flight = max_in_flight
        self._rng = rng
        self.pending: set[asyncio.Task[None]] = set()  # the requests running now
        self.skipped = 0

    async def run(self, stop: asyncio.Event, start: Callable[[], asyncio.Task[None]]) -> None:
        """Call ``start`` at each arrival until ``stop`` is set; the requests it started and
        still running are left in `pending`, for the caller to wait for or cancel."""
        while not stop.is_set():
            if len(self.pending) < self.max_in_flight:
                task = start()
                self.pending.add(task)
                task.add_done_callback(self.pending.discard)
            else:
                self.skipped += 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._rng.expovariate(self.rate)):
                    await stop.wait()
