"""Device-tier transports side by side: latency per load, wire bytes, registrations.

Two processes (sub-pools of one xoscar pool on ``nixl://`` addresses) stand in for
two replicas. The holder keeps snapshots in a device-tier tensor (store rows); the
loader loads them into an engine KV cache laid out like vLLM's. Both hold every
transport, so one run compares them under the same conditions:

  xoscar        XoscarSlabTransport: a push call per chunk, the holder gathers into
                its send slab and ``xo.copy_to``s it into the loader's receive slab
                (the seed's path, with its slab selector); the loader scatters.
  nixl-slab     NixlDirectTransport, slab placement: one NIXL READ of the holder's
                rows into the loader's registered receive slab, one descriptor per
                contiguous run of holder rows; the loader scatters.
  nixl-engine   NixlDirectTransport, engine placement: one NIXL READ straight into
                the engine blocks, one descriptor per (block, layer) piece, or,
                with ``--engine-allocation cross-layer``, one per run of keys whose
                holder rows and engine blocks both continue each other.
  nixl-auto     NixlDirectTransport, auto placement (what serving uses): engine
                placement where the blocks are whole ranges (cross-layer) and the
                peer's READs are bounded (VRAM to VRAM over cuda_ipc), else slab.
  nixl-slab-rpc nixl-slab plus the holder RPC that locates the leased rows, i.e.
                without the rows travelling in the lease grant.
  nixl-read     nixl-slab without the scatter: the transport's part alone (the
                rows land in the receive slab, which is checked instead of the
                engine blocks).
  nixl-read-rows  nixl-read with the endpoint's prepared row lists turned on
                (``RowLists.enabled``): a READ names rows of descriptor lists NIXL
                prepared when the peer was met, instead of building its own.

``--engine-allocation one`` lays the engine's layers out as views of one allocation
(vLLM on CPU does; the scatter then copies a chunk in one kernel through the stacked
layers), ``per-layer`` gives each layer its own allocation (vLLM on GPU does; one
copy through the piece span where the addresses allow, else one per layer),
``cross-layer`` one allocation with blocks outermost, then layers (vLLM's
cross-layer cache: a block of every layer is contiguous). The header says which
scatter path the loader took.

``--dst-blocks`` picks the destination engine blocks of a load of n snapshots
(read from n consecutive holder slots): ``reversed`` (n-1 .. 0, nothing lines up),
``consecutive`` (0 .. n-1, the best case: one run), ``every-other`` (0, 2, 4, ...:
no two blocks adjacent) or ``shuffled`` (a fixed random set). The "runs" column is
the number of runs of keys that continue each other in both the holder and the
engine: what a cross-layer ``nixl-engine`` load needs in descriptors.

Loads carry 1, 16 and 64 snapshots of Qwen2.5-0.5B in BF16 (24 layers x 8 KiB per
layer-block = 192 KiB per block; 64 blocks = 12 MiB). Each case runs ``--warmup``
loads, then ``--loads`` measured loads, timed inside the loader process around the
transport's ``load`` and the wait for the copies it queued: the scatter is the load
runner's own (``actor.loads.row_scatter``, a wait per chunk only where the
transport does not guard its buffer), and the end is its wait (``settle``). Contents are checked
after each case. NIXL ``register_memory`` calls are counted in both processes by
wrapping the method (the real one still runs), so "registrations" covers xoscar's
channel and our agents alike.

Run from the repository root:

  python benchmark/transport_benchmark.py --device cpu [--loads 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.metadata
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import xoscar as xo

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import xinference.model.llm.vllm.xavier.transports.nixl.transport as nixl_transport  # noqa: E402, E501
from tests.model.llm.vllm.xavier.transports.registrations import (  # noqa: E402
    install_registration_counter,
    registration_calls,
)
from xinference.model.llm.vllm.xavier.actor.loads import row_scatter  # noqa: E402
from xinference.model.llm.vllm.xavier.engine.blocks import (  # noqa: E402
    BlockMajorCache,
)
from xinference.model.llm.vllm.xavier.engine.device import (  # noqa: E402
    DeviceWorkMark,
    settle,
)
from xinference.model.llm.vllm.xavier.engine.layout import detect_layout  # noqa: E402
from xinference.model.llm.vllm.xavier.transports.base import (  # noqa: E402
    TransportContext,
)
from xinference.model.llm.vllm.xavier.transports.nixl.endpoint import (  # noqa: E402
    NixlAgentEndpoint,
)
from xinference.model.llm.vllm.xavier.transports.nixl.placement import (  # noqa: E402
    PLACEMENT_AUTO,
    PLACEMENT_ENGINE,
    PLACEMENT_SLAB,
)
from xinference.model.llm.vllm.xavier.transports.nixl.transport import (  # noqa: E402
    NixlDirectTransport,
)
from xinference.model.llm.vllm.xavier.transports.xoscar.transport import (  # noqa: E402
    XoscarSlabTransport,
)
from xinference.model.llm.vllm.xavier.wire import (  # noqa: E402
    KVGeometry,
    TransportHint,
)

KiB = 1024
MiB = 1024 * KiB
# Qwen2.5-0.5B, BF16: 24 layers; K and V of 2 KV heads x 16 tokens x head dim 64.
LAYERS, KV_HEADS, BLOCK_TOKENS, HEAD_DIM = 24, 2, 16, 64
GEOMETRY = KVGeometry(
    num_layers=LAYERS,
    layer_block_nbytes=2 * KV_HEADS * BLOCK_TOKENS * HEAD_DIM * 2,
    logical_dtype="bfloat16",
    block_size=BLOCK_TOKENS,
)
SIZES = (1, 16, 64)
HOLDER_SLOTS = 96  # 18 MiB of store rows
ENGINE_BLOCKS = 128  # room for 64 blocks every other one
CASES = (
    "xoscar",
    "nixl-slab",
    "nixl-engine",
    "nixl-auto",
    "nixl-slab-rpc",
    "nixl-read",
    "nixl-read-rows",
)
SLAB_ONLY = ("nixl-read", "nixl-read-rows")  # cases that leave rows in the slab
HOLDER_UID = "transport-bench-holder"
LOADER_UID = "transport-bench-loader"
RPC_TIMEOUT_S = 30.0


DST_PATTERNS = ("reversed", "consecutive", "every-other", "shuffled")


def destination_blocks(pattern: str, n: int) -> list[int]:
    """The engine blocks a load of ``n`` snapshots goes to (``--dst-blocks``)."""
    if pattern == "reversed":
        return list(range(n - 1, -1, -1))
    if pattern == "consecutive":
        return list(range(n))
    if pattern == "every-other":
        return list(range(0, 2 * n, 2))
    if pattern == "shuffled":
        gen = torch.Generator().manual_seed(n)
        return torch.randperm(ENGINE_BLOCKS, generator=gen)[:n].tolist()
    raise ValueError(f"unknown destination pattern {pattern!r}")


def runs(slots: list[int], blocks: list[int]) -> int:
    """Runs of keys that continue each other in the holder and in the engine."""
    return 1 + sum(
        not (slots[i] == slots[i - 1] + 1 and blocks[i] == blocks[i - 1] + 1)
        for i in range(1, len(slots))
    )


def cross_layer_tensors(layout: str, device: str) -> list[torch.Tensor]:
    """Per-layer views of one ``(blocks, layers, ...)`` allocation, as vLLM's
    cross-layer cache: in memory a block of every layer is contiguous, each layer
    keeps the attention backend's logical shape."""
    nb, h, t, d = ENGINE_BLOCKS, KV_HEADS, BLOCK_TOKENS, HEAD_DIM
    if layout == "packed_kv":
        packed = torch.zeros(
            (nb, LAYERS, h, t, 2 * d), dtype=torch.bfloat16, device=device
        )
        return [packed[:, i] for i in range(LAYERS)]
    if layout == "packed_kv_nhd":  # vLLM 0.26's FlashAttention: tokens, then heads
        nhd = torch.zeros(
            (nb, LAYERS, t, h, 2 * d), dtype=torch.bfloat16, device=device
        )
        return [nhd[:, i].transpose(1, 2) for i in range(LAYERS)]
    blocks = torch.zeros((nb, LAYERS, 2, t, h, d), dtype=torch.bfloat16, device=device)
    if layout == "block_first":
        return [blocks[:, i] for i in range(LAYERS)]
    if layout == "kv_first":  # (2, blocks, ...) logically, block-major in memory
        return [blocks[:, i].transpose(0, 1) for i in range(LAYERS)]
    raise ValueError(f"unknown layout {layout!r}")


