"""Test actors for the device-tier transports: one replica's side of a real load.

Sub-pool processes import this module by name, which is why the tests tree is a
package. A key names a slot: ``slot_key(s)`` is snapshot ``s``, rows ``s * L .. s * L
+ L - 1`` of the source or destination tensor. Two kinds of peer:

- ``TransportPeer`` (``transport_pair``) owns one transport behind the seam
  (``XoscarSlabTransport`` or ``NixlDirectTransport``), a source tensor it serves
  rows from (standing in for the store's device tier) and, as the loader, a
  destination tensor its scatter writes into, plus optionally an engine KV cache in
  a given layout for loads placed straight into engine blocks. The holder answers
  ``transport_call(op, *args)`` with its transport's holder ops, as the transfer
  actor does.
- ``TransferPeer`` (``transfer_pair``) owns the seed's ``GPUTransfer`` runtime
  directly, below the seam, with a chosen slab policy.

``instrument_registrations`` wraps NIXL's ``nixl_agent.register_memory`` in the
actor's process with a counter (``registrations.py``) and calls the real method.
Nothing in the transfer is replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xoscar as xo

import xinference.model.llm.vllm.xavier.transports.nixl.transport as nixl_transport
from xinference.model.llm.vllm.xavier.engine.blocks import BlockMajorCache
from xinference.model.llm.vllm.xavier.engine.layout import detect_layout
from xinference.model.llm.vllm.xavier.transports.base import TransportContext
from xinference.model.llm.vllm.xavier.transports.nixl.peers import PeerPath
from xinference.model.llm.vllm.xavier.transports.nixl.placement import PLACEMENT_SLAB
from xinference.model.llm.vllm.xavier.transports.nixl.transport import (
    NixlDirectTransport,
)
from xinference.model.llm.vllm.xavier.transports.nixl.wire import NixlSource
from xinference.model.llm.vllm.xavier.transports.xoscar.gpu_transfer import (
    GPUTransfer,
    PushRequest,
    chunk_row_index,
    full_slab_bytes,
)
from xinference.model.llm.vllm.xavier.transports.xoscar.slab_selector import (
    FullSlabSelector,
    SlabPolicy,
    SlabSelector,
    SmallestFitSelector,
)
from xinference.model.llm.vllm.xavier.transports.xoscar.transport import (
    XoscarSlabTransport,
)
from xinference.model.llm.vllm.xavier.wire import KVGeometry, TransportHint

from .registrations import install_registration_counter, registration_calls

HOLDER_UID = "transport-test-holder"
LOADER_UID = "transport-test-loader"
TRANSFER_HOLDER_UID = "transfer-test-holder"
TRANSFER_LOADER_UID = "transfer-test-loader"
HOLDER_RANK = 0


def _trusted(path: PeerPath | None) -> bool:
    """An engine read policy that trusts every peer (``trust_engine_reads``)."""
    return True


def slot_key(slot: int) -> bytes:
    return slot.to_bytes(16, "big")


def key_slot(key: bytes) -> int:
    return int.from_bytes(key, "big")


@dataclass(frozen=True)
class PeerSpec:
    """How to build one ``TransportPeer``.

    ``engine_layout``: None for no engine cache, else ``block_first`` (blocks
    contiguous) or ``kv_first`` (allocated ``(2, num_blocks, ...)``, so a block of a
    layer is two separate pieces, as on GPU attention backends), both one layer
    after the other in one allocation, or ``cross_layer`` (``block_first`` views of
    one ``(num_blocks, layers, ...)`` allocation, as vLLM's cross-layer cache: a
    block of every layer is one contiguous range).

    ``trust_engine_reads``: under ``auto`` placement, treat every peer's READs as
    unable to outlive their deadline (what VRAM over cuda_ipc gives), so that DRAM
    loads may take the engine path. ``serving``: build the transport as serving
    does (``transports.nixl.transport.create``), ignoring ``placement``.
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
    trust_engine_reads: bool = False
    serving: bool = False


