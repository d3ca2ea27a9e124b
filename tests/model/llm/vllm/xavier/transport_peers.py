"""Test actors for the device-tier transports: one replica's side of a real load.

Sub-pool processes import this module by name, which is why the tests tree is a
package. A ``TransportPeer`` owns one transport (``xoscar``: ``XoscarSlabTransport``;
``nixl``: ``NixlDirectTransport``), a source tensor it serves rows from (standing in
for the store's device tier) and, as the loader, a destination tensor that its
scatter writes loaded rows into, plus optionally an engine KV cache in a given layout
for loads placed straight into engine blocks. A key names a slot: ``slot_key(s)`` is
snapshot ``s``, rows ``s * L .. s * L + L - 1`` of either tensor.

The holder answers what each transport asks of a holder's actor: ``push_rows``
(xoscar) and ``nixl_endpoint_info`` / ``nixl_source`` (nixl), the same methods the
transfer actor exposes.

``instrument_registrations`` is test-only instrumentation: it wraps NIXL's
``nixl_agent.register_memory`` in the actor's process with a counter and calls the
real method. Nothing in the transfer is replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xoscar as xo

from xinference.model.llm.vllm.xavier.gpu_transfer import chunk_row_index
from xinference.model.llm.vllm.xavier.layout import BlockMajorCache, detect_layout
from xinference.model.llm.vllm.xavier.messages import KVGeometry, PushRequest
from xinference.model.llm.vllm.xavier.nixl_registrations import (
    install_registration_counter,
    registration_calls,
)
from xinference.model.llm.vllm.xavier.nixl_transport import (
    PLACEMENT_SLAB,
    NixlDirectTransport,
    NixlEndpointInfo,
    NixlSource,
)
from xinference.model.llm.vllm.xavier.transport import XoscarSlabTransport

HOLDER_UID = "transport-test-holder"
LOADER_UID = "transport-test-loader"
HOLDER_RANK = 0


def slot_key(slot: int) -> bytes:
    return slot.to_bytes(16, "big")


def key_slot(key: bytes) -> int:
    return int.from_bytes(key, "big")


@dataclass(frozen=True)
class PeerSpec:
    """How to build one ``TransportPeer``.

    ``engine_layout``: None for no engine cache, else ``block_first`` (blocks
    contiguous) or ``kv_first`` (allocated ``(2, num_blocks, ...)``, so a block of a
    layer is two separate pieces, as on GPU attention backends).
    """

    transport: str  # "xoscar" or "nixl"
    geometry: KVGeometry
    device: str = "cpu"
    num_slots: int = 8
    placement: str = PLACEMENT_SLAB
    engine_layout: str | None = None
    engine_blocks: int = 0
    rpc_timeout_s: float = 20.0
    transfer_timeout_s: float | None = None


def _engine_tensors(spec: PeerSpec) -> list[torch.Tensor]:
    """Per-layer bf16 KV tensors of ``spec.engine_blocks`` blocks, whose block of
    one layer is ``geometry.layer_block_nbytes`` bytes: (2, 16 tokens, 2 heads, d)."""
    geometry = spec.geometry
    elements = geometry.layer_block_nbytes // 2
    head = elements // (2 * 16 * 2)
    if head * 2 * 16 * 2 != elements:
        raise ValueError("layer_block_nbytes must be a multiple of 128 bytes")
    nb = spec.engine_blocks
    per_layer = nb * elements
    flat = torch.zeros(
        geometry.num_layers * per_layer, dtype=torch.bfloat16, device=spec.device
    )
    layers = [
        flat[i * per_layer : (i + 1) * per_layer] for i in range(geometry.num_layers)
    ]
    if spec.engine_layout == "block_first":
        return [t.view(nb, 2, 16, 2, head) for t in layers]
    if spec.engine_layout == "kv_first":
        return [t.view(2, nb, 16, 2, head) for t in layers]
    raise ValueError(f"unknown engine layout {spec.engine_layout!r}")


class TransportPeer(xo.StatelessActor):
    def __init__(self, spec: PeerSpec) -> None:
        super().__init__()
        self._spec = spec
        geometry = spec.geometry
        rows = (spec.num_slots * geometry.num_layers, geometry.layer_block_nbytes)
        self.source_rows = torch.zeros(rows, dtype=torch.uint8, device=spec.device)
        self.dest_rows = torch.zeros(rows, dtype=torch.uint8, device=spec.device)
        self.cache: BlockMajorCache | None = None
        self.engine_tensors: list[torch.Tensor] | None = None
        if spec.engine_layout is not None:
            tensors = _engine_tensors(spec)
            layout = detect_layout(tensors, spec.engine_blocks, spec.engine_layout)
            self.cache = BlockMajorCache(tensors, layout)
            self.engine_tensors = tensors
        self.transport: Any = None
        # every (first_row, num_rows) handed to scatter, in order
        self.scatter_calls: list[tuple[int, int]] = []
        self.scatter_dtypes: set[str] = set()
        # holder address -> actor ref, made once: making a ref asks the holder's pool,
        # which a stopped holder never answers
        self._holders: dict[str, Any] = {}

    async def __post_create__(self) -> None:
        spec = self._spec
        if spec.transport == "xoscar":
            self.transport = XoscarSlabTransport(
                self.address, spec.device, spec.geometry, spec.rpc_timeout_s
            )
        elif spec.transport == "nixl":
            cache = self.cache
            self.transport = await NixlDirectTransport.create(
                f"test-{os.getpid()}",
                spec.geometry,
                self.source_rows,
                rpc_timeout_s=spec.rpc_timeout_s,
                transfer_timeout_s=spec.transfer_timeout_s,
                placement=spec.placement,
                engine_layers=self.engine_tensors,
                engine_block_axis=(
                    cache.layout.block_axis if cache is not None else None
                ),
            )
        else:
            raise ValueError(f"unknown transport {spec.transport!r}")

    async def __pre_destroy__(self) -> None:
        if self.transport is not None:
            await self.transport.close()

    # ---- data -------------------------------------------------------------------

    def write_source(self, first_row: int, data: bytes) -> None:
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = flat.view(-1, self._spec.geometry.layer_block_nbytes)
        self.source_rows[first_row : first_row + rows.shape[0]].copy_(
            rows.to(self.source_rows.device)
        )

    def read_dest(self, first_row: int, num_rows: int) -> bytes:
        rows = self.dest_rows[first_row : first_row + num_rows]
        return rows.cpu().numpy().tobytes()

    def clear_dest(self) -> None:
        self.dest_rows.zero_()
        for tensor in self.engine_tensors or []:
            tensor.zero_()

    def read_engine_block(self, block_id: int) -> bytes:
        """Every layer of one engine block as rows, read through ``layout.py``."""
        assert self.cache is not None
        index = torch.tensor([block_id], dtype=torch.long)
        rows = [self.cache.gather(i, index) for i in range(self.cache.num_layers)]
        return torch.cat(rows).cpu().numpy().tobytes()

    async def replace_store(self) -> None:
        """Move the device tier to a new allocation (same contents), re-registered."""
        rows = self.source_rows.clone()
        await self.transport.endpoint.replace_store_rows(rows)
        self.source_rows = rows

    # ---- holder side ------------------------------------------------------------

    async def push_rows(self, req: PushRequest) -> None:
        num_layers = self._spec.geometry.num_layers
        index = chunk_row_index(
            [key_slot(k) * num_layers for k in req.keys],
            num_layers,
            req.first_row,
            req.num_rows,
        )
        await self.transport.serve(req, self.source_rows, index)

    async def nixl_endpoint_info(self) -> NixlEndpointInfo:
        return self.transport.endpoint.info

    async def nixl_source(self, lease_id: str, keys: list[bytes]) -> NixlSource:
        num_layers = self._spec.geometry.num_layers
        return self.transport.endpoint.source([key_slot(k) * num_layers for k in keys])

    # ---- loader side ------------------------------------------------------------

    async def load(
        self,
        holder_address: str,
        slots: Sequence[int],
        *,
        dst_slots: Sequence[int] | None = None,
        dst_blocks: Sequence[int] | None = None,
        source: NixlSource | None = None,
        fail_at_row: int | None = None,
    ) -> float:
        """Load ``slots`` from the holder; seconds taken (inside this process).

        Rows land in ``dst_slots`` (default: the same slots) of ``dest_rows``
        through the scatter callback, or in engine blocks ``dst_blocks`` when the
        transport places loads there. ``fail_at_row``: scatter raises when handed
        that global row (a consumer failing mid-load).
        """
        holder = await self._holder(holder_address)
        num_layers = self._spec.geometry.num_layers
        targets = list(dst_slots if dst_slots is not None else slots)
        first_rows = [s * num_layers for s in targets]
        dest = self.dest_rows

        def scatter(first_row: int, rows: torch.Tensor) -> None:
            self.scatter_calls.append((first_row, rows.shape[0]))
            self.scatter_dtypes.add(str(rows.dtype))
            if fail_at_row is not None and first_row <= fail_at_row < (
                first_row + rows.shape[0]
            ):
                raise RuntimeError(f"scatter refused row {fail_at_row}")
            index = chunk_row_index(first_rows, num_layers, first_row, rows.shape[0])
            dest.index_copy_(0, index.to(dest.device), rows)

        kwargs: dict[str, Any] = {}
        if self._spec.transport == "nixl":
            kwargs = {"source": source, "dst_block_ids": dst_blocks}
        started = time.perf_counter()
        await self.transport.load(
            holder,
            HOLDER_RANK,
            "lease-test",
            [slot_key(s) for s in slots],
            scatter,
            **kwargs,
        )
        return time.perf_counter() - started

    async def fetch_source(self, holder_address: str, slots: Sequence[int]) -> Any:
        """Ask the holder where ``slots`` are now, for a later ``load(source=...)``."""
        holder = await self._holder(holder_address)
        return await holder.nixl_source("lease-test", [slot_key(s) for s in slots])

    async def _holder(self, address: str) -> Any:
        if address not in self._holders:
            self._holders[address] = await xo.actor_ref(address, HOLDER_UID)
        return self._holders[address]

    def take_scatter_calls(self) -> list[tuple[int, int]]:
        calls, self.scatter_calls = self.scatter_calls, []
        return calls

    def get_scatter_dtypes(self) -> set[str]:
        return set(self.scatter_dtypes)

    # ---- introspection ----------------------------------------------------------

    def pid(self) -> int:
        return os.getpid()

    def environment(self) -> dict[str, str]:
        """This process's UCX_* environment variables."""
        return {k: v for k, v in os.environ.items() if k.startswith("UCX_")}

    def instrument_registrations(self) -> None:
        install_registration_counter()

    def registration_calls(self) -> int:
        return registration_calls()

    def counters(self) -> dict[str, int]:
        return self.transport.counters()

    def rows_per_chunk(self) -> int:
        transport = self.transport
        if isinstance(transport, NixlDirectTransport):
            return transport.rows_per_read
        return transport.runtime.rows_per_copy

    def ucx_report(self) -> dict[str, Any]:
        report = self.transport.endpoint.ucx_report
        return {
            "env": dict(report.env),
            "resources": report.resources,
            "transports": report.transports,
            "tcp_only": report.tcp_only,
            "probe_error": report.probe_error,
            "applied": dict(report.applied),
            "text": report.describe(),
        }

    def peer_paths(self) -> dict[str, dict[str, Any]]:
        paths = self.transport.endpoint.peer_paths
        return {name: dataclasses.asdict(path) for name, path in paths.items()}

    async def pending_orphans(self) -> int:
        return await self.transport.endpoint.pending_reads()


