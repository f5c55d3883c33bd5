"""What the gateway reads from OpenAI request bodies, and the error JSON it answers with."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.gateway.errors import BadRequest
from llmgw.gateway.openai import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    ParsedRequest,
    error_body,
    parse_request,
    render_messages,
)
from llmgw.sim.engine import render_chat


def parse(path: str, document: Any, headers: dict[str, str] | None = None) -> ParsedRequest:
    return parse_request(path, json.dumps(document).encode(), headers or {})


def test_completion_prompt_is_the_text() -> None:
    parsed = parse(COMPLETIONS_PATH, {"model": "m", "prompt": "Once upon", "stream": True})
    assert parsed == ParsedRequest(model="m", stream=True, text="Once upon", session="")


def test_a_batch_routes_by_its_first_prompt_and_token_ids_become_text() -> None:
    assert parse(COMPLETIONS_PATH, {"model": "m", "prompt": ["ab", "cd"]}).text == "ab"
    ids = parse(COMPLETIONS_PATH, {"model": "m", "prompt": [1, 22, 333]}).text
    longer = parse(COMPLETIONS_PATH, {"model": "m", "prompt": [1, 22, 333, 4]}).text
    assert longer.startswith(ids)  # a longer token prompt extends the shorter one's text
    assert parse(COMPLETIONS_PATH, {"model": "m", "prompt": [[5, 6], [7]]}).text == "5 6 "


def test_chat_text_is_the_chatml_rendering_the_engine_tokenizes() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        },
        {"role": "assistant", "content": None},
    ]
    parsed = parse(CHAT_PATH, {"model": "m", "messages": messages})
    assert parsed.text == render_messages(messages)
    # the simulated engine (SmolLM2's ChatML) renders the same text
    plain = [messages[0], {"role": "user", "content": "Hi there"}, messages[2]]
    assert parsed.text == render_chat(plain)


def test_a_conversation_s_turns_share_a_growing_prefix() -> None:
    turns = [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}]
    first = render_messages(turns)
    later = render_messages(
        [*turns, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    )
    common = first.removesuffix("<|im_start|>assistant\n")
    assert later.startswith(common)


def test_session_from_header_else_user() -> None:
    body = {"model": "m", "prompt": "p", "user": "u-1"}
    assert parse(COMPLETIONS_PATH, body).session == "u-1"
    assert parse(COMPLETIONS_PATH, body, {"x-session-id": "s-9"}).session == "s-9"
    assert parse(COMPLETIONS_PATH, {"model": "m", "prompt": "p", "user": 5}).session == ""


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (CHAT_PATH, b"", None, "empty"),
        (CHAT_PATH, b"\xff\xfe", None, "not UTF-8"),
        (CHAT_PATH, b"{", None, "not valid JSON"),
        (CHAT_PATH, b'"text"', None, "JSON object"),
        (CHAT_PATH, b'{"model": ""}', "model", "`model`"),
        (CHAT_PATH, b'{"model": 3}', "model", "`model`"),
        (CHAT_PATH, b'{"model": "m", "messages": []}', "messages", "`messages`"),
        (CHAT_PATH, b'{"model": "m", "messages": [1]}', "messages", "messages[0]"),
        (
            CHAT_PATH,
            b'{"model": "m", "messages": [{"content": "x"}]}',
            "messages",
            "messages[0].role",
        ),
        (
            CHAT_PATH,
            b'{"model": "m", "messages": [{"role": "u", "content": 1}]}',
            "messages",
            ".content",
        ),
        (
            CHAT_PATH,
            b'{"model": "m", "messages": [{"role": "u"}], "stream": 1}',
            "stream",
            "`stream`",
        ),
        (COMPLETIONS_PATH, b'{"model": "m"}', "prompt", "`prompt`"),
        (COMPLETIONS_PATH, b'{"model": "m", "prompt": [true]}', "prompt", "`prompt`"),
        (COMPLETIONS_PATH, b'{"model": "m", "prompt": ["a", 1]}', "prompt", "`prompt`"),
    ],
)
def test_malformed_requests_name_the_fault(
    path: str, body: bytes, param: str | None, words: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_request(path, body, {})
    assert words in caught.value.message
    assert caught.value.param == param
    assert caught.value.status == 400


def test_error_body_has_vllms_shape() -> None:
    body = json.loads(
        error_body("The model `x` does not exist.", "NotFoundError", 404, param="model")
    )
    assert body == {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert json.loads(error_body("m", "BadRequestError"))["error"]["code"] is None


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_documents = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.text(max_size=5), _json),
        "prompt": _json,
        "messages": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {}, optional={"role": st.one_of(st.text(max_size=5), _json), "content": _json}
                ),
                max_size=4,
            ),
            _json,
        ),
        "stream": _json,
        "user": _json,
    },
)


@given(path=st.sampled_from([CHAT_PATH, COMPLETIONS_PATH]), document=_documents)
def test_any_json_document_parses_or_is_refused_as_bad_request(
    path: str, document: dict[str, Any]
) -> None:
    try:
        parsed = parse(path, document)
    except BadRequest as exc:
        assert exc.message
        return
    assert parsed.model == document["model"]
    assert isinstance(parsed.text, str)


@given(body=st.binary(max_size=200))
def test_any_bytes_parse_or_are_refused_as_bad_request(body: bytes) -> None:
    try:
        parse_request(CHAT_PATH, body, {})
    except BadRequest:
        pass
