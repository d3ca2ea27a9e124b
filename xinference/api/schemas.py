"""Request bodies of the REST API (pydantic), OpenAI-compatible where OpenAI has one.

Unknown fields are refused (a misspelt option must not be silently ignored); values
are checked for type here and for meaning by ``LaunchSpec.from_options``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..model.llm.vllm.xavier.config import DEFAULT_TRANSPORT


class LaunchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_uid: str | None = None
    model_name: str | None = None
    model_path: str | None = None
    model_engine: str = "vllm"
    replica: int = 1
    enable_xavier: bool = False
    xavier_gpu_cache_bytes: int | str | None = None
    xavier_transport: str = DEFAULT_TRANSPORT
    xavier_cross_layer_blocks: bool = False
    router: str = "round-robin"
    router_busy_margin: int = 2
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    block_size: int | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    enforce_eager: bool = False
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    seed: int = 0


class _SamplingFields(BaseModel):
    # OpenAI clients send fields we do not use (user, logit_bias, ...): ignore them.
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str
    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # vLLM's extension, handy for benchmarks

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def token_budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16


class PrefixRequest(BaseModel):
    """A prompt (text or token ids) or chat messages, to look up in the tracker."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
