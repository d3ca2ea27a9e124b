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
    """Stands in for ``AsyncLLM``: records each prompt, answers one token."""

    def __init__(self) -> None:
        self.prompts: list[dict[str, Any]] = []

    async def generate(self, prompt: Any, params: Any, request_id: str) -> Any:
        self.prompts.append(dict(prompt))
        yield SimpleNamespace(
            outputs=[SimpleNamespace(text="x", token_ids=[5], finish_reason="length")],
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
