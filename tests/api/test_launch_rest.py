"""The REST launch endpoint refuses invalid options before starting anything."""

import httpx
import pytest
from xinference_client import RESTfulClient as UpstreamClient

from xinference.client import Client, XinferenceError


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "some-model"
    path.mkdir()
    return str(path)


@pytest.fixture
def http(server):
    # A launch with free engine arguments first imports vLLM in the server (slow).
    with httpx.Client(base_url=server.endpoint, timeout=300) as client:
        yield client


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(replica=1, enable_xavier=True), "it needs replica >= 2, got 1"),
        (
            dict(replica=2, enable_xavier=True, model_engine="transformers"),
            "Xavier works with the vLLM engine only, got model_engine 'transformers'",
        ),
        (
            dict(replica=2, enable_xavier=True, xavier_gpu_cache_bytes=-1),
            "size must be non-negative, got -1",
        ),
        (
            dict(replica=2, enable_xavier=True, xavier_gpu_cache_bytes="256 MiBs"),
            "malformed size '256 MiBs'",
        ),
        (
            # more than the host (or GPU) has: refused before any engine loads
            dict(replica=2, enable_xavier=True, xavier_gpu_cache_bytes="1024TiB"),
            "xavier_gpu_cache_bytes 1024.0 TiB per replica does not fit",
        ),
        (
            # one tier per engine rank: two replicas of two ranks on CPU need four
            dict(
                replica=2,
                enable_xavier=True,
                tensor_parallel_size=2,
                xavier_gpu_cache_bytes="1024TiB",
            ),
            "4 engine rank(s) on worker",
        ),
        (
            dict(replica=2, enable_xavier=True, pipeline_parallel_size=2),
            "pipeline_parallel_size must be 1, got 2",
        ),
        (
            dict(replica=2, xavier_gpu_cache_bytes="1GiB"),
            "xavier_gpu_cache_bytes is set but enable_xavier is not",
        ),
        (
            dict(replica=2, router="cache-aware"),
            "cache-aware router needs enable_xavier",
        ),
        (dict(generation_config="greedy"), "generation_config must be one of auto"),
        (
            dict(replica=2, xavier_remote_loads=False),
            "xavier_remote_loads=false (routing only) needs enable_xavier",
        ),
        # not coerced by the request schema: a 400 that names the option
        (
            dict(replica=2, enable_xavier=True, xavier_fast_path="no"),
            "xavier_fast_path must be a boolean, got 'no'",
        ),
        (
            dict(replica=2, enable_xavier=True, xavier_fast_path=1),
            "xavier_fast_path must be a boolean, got 1",
        ),
        (
            dict(replica=2, xavier_fast_path=True),
            "xavier_fast_path is set but enable_xavier is not",
        ),
    ],
)
def test_invalid_launch_options_are_a_400(http, model_dir, options, message):
    response = http.post("/v1/models", json=dict(model_path=model_dir, **options))
    assert response.status_code == 400, response.text
    assert message in response.json()["detail"]
    assert http.get("/v1/models").json() == {"object": "list", "data": []}


def test_misspelt_options_are_refused(http, model_dir):
    # Not an option and not a vLLM engine argument either.
    response = http.post(
        "/v1/models", json=dict(model_path=model_dir, enable_xavir=True)
    )
    assert response.status_code == 400
    assert "unknown launch option 'enable_xavir'" in response.json()["detail"]
    assert (
        "did you mean 'enable_xavier' (--enable-xavier)?" in response.json()["detail"]
    )
    # named before the checks of the option it was meant for, which would see
    # that option's default (replica 1: "it needs replica >= 2, got 1")
    response = http.post(
        "/v1/models", json=dict(model_path=model_dir, replicas=2, enable_xavier=True)
    )
    assert response.status_code == 400
    assert response.json()["detail"] == (
        "unknown launch option 'replicas': neither an Xinference option nor a "
        "vLLM engine argument; did you mean 'replica' (--replica)?"
    )