def _engine_tensors(spec: PeerSpec) -> list[torch.Tensor]:
    """Per-layer bf16 KV tensors of ``spec.engine_blocks`` blocks, whose block of
    one layer is ``geometry.layer_block_nbytes`` bytes: (2, 16 tokens, 2 heads, d)."""
    geometry = spec.geometry
    elements = geometry.layer_block_nbytes // 2
    head = elements // (2 * 16 * 2)
    if head * 2 * 16 * 2 != elements:
        raise ValueError("layer_block_nbytes must be a multiple of 128 bytes")
    nb = spec.engine_blocks
    if spec.engine_layout == "cross_layer":
        blocks = torch.zeros(
            (nb, geometry.num_layers, 2, 16, 2, head),
            dtype=torch.bfloat16,
            device=spec.device,
        )
        return [blocks[:, layer] for layer in range(geometry.num_layers)]
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
            hint = (
                "block_first"
                if spec.engine_layout == "cross_layer"
                else spec.engine_layout
            )
            layout = detect_layout(tensors, spec.engine_blocks, hint)
            self.cache = BlockMajorCache(tensors, layout)
            self.engine_tensors = tensors
        self.transport: Any = None
        # every (first_row, num_rows) handed to scatter, in order
        self.scatter_calls: list[tuple[int, int]] = []
        self.scatter_dtypes: set[str] = set()
        # holder address -> actor ref, made once: making a ref asks the holder's pool,
        # which a stopped holder never answers
        self._holders: dict[str, Any] = {}

    def _locate(self, lease_id: str, keys: Sequence[bytes]) -> list[int]:
        num_layers = self._spec.geometry.num_layers
        return [key_slot(k) * num_layers for k in keys]

    async def __post_create__(self) -> None:
        spec = self._spec
        # what the transfer actor hands the serving transports
        context = TransportContext(
            address=self.address,
            device=torch.device(spec.device),
            geometry=spec.geometry,
            rpc_timeout_s=spec.rpc_timeout_s,
            agent_name=f"test-{os.getpid()}",
            store_rows=self.source_rows,
            locate_rows=self._locate,
        )
        if spec.transport == "xoscar":
            self.transport = XoscarSlabTransport(context)
        elif spec.transport == "nixl" and spec.serving:
            cache = self.cache
            self.transport = await nixl_transport.create(
                dataclasses.replace(
                    context,
                    engine_layers=self.engine_tensors,
                    engine_block_axis=(
                        cache.layout.block_axis if cache is not None else None
                    ),
                )
            )
        elif spec.transport == "nixl":
            cache = self.cache
            policy = {"engine_read_policy": _trusted} if spec.trust_engine_reads else {}
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
                locate_rows=self._locate,
                **policy,
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

    async def transport_call(self, op: str, *args: Any) -> Any:
        """As the transfer actor: one of the transport's holder ops."""
        return await self.transport.holder_ops()[op](*args)

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
            index = loader_row_index(first_rows, num_layers, first_row, rows.shape[0])
            dest.index_copy_(0, index.to(dest.device), rows)

        async def holder_call(op: str, *args: Any) -> Any:
            return await holder.transport_call(op, *args)

        hint = None
        if source is not None:  # what a grant would carry
            hint = TransportHint(source.epoch, tuple(source.first_rows))
        started = time.perf_counter()
        await self.transport.load(
            holder_call,
            HOLDER_RANK,
            "lease-test",
            [slot_key(s) for s in slots],
            scatter,
            hint=hint,
            dst_block_ids=dst_blocks,
        )
        return time.perf_counter() - started

    async def fetch_source(self, holder_address: str, slots: Sequence[int]) -> Any:
        """Ask the holder where ``slots`` are now, for a later ``load(source=...)``."""
        holder = await self._holder(holder_address)
        return await holder.transport_call(
            "source", "lease-test", [slot_key(s) for s in slots]
        )

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

    def placement(self) -> dict[str, Any]:
        """The NIXL transport's placement, whether its endpoint registered the
        engine cache, and whether it places loads from each met peer there."""
        transport = self.transport
        endpoint = transport.endpoint
        return {
            "placement": transport.placement,
            "engine_registered": endpoint.engine_map is not None,
            "places_in_engine": {
                peer: transport.places_in_engine(peer) for peer in endpoint.peer_paths
            },
        }

    def environment(self) -> dict[str, str]:
        """This process's UCX_* environment variables."""
        return {k: v for k, v in os.environ.items() if k.startswith("UCX_")}

    def instrument_registrations(self) -> None:
        install_registration_counter()

    def registration_calls(self) -> int:
        return registration_calls()

    def transport_name(self) -> str:
        return self._spec.transport

    def counters(self) -> dict[str, int]:
        return dataclasses.asdict(self.transport.stats())

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

    def use_row_lists(self, enabled: bool) -> tuple[str, ...]:
        """Turn the NIXL endpoint's prepared row lists on or off; returns the peers
        it has lists for."""
        row_lists = self.transport.endpoint.row_lists
        row_lists.enabled = enabled
        return row_lists.peers

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


