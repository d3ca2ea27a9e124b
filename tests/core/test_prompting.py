"""Prompt rendering with the tiny models' real tokenizers: one shaped like a
Qwen2.5-Instruct release (ChatML template with a default system prompt), one
without a chat template (the fallback)."""

import copy
from concurrent.futures import ThreadPoolExecutor

import pytest

from xinference.core.prompting import (
    PromptRefused,
    PromptRenderer,
    template_arguments,
)
from xinference.model.llm.tiny_model import DEFAULT_SYSTEM_PROMPT, build_tiny_qwen2

pytestmark = pytest.mark.slow  # builds the models once (a few seconds each)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def renderer(models):
    return PromptRenderer.load(str(build_tiny_qwen2(models / "chat")))


@pytest.fixture(scope="module")
def untemplated(models):
    path = build_tiny_qwen2(models / "plain", with_chat_template=False)
    return PromptRenderer.load(str(path))


def chatml(*turns: tuple[str, str]) -> str:
    """The text a ChatML template renders, ready for the assistant's turn."""
    text = "".join(
        f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns
    )
    return text + "<|im_start|>assistant\n"


def test_text_and_token_prompts(renderer):
    ids = renderer.completion_ids("the quick brown fox")
    assert ids and all(isinstance(token, int) for token in ids)
    assert renderer.completion_ids(ids) == ids


def test_chat_renders_the_template_with_its_default_system_prompt(renderer):
    ids = renderer.chat_ids([{"role": "user", "content": "hello"}])
    expected = chatml(("system", DEFAULT_SYSTEM_PROMPT), ("user", "hello"))
    assert ids == renderer.completion_ids(expected)
    # the special tokens are single ids, as in a real release: 1 and 2
    assert ids[0] == 1 and ids.count(2) == 2


def test_a_system_message_replaces_the_default_one(renderer):
    messages = [
        {"role": "system", "content": "Answer in syllables."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "kalo"},
        {"role": "user", "content": "again"},
    ]
    expected = chatml(
        ("system", "Answer in syllables."),
        ("user", "hello"),
        ("assistant", "kalo"),
        ("user", "again"),
    )
    assert renderer.chat_ids(messages) == renderer.completion_ids(expected)


def test_list_content_is_its_text_parts_joined(renderer):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    as_parts = renderer.chat_ids([{"role": "user", "content": parts}])
    assert as_parts == renderer.chat_ids([{"role": "user", "content": "hello\nthere"}])
    with pytest.raises(ValueError, match="only text parts"):
        renderer.chat_ids([{"role": "user", "content": [{"type": "image_url"}]}])


def test_chat_without_a_template_uses_role_markers(untemplated):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
    ]
    expected = untemplated.completion_ids(
        "<|system|>\nbe brief\n<|user|>\nhello\n<|assistant|>\n"
    )
    assert untemplated.chat_ids(messages) == expected


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
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        chats = list(pool.map(renderer.chat_ids, conversations))
    assert chats == [renderer.chat_ids(c) for c in conversations]


CONTEXT = 64  # tokens: a small model context for the bound tests


def test_a_lone_surrogate_is_refused_naming_where(renderer, untemplated):
    with pytest.raises(
        PromptRefused, match=r"lone surrogate \(U\+D800\) at char.* 1"
    ) as bad:
        renderer.completion_ids("a\ud800b")
    assert bad.value.param == "prompt"
    for chat in (renderer, untemplated):
        messages = [
            {"role": "user", "content": "fine"},
            {"role": "user", "content": [{"type": "text", "text": "x\udfff"}]},
        ]
        with pytest.raises(PromptRefused, match="U\\+DFFF") as bad:
            chat.chat_ids(messages)
        assert bad.value.param == "messages[1].content"
    # a surrogate pair is one character outside the BMP, and fine
    assert renderer.completion_ids("a\U0001f600b") == renderer.completion_ids(
        "a\ud83d\ude00b".encode("utf-16", "surrogatepass").decode("utf-16")
    )