def engine_tensors(layout: str, device: str, allocation: str) -> list[torch.Tensor]:
    """Per-layer KV tensors of ``ENGINE_BLOCKS`` blocks: views of one allocation
    (layer after layer, or ``cross-layer``: block after block), or one allocation
    per layer."""
    if allocation == "cross-layer":
        return cross_layer_tensors(layout, device)
    per_layer = ENGINE_BLOCKS * GEOMETRY.layer_block_nbytes // 2
    if allocation == "one":
        flat = torch.zeros(LAYERS * per_layer, dtype=torch.bfloat16, device=device)
        layers = [flat[i * per_layer : (i + 1) * per_layer] for i in range(LAYERS)]
    else:
        layers = [
            torch.zeros(per_layer, dtype=torch.bfloat16, device=device)
            for _ in range(LAYERS)
        ]
    nb, h, t, d = ENGINE_BLOCKS, KV_HEADS, BLOCK_TOKENS, HEAD_DIM
    if layout == "packed_kv":
        return [x.view(nb, h, t, 2 * d) for x in layers]
    if layout == "packed_kv_nhd":
        return [x.view(nb, t, h, 2 * d).transpose(1, 2) for x in layers]
    if layout == "block_first":
        return [x.view(nb, 2, t, h, d) for x in layers]
    if layout == "kv_first":
        return [x.view(2, nb, t, h, d) for x in layers]
    raise ValueError(f"unknown layout {layout!r}")


