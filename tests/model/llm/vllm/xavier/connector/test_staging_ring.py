"""The staging ring's size as the environment sets it."""

from __future__ import annotations

import pytest

from xinference.model.llm.vllm.xavier.connector.staging_ring import (
    DEFAULT_RING_BYTES,
    RING_BYTES_ENV,
    ring_bytes_from_env,
)


def test_the_ring_keeps_its_default_size_unless_the_environment_sets_one(
    monkeypatch,
):
    monkeypatch.delenv(RING_BYTES_ENV, raising=False)
    assert ring_bytes_from_env() == DEFAULT_RING_BYTES
    monkeypatch.setenv(RING_BYTES_ENV, " ")
    assert ring_bytes_from_env() == DEFAULT_RING_BYTES


@pytest.mark.parametrize(
    "raw, nbytes",
    [("512MiB", 512 * 1024**2), ("1GiB", 1024**3), ("4194304", 4 << 20), ("0", 0)],
)
def test_a_ring_size_from_the_environment_is_parsed_as_a_size(monkeypatch, raw, nbytes):
    monkeypatch.setenv(RING_BYTES_ENV, raw)
    assert ring_bytes_from_env() == nbytes


@pytest.mark.parametrize("raw", ["lots", "-1", "64 parsecs", "1.5GiB"])
def test_a_malformed_ring_size_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(RING_BYTES_ENV, raw)
    with pytest.raises(ValueError, match=RING_BYTES_ENV):
        ring_bytes_from_env()
