"""What ``VLLMEngine.generate`` hands vLLM's ``AsyncLLM`` for a request: the
prompt's token ids and, for a salted request, its ``cache_salt`` (vLLM salts
the prompt's first block hash with it, and the Xavier connector reads it from
vLLM's ``Request``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from xinference.core.messages import GenerationRequest
from xinference.core.vllm_engine import VLLMEngine

pytest.importorskip("vllm", reason="vLLM is not installed")


class _Recorder:
    """Stands in for ``AsyncLLM``: records each prompt and its sampling
    parameters, answers one token per choice (``n`` of them, the last first)."""

    def __init__(self) -> None:
        self.prompts: list[dict[str, Any]] = []
        self.params: list[Any] = []

    async def generate(self, prompt: Any, params: Any, request_id: str) -> Any:
        self.prompts.append(dict(prompt))
        self.params.append(params)
        logprob = SimpleNamespace(logprob=-0.5, decoded_token="x")
        yield SimpleNamespace(
            outputs=[
                SimpleNamespace(
                    index=index,
                    text=f"x{index}",
                    token_ids=[5],
                    finish_reason="length",
                    logprobs=None if params.logprobs is None else [{5: logprob}],
                )
                for index in reversed(range(params.n))
            ],
            finished=True,
            num_cached_tokens=0,
            kv_transfer_params=None,
        )


@pytest.mark.parametrize("salt", [None, "tenant-a"])
async def test_a_requests_salt_reaches_vllms_prompt(salt):
    recorder = _Recorder()
    engine = VLLMEngine(recorder)
    request = GenerationRequest("r", (1, 2, 3), max_tokens=1, cache_salt=salt)
    async for _ in engine.generate(request, stream=False):
        pass
    expected = {"prompt_token_ids": [1, 2, 3]}
    if salt is not None:
        expected["cache_salt"] = salt
    assert recorder.prompts == [expected]


async def test_the_options_vllm_mapped_reach_its_sampling_params():
    recorder = _Recorder()
    engine = VLLMEngine(recorder)
    options = {"n": 3, "frequency_penalty": 0.5, "logprobs": 2, "min_tokens": 1}
    request = GenerationRequest("r", (1, 2, 3), max_tokens=4, options=options)
    chunks = [chunk async for chunk in engine.generate(request, stream=False)]
    params = recorder.params[0]
    assert (params.n, params.frequency_penalty, params.logprobs) == (3, 0.5, 2)
    assert params.min_tokens == 1 and params.max_tokens == 4
    # one chunk: the first choice, the others in order with it
    (chunk,) = chunks
    assert [c.index for c in (chunk, *chunk.more)] == [0, 1, 2]
    assert [c.text for c in (chunk, *chunk.more)] == ["x0", "x1", "x2"]
    assert chunk.logprobs == (((5, -0.5, "x"),),)


async def test_streamed_choices_come_one_chunk_each():
    recorder = _Recorder()
    engine = VLLMEngine(recorder)
    request = GenerationRequest("r", (1, 2, 3), max_tokens=4, options={"n": 2})
    chunks = [chunk async for chunk in engine.generate(request, stream=True)]
    assert sorted(c.index for c in chunks) == [0, 1]
    assert all(not c.more and c.logprobs is None for c in chunks)