def _fence(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BenchPeer(xo.StatelessActor):
    def __init__(
        self,
        device: str,
        layout: str,
        allocation: str,
        torch_threads: int,
        scatter_graphs: bool,
    ) -> None:
        super().__init__()
        if torch_threads > 0:
            # Idle intra-op threads spin and compete with UCX's progress thread.
            torch.set_num_threads(torch_threads)
        self._device = torch.device(device)
        rows = (HOLDER_SLOTS * LAYERS, GEOMETRY.layer_block_nbytes)
        gen = torch.Generator().manual_seed(1234)
        self.rows = torch.randint(0, 256, rows, dtype=torch.uint8, generator=gen).to(
            self._device
        )
        tensors = engine_tensors(layout, device, allocation)
        self.engine = tensors
        self.cache = BlockMajorCache(
            tensors,
            detect_layout(tensors, ENGINE_BLOCKS, layout),
            scatter_graphs=scatter_graphs,
        )
        self.transports: dict[str, Any] = {}
        self._holder: Any = None

    async def __post_create__(self) -> None:
        self.transports["xoscar"] = XoscarSlabTransport(
            TransportContext(
                address=self.address,
                device=self._device,
                geometry=GEOMETRY,
                rpc_timeout_s=RPC_TIMEOUT_S,
                agent_name=f"bench-{os.getpid()}",
                store_rows=self.rows,
                locate_rows=_locate,
            )
        )
        # One endpoint (one agent, one registration of each region) serves both
        # placements, as it would in one transfer actor.
        endpoint = await NixlAgentEndpoint.create(
            f"bench-{os.getpid()}",
            row_bytes=GEOMETRY.layer_block_nbytes,
            store_rows=self.rows,
            slab_bytes=12 * MiB,
            engine_layers=self.cache.row_layers,
            engine_block_axis=self.cache.layout.block_axis,
        )
        for name, placement in (
            ("nixl-slab", PLACEMENT_SLAB),
            ("nixl-engine", PLACEMENT_ENGINE),
            ("nixl-auto", PLACEMENT_AUTO),
        ):
            self.transports[name] = NixlDirectTransport(
                endpoint,
                GEOMETRY,
                rpc_timeout_s=RPC_TIMEOUT_S,
                placement=placement,
                locate_rows=_locate,
            )
        self.transports["nixl-slab-rpc"] = self.transports["nixl-slab"]
        self.transports["nixl-read"] = self.transports["nixl-slab"]
        self.transports["nixl-read-rows"] = self.transports["nixl-slab"]

    async def __pre_destroy__(self) -> None:
        for transport in set(self.transports.values()):
            await transport.close()

    def instrument(self) -> None:
        install_registration_counter()

    def instrument_breakdown(self) -> None:
        """Time the steps of a direct NIXL load (``--breakdown``): wraps the read
        plan, every DeviceWorkMark.wait (timed as "slab wait": the wait for the
        last scatter out of the slab before a READ, and also the pinned id
        buffer's wait inside the scatter and the end-of-load wait when the copies
        outlast its poll), the READ (post to completion), the scatter and the
        end-of-load wait for the copies the scatters queued ("settle")."""
        self._steps: dict[str, list[float]] = {}

        def timed(name: str, function: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return function(*args, **kwargs)
                finally:
                    self._record(name, started)

            return wrapper

        def timed_async(name: str, function: Any) -> Any:
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return await function(*args, **kwargs)
                finally:
                    self._record(name, started)

            return wrapper

        module = nixl_transport
        module.plan_slab_read = timed("plan", module.plan_slab_read)  # type: ignore
        module.plan_slab_rows = timed("plan", module.plan_slab_rows)  # type: ignore
        module.plan_engine_read = timed("plan", module.plan_engine_read)  # type: ignore
        mark = module.DeviceWorkMark
        mark.wait = timed("slab wait", mark.wait)  # type: ignore
        endpoint = module.NixlAgentEndpoint
        endpoint.read = timed_async("read", endpoint.read)  # type: ignore
        self._timed = timed

    def _record(self, name: str, started: float) -> None:
        self._steps.setdefault(name, []).append(time.perf_counter() - started)

    def take_breakdown(self) -> dict[str, float]:
        """Median microseconds per step since the last call, and how many."""
        steps, self._steps = self._steps, {}
        return {k: 1e6 * statistics.median(v) for k, v in steps.items()}

    def snapshot(self, case: str) -> dict[str, int]:
        return {
            "registration_calls": registration_calls(),
            **dataclasses.asdict(self.transports[case].stats()),
        }

    def ucx_report(self) -> str:
        endpoint = self.transports["nixl-slab"].endpoint
        report = endpoint.ucx_report
        lines = [report.describe() if report is not None else "no UCX report"]
        lines += [f"peer check: {p.describe()}" for p in endpoint.peer_paths.values()]
        return "\n".join(lines)

    # ---- holder ---------------------------------------------------------------------

    async def transport_call(self, op: str, *args: Any) -> Any:
        """As the transfer actor: one of a transport's holder ops (``push_rows``
        belongs to xoscar, ``endpoint_info`` and ``source`` to the NIXL ones)."""
        name = "xoscar" if op == "push_rows" else "nixl-slab"
        return await self.transports[name].holder_ops()[op](*args)

    # ---- loader ---------------------------------------------------------------------

    def clear(self) -> None:
        for tensor in self.engine:
            tensor.zero_()
        _fence(self._device)

    async def load(
        self,
        case: str,
        holder_address: str,
        slots: list[int],
        blocks: list[int],
        n: int,
    ) -> list[float]:
        """``n`` loads of ``slots`` into engine ``blocks``; seconds per load."""
        if self._holder is None:
            self._holder = await xo.actor_ref(holder_address, HOLDER_UID)
        transport = self.transports[case]
        keys = [s.to_bytes(16, "big") for s in slots]
        holder = self._holder

        async def holder_call(op: str, *args: Any) -> Any:
            return await holder.transport_call(op, *args)

        extra: dict[str, Any] = {}
        if isinstance(transport, NixlDirectTransport):
            row_lists = transport.endpoint.row_lists
            if row_lists is not None:
                row_lists.enabled = case == "nixl-read-rows"
        if case in ("nixl-slab", "nixl-engine", "nixl-auto", *SLAB_ONLY):
            # What the lease grant carries: no RPC to locate the rows.
            source = await holder.transport_call("source", "bench", keys)
            hint = TransportHint(source.epoch, tuple(source.first_rows))
            extra = {"hint": hint, "dst_block_ids": blocks}
        timed = getattr(self, "_timed", None)
        times = []
        for _ in range(n):
            start = time.perf_counter()
            # as the load runner does: its scatter (destinations staged once per
            # load), and one wait for the copies it queued at the end
            written = DeviceWorkMark(self._device)
            scatter = (
                self._scatter(transport, blocks, written)
                if case not in SLAB_ONLY
                else _no_scatter
            )
            await transport.load(holder_call, 0, "bench", keys, scatter, **extra)
            # the engine may read the blocks only once every write has completed
            settling = time.perf_counter()
            await settle(written)
            if timed is not None:
                self._record("settle", settling)
            times.append(time.perf_counter() - start)
        return times

    def _scatter(
        self, transport: Any, blocks: list[int], written: DeviceWorkMark
    ) -> Any:
        """The load runner's scatter (``actor.loads.row_scatter``)."""
        scatter = row_scatter(
            self.cache,
            blocks,
            written,
            complete_each_chunk=not transport.guards_scatter_source,
        )
        timed = getattr(self, "_timed", None)
        return timed("scatter", scatter) if timed is not None else scatter

    def verify(self, holder_rows: bytes, slots: list[int], blocks: list[int]) -> bool:
        source = torch.frombuffer(bytearray(holder_rows), dtype=torch.uint8).view(
            -1, GEOMETRY.layer_block_nbytes
        )
        for slot, block in zip(slots, blocks, strict=True):
            index = torch.tensor([block], dtype=torch.long)
            got = torch.cat([self.cache.gather(i, index) for i in range(LAYERS)]).cpu()
            if not torch.equal(got, source[slot * LAYERS : (slot + 1) * LAYERS]):
                return False
        return True

    def verify_slab(self, holder_rows: bytes, slots: list[int]) -> bool:
        """The receive slab starts with the rows of ``slots`` (nixl-read)."""
        row_bytes = GEOMETRY.layer_block_nbytes
        source = torch.frombuffer(bytearray(holder_rows), dtype=torch.uint8).view(
            -1, row_bytes
        )
        expected = torch.cat([source[s * LAYERS : (s + 1) * LAYERS] for s in slots])
        slab = self.transports["nixl-read"].endpoint.slab
        got = slab[: expected.numel()].view(-1, row_bytes).cpu()
        return torch.equal(got, expected)

    def rows_bytes(self) -> bytes:
        return self.rows.cpu().numpy().tobytes()

    def scatter_path(self) -> str:
        graphs = self.cache.scatter_graphs
        if graphs is None:
            return self.cache.scatter_path
        state = "off" if graphs.disabled else "on"
        return f"{self.cache.scatter_path} (CUDA graphs {state})"

    def graph_report(self) -> str:
        graphs = self.cache.scatter_graphs
        if graphs is None:
            return "scatter graphs: none"
        return f"scatter graphs: {graphs.summary()}"


def _locate(lease_id: str, keys: Any) -> list[int]:
    """The bench holder's rows: key ``s`` is slot ``s``."""
    return [int.from_bytes(k, "big") * LAYERS for k in keys]


def _no_scatter(first_row: int, rows: torch.Tensor) -> None:
    """nixl-read: the rows stay in the receive slab."""


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run_case(
    case: str,
    blocks: int,
    holder: Any,
    loader: Any,
    holder_address: str,
    holder_rows: bytes,
    args: argparse.Namespace,
) -> dict[str, Any]:
    # holder slots from the back, destination blocks as --dst-blocks says
    slots = list(range(HOLDER_SLOTS - blocks, HOLDER_SLOTS))
    dst = destination_blocks(args.dst_blocks, blocks)
    await loader.clear()
    await loader.load(case, holder_address, slots, dst, args.warmup)
    before = (await holder.snapshot(case), await loader.snapshot(case))
    if args.breakdown:
        await loader.take_breakdown()
    times = await loader.load(case, holder_address, slots, dst, args.loads)
    after = (await holder.snapshot(case), await loader.snapshot(case))
    steps = await loader.take_breakdown() if args.breakdown else {}
    if case in SLAB_ONLY:
        verified = await loader.verify_slab(holder_rows, slots)
    else:
        verified = await loader.verify(holder_rows, slots, dst)
    if not verified:
        raise RuntimeError(f"{case}, {blocks} blocks: engine blocks differ from source")
    delta = {k: after[1][k] - before[1][k] for k in after[1]}
    if (
        args.engine_allocation == "cross-layer"
        and delta["engine_placed_loads"] == len(times)
        and delta["descriptors"] != runs(slots, dst) * len(times)
    ):
        raise RuntimeError(
            f"{case}, {blocks} blocks: {delta['descriptors'] / len(times)} "
            f"descriptors per load into cross-layer blocks, {runs(slots, dst)} runs"
        )
    registrations = (
        after[0]["registration_calls"]
        - before[0]["registration_calls"]
        + delta["registration_calls"]
    )
    return {
        "case": case,
        "blocks": blocks,
        "payload_bytes": blocks * GEOMETRY.block_nbytes,
        "loads": len(times),
        "p50_us": 1e6 * statistics.median(times),
        "p95_us": 1e6 * _percentile(times, 0.95),
        "mean_us": 1e6 * statistics.fmean(times),
        "wire_bytes": delta["received_wire_bytes"],
        "useful_bytes": delta["received_useful_bytes"],
        "wire_over_useful": delta["received_wire_bytes"]
        / max(delta["received_useful_bytes"], 1),
        "copies_per_load": delta["received_copies"] / len(times),
        "descriptors_per_load": (
            delta["descriptors"] / len(times) if "descriptors" in delta else None
        ),
        "runs": runs(slots, dst),
        "engine_placed_loads": delta.get("engine_placed_loads", 0),
        "registrations_after_warmup": registrations,
        "verified": True,
        "steps_p50_us": steps,
    }


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def print_table_head() -> None:
    print(
        "| transport | blocks | payload | p50 us | p95 us | wire/useful | "
        "copies/load | descriptors/load | runs | registrations after warm-up |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def print_row(r: dict[str, Any]) -> None:
    """One result, printed as soon as its case ends: a run cut short by a time
    limit still leaves every finished row."""
    descriptors = (
        "-" if r["descriptors_per_load"] is None else f"{r['descriptors_per_load']:.0f}"
    )
    case = r["case"]
    if case == "nixl-auto":
        # which placement auto chose for these loads
        case += " (engine)" if r["engine_placed_loads"] else " (slab)"
    print(
        f"| {case} | {r['blocks']} | {_size(r['payload_bytes'])} | "
        f"{r['p50_us']:.0f} | {r['p95_us']:.0f} | {r['wire_over_useful']:.2f} | "
        f"{r['copies_per_load']:.0f} | {descriptors} | {r['runs']} | "
        f"{r['registrations_after_warmup']} |",
        flush=True,
    )
    if r["steps_p50_us"]:
        steps = ", ".join(f"{k} {v:.0f}" for k, v in r["steps_p50_us"].items())
        print(f"|  | steps, p50 us: {steps} | | | | | | | | |", flush=True)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    layout = args.layout or ("packed_kv_nhd" if device.type == "cuda" else "packed_kv")
    pool = await xo.create_actor_pool(
        "127.0.0.1", n_process=2, external_address_schemes=["nixl"] * 3
    )
    async with pool:
        holder_address, loader_address = list(pool.sub_processes)
        peers = []
        for address, uid in (
            (holder_address, HOLDER_UID),
            (loader_address, LOADER_UID),
        ):
            peers.append(
                await xo.create_actor(
                    BenchPeer,
                    args.device,
                    layout,
                    args.engine_allocation,
                    args.torch_threads,
                    args.scatter_graphs,
                    address=address,
                    uid=uid,
                )
            )
        holder, loader = peers
        await holder.instrument()
        await loader.instrument()
        if args.breakdown:
            await loader.instrument_breakdown()
        holder_rows = await holder.rows_bytes()
        scatter_path = await loader.scatter_path()
        cases = args.cases.split(",") if args.cases else list(CASES)
        print(
            f"device {device}"
            + (
                f" ({torch.cuda.get_device_name(device)})"
                if device.type == "cuda"
                else ""
            )
            + f", engine layout {layout} ({args.engine_allocation} allocation, "
            f"scatter {scatter_path}; destination blocks {args.dst_blocks}), "
            f"torch {torch.__version__}, xoscar "
            f"{importlib.metadata.version('xoscar')}, nixl "
            f"{importlib.metadata.version('nixl')}, UCX_TLS "
            f"{os.environ.get('UCX_TLS', '(unset)')}; {args.loads} loads after "
            f"{args.warmup} warm-up per case\n"
        )
        print_table_head()
        results = []
        for blocks in SIZES:
            for case in cases:
                result = await run_case(
                    case, blocks, holder, loader, holder_address, holder_rows, args
                )
                print_row(result)
                results.append(result)
        ucx = await loader.ucx_report()
        graphs = await loader.graph_report()
        print(f"\n{ucx}\n{graphs}")
    return {
        "scatter_graphs": graphs,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "engine_layout": layout,
        "engine_allocation": args.engine_allocation,
        "dst_blocks": args.dst_blocks,
        "torch": torch.__version__,
        "xoscar": importlib.metadata.version("xoscar"),
        "nixl": importlib.metadata.version("nixl"),
        "ucx": ucx,
        "ucx_tls": os.environ.get("UCX_TLS", "(unset)"),
        "warmup": args.warmup,
        "loads": args.loads,
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--loads", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--cases", default="", help=f"comma-separated subset of {','.join(CASES)}"
    )
    parser.add_argument(
        "--layout",
        choices=("packed_kv", "packed_kv_nhd", "block_first", "kv_first"),
        default=None,
        help="engine KV layout (default: packed_kv on CPU; on CUDA packed_kv_nhd, "
        "FlashAttention's in vLLM 0.26: the packed shape stored tokens first)",
    )
    parser.add_argument(
        "--engine-allocation",
        choices=("one", "per-layer", "cross-layer"),
        default="one",
        help="engine KV layers as views of one allocation (layer after layer), "
        "one allocation each, or one allocation block after block (vLLM's "
        "cross-layer cache)",
    )
    parser.add_argument(
        "--dst-blocks",
        choices=DST_PATTERNS,
        default="reversed",
        help="the destination engine blocks of each load: reversed (nothing lines "
        "up), consecutive (the best case), every-other or shuffled (fragmented)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads per process (0: torch's default)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the steps of direct NIXL loads (plan, read, scatter, waits)",
    )
    parser.add_argument(
        "--scatter-graphs",
        action="store_true",
        help="replay repeated chunk scatters as CUDA graphs (XAVIER_SCATTER_GRAPHS=1 "
        "in serving; off: every chunk scatters eagerly, the default)",
    )
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    if args.loads < 1 or args.warmup < 1:
        parser.error("--loads and --warmup must be at least 1")
    report = asyncio.run(run(args))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
