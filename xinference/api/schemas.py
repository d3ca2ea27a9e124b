"""Request bodies of the REST API (pydantic), OpenAI-compatible where OpenAI has one.

Nothing unknown is silently ignored: a launch key that is not an option here must
be a vLLM engine argument (``LaunchSpec.from_options`` checks it with vLLM's own
parser), and a sampling parameter we cannot honour is a 400 naming it (``refused``).
Values are checked for type here and for meaning by ``LaunchSpec.from_options``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..core.sampling import DEFAULT_GENERATION_CONFIG
from ..model.llm.vllm.xavier.config import DEFAULT_TRANSPORT
from .vllm_sampling import DELEGATED, Kind


class LaunchRequest(BaseModel):
    # Extra keys are free vLLM engine arguments, as upstream Xinference passes them.
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model_uid: str | None = None
    model_name: str | None = None
    model_path: str | None = None
    model_engine: str | None = "vllm"
    replica: int = 1
    enable_xavier: bool = False
    xavier_gpu_cache_bytes: int | str | None = None
    xavier_transport: str = DEFAULT_TRANSPORT
    xavier_cross_layer_blocks: bool = False
    xavier_remote_loads: bool = True
    # None: the engine's XAVIER_FAST_PATH decides. Typed Any so that a value that
    # is not a boolean reaches LaunchSpec's check (a 400 naming the option)
    # instead of being coerced ("no" -> False) or refused as a 422.
    xavier_fast_path: Any = None
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
    # "auto": generation_config.json supplies default sampling parameters (vLLM's
    # --generation-config auto); "vllm": neutral defaults.
    generation_config: str = DEFAULT_GENERATION_CONFIG
    # Upstream Xinference's keys (its client sends them all, mostly as null).
    model_type: str | None = "LLM"
    model_size_in_billions: int | str | None = None
    model_format: str | None = None
    quantization: str | None = None
    n_gpu: int | str | None = "auto"
    n_worker: int = 1
    gpu_idx: int | list[int] | None = None
    worker_ip: str | None = None
    peft_model_config: dict[str, Any] | None = None
    request_limits: int | None = None
    replica_config: list[Any] | None = None
    enable_thinking: bool | None = None
    enable_virtual_env: bool | None = None
    virtual_env_packages: list[str] | None = None
    virtual_env_find_links: list[str] | None = None
    envs: dict[str, str] | None = None


# Parameters we cannot honour yet, with the values that ask for nothing (a client
# may send them at their defaults). Any other value, or any other parameter that
# is neither declared below nor delegated to vLLM (``vllm_sampling.DELEGATED``), is
# refused with a 400 that names it: never dropped.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "chat_template_kwargs": (None, {}),  # completions: no template to take them
}
# Parameters that only label a request (no effect on its output): accepted.
_LABELS = ("user", "metadata", "store")
# The sampling fields the front end resolves itself (``core/sampling.py``); vLLM
# checks them with the delegated ones (``vllm_sampling.sampling_options``).
_CLASSIC = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "ignore_eos",
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    # None: the model's default (generation_config.json), else the neutral value
    # (``core/sampling.py``). top_k, min_p and repetition_penalty are vLLM's
    # extensions of OpenAI's parameters; top_k -1 means "no cut", as vLLM had it.
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # vLLM's extension, handy for benchmarks
    # vLLM's extension: requests of different salts never share cached KV
    # (checked as vLLM checks it, and combined with the caller: ``tenancy.py``)
    cache_salt: str | None = None

    def sampling(self) -> dict[str, Any]:
        """The sampling parameters this request set (None: left to the defaults)."""
        top_k = 0 if self.top_k == -1 else self.top_k
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    # Which of vLLM's request models takes the delegated fields (``vllm_sampling``).
    _KIND: Kind = "completion"

    def delegated(self) -> dict[str, Any]:
        """The fields this request sets whose meaning is vLLM's, as sent (None
        counts as unset, as it does for vLLM)."""
        fields = {
            name: value
            for name, value in (self.model_extra or {}).items()
            if name in DELEGATED[self._KIND] and value is not None
        }
        if self.n != 1:
            fields["n"] = self.n
        return fields

    def classic(self) -> dict[str, Any]:
        """The classic sampling fields this request sets (not None), as sent."""
        return {
            name: getattr(self, name)
            for name in _CLASSIC
            if getattr(self, name) is not None
        }

    def refused(self) -> list[str]:
        """The parameters this request sets that the server cannot honour."""
        names = []
        for name, value in (self.model_extra or {}).items():
            if name in _LABELS or name in DELEGATED[self._KIND]:
                continue
            if name not in _NEUTRAL or value not in _NEUTRAL[name]:
                names.append(name)
        if self.stream_options is not None and not self.stream:
            names.append("stream_options")  # OpenAI: only with stream=true
        return sorted(names)


class CompletionRequest(_SamplingFields):
    # One prompt (text or token ids) or, as OpenAI allows, a list of them.
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's completions default; chat completions run to the end (None).
    max_tokens: int | None = Field(default=16, ge=1)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice of the response."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt or all(isinstance(item, int) for item in prompt):
            return [prompt]  # type: ignore[list-item]  # one prompt of token ids
        return list(prompt)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # A string or OpenAI's content parts; only text parts (no images, no audio).
    content: str | list[TextPart] | None

    def plain(self) -> dict[str, Any]:
        """The message as plain data (``PromptRenderer.chat_ids`` renders it)."""
        return self.model_dump(include={"role", "content"})


class ChatCompletionRequest(_SamplingFields):
    _KIND: Kind = "chat"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # Passed to the model's chat template (Qwen3's enable_thinking, ...), as vLLM
    # passes them (``PromptRenderer.chat_ids``).
    chat_template_kwargs: dict[str, Any] | None = None

    def token_budget(self) -> int | None:
        """Tokens to generate at most; None: until the end of sequence or context."""
        return self.max_completion_tokens or self.max_tokens


class PrefixRequest(BaseModel):
    """A prompt (text or token ids) or chat messages, to look up in the tracker."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    # Look up the run from this block on: what a replica that has the first
    # ``after_blocks`` blocks itself asks for (0: the whole prefix).
    after_blocks: int = Field(default=0, ge=0)
    # looked up under the salt the same request would be served under
    cache_salt: str | None = None
