"""What hashing a prompt's blocks costs vLLM's scheduler thread.

The scheduler half hashes every prompt's full blocks when vLLM first asks about
the request (``RequestState.first_asked``), on the engine core's only thread, hit
or miss. ``hash_full_blocks`` encodes the new blocks' tokens at once and hashes
them a block's bytes at a time; the baseline is the same chain built one block at
a time through the public ``block_hash`` (which encodes each block on its own),
as ``extend_full_blocks`` did before. Both give the same keys (checked here).

Usage: python benchmark/block_hashing.py [--repeats 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from xinference.model.llm.vllm.xavier.hashing import (
    BlockHash,
    block_hash,
    hash_full_blocks,
    root_hash,
)

BLOCK_SIZE = 16  # vLLM's default on GPUs
NAMESPACE = "bench-model|bfloat16|16"
LENGTHS = (512, 2048, 8192, 32768)


def one_block_at_a_time(
    tokens: list[int], block_size: int, namespace: str
) -> list[BlockHash]:
    keys: list[BlockHash] = []
    parent = root_hash(namespace)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys


def median_us(
    hash_blocks: Callable[[list[int], int, str], list[BlockHash]],
    tokens: list[int],
    repeats: int,
) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        hash_blocks(tokens, BLOCK_SIZE, NAMESPACE)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"block size {BLOCK_SIZE}, median of {args.repeats} runs per cell\n")
    print(
        "| prompt tokens | blocks | one block at a time (us) | hash_full_blocks (us) | ratio |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for length in LENGTHS:
        tokens = [rng.randrange(0, 152_000) for _ in range(length)]
        if hash_full_blocks(tokens, BLOCK_SIZE, NAMESPACE) != one_block_at_a_time(
            tokens, BLOCK_SIZE, NAMESPACE
        ):
            raise SystemExit(f"the two give different keys at {length} tokens")
        baseline = median_us(one_block_at_a_time, tokens, args.repeats)
        batched = median_us(hash_full_blocks, tokens, args.repeats)
        print(
            f"| {length} | {length // BLOCK_SIZE} | {baseline:.1f} | {batched:.1f} "
            f"| x{batched / baseline:.2f} |"
        )


if __name__ == "__main__":
    main()
