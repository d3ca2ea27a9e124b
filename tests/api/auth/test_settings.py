"""When a server authenticates: off on loopback, on elsewhere, on when asked,
and never open on a reachable address unless the operator said so."""

from __future__ import annotations

import pytest

from xinference.api.auth.settings import (
    AUTH_ENV,
    InsecureBind,
    check_bind,
    decide,
    is_loopback,
)
from xinference.deploy.local import start_local_cluster


@pytest.mark.parametrize(
    "host, flag, env, enabled, explicit",
    [
        ("127.0.0.1", None, {}, False, False),
        ("localhost", None, {}, False, False),
        ("::1", None, {}, False, False),
        ("0.0.0.0", None, {}, True, False),
        ("10.0.0.7", None, {}, True, False),
        ("127.0.0.1", True, {}, True, True),
        ("127.0.0.1", None, {AUTH_ENV: "true"}, True, True),
        ("0.0.0.0", None, {AUTH_ENV: "false"}, False, True),
        ("0.0.0.0", False, {AUTH_ENV: "true"}, False, True),  # the flag wins
        ("127.0.0.1", True, {AUTH_ENV: "false"}, True, True),
    ],
)
def test_defaults_and_what_overrides_them(host, flag, env, enabled, explicit):
    decision = decide(host, flag, env)
    assert (decision.enabled, decision.explicit) == (enabled, explicit)
    assert decision.reason


def test_a_bad_environment_value_is_an_error():
    with pytest.raises(ValueError, match=AUTH_ENV):
        decide("127.0.0.1", None, {AUTH_ENV: "maybe"})


def test_loopback_detection():
    assert is_loopback("127.0.0.2") and not is_loopback("0.0.0.0")
    assert not is_loopback("") and not is_loopback("192.168.1.1")


def test_a_reachable_bind_without_auth_is_refused_unless_chosen():
    with pytest.raises(InsecureBind, match="--no-auth"):
        check_bind("0.0.0.0", enabled=False, explicit=False)
    check_bind("0.0.0.0", enabled=False, explicit=True)
    check_bind("0.0.0.0", enabled=True, explicit=False)
    check_bind("127.0.0.1", enabled=False, explicit=False)


async def test_the_library_refuses_before_it_binds_anything():
    with pytest.raises(InsecureBind, match="without authentication"):
        await start_local_cluster("0.0.0.0", 0)
