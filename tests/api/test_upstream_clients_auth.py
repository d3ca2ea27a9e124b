"""Upstream Xinference's published client and the ``openai`` package against a real
server with authentication on: one real vLLM CPU engine, launched with an API key,
chatted with through both clients, terminated after a login.

The admin is created with the first-run setup call, then an operator user who may
list, read, start and stop models, and an API key of theirs.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from xinference_client import RESTfulClient as UpstreamClient

from ..deploy.local_server import LocalServer, wait_for_no_descendants


def engine(test: Any) -> Any:
    """The marks of a test that starts a real engine (only those carry them)."""
    for mark in (pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)):
        test = mark(test)
    return test


UID = "authed-tiny"
ADMIN = {"username": "admin", "password": "admin password 1"}
OPERATOR = {
    "username": "operator",
    "password": "operator password",
    "permissions": ["models:list", "models:read", "models:start", "models:stop"],
}
MESSAGES = [{"role": "user", "content": "name three syllables"}]
EXIT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def operator(authed_server: LocalServer) -> dict[str, Any]:
    endpoint = authed_server.endpoint
    setup = httpx.post(f"{endpoint}/v1/admin/setup", json=ADMIN)
    assert setup.status_code == 200, setup.text
    admin = {"Authorization": f"Bearer {setup.json()['access_token']}"}
    created = httpx.post(f"{endpoint}/v1/admin/users", json=OPERATOR, headers=admin)
    assert created.status_code == 200, created.text
    key = httpx.post(
        f"{endpoint}/v1/admin/keys",
        json={"name": "tests", "owner": "operator"},
        headers=admin,
    )
    assert key.status_code == 200, key.text
    return {"key": key.json()["api_key"], "baseline": authed_server.descendants()}


def test_without_a_credential_upstreams_client_is_refused(authed_server):
    client = UpstreamClient(authed_server.endpoint)
    with pytest.raises(RuntimeError):
        client.list_models()
    with pytest.raises(RuntimeError, match="login"):
        client.login("operator", "wrong password")


def test_both_clients_authenticate_with_a_key_and_a_login(authed_server, operator):
    """The credential plumbing alone (no engine): each way in reaches the API."""
    endpoint = authed_server.endpoint
    assert UpstreamClient(endpoint, api_key=operator["key"]).list_models() == {}
    client = UpstreamClient(endpoint)
    client.login(OPERATOR["username"], OPERATOR["password"])
    assert client.list_models() == {}
    keyed = openai.OpenAI(base_url=f"{endpoint}/v1", api_key=operator["key"])
    assert list(keyed.models.list()) == []
    stranger = openai.OpenAI(base_url=f"{endpoint}/v1", api_key="sk-not-a-key")
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


@engine
def test_launch_and_chat_with_an_api_key(authed_server, operator):
    client = UpstreamClient(authed_server.endpoint, api_key=operator["key"])
    uid = client.launch_model(
        model_name="tiny-qwen2",
        model_engine="vllm",
        model_uid=UID,
        replica=1,
        max_model_len=256,
        enforce_eager=True,
        dtype="float32",
    )
    assert uid == UID
    reply = client.get_model(UID).chat(
        MESSAGES, generate_config={"max_tokens": 6, "ignore_eos": True}
    )
    assert reply["usage"]["completion_tokens"] == 6


@engine
def test_the_openai_client_with_a_key(authed_server, operator):
    base = f"{authed_server.endpoint}/v1"
    client = openai.OpenAI(base_url=base, api_key=operator["key"])
    assert UID in [model.id for model in client.models.list()]
    reply = client.chat.completions.create(
        model=UID, messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert reply.choices[0].message.content is not None
    stranger = openai.OpenAI(base_url=base, api_key="sk-not-a-key")
    with pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.create(model=UID, messages=MESSAGES, max_tokens=2)


@engine
def test_terminate_after_a_login(authed_server, operator):
    client = UpstreamClient(authed_server.endpoint)
    client.login(OPERATOR["username"], OPERATOR["password"])
    assert list(client.list_models()) == [UID]
    client.terminate_model(UID)
    assert client.list_models() == {}
    assert (
        wait_for_no_descendants(authed_server, operator["baseline"], EXIT_TIMEOUT_S)
        == set()
    )