# ---- the seed's GPUTransfer runtime, below the seam ------------------------------


def make_policy(name: str, full_bytes: int) -> SlabPolicy:
    """``streak`` (the runtime's), ``smallest`` (the old choice) or ``full``."""
    policies = {
        "streak": SlabSelector,
        "smallest": SmallestFitSelector,
        "full": FullSlabSelector,
    }
    return policies[name](full_bytes)


def loader_row_index(
    key_first_rows: list[int], num_layers: int, first_row: int, num_rows: int
) -> torch.Tensor:
    """Where the loader puts a chunk's rows: global row ``r`` is layer
    ``r % num_layers`` of the ``r // num_layers``-th key.

    Written out row by row here, not with the production ``chunk_row_index``: the
    holders gather with that one, and a bug in it used at both ends would cancel
    out and leave the bytes looking right.
    """
    index = []
    for row in range(first_row, first_row + num_rows):
        key, layer = divmod(row, num_layers)
        index.append(key_first_rows[key] + layer)
    return torch.tensor(index, dtype=torch.long)


def scatter_into(
    dest: torch.Tensor, key_first_rows: list[int], num_layers: int
) -> Callable[[int, torch.Tensor], None]:
    """A scatter callback writing a load's global rows into ``dest``'s snapshot rows."""

    def scatter(first_row: int, rows: torch.Tensor) -> None:
        index = loader_row_index(key_first_rows, num_layers, first_row, rows.shape[0])
        dest.index_copy_(0, index.to(dest.device), rows)

    return scatter


