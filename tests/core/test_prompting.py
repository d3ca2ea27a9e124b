"""Prompt rendering with the tiny model's real tokenizer."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from xinference.core.prompting import PromptRenderer
from xinference.model.llm.tiny_model import build_tiny_qwen2

pytestmark = pytest.mark.slow  # builds the model once (a few seconds)


@pytest.fixture(scope="module")
def renderer(tmp_path_factory):
    path = build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny")
    return PromptRenderer.load(str(path))


def test_text_and_token_prompts(renderer):
    ids = renderer.completion_ids("the quick brown fox")
    assert ids and all(isinstance(token, int) for token in ids)
    assert renderer.completion_ids(ids) == ids


def test_chat_without_a_template_uses_role_markers(renderer):
    messages = [{"role": "user", "content": "hello"}]
    expected = renderer.completion_ids("<|user|>\nhello\n<|assistant|>\n")
    assert renderer.chat_ids(messages) == expected


def test_a_shared_text_prefix_gives_a_shared_token_prefix(renderer):
    """What prefix sharing relies on: words after the prefix do not merge into it."""
    prefix = "Context 3: " + "kalo mine suta " * 40
    a = renderer.completion_ids(prefix + "\nQuestion 0: ta?")
    b = renderer.completion_ids(prefix + "\nQuestion 1: ri?")
    shared = renderer.completion_ids(prefix)
    assert a[: len(shared)] == b[: len(shared)] == shared


def test_concurrent_tokenisation_is_safe(renderer):
    prompts = [f"prompt {i} " * 50 for i in range(64)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(renderer.completion_ids, prompts))
    assert results == [renderer.completion_ids(p) for p in prompts]
