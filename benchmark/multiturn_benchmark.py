"""Multi-turn chat with Xavier off and on: TTFT per turn, on CPU, in one command.

Starts a local cluster in this process (as ``xinference.deploy.demo`` does, with
the demo's offline model), then twice launches two replicas -- Xavier off, then on
-- and runs ``serving_benchmark.py``'s ``multiturn`` phase against each: chats of
``--turns`` turns sent one request at a time; round robin puts every turn on the
other replica than the previous one, so with Xavier a turn loads the history (the
previous answer included) from its peer. Prints the TTFT p50 of every turn for both
deployments and their ratio (on over off, medians of the same run); logs go to a
file under ``$XINFERENCE_HOME/logs``.

    python benchmark/multiturn_benchmark.py [--conversations 8] [--turns 4]
        [--json out.json]

On a GPU host run ``serving_benchmark.py run --phases multiturn`` against launched
deployments instead (32 conversations of 4 turns by default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmark.serving_benchmark import (  # noqa: E402
    Client,
    ConversationShape,
    multiturn_report,
    phase_multiturn,
)
from xinference.core.registry import xinference_home  # noqa: E402
from xinference.deploy import demo  # noqa: E402

MODEL_UID = "xavier-multiturn"


async def one_deployment(
    http: httpx.AsyncClient, model_path: Path, xavier: bool, args: argparse.Namespace
) -> dict[str, Any]:
    options: dict[str, Any] = dict(
        model_uid=MODEL_UID,
        model_path=str(model_path),
        replica=2,
        block_size=demo.BLOCK_SIZE,
        max_model_len=4096,
        enforce_eager=True,
        dtype=demo.DTYPE,
    )
    if xavier:
        options |= dict(enable_xavier=True, xavier_gpu_cache_bytes="64MiB")
    label = "on" if xavier else "off"
    demo.say(f"launching 2 CPU replicas, Xavier {label}")
    response = await http.post(
        "/v1/models", json=options, timeout=demo.LAUNCH_TIMEOUT_S
    )
    if response.status_code != 200:
        raise RuntimeError(f"launch failed: {response.text}")
    try:
        client = Client(http, MODEL_UID)
        data = await phase_multiturn(
            client, ConversationShape.from_args(args), seed=2028
        )
    finally:
        await http.delete(f"/v1/models/{MODEL_UID}")
    return {"label": label, "phases": {"multiturn": data}}


async def run(args: argparse.Namespace) -> None:
    from xinference.deploy.local import start_local_cluster
    from xinference.model.llm.tiny_model import build_tiny_qwen2

    model_path = await asyncio.to_thread(
        build_tiny_qwen2, Path(args.workdir) / "demo-qwen2", **demo.DEMO_MODEL
    )
    cluster = await start_local_cluster(port=0)
    runs: dict[str, Any] = {}
    try:
        async with httpx.AsyncClient(
            base_url=cluster.endpoint, timeout=demo.REQUEST_TIMEOUT_S
        ) as http:
            for xavier in (False, True):
                result = await one_deployment(http, model_path, xavier, args)
                runs[result["label"]] = result
    finally:
        await cluster.stop()
    demo.show("\n".join(multiturn_report(runs)))
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default=".demo", help="where the model is built")
    ConversationShape.add_arguments(parser)
    # fewer conversations than on a GPU: a CPU prefill of a turn takes a while
    parser.set_defaults(conversations=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.turns % 2:
        parser.error("--turns must be even: round robin then alternates replicas")
    args.workdir = os.path.abspath(args.workdir)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    log_path = (
        xinference_home() / "logs" / f"multiturn-{time.strftime('%Y%m%d-%H%M%S')}.log"
    )
    demo.say(f"engine, pool and UCX logs: {log_path}")
    demo.send_output_to(log_path)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