def test_a_chat_template_refusal_is_the_senders(renderer):
    """A template that refuses the messages (HF templates call raise_exception,
    e.g. for roles that do not alternate) refuses the request, naming why."""
    tokenizer = copy.deepcopy(renderer._tokenizer)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    strict = PromptRenderer(tokenizer)
    with pytest.raises(PromptRefused, match="roles must alternate") as refused:
        strict.chat_ids([{"role": "user", "content": "hi"}])
    assert refused.value.param == "messages"


def lent_counter(renderer, monkeypatch) -> list[int]:
    """How many times a tokenizer copy was lent for encoding."""
    lent = [0]
    borrowed = renderer._pool.borrowed

    def counting():
        lent[0] += 1
        return borrowed()

    monkeypatch.setattr(renderer._pool, "borrowed", counting)
    return lent


def test_a_text_that_cannot_fit_is_refused_before_encoding(renderer, monkeypatch):
    bound = renderer.char_bound
    assert bound is not None  # byte-level BPE after NFC, as Qwen2's
    limit = (CONTEXT - 1) * bound.longest_token
    lent = lent_counter(renderer, monkeypatch)
    with pytest.raises(PromptRefused, match=f"at most {limit} characters") as long:
        renderer.completion_ids("z" * (limit + 1), CONTEXT)
    assert long.value.param == "prompt" and "max_model_len" in str(long.value)
    with pytest.raises(PromptRefused, match="max_model_len"):
        renderer.chat_ids([{"role": "user", "content": "z" * limit}], CONTEXT)
    assert lent == [0]
    # at the bound, the text is encoded (and then found too long by its ids,
    # which is the serving routes' check, not this one)
    assert len(renderer.completion_ids("z" * limit, CONTEXT)) >= 1
    assert lent == [1]
    # no context known: nothing is refused for its length
    assert renderer.completion_ids("z" * (limit + 1)) and lent == [2]


def test_a_short_prompt_does_not_wait_for_an_encode_in_progress(renderer):
    """Each encoding thread has a tokenizer copy of its own: with one copy lent
    (a long prompt being encoded), a short prompt is still encoded."""
    pool = ThreadPoolExecutor(1)
    in_progress = renderer._pool.borrowed()
    in_progress.__enter__()
    try:
        short = pool.submit(renderer.completion_ids, "short")
        assert short.result(timeout=60) == renderer.completion_ids("short")
    finally:
        in_progress.__exit__(None, None, None)
        pool.shutdown()


def test_chat_template_kwargs_reach_the_template_that_reads_them(models):
    # a ChatML template that reads one argument of the request's (as Qwen3's
    # reads enable_thinking)
    thinking = PromptRenderer.load(str(build_tiny_qwen2(models / "thinking")))
    tokenizer = thinking._tokenizer
    tokenizer.chat_template += "{%- if enable_thinking is false -%}<think>{%- endif -%}"
    messages = [{"role": "user", "content": "hi"}]
    plain = tokenizer.decode(thinking.chat_ids(messages))
    off = thinking.chat_ids(messages, template_kwargs={"enable_thinking": False})
    assert tokenizer.decode(off) == plain + "<think>"
    # arguments the template does not read are dropped, as vLLM drops them
    ignored = {"enable_thinking": True, "unknown": 1, "add_generation_prompt": False}
    assert tokenizer.decode(thinking.chat_ids(messages, template_kwargs=ignored)) == (
        plain
    )


def test_chat_template_kwargs_the_template_does_not_read_are_dropped():
    # as vLLM's server drops them; tokenize and chat_template would change how
    # the template is applied, not what it reads
    read = "{{ x }}{{ messages }}{{ tokenize }}"
    kwargs = {"x": 1, "y": 2, "messages": [], "tokenize": True}
    assert template_arguments(read, kwargs) == {"x": 1}
    assert template_arguments(None, {"x": 1}) == {}