class TransferPeer(xo.StatelessActor):
    def __init__(
        self, geometry: KVGeometry, device: str, num_slots: int, policy: str
    ) -> None:
        super().__init__()
        self._geometry = geometry
        self._device = device
        self._policy = policy
        rows = (num_slots * geometry.num_layers, geometry.layer_block_nbytes)
        self.source_rows = torch.zeros(rows, dtype=torch.uint8, device=device)
        self.dest_rows = torch.zeros(rows, dtype=torch.uint8, device=device)
        # (address, uid) of every destination ref a push asked us to write
        self.seen_dests: set[tuple[str, bytes]] = set()

    async def __post_create__(self) -> None:
        # xo.buffer_ref needs the actor's address, known only after construction.
        self.transfer = self._new_transfer(self._policy)

    def _new_transfer(self, policy: str) -> GPUTransfer:
        return GPUTransfer(
            self.address,
            self._device,
            self._geometry,
            selector=make_policy(policy, full_slab_bytes(self._geometry)),
        )

    # ---- data -------------------------------------------------------------------

    def write_source(self, first_row: int, data: bytes) -> None:
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = flat.view(-1, self._geometry.layer_block_nbytes)
        self.source_rows[first_row : first_row + rows.shape[0]].copy_(rows)

    def read_dest(self, first_row: int, num_rows: int) -> bytes:
        rows = self.dest_rows[first_row : first_row + num_rows]
        return rows.cpu().numpy().tobytes()

    def clear_dest(self) -> None:
        self.dest_rows.zero_()

    # ---- the two halves of a transfer -------------------------------------------

    async def push_rows(self, req: PushRequest) -> None:
        self.seen_dests.add((req.dest.address, req.dest.uid))
        num_layers = self._geometry.num_layers
        index = chunk_row_index(
            [key_slot(k) * num_layers for k in req.keys],
            num_layers,
            req.first_row,
            req.num_rows,
        )
        await self.transfer.serve_push(req, self.source_rows, index)

    async def load(self, holder_address: str, batches: Sequence[Sequence[int]]) -> int:
        """Load each batch of slots into the same slots of ``dest_rows``; rows."""
        holder = await xo.actor_ref(holder_address, TRANSFER_HOLDER_UID)
        num_layers = self._geometry.num_layers
        loaded = 0
        for slots in batches:
            scatter = scatter_into(
                self.dest_rows, [s * num_layers for s in slots], num_layers
            )

            loaded += await self.transfer.load_rows(
                HOLDER_RANK,
                holder.push_rows,
                "lease-test",
                [slot_key(s) for s in slots],
                scatter,
            )
        return loaded

    async def push_into_wrong_view(self, holder_address: str, slots: list[int]) -> None:
        """Ask for a full-slab write into our small view: both ends must refuse."""
        holder = await xo.actor_ref(holder_address, TRANSFER_HOLDER_UID)
        gt = self.transfer
        num_rows = len(slots) * self._geometry.num_layers
        await holder.push_rows(
            PushRequest(
                lease_id="lease-test",
                keys=tuple(slot_key(s) for s in slots),
                first_row=0,
                num_rows=num_rows,
                wire_bytes=gt.full_bytes,
                dest=gt.recv_refs[gt.small_bytes],
            )
        )

    # ---- introspection ----------------------------------------------------------

    def instrument_registrations(self) -> None:
        install_registration_counter()

    def registration_calls(self) -> int:
        return registration_calls()

    def counters(self) -> dict[str, int]:
        return self.transfer.counters.as_dict()

    def get_seen_dests(self) -> set[tuple[str, bytes]]:
        return set(self.seen_dests)

    def transfer_info(self) -> dict[str, Any]:
        from xoscar.core import BufferRef

        gt = self.transfer
        registry = BufferRef._ref_to_buffers
        return {
            "address": self.address,
            "full_bytes": gt.full_bytes,
            "small_bytes": gt.small_bytes,
            "rows_per_copy": gt.rows_per_copy,
            "view_sizes": gt.view_sizes,
            # size -> (data_ptr, numel, storage data_ptr)
            "send": {
                n: (v.data_ptr(), v.numel(), v.untyped_storage().data_ptr())
                for n, v in gt.send_views.items()
            },
            "recv": {
                n: (v.data_ptr(), v.numel(), v.untyped_storage().data_ptr())
                for n, v in gt.recv_views.items()
            },
            # size -> (id of the ref object, (address, uid), the registry's buffer is
            # the very view object)
            "refs": {
                n: (id(r), (r.address, r.uid), registry[r] is gt.recv_views[n])
                for n, r in gt.recv_refs.items()
            },
            "object_ids": {
                "send": {n: id(v) for n, v in gt.send_views.items()},
                "recv": {n: id(v) for n, v in gt.recv_views.items()},
            },
            "registry_refs_here": sum(
                1 for r in list(registry.keys()) if r.address == self.address
            ),
            "device": str(gt.device),
        }


@contextlib.asynccontextmanager
async def transfer_pair(
    geometry: KVGeometry,
    device: str = "cpu",
    num_slots: int = 8,
    loader_policy: str = "streak",
) -> AsyncIterator[tuple[Any, Any, str]]:
    """(holder, loader, holder address): two processes on ``nixl://`` addresses.

    Both processes count their NIXL registrations from before the first copy.
    """
    pool = await xo.create_actor_pool(
        "127.0.0.1", n_process=2, external_address_schemes=["nixl"] * 3
    )
    async with pool:
        holder_address, loader_address = list(pool.sub_processes)
        holder = await xo.create_actor(
            TransferPeer,
            geometry,
            device,
            num_slots,
            "streak",
            address=holder_address,
            uid=TRANSFER_HOLDER_UID,
        )
        loader = await xo.create_actor(
            TransferPeer,
            geometry,
            device,
            num_slots,
            loader_policy,
            address=loader_address,
            uid=TRANSFER_LOADER_UID,
        )
        await holder.instrument_registrations()
        await loader.instrument_registrations()
        yield holder, loader, holder_address
