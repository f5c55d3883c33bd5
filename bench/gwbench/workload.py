"""bench.gateway's workload: chat requests with realistic text, groups sharing a long system
prompt, each user with a question of their own, in a shuffled order."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Final

from bench.gwbench.settings import BENCH_KEY
from bench.kit import HOST

MODEL: Final = "bench-model"

_WORDS: Final = (
    "the of and to in is that for it as with was on be by this are from at or an have not "
    "which but all they one can were their there been has when if more will would who so no "
    "what about out up into do than some could them time only other new these two may first "
    "then any like now my such make over our even most after also did many before must "
    "through back years where much your way well down should because each just those people "
    "how too little state good very world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off "
    "come since against go came right used take three himself few house use during without "
    "again place around however home small found thought went say part once general high "
    "upon school every does group number customer account order invoice shipment refund "
    "policy request support answer question please thanks document contract clause section "
    "service model replica latency throughput memory cache prompt token server cluster"
).split()


@dataclass(frozen=True, slots=True)
class Prompt:
    group: int
    system: str
    user: str


def prose(rng: random.Random, chars: int) -> str:
    """Sentences of common English words, about ``chars`` long."""
    sentences: list[str] = []
    size = 0
    while size < chars:
        words = rng.choices(_WORDS, k=rng.randint(6, 18))
        sentence = " ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!"))
        sentences.append(sentence)
        size += len(sentence) + 1
    return " ".join(sentences)


def make_prompts(groups: int, users: int, prefix_chars: int, question_chars: int) -> list[Prompt]:
    """``groups`` x ``users`` prompts, shuffled; the same arguments give the same prompts."""
    rng = random.Random(20_250_601)
    systems = [
        f"You are the assistant of team {g}. " + prose(rng, prefix_chars) for g in range(groups)
    ]
    prompts = [
        Prompt(g, systems[g], f"User {u}: " + prose(rng, question_chars))
        for g in range(groups)
        for u in range(users)
    ]
    rng.shuffle(prompts)
    return prompts


def chat_request(port: int, prompt: Prompt, stream: bool) -> bytes:
    """A ``/v1/chat/completions`` POST as an OpenAI client sends it, pre-encoded."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": prompt.system},
                {"role": "user", "content": prompt.user},
            ],
            "max_tokens": 16,
            "stream": stream,
        },
        separators=(",", ":"),
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: */*\r\nAuthorization: Bearer {BENCH_KEY}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body
