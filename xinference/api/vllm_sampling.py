"""The sampling fields whose meaning is vLLM's, checked and mapped by vLLM itself.

OpenAI's classic fields (temperature, top_p, max_tokens, stop, seed, ...) are
resolved by the front end as before (``core/sampling.py``). Every further field a
request may set that ends in vLLM's ``SamplingParams`` (n, the penalties,
logit_bias, logprobs, min_tokens, stop_token_ids, structured outputs, ...) is
handed, as the request set it, to vLLM's own OpenAI request model, the one
``vllm serve`` parses its bodies with: its validators and its
``to_sampling_params`` decide what the field means and which values are refused,
in vLLM's words. The ``SamplingParams`` arguments that mapping produced travel
to the replica as plain keyword arguments (``GenerationRequest.options``).

Only the sampling fields reach vLLM's request model (the classic ones too, for
the checks that combine them): the prompt and the messages stay the front
end's (it tokenises them, for routing), so the model is given a placeholder
for them. vLLM's request models import most of vLLM (tens of seconds
on a small machine), so they are imported on the first request that sets such a
field: a request without one costs nothing more than before.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Literal

from .errors import InvalidRequest

Kind = Literal["completion", "chat"]

# Request fields delegated to vLLM's request model (those of one kind only are
# refused by the other kind's model as vLLM refuses them: ``schemas.py`` routes
# them here only for the kind that has them).
_BOTH = frozenset(
    {
        "n",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "logprobs",
        "min_tokens",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "allowed_token_ids",
        "bad_words",
        "response_format",
        "structured_outputs",
    }
)
DELEGATED: dict[Kind, frozenset[str]] = {
    "completion": _BOTH,
    "chat": _BOTH | {"top_logprobs"},
}

# The ``SamplingParams`` arguments those fields map to, forwarded to the replica.
# The classic ones (temperature, ..., stop, seed, max_tokens) are not: the front
# end resolves them itself, the same way, and the replica sets them.
FORWARDED = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "logit_bias",
    "min_tokens",
    "stop_token_ids",
    "bad_words",
    "allowed_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "structured_outputs",
)

# What stands for the prompt in vLLM's request model (checked by the front end).
_PLACEHOLDER: dict[Kind, dict[str, Any]] = {
    "completion": {"prompt": [0]},
    "chat": {"messages": []},
}


def sampling_options(
    kind: Kind,
    fields: Mapping[str, Any],
    max_tokens: int | None,
    defaults: Mapping[str, Any],
    classic: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``SamplingParams`` arguments vLLM maps ``fields`` (delegated request
    fields, as sent) to, only those that differ from ``SamplingParams``' own
    defaults; an ``InvalidRequest`` in vLLM's words for a value vLLM refuses.
    ``defaults``: the model's sampling defaults, as ``vllm serve`` passes them;
    ``classic``: the request's classic fields (temperature, ...), which vLLM
    checks together with the others (n > 1 is refused with greedy sampling)."""
    classic = classic or {}
    if not fields:
        return {}
    vllm = _vllm()
    try:
        request = vllm.request_models[kind].model_validate(
            {"model": "", **_PLACEHOLDER[kind], **classic, **fields}
        )
        params = vllm.to_sampling_params(request, max_tokens, dict(defaults))
    except vllm.pydantic_error as error:
        raise InvalidRequest(*_pydantic_reason(error)) from None
    except vllm.client_errors as error:
        raise InvalidRequest(str(error), getattr(error, "parameter", None)) from None
    neutral = vllm.neutral_params
    return {
        name: getattr(params, name)
        for name in FORWARDED
        if getattr(params, name) != getattr(neutral, name)
    }


def is_request_error(error: BaseException) -> bool:
    """Whether a replica's refusal of a request is the sender's to fix (a 400),
    as vLLM's server decides: its client errors (``VLLMClientError``, which is
    not a ``ValueError`` in recent releases: matched by name, so that the front
    end need not import vLLM for it) and the plain ValueError / TypeError its
    older checks raise."""
    if isinstance(error, ValueError | TypeError | OverflowError):
        return True
    return any(kind.__name__ == "VLLMClientError" for kind in type(error).__mro__)


def _pydantic_reason(error: Any) -> tuple[str, str | None]:
    """A pydantic refusal as vLLM's server words it: the first error's message
    (the validator's own, when one raised), the field it names."""
    first = error.errors()[0]
    cause = first.get("ctx", {}).get("error")
    param = getattr(cause, "parameter", None)
    location = ".".join(str(part) for part in first.get("loc", ()))
    if param is None and location:
        param = location
    message = str(cause) if cause is not None else first["msg"]
    return (f"{location}: {message}" if location else message), param


class _Vllm:
    """vLLM's request models and errors, imported once (``_vllm``)."""

    def __init__(self) -> None:
        import pydantic
        from vllm import SamplingParams

        try:  # vLLM 0.27 on: one module per API
            from vllm.entrypoints.openai.chat_completion.protocol import (
                ChatCompletionRequest,
            )
            from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        except ImportError:  # vLLM 0.26: one protocol module
            from vllm.entrypoints.openai.protocol import (  # type: ignore[no-redef]
                ChatCompletionRequest,
                CompletionRequest,
            )
        import vllm.exceptions

        self.request_models: dict[Kind, Any] = {
            "completion": CompletionRequest,
            "chat": ChatCompletionRequest,
        }
        self.pydantic_error = pydantic.ValidationError
        # What vLLM's server answers 400 for: its client errors, and the plain
        # ValueError / TypeError its older checks still raise.
        client_error = getattr(vllm.exceptions, "VLLMClientError", ValueError)
        self.client_errors = (client_error, ValueError, TypeError, OverflowError)
        self.neutral_params = SamplingParams()
        # Older releases took the logits processors' pattern in between.
        self._pattern_argument = (
            "logits_processor_pattern"
            in inspect.signature(CompletionRequest.to_sampling_params).parameters
        )

    def to_sampling_params(
        self, request: Any, max_tokens: int | None, defaults: dict[str, Any]
    ) -> Any:
        if self._pattern_argument:
            return request.to_sampling_params(
                max_tokens=max_tokens,
                logits_processor_pattern=None,
                default_sampling_params=defaults,
            )
        return request.to_sampling_params(
            max_tokens=max_tokens, default_sampling_params=defaults
        )


@functools.cache
def _vllm() -> _Vllm:
    return _Vllm()
