"""Bad input through REST, against a real ``xinference local`` server: every
operation of its OpenAPI schema is fuzzed with schemathesis (valid and invalid
bodies, paths and queries), and a few inputs are tried by name. No input may
make the server fail (a 5xx) or hang; every rejection is a 4xx that says why.

No model is running: launches the fuzzer makes point at paths that do not
exist, and requests to models name uids that are unknown. The examples are
bounded and derandomized to keep CI time small and failures reproducible.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

# Requests a call may take: a launch the server refuses answers in milliseconds.
CALL_TIMEOUT_S = 30
MAX_EXAMPLES = 15


@pytest.fixture(scope="module")
def api_schema(server: Any) -> Any:
    return schemathesis.openapi.from_url(f"{server.endpoint}/openapi.json")


@pytest.fixture
def http(server: Any) -> Any:
    with httpx.Client(base_url=server.endpoint, timeout=CALL_TIMEOUT_S) as client:
        yield client


def assert_clear_rejection(response: Any) -> None:
    """A 2xx, or a 4xx whose body says what was wrong; never a 5xx."""
    assert response.status_code < 500, (
        f"{response.request.method} {response.request.url} -> "
        f"{response.status_code}: {response.text[:500]}"
    )
    if response.status_code >= 400:
        detail = response.json().get("detail")
        assert detail, f"a {response.status_code} without a message: {response.text}"


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_is_a_server_error(api_schema, mode):
    """Each operation of the schema, with requests that fit it (positive) and
    requests that break it (negative). Driven through hypothesis directly: the
    schemathesis pytest plugin does not load under this pytest."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10, [op.label for op in operations]
    fuzzed = []
    for operation in operations:

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def call(case: Any) -> None:
            assert_clear_rejection(case.call(timeout=CALL_TIMEOUT_S))

        try:
            call()
        except Unsatisfiable:
            # Nothing to break in an operation without parameters or body
            # (GET /status): there is no negative request to make.
            assert mode == GenerationMode.NEGATIVE, operation.label
            continue
        fuzzed.append(operation.label)
    assert "POST /v1/models" in fuzzed and "POST /v1/completions" in fuzzed, fuzzed


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", "/v1/models/no-such-model", None),
        ("GET", "/v1/models/no-such-model/progress", None),
        ("GET", "/v1/models/no-such-model/replicas", None),
        ("DELETE", "/v1/models/no-such-model", None),
        ("POST", "/v1/models/no-such-model/prefix", {"prompt": "hello"}),
        ("POST", "/v1/completions", {"model": "no-such-model", "prompt": "hi"}),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        ),
    ],
)
def test_an_unknown_model_uid_is_a_404_with_a_message(http, method, path, body):
    response = http.request(method, path, json=body)
    assert response.status_code == 404, response.text
    assert "no-such-model" in response.json()["detail"]


@pytest.mark.parametrize(
    "path",
    ["/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/models/m/prefix"],
)
@pytest.mark.parametrize(
    "content", [b"{", b"not json", b"[1, 2", b"\xff\xfe", b'{"model": }']
)
def test_malformed_json_is_a_4xx_with_a_message(http, path, content):
    response = http.post(
        path, content=content, headers={"content-type": "application/json"}
    )
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["detail"]


@pytest.mark.parametrize(
    "body",
    [
        {"model": "no-such-model", "prompt": "hi", "max_tokens": -1},
        {"model": "no-such-model", "prompt": "hi", "n": -3},
        {"model": "no-such-model", "prompt": "hi", "temperature": -1e308},
        {"model": "no-such-model", "prompt": "x" * 2_000_000},
        {"model": "no-such-model", "prompt": [[-1, -2]]},
        {"model": "", "prompt": "hi"},
    ],
    ids=[
        "negative-max-tokens",
        "negative-n",
        "huge-negative-temperature",
        "oversized-prompt",
        "negative-token-ids",
        "empty-model",
    ],
)
def test_nonsense_completion_bodies_are_rejected_clearly(http, body):
    response = http.post("/v1/completions", json=body)
    assert_clear_rejection(response)
    assert response.status_code >= 400


def test_concurrent_terminates_of_one_unknown_uid_are_all_clear(http):
    """Many terminations of one uid at once: each answers 404, none fails."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(
            pool.map(lambda _: http.delete("/v1/models/racing-uid"), range(16))
        )
    for response in responses:
        assert response.status_code == 404, response.text
        assert response.json()["detail"]
