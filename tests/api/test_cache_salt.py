"""``cache_salt`` through the REST API, with stand-in replicas (no engine): the
salt a request is served under reaches the replica (vLLM) and the router alike,
and with authentication on the server salts by the caller (``--kv-sharing``),
so no caller's requests share KV with another's unless the operator says so."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from xinference.api import restful_api
from xinference.api.auth import AuthService
from xinference.api.server_options import ServerOptions
from xinference.deploy import cmdline

from .stand_in import StandInReplicas, serve_with

ADMIN = {"username": "root", "password": "correct horse battery"}


@pytest.fixture
def replicas(monkeypatch) -> StandInReplicas:
    stand_in = StandInReplicas()
    serve_with(monkeypatch, stand_in)
    return stand_in


def client(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://t")


async def salts_of(http: httpx.AsyncClient, replicas: StandInReplicas, **request: Any):
    """The salt a completion, a streamed chat and a prefix lookup with
    ``request``'s headers and body fields were served and looked up under."""
    headers = request.pop("headers", {})
    replicas.routed.clear()
    replicas.served.clear()
    replicas.looked_up.clear()
    completion = await http.post(
        "/v1/completions",
        json={"model": "m", "prompt": "hi", "max_tokens": 1} | request,
        headers=headers,
    )
    assert completion.status_code == 200, completion.text
    chat = await http.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
        }
        | request,
        headers=headers,
    )
    assert chat.status_code == 200, chat.text
    lookup = await http.post(
        "/v1/models/m/prefix", json={"prompt": "hi"} | request, headers=headers
    )
    assert lookup.status_code == 200, lookup.text
    served = {r.cache_salt for r in replicas.served}
    assert len(served) == 1 and set(replicas.routed) == served
    assert replicas.looked_up == list(served)
    return served.pop()


async def test_without_authentication_a_salt_is_used_as_sent(replicas):
    async with client(restful_api.create_app("127.0.0.1:1")) as http:
        assert await salts_of(http, replicas) is None
        assert await salts_of(http, replicas, cache_salt="tenant-a") == "tenant-a"


@pytest.mark.parametrize(
    "salt", ["", "x" * 129, "a/b", "a@b", "a\\b", "a\x00b", "a\ud800b"]
)
async def test_a_salt_vllm_would_refuse_is_a_400(replicas, salt):
    async with client(restful_api.create_app("127.0.0.1:1")) as http:
        for path, body in [
            ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1}),
            (
                "/v1/chat/completions",
                {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            ),
            ("/v1/models/m/prefix", {"prompt": "hi"}),
        ]:
            response = await http.post(
                path,
                content=json.dumps(body | {"cache_salt": salt}).encode(),
                headers={"content-type": "application/json"},
            )
            assert response.status_code == 400, (path, response.text)
            assert response.json()["error"]["param"] == "cache_salt"
    assert replicas.served == [] and replicas.looked_up == []


@pytest.fixture
def auth_home(tmp_path):
    """Where the tests' authentication store lives; closed after the test."""
    opened: list[AuthService] = []
    yield tmp_path, opened
    for service in opened:
        service.close()


async def authed_app(auth_home, sharing: str) -> tuple[httpx.AsyncClient, dict]:
    """An app with authentication on and ``--kv-sharing sharing``; the
    credentials (headers) of two users, one with two API keys."""
    home, opened = auth_home
    service = AuthService.open(home)
    opened.append(service)
    app = restful_api.create_app(
        "127.0.0.1:1", service, ServerOptions(kv_sharing=sharing)
    )
    http = client(app)
    admin = (await http.post("/v1/admin/setup", json=ADMIN)).json()["access_token"]
    as_admin = {"Authorization": f"Bearer {admin}"}
    credentials: dict[str, dict[str, str]] = {}
    for user in ("alice", "bob"):
        made = await http.post(
            "/v1/admin/users",
            json={
                "username": user,
                "password": "p" * 12,
                "permissions": ["models:read"],
            },
            headers=as_admin,
        )
        assert made.status_code == 200, made.text
        token = await http.post("/token", json={"username": user, "password": "p" * 12})
        credentials[f"{user}-token"] = {
            "Authorization": f"Bearer {token.json()['access_token']}"
        }
        for index in range(2 if user == "alice" else 1):
            key = await http.post(
                "/v1/admin/keys", json={"owner": user}, headers=as_admin
            )
            credentials[f"{user}-key{index}"] = {
                "Authorization": f"Bearer {key.json()['api_key']}"
            }
    return http, credentials


@pytest.mark.parametrize(
    "sharing, together",
    [
        # which credentials' requests are served under one salt
        (
            "user",
            [{"alice-token", "alice-key0", "alice-key1"}, {"bob-token", "bob-key0"}],
        ),
        (
            "key",
            [
                {"alice-token"},
                {"alice-key0"},
                {"alice-key1"},
                {"bob-token"},
                {"bob-key0"},
            ],
        ),
    ],
)
async def test_the_server_salts_by_the_caller(auth_home, replicas, sharing, together):
    http, credentials = await authed_app(auth_home, sharing)
    try:
        served = {
            name: await salts_of(http, replicas, headers=headers)
            for name, headers in credentials.items()
        }
        # a client's own salt separates further, within the caller's scope only
        salted = {
            name: await salts_of(http, replicas, headers=headers, cache_salt="shared")
            for name, headers in credentials.items()
        }
    finally:
        await http.aclose()
    for salts in (served, salted):
        groups = [{salts[name] for name in group} for group in together]
        assert all(len(group) == 1 for group in groups), groups
        assert len(set().union(*groups)) == len(together)  # no two groups share
        # what reaches vLLM is a digest: it passes vLLM's own salt check
        assert all(len(salt) == 64 and salt.isalnum() for salt in salts.values())
    assert not set(served.values()) & set(salted.values())
    assert "shared" not in salted.values()


async def test_with_sharing_among_all_a_salt_is_used_as_sent(auth_home, replicas):
    http, credentials = await authed_app(auth_home, "all")
    try:
        for headers in credentials.values():
            assert await salts_of(http, replicas, headers=headers) is None
            assert (
                await salts_of(http, replicas, headers=headers, cache_salt="t") == "t"
            )
    finally:
        await http.aclose()


def test_the_kv_sharing_option(monkeypatch, tmp_path):
    started = {}

    async def serve(*args):
        started["options"] = args[-1]

    monkeypatch.setattr(cmdline, "_serve_local", serve)
    monkeypatch.setenv("XINFERENCE_HOME", str(tmp_path))
    runner = CliRunner()
    done = runner.invoke(cmdline.cli, ["local", "--auth", "--kv-sharing", "key"])
    assert done.exit_code == 0, done.output
    assert started["options"].kv_sharing == "key"
    assert "shared among each API key's requests (--kv-sharing key)" in done.output
    done = runner.invoke(cmdline.cli, ["local", "--auth"])
    assert started["options"].kv_sharing == "user"
    assert "(--kv-sharing user)" in done.output
    # per user or per key needs users
    refused = runner.invoke(cmdline.cli, ["local", "--no-auth", "--kv-sharing", "user"])
    assert refused.exit_code == 2 and "needs authentication" in refused.output
    done = runner.invoke(cmdline.cli, ["local", "--kv-sharing", "all"])
    assert done.exit_code == 0 and started["options"].kv_sharing == "all"
