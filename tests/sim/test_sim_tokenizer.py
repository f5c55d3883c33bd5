"""The deterministic tokenizer, the chat template and the deterministic answers."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.sim.engine.generation import OutputPlan, SamplingSpec, word_token_ids
from llmgw.sim.engine.tokenizer import (
    EOS_TOKEN_ID,
    FIRST_HASHED_ID,
    IM_END,
    IM_START,
    VOCAB_SIZE,
    SimTokenizer,
    render_chat,
    split_pieces,
)

TEXT = "Hello world, this is a test"


@given(st.text(max_size=200))
def test_pieces_join_back_to_the_text(text: str) -> None:
    assert "".join(split_pieces(text)) == text


@given(st.text(max_size=200))
def test_decode_inverts_encode_in_one_process(text: str) -> None:
    tokenizer = SimTokenizer()
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= t < VOCAB_SIZE for t in ids)


def test_words_and_punctuation_are_tokens_like_a_bpe_would_cut_them() -> None:
    assert split_pieces(TEXT) == ["Hello", " world", ",", " this", " is", " a", " test"]
    assert len(SimTokenizer().encode(TEXT)) == 7  # vLLM's SmolLM2 also counts 7


def test_the_same_text_gives_the_same_ids_in_another_process() -> None:
    code = (
        "from llmgw.sim.engine.tokenizer import SimTokenizer;"
        f"print(SimTokenizer().encode({TEXT!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == str(SimTokenizer().encode(TEXT))


def test_special_tokens_have_fixed_ids_and_others_are_hashed_above_them() -> None:
    ids = SimTokenizer().encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == IM_START and ids[-1] == IM_END
    assert all(t >= FIRST_HASHED_ID for t in ids[1:-1])


def test_an_id_never_seen_decodes_to_a_placeholder() -> None:
    assert SimTokenizer().decode([12345]) == "<|id:12345|>"


def test_decode_can_skip_special_tokens() -> None:
    tokenizer = SimTokenizer()
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi"


def test_chat_template_is_chatml_with_a_generation_prompt() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert render_chat(messages) == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_reads_text_parts_and_can_continue_the_last_message() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "partial"},
    ]
    text = render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\npartial"


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([{"content": "x"}], "role"),
        ([{"role": "user", "content": 5}], "content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "text parts"),
        (["not an object"], "object"),
    ],
)
def test_malformed_messages_are_refused_saying_what(messages: list[Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        render_chat(messages)


def test_both_generation_prompt_and_continue_are_refused_as_vllm_does() -> None:
    with pytest.raises(ValueError, match="continue_final_message"):
        render_chat([{"role": "user", "content": "x"}], continue_final_message=True)


def _answer(prompt: list[int], spec: SamplingSpec) -> list[int]:
    plan = OutputPlan(prompt, spec, word_token_ids(SimTokenizer()))
    out: list[int] = []
    while plan.finish_reason(len(out), len(prompt) + len(out), 10_000) is None:
        out.append(plan.token(len(out)))
    return out


def test_answers_are_deterministic_and_end_with_eos_at_their_natural_length() -> None:
    spec = SamplingSpec(max_tokens=1000)
    first, again = _answer([1, 2, 3], spec), _answer([1, 2, 3], spec)
    assert first == again
    assert 8 <= len(first) <= 64 and first[-1] == EOS_TOKEN_ID
    assert EOS_TOKEN_ID not in first[:-1]
    assert _answer([1, 2, 4], spec) != first


def test_max_tokens_ignore_eos_min_tokens_and_seed_shape_the_answer() -> None:
    assert len(_answer([7], SamplingSpec(max_tokens=3))) == 3
    long = _answer([7], SamplingSpec(max_tokens=100, ignore_eos=True))
    assert len(long) == 100 and EOS_TOKEN_ID not in long
    natural = len(_answer([7], SamplingSpec(max_tokens=1000)))
    assert len(_answer([7], SamplingSpec(max_tokens=1000, min_tokens=natural + 5))) >= natural + 5
    assert _answer([7], SamplingSpec(max_tokens=5, seed=1)) != _answer(
        [7], SamplingSpec(max_tokens=5, seed=2)
    )
