"""Deterministic, chained hashes of token blocks (a prompt, then generated tokens).

Every replica must compute the same key for the same prefix, whatever its
``PYTHONHASHSEED`` is, so Python's ``hash`` is out; we use xxh3-128 over an explicit
byte encoding. Each block's hash covers its parent's hash, so a key names a whole
prefix, not just one block's tokens. The format version and a namespace (model and
geometry) are folded into the root, so a format change or another model can never
silently match old keys.

A request's ``cache_salt`` is folded into the root too, as vLLM folds it into its
first block's hash (``generate_block_hash_extra_keys`` adds it to block 0's extra
keys only; the chain carries it to every later block): a salted prompt and an
unsalted one, or two salts, share no key, so no block of one is ever found for
the other, in a replica's store, in the tracker's index or by the router. An
empty salt is no salt, as in vLLM (it tests the salt for truth).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

# Bump when anything about the encoding below changes. 2: the root encodes its
# namespace length-prefixed, then the request's cache salt (when it has one).
HASH_FORMAT_VERSION = 2

BlockHash = bytes  # 16 bytes of xxh3-128 digest
_TOKEN_BYTES = 8  # a token id is encoded as a signed 64-bit integer


def model_namespace(model_uid: str, dtype: str, block_size: int) -> str:
    """The namespace every replica of one model hashes under (and the router too).

    Replicas launched under one model uid serve the same weights; the KV dtype and
    the block size complete what must be equal for two blocks' KV to be the same.
    """
    return f"{model_uid}|{dtype}|{block_size}"


def root_hash(namespace: str, salt: str | None = None) -> BlockHash:
    """The parent of a prompt's first block: the format version, the namespace
    and the request's cache salt. Each string is length-prefixed (4 bytes,
    little-endian, then its UTF-8), so that no namespace and salt can be read
    as another pair: ``a|b`` salted ``c`` never meets ``a`` salted ``b|c``."""
    seed = f"xavier-block-hash/v{HASH_FORMAT_VERSION}".encode() + _prefixed(namespace)
    if salt:
        seed += _prefixed(salt)
    return xxhash.xxh3_128_digest(seed)


def _prefixed(text: str) -> bytes:
    encoded = text.encode("utf-8")
    return len(encoded).to_bytes(4, "little") + encoded


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one block chained through its parent's hash: xxh3-128 over the
    parent, the block's token count (4 bytes, little-endian) and its tokens."""
    if len(parent) != 16:
        raise ValueError(f"parent hash must be 16 bytes, got {len(parent)}")
    return _chained(
        parent, len(token_ids).to_bytes(4, "little"), _encode_tokens(token_ids)
    )


def _chained(parent: BlockHash, count: bytes, encoded_tokens: bytes) -> BlockHash:
    # one call over the joined bytes: the digest a streaming hash of the three
    # parts gives, for less Python per block
    return xxhash.xxh3_128_digest(parent + count + encoded_tokens)


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Little-endian signed 64-bit encoding, independent of the host's byte order."""
    encoded = array("q", token_ids)
    if sys.byteorder != "little":
        encoded.byteswap()
    return encoded.tobytes()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    namespace: str,
    salt: str | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (a request salted with
    ``salt``); a partial tail is ignored."""
    hashes: list[BlockHash] = []
    extend_full_blocks(hashes, token_ids, block_size, namespace, salt)
    return hashes


def extend_full_blocks(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    namespace: str,
    salt: str | None = None,
) -> None:
    """Append to ``hashes`` (the chain of ``token_ids``' first ``len(hashes)`` full
    blocks) the hashes of its further full blocks.

    A sequence that grows (a request's generated tokens) is hashed once per block:
    the result equals ``hash_full_blocks`` over all of ``token_ids``. ``salt``
    matters only for the first block (its root); it must be the one the chain
    was started with.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if len(hashes) * block_size > len(token_ids):
        raise ValueError(
            f"{len(hashes)} block hashes for only {len(token_ids)} tokens of "
            f"{block_size} per block"
        )
    first = len(hashes) * block_size
    count = (len(token_ids) - first) // block_size
    if count == 0:
        return
    parent = hashes[-1] if hashes else root_hash(namespace, salt)
    # The new blocks' tokens encoded at once, then hashed a block's bytes at a
    # time: a third less time than encoding block by block (this runs on vLLM's
    # scheduler thread for every prompt; benchmark/block_hashing.py).
    encoded = _encode_tokens(token_ids[first : first + count * block_size])
    size = block_size.to_bytes(4, "little")
    stride = block_size * _TOKEN_BYTES
    for offset in range(0, count * stride, stride):
        parent = _chained(parent, size, encoded[offset : offset + stride])
        hashes.append(parent)