@contextlib.asynccontextmanager
async def transport_pair(
    holder_spec: PeerSpec,
    loader_spec: PeerSpec | None = None,
    envs: list[dict[str, str]] | None = None,
) -> AsyncIterator[tuple[Any, Any, str]]:
    """(holder, loader, holder address): two processes on ``nixl://`` addresses.

    ``envs`` sets environment variables per process (holder's first), before
    anything in them creates a NIXL agent. Both processes count their NIXL
    registrations from before their transports exist.
    """
    pool = await xo.create_actor_pool(
        "127.0.0.1",
        n_process=2,
        external_address_schemes=["nixl"] * 3,
        envs=envs,
        # A holder killed on purpose stays dead rather than coming back.
        auto_recover=False,
    )
    async with pool:
        holder_address, loader_address = list(pool.sub_processes)
        for address in (holder_address, loader_address):
            counter = await xo.create_actor(
                RegistrationCounter, address=address, uid="registration-counter"
            )
            await counter.install()
        holder = await xo.create_actor(
            TransportPeer, holder_spec, address=holder_address, uid=HOLDER_UID
        )
        loader = await xo.create_actor(
            TransportPeer,
            loader_spec or holder_spec,
            address=loader_address,
            uid=LOADER_UID,
        )
        yield holder, loader, holder_address


class RegistrationCounter(xo.StatelessActor):
    """Installs the register_memory counter in its process before any agent exists."""

    def install(self) -> None:
        install_registration_counter()