def test_upstream_client_payloads_reach_validation(server, model_dir):
    """Upstream's published client sends all its launch keys; they must parse, and
    its errors carry our reason."""
    client = UpstreamClient(server.endpoint)
    with pytest.raises(RuntimeError, match="needs replica >= 2, got 1"):
        client.launch_model(
            model_name="my-model",
            model_engine="vllm",
            model_path=model_dir,
            replica=1,
            enable_xavier=True,
        )
    with pytest.raises(RuntimeError, match="n_worker=2 is not supported"):
        client.launch_model(model_name="m", model_path=model_dir, n_worker=2)
    assert client.list_models() == {}
    with pytest.raises(RuntimeError, match="'ghost' is not launched"):
        client.get_launch_model_progress("ghost")
    with pytest.raises(RuntimeError, match="'ghost' is not launched"):
        client.cancel_launch_model("ghost")


@pytest.mark.parametrize(
    "body, status, names",
    [
        (dict(echo=True), 400, ["echo"]),
        # vLLM's own fields pass; what is refused is named
        (dict(frequency_penalty=0.5, tools=[{"type": "function"}]), 400, ["tools"]),
        (dict(best_of=2), 400, ["best_of"]),
        (dict(stream_options={"include_usage": True}), 400, ["stream_options"]),
        (dict(best_of_luck=1), 400, ["best_of_luck"]),
        # neutral values and labels ask for nothing: the model lookup comes next
        (dict(best_of=1, echo=False, user="u", tools=None), 404, []),
        # fields vLLM gives a meaning are checked once the model is known
        (dict(n=2, logprobs=1, frequency_penalty=0.5), 404, []),
    ],
)
def test_sampling_parameters_we_cannot_honour_are_named(http, body, status, names):
    for path, payload in (
        ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}])),
        ("/v1/completions", dict(prompt="hi")),
    ):
        response = http.post(path, json=dict(model="ghost", **payload, **body))
        assert response.status_code == status, response.text
        if status == 400:  # OpenAI's error shape, and upstream's "detail"
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["message"] == response.json()["detail"]
            for name in names or list(body):
                assert name in error["message"]


def test_chat_content_parts_are_text_only(http):
    text = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    response = http.post(
        "/v1/chat/completions", json=dict(model="ghost", messages=[text])
    )
    assert response.status_code == 404  # parsed; the model is what is missing
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}
    response = http.post(
        "/v1/chat/completions", json=dict(model="ghost", messages=[image])
    )
    assert response.status_code == 422 and "text" in response.text


def test_the_python_client_raises_the_servers_reason(server, model_dir):
    with Client(server.endpoint) as client:
        with pytest.raises(XinferenceError, match="needs replica >= 2") as caught:
            client.launch_model(model_path=model_dir, replica=1, enable_xavier=True)
        assert caught.value.status_code == 400
        with pytest.raises(XinferenceError, match="not launched") as caught:
            client.terminate_model("ghost")
        assert caught.value.status_code == 404
        # a handle on a model that is not served fails at once, not at .chat()
        with pytest.raises(XinferenceError, match="is not launched") as caught:
            client.get_model("ghost")
        assert caught.value.status_code == 404
        assert "no model is launched" in caught.value.detail


def test_unknown_models_are_a_404(http):
    assert http.get("/v1/models/ghost").status_code == 404
    response = http.post(
        "/v1/completions", json=dict(model="ghost", prompt="hi", max_tokens=2)
    )
    assert response.status_code == 404
    assert "not launched" in response.json()["detail"]


def test_metrics_without_models(http):
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "# TYPE xavier_remote_hits_total counter" in response.text


def test_the_model_names_a_launch_takes_are_listed(http):
    """The page offers them in its model box (upstream's route and keys)."""
    listed = http.get("/v1/model_registrations/LLM")
    assert listed.status_code == 200
    names = {entry["model_name"]: entry for entry in listed.json()}
    assert names["tiny-qwen2"]["is_builtin"] is True
    assert names["tiny-qwen2"]["description"]
    other = http.get("/v1/model_registrations/embedding")
    assert other.status_code == 404
    assert other.json()["detail"] == "no 'embedding' models here: only 'LLM' is served"
