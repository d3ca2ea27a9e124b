"""How the serving routes turn a request body into what a replica generates:
the model's sampling defaults, the request's own values, the limits, batches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from xinference.api.errors import InvalidRequest
from xinference.api.schemas import ChatCompletionRequest, CompletionRequest
from xinference.api.serving import _generation_request

QWEN25_DEFAULTS = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
}


def dispatcher(defaults=None, max_model_len=256, vocab_size=1024, tokenizer=1000):
    return SimpleNamespace(
        deployment=SimpleNamespace(max_model_len=max_model_len, vocab_size=vocab_size),
        renderer=SimpleNamespace(vocab_size=tokenizer),
        sampling_defaults=dict(QWEN25_DEFAULTS if defaults is None else defaults),
    )


def request(body, served=None, ids=(5, 6, 7)):
    return _generation_request(
        served or dispatcher(), "cmpl", list(ids), body, body.max_tokens, "max_tokens"
    )


def test_the_models_defaults_apply_where_the_request_sets_nothing():
    generated = request(CompletionRequest(model="m", prompt="hi"))
    assert (generated.temperature, generated.top_p, generated.top_k) == (0.7, 0.8, 20)
    assert generated.repetition_penalty == 1.05 and generated.min_p == 0.0


def test_the_requests_own_values_win():
    body = CompletionRequest(
        model="m",
        prompt="hi",
        temperature=0,
        top_p=1.0,
        top_k=-1,  # vLLM's old "no cut"
        repetition_penalty=1.0,
        min_p=0.05,
    )
    generated = request(body)
    assert (generated.temperature, generated.top_p, generated.top_k) == (0.0, 1.0, 0)
    assert generated.repetition_penalty == 1.0 and generated.min_p == 0.05


def test_without_model_defaults_the_values_are_neutral():
    generated = request(CompletionRequest(model="m", prompt="hi"), dispatcher({}))
    assert (generated.temperature, generated.top_p, generated.top_k) == (1.0, 1.0, 0)
    assert generated.repetition_penalty == 1.0


def test_limits_are_checked_with_the_larger_vocabulary():
    body = CompletionRequest(model="m", prompt="hi", max_tokens=10)
    request(body, dispatcher(vocab_size=1024, tokenizer=1100), ids=[1099])
    with pytest.raises(InvalidRequest, match="token id 1100 is outside"):
        request(body, dispatcher(vocab_size=1024, tokenizer=1100), ids=[1100])
    with pytest.raises(InvalidRequest, match="max_tokens is 300") as refused:
        request(CompletionRequest(model="m", prompt="hi", max_tokens=300))
    assert refused.value.param == "max_tokens"
    chat = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x"}], max_tokens=None
    )
    with pytest.raises(InvalidRequest, match="the prompt is 256 tokens") as refused:
        _generation_request(
            dispatcher(), "chatcmpl", [5] * 256, chat, None, "max_tokens"
        )
    assert refused.value.param == "messages"


@pytest.mark.parametrize(
    "prompt, prompts",
    [
        ("one", ["one"]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["one", "two"], ["one", "two"]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        ([], [[]]),
    ],
)
def test_a_completion_takes_one_prompt_or_a_list(prompt, prompts):
    assert CompletionRequest(model="m", prompt=prompt).prompts() == prompts
