import os
import subprocess
import sys

import pytest
import xxhash

from xinference.model.llm.vllm.xavier import hashing
from xinference.model.llm.vllm.xavier.hashing import (
    block_hash,
    extend_full_blocks,
    hash_full_blocks,
    root_hash,
)

_PRINT_HASHES = (
    "from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks;"
    "print([h.hex() for h in hash_full_blocks(list(range(100)), 16, 'm')])"
)


def test_identical_across_processes_whatever_the_hash_seed():
    """Two processes with different PYTHONHASHSEED values agree on every key."""
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", _PRINT_HASHES],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        outputs.add(out)
    assert len(outputs) == 1
    assert outputs.pop().strip() == str(
        [h.hex() for h in hash_full_blocks(list(range(100)), 16, "m")]
    )


def test_only_full_blocks_are_hashed():
    assert len(hash_full_blocks(list(range(47)), 16, "m")) == 2
    assert len(hash_full_blocks(list(range(48)), 16, "m")) == 3
    assert hash_full_blocks(list(range(15)), 16, "m") == []


def test_chained_through_the_parent():
    """Blocks with equal tokens but different prefixes get different keys."""
    a = hash_full_blocks([1] * 16 + [7] * 16, 16, "m")
    b = hash_full_blocks([2] * 16 + [7] * 16, 16, "m")
    assert a[0] != b[0]
    assert a[1] != b[1]
    assert a[1] == block_hash(a[0], [7] * 16)


def test_shared_prefix_shares_leading_keys():
    a = hash_full_blocks(list(range(64)), 16, "m")
    b = hash_full_blocks(list(range(32)) + [999] * 32, 16, "m")
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_namespace_and_format_version_change_every_key(monkeypatch):
    tokens = list(range(32))
    base = hash_full_blocks(tokens, 16, "model-a")
    assert hash_full_blocks(tokens, 16, "model-b")[0] != base[0]
    monkeypatch.setattr(hashing, "HASH_FORMAT_VERSION", hashing.HASH_FORMAT_VERSION + 1)
    assert hash_full_blocks(tokens, 16, "model-a")[0] != base[0]


def test_large_and_negative_token_ids_are_distinct():
    assert block_hash(root_hash("m"), [2**40]) != block_hash(root_hash("m"), [0])
    assert block_hash(root_hash("m"), [-1]) != block_hash(
        root_hash("m"), [2**64 - 1 - 2**63]
    )


def test_bad_input():
    with pytest.raises(ValueError, match="block_size"):
        hash_full_blocks([1, 2], 0, "m")
    with pytest.raises(ValueError, match="16 bytes"):
        block_hash(b"short", [1])


# Keys of ``hash_full_blocks(GOLDEN_TOKENS, 16, GOLDEN_NAMESPACE)`` as format 2
# defines them, unsalted and salted. Replicas of different releases share one
# index: a change of the encoding must bump HASH_FORMAT_VERSION (and these keys),
# never slip in. (Format 1 had no salt: a replica of that release would publish a
# salted prompt's blocks under unsalted keys, so 2 must never meet 1's keys.)
GOLDEN_TOKENS = [2**40, -(2**40)] + [7919 * t - 3 for t in range(70)]
GOLDEN_NAMESPACE = "golden-model|bfloat16|16"
GOLDEN_SALT = "tenant-7f3a"
GOLDEN_KEYS = [
    "5f06a4057044cb0cb77c02573adc828e",
    "4727681156d9f935c4fd140e23390870",
    "1e232ebc84125d7d07857f362cc85da1",
    "1cd252eabf56cdeee0b97ac0c3316ea1",
]
GOLDEN_SALTED_KEYS = [
    "dbca9e46760a7464ecc82bb7f143c1cf",
    "437069f2b05c129630e4fbf2fcd6522c",
    "4339432607fff3b9baff178881cc87d7",
    "06141424f3fb36b02d0b470f003f54a1",
]


def _length_prefixed(text: str) -> bytes:
    return len(text.encode()).to_bytes(4, "little") + text.encode()


@pytest.mark.parametrize(
    "salt, golden", [(None, GOLDEN_KEYS), (GOLDEN_SALT, GOLDEN_SALTED_KEYS)]
)
def test_the_keys_of_format_2_do_not_change(salt, golden):
    assert hashing.HASH_FORMAT_VERSION == 2
    keys = hash_full_blocks(GOLDEN_TOKENS, 16, GOLDEN_NAMESPACE, salt)
    assert [key.hex() for key in keys] == golden
    # the root, byte by byte: version, then namespace and salt length-prefixed
    seed = b"xavier-block-hash/v2" + _length_prefixed(GOLDEN_NAMESPACE)
    if salt:
        seed += _length_prefixed(salt)
    parent = root_hash(GOLDEN_NAMESPACE, salt)
    assert parent == xxhash.xxh3_128_digest(seed)
    # block by block, through the public one-block hash, the same chain
    for index, key in enumerate(keys):
        parent = block_hash(parent, GOLDEN_TOKENS[16 * index : 16 * (index + 1)])
        assert parent == key


def test_a_salt_changes_every_key_and_an_empty_one_is_none():
    """As vLLM salts its own block hashes: the salt enters the first block, the
    chain carries it; salted and unsalted prompts, or two salts, share no key."""
    tokens = list(range(64))
    plain = hash_full_blocks(tokens, 16, "m")
    alice = hash_full_blocks(tokens, 16, "m", "alice")
    bob = hash_full_blocks(tokens, 16, "m", "bob")
    assert not set(plain) & set(alice) and not set(alice) & set(bob)
    assert hash_full_blocks(tokens, 16, "m", "alice") == alice
    assert hash_full_blocks(tokens, 16, "m", "") == plain
    # a namespace and a salt are never read as another pair
    assert root_hash("m|x", "y") != root_hash("m", "x|y")
    assert root_hash("mx") != root_hash("m", "x")
    # a growing salted sequence extends under its salt
    grown: list[bytes] = []
    extend_full_blocks(grown, tokens[:8], 16, "m", "alice")  # no full block yet
    extend_full_blocks(grown, tokens, 16, "m", "alice")
    assert grown == alice


def test_extending_a_growing_sequence_equals_hashing_it_whole():
    """Generated tokens are hashed a block at a time as they arrive; the keys must
    be those a later prompt holding the same tokens gets."""
    tokens = list(range(1000, 1037))
    grown: list[bytes] = []
    for length in (0, 3, 8, 9, 20, 37):
        extend_full_blocks(grown, tokens[:length], 4, "m")
        assert grown == hash_full_blocks(tokens[:length], 4, "m")
    assert len(grown) == 9


def test_extending_refuses_more_hashes_than_tokens():
    hashes = hash_full_blocks(list(range(8)), 4, "m")
    with pytest.raises(ValueError, match="2 block hashes for only 7 tokens"):
        extend_full_blocks(hashes, list(range(7)), 4, "m")
