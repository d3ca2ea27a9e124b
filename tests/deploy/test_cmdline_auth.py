"""The command line against a real ``xinference local --auth`` server (no engine):
``xinference login``, ``--api-key/-ak`` actually sent, and a refusal that says
what to do."""

from __future__ import annotations

import httpx
import pytest
from click.testing import CliRunner

from xinference.deploy.cmdline import cli

from .local_server import LocalServer

ADMIN = {"username": "admin", "password": "admin password 1"}
READER = {"username": "reader", "password": "reader password", "permissions": []}


@pytest.fixture(scope="module")
def authed_server(tmp_path_factory):
    server = LocalServer(
        tmp_path_factory.mktemp("auth-home"), extra_args=("--auth",)
    ).start()
    try:
        token = httpx.post(f"{server.endpoint}/v1/admin/setup", json=ADMIN).json()[
            "access_token"
        ]
        admin = {"Authorization": f"Bearer {token}"}
        READER["permissions"] = ["models:list"]
        assert httpx.post(
            f"{server.endpoint}/v1/admin/users", json=READER, headers=admin
        ).is_success
        key = httpx.post(
            f"{server.endpoint}/v1/admin/keys",
            json={"name": "cli", "owner": "reader"},
            headers=admin,
        ).json()["api_key"]
        server.reader_key = key
        yield server
    finally:
        assert server.stop() == [], server.tail()


@pytest.fixture
def cli_home(tmp_path, monkeypatch):
    """Where ``xinference login`` keeps tokens: this test's own."""
    monkeypatch.setenv("XINFERENCE_HOME", str(tmp_path))
    return tmp_path


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_without_a_credential_the_cli_says_how_to_get_one(authed_server, cli_home):
    result = run("list", "-e", authed_server.endpoint)
    assert result.exit_code == 1
    assert "needs authentication" in result.output
    assert "xinference login" in result.output and "--api-key" in result.output


def test_the_api_key_is_sent(authed_server, cli_home):
    for flag in ("--api-key", "-ak"):
        result = run(
            "list", "-e", authed_server.endpoint, flag, authed_server.reader_key
        )
        assert result.exit_code == 0, result.output
        assert "no models" in result.output


def test_a_missing_permission_is_a_clear_refusal(authed_server, cli_home):
    result = run(
        "terminate",
        "-e",
        authed_server.endpoint,
        "-ak",
        authed_server.reader_key,
        "-u",
        "anything",
    )
    assert result.exit_code == 1
    assert "not allowed on" in result.output and "models:stop" in result.output
    assert authed_server.reader_key not in result.output


def test_login_keeps_a_token_the_other_commands_send(authed_server, cli_home):
    endpoint = authed_server.endpoint
    wrong = run("login", "-e", endpoint, "-u", "reader", "-p", "nope")
    assert wrong.exit_code == 1 and "login failed" in wrong.output
    # the password is asked for when not given
    result = CliRunner().invoke(
        cli, ["login", "-e", endpoint, "-u", "reader"], input="reader password\n"
    )
    assert result.exit_code == 0, result.output
    assert "reader password" not in result.output
    kept = cli_home / "auth" / "cli-tokens.json"
    assert (kept.stat().st_mode & 0o777) == 0o600
    listed = run("list", "-e", endpoint)
    assert listed.exit_code == 0 and "no models" in listed.output
