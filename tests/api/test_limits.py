"""What a serving request must fit: each refusal a 400 naming the limit."""

import re

import pytest

from xinference.api.errors import InvalidRequest
from xinference.api.limits import ModelLimits

LIMITS = ModelLimits(max_model_len=256, vocab_size=1024)


def test_a_request_that_fits_passes():
    LIMITS.check([5] * 200, 56)  # exactly the context
    LIMITS.check([5] * 255, None)  # one position left: runs to the context's end
    LIMITS.check([0, 1023], 1)
    ModelLimits(0, 0).check([10**6] * 10**4, 10**6)  # unknown limits: unchecked


@pytest.mark.parametrize(
    "ids, max_tokens, param, message",
    [
        ([], 1, "prompt", "the prompt is empty"),
        ([5, 1024], 1, "prompt", "token id 1024 is outside the model's vocabulary"),
        ([-1], 1, "prompt", "token id -1 is outside"),
        ([5] * 256, None, "prompt", "the prompt is 256 tokens, but this model's "),
        ([5] * 300, 1, "prompt", "context (max_model_len) is 256 tokens"),
        ([5] * 200, 57, "max_tokens", "max_tokens is 57, but this model's context"),
        ([5] * 200, 100000, "max_tokens", "at most 56 tokens can be generated"),
    ],
)
def test_what_does_not_fit_is_refused_naming_the_limit(ids, max_tokens, param, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)) as refused:
        LIMITS.check(ids, max_tokens)
    assert refused.value.param == param
