"""``NixlAgentEndpoint``: one NIXL agent per transfer actor, memory registered once.

Registered at start: what peers read (the device tier rows and their generation
words, ``published.py``), the receive slab, one scratch row for the peer check, a
host scratch for peers' generation words and, when asked, the engine's KV layers.
After that nothing is registered again, except a fresh receive slab or words
scratch when a READ into the old one missed its deadline. Peers are met once
(their partial metadata loaded, a connection made, one row READ as a check of the
path, so a missing zero-copy path fails there with its reason rather than on
every load) and again only when their generation changes (that check READ is
planned and explained in ``peers.py``). READs themselves are
``reads.ReadWaiter``'s; the descriptor lists prepared once for them,
``row_lists.RowLists``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from ...aio import finish_even_if_cancelled
from .peers import PeerPath, check_failed, check_plan
from .plan import EngineBlockMap, ReadPlan
from .published import PublishedMemory, load_published
from .reads import DEST_PROBE, DEST_SLAB, DEST_WORDS, ReadWaiter
from .row_lists import RowLists
from .ucx import (
    PROGRESS_THREAD_DELAY_US,
    VRAM_UCX_SETTINGS,
    WORDS_READER_UCX_SETTINGS,
    UcxReport,
    _progress_thread_delay,
    log_endpoint_start,
    pair_transports,
    probe_ucx,
    progress_thread_delay_us,
    ucx_settings,
)
from .wire import (
    NixlEndpointInfo,
    NixlRegion,
    NixlSource,
    NixlTransferError,
    NixlTransferTimeout,
    _nixl_errors,
)

logger = logging.getLogger(__name__)

# An engine layout whose block splits into more pieces than this is not worth
# addressing piece by piece; such an engine uses slab placement.
MAX_ENGINE_SEGMENTS = 8
# The host scratch that peers' generation words are READ into: 512 words a READ
# (``generation_words.read_words`` splits more), in host memory on every endpoint,
# so that reading them back needs no device synchronization.
WORDS_SCRATCH_BYTES = 4096

# Memory that a READ which never reached a terminal state may still write, with the
# agent that owns the request: kept alive for the life of the process, because freeing
# it would let a late write land in memory reused for something else.
_QUARANTINE: list[Any] = []


class NixlAgentEndpoint:
    """One NIXL agent with the transfer actor's memory registered once.

    Build it with ``await NixlAgentEndpoint.create(...)`` (agent creation and
    registration are blocking, so they run in a thread). Registered at start: the
    device tier rows and their generation words (what peers read), the receive
    slab (``slab`` placement), one scratch row for the peer check, a host scratch
    for peers' generation words and, when given, the engine's KV layers
    (``engine`` placement). After that nothing is registered again, except a fresh
    receive slab or words scratch when a READ into the old one missed its deadline
    (``registrations`` counts every registration).

    An endpoint on VRAM creates its agent with ``VRAM_UCX_SETTINGS`` (unless the
    environment sets them), and ``add_peer`` READs one row from each new peer: with
    UCX's emulation off, that READ fails when UCX has no zero-copy path, so a TCP
    fallback shows up when a peer is met, not as slow loads.
    """

    def __init__(
        self,
        name: str,
        *,
        row_bytes: int,
        store_rows: torch.Tensor,
        slab_bytes: int,
        engine_layers: Sequence[torch.Tensor] | None = None,
        engine_block_axis: int | None = None,
        words: torch.Tensor | None = None,
        reads_peer_words: bool = False,
    ) -> None:
        """Checks and allocations only; ``create`` also starts the agent.

        ``store_rows``: the device tier, ``(rows, row_bytes)`` uint8 (may have 0
        rows); the receive slab is allocated on its device. ``engine_layers``: the
        engine's per-layer KV tensors as mapped here, with their block axis.
        ``words``: the device tier's generation words, published with the rows
        in whatever memory they are in (host memory, even for a tier on a GPU).
        ``reads_peer_words``: READs peers' words (the engine's reader; ``ucx.py``).
        """
        if row_bytes <= 0 or slab_bytes < row_bytes:
            raise ValueError(
                f"need row_bytes > 0 and a slab of at least one row, got "
                f"row_bytes={row_bytes}, slab_bytes={slab_bytes}"
            )
        if store_rows.dtype != torch.uint8 or store_rows.dim() != 2:
            raise ValueError("store_rows must be a 2-D uint8 tensor")
        if store_rows.shape[1] != row_bytes or not store_rows.is_contiguous():
            raise ValueError(
                f"store_rows must be contiguous ({store_rows.shape[0]}, {row_bytes})"
            )
        engine_map = None
        if engine_layers is not None:
            if engine_block_axis is None:
                raise ValueError("engine_layers need engine_block_axis")
            engine_map = EngineBlockMap.from_layers(
                engine_layers, engine_block_axis, row_bytes
            )
            if len(engine_map.segment_offsets) > MAX_ENGINE_SEGMENTS:
                logger.warning(
                    "engine KV blocks split into %d pieces each; engine placement "
                    "is off, loads go through the receive slab",
                    len(engine_map.segment_offsets),
                )
                engine_map = None
        self.agent_name = f"xavier-{name}-{uuid.uuid4().hex[:12]}"
        self.row_bytes = row_bytes
        self.device = store_rows.device
        self.generation = 1
        self.registrations = 0
        self.ucx_report: UcxReport | None = None
        self.progress_delay_us = PROGRESS_THREAD_DELAY_US
        self.zero_copy_only = False
        self._agent: Any = None
        self._nixl_errors = _nixl_errors()
        self._store_rows = store_rows
        self._words = words
        self._reads_peer_words = reads_peer_words
        self._published: PublishedMemory | None = None  # once the agent exists
        # Zeroed once, so a slab never exposes stale memory.
        self._slab = torch.zeros(slab_bytes, dtype=torch.uint8, device=self.device)
        self._slab_region = NixlRegion.of(self._slab)
        self._slab_reg: Any = None
        self.row_lists: RowLists | None = None  # once the agent exists
        self._probe = torch.zeros(row_bytes, dtype=torch.uint8, device=self.device)
        self._probe_reg: Any = None
        self._words_scratch = torch.zeros(WORDS_SCRATCH_BYTES, dtype=torch.uint8)
        self._words_scratch_reg: Any = None
        self.peer_paths: dict[str, PeerPath] = {}
        # Kept so that the mapped engine memory outlives its registration.
        self._engine_layers = (
            list(engine_layers) if engine_layers is not None and engine_map else []
        )
        self._engine_map = engine_map
        self._engine_regs: Any = None
        self._info: NixlEndpointInfo | None = None
        # remote agent name -> generation loaded
        self._peers: dict[str, int] = {}
        self._reads: ReadWaiter | None = None  # once the agent exists
        self._closed = False

    @classmethod
    async def create(
        cls,
        name: str,
        *,
        row_bytes: int,
        store_rows: torch.Tensor,
        slab_bytes: int,
        engine_layers: Sequence[torch.Tensor] | None = None,
        engine_block_axis: int | None = None,
        words: torch.Tensor | None = None,
        reads_peer_words: bool = False,
    ) -> NixlAgentEndpoint:
        """A started endpoint: agent created, memory registered, UCX reported.

        Blocking NIXL work (agent creation, registration) runs in a thread."""
        self = cls(
            name,
            row_bytes=row_bytes,
            store_rows=store_rows,
            slab_bytes=slab_bytes,
            engine_layers=engine_layers,
            engine_block_axis=engine_block_axis,
            words=words,
            reads_peer_words=reads_peer_words,
        )
        await asyncio.to_thread(self._start)
        return self

    # ---- start --------------------------------------------------------------------

    def _start(self) -> None:
        import nixl._api as api  # type: ignore[import-not-found]

        vram = (
            WORDS_READER_UCX_SETTINGS if self._reads_peer_words else VRAM_UCX_SETTINGS
        )
        settings = vram if self.device.type == "cuda" else ()
        self.progress_delay_us = progress_thread_delay_us()
        with (
            ucx_settings(settings) as applied,
            _progress_thread_delay(api, self.progress_delay_us),
        ):
            # RW sync: posts may run in worker threads while the event loop polls.
            self._agent = api.nixl_agent(
                self.agent_name,
                api.nixl_agent_config(
                    enable_prog_thread=True,
                    enable_listen_thread=False,
                    backends=["UCX"],
                    sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
                ),
            )
            self.ucx_report = probe_ucx(self._agent, applied)
        self._reads = ReadWaiter(
            self._agent, self._nixl_errors, self._retire, self._free
        )
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend in this process")
        self.zero_copy_only = dict(self.ucx_report.env).get(
            "UCX_PROTO_EMULATION_ENABLE", "y"
        ).lower() in ("n", "no", "off", "0", "false")
        self._published = PublishedMemory(self._agent, self._register)
        try:
            self._published.publish(self._store_rows, self._words)
            self._slab_reg = self._register([self._slab_region])
            self._probe_reg = self._register([NixlRegion.of(self._probe)])
            self._words_scratch_reg = self._register(
                [NixlRegion.of(self._words_scratch)]
            )
            if self._engine_map is not None:
                self._register_engine(self._engine_map)
            self._info = self._make_info()
            self.row_lists = RowLists(
                self._agent, self.agent_name, self.row_bytes, self._nixl_errors
            )
            self.row_lists.new_slab(self._slab_region)
        except BaseException:
            self._deregister_all()
            raise
        self._log_start()

    def _register_engine(self, engine_map: EngineBlockMap) -> None:
        try:
            self._engine_regs = self._register(list(engine_map.regions))
        except self._nixl_errors as exc:
            # The engine cache here is a mapping of the worker's memory (CUDA IPC on
            # a GPU), which a backend may refuse to register. Loads still work,
            # through the slab; say so once.
            logger.warning(
                "NIXL endpoint %s could not register the engine KV cache (%r); "
                "engine placement is off, loads go through the receive slab",
                self.agent_name,
                exc,
            )
            self._engine_map = None
            self._engine_layers = []

    def _register(self, regions: Sequence[NixlRegion]) -> Any:
        (mem_type,) = {r.mem_type for r in regions}
        reg = self._agent.register_memory(
            [(r.address, r.nbytes, r.device_id, "") for r in regions],
            mem_type=mem_type,
        )
        self.registrations += 1
        return reg

    def _make_info(self) -> NixlEndpointInfo:
        published = self._published
        assert published is not None
        words = published.published_words
        report = self.ucx_report
        return NixlEndpointInfo(
            self.agent_name,
            self.generation,
            published.metadata,
            published.rows,
            self.row_bytes,
            host=socket.gethostname(),
            transports=report.transports if report is not None else (),
            words=words,
            words_metadata=published.words_metadata if words is not None else b"",
        )

    def _log_start(self) -> None:
        assert self.ucx_report is not None
        log_endpoint_start(
            self.agent_name,
            self.ucx_report,
            holds_vram=self.device.type == "cuda",
            memory=(
                f"on {self.device}: device tier {self._store_rows.numel()} bytes, "
                f"receive slab {self._slab.numel()} bytes, engine cache "
                f"{'' if self._engine_map is not None else 'not '}registered, "
                f"progress thread delay {self.progress_delay_us} us"
            ),
        )

    # ---- what peers see -------------------------------------------------------------

    @property
    def info(self) -> NixlEndpointInfo:
        self._check_open()
        assert self._info is not None
        return self._info

    def source(self, first_rows: Sequence[int]) -> NixlSource:
        """The ``NixlSource`` of leased snapshots at ``first_rows`` (this epoch)."""
        return NixlSource(self.agent_name, self.generation, tuple(first_rows))

    @property
    def probe(self) -> torch.Tensor:
        """The registered scratch row of the peer checks (nothing reads it)."""
        return self._probe

    @property
    def words_scratch(self) -> torch.Tensor:
        """The registered host scratch for peers' generation words (replaced
        when a READ into it missed its deadline: look it up for each READ)."""
        return self._words_scratch

    @property
    def store_rows(self) -> torch.Tensor:
        return self._store_rows

    @property
    def slab_region(self) -> NixlRegion:
        """The receive slab's region (looked up once per slab: a load's path)."""
        return self._slab_region

    @property
    def slab(self) -> torch.Tensor:
        return self._slab

    @property
    def engine_map(self) -> EngineBlockMap | None:
        return self._engine_map

    async def replace_store_rows(self, store_rows: torch.Tensor) -> None:
        """Register a new device tier in place of the old one (a new generation).

        The caller guarantees that no peer still reads the old rows (no leases).
        """
        self._check_open()
        if store_rows.dtype != torch.uint8 or store_rows.shape[1:] != (self.row_bytes,):
            raise ValueError(f"store rows must be (rows, {self.row_bytes}) uint8")
        if store_rows.device != self.device or not store_rows.is_contiguous():
            raise ValueError(f"store rows must be contiguous on {self.device}")

        def swap() -> None:
            assert self._published is not None
            self._store_rows = store_rows
            self._published.replace_rows(store_rows)
            self.generation += 1
            self._info = self._make_info()

        await asyncio.to_thread(swap)
        logger.info(
            "NIXL endpoint %s re-registered its device tier (generation %d)",
            self.agent_name,
            self.generation,
        )

    # ---- peers ----------------------------------------------------------------------

    async def add_peer(self, info: NixlEndpointInfo, *, check_timeout_s: float) -> None:
        """Load a peer's metadata (again only if its generation changed), connect,
        and READ one row from it (``peer_paths`` keeps the outcome).

        Raises ``NixlTransferError`` if the peer cannot be loaded or that READ
        fails (then the peer is forgotten), ``NixlTransferTimeout`` if the READ
        misses ``check_timeout_s``.
        """
        self._check_open()
        name = info.agent_name
        if self._peers.get(name) == info.generation and name in self.peer_paths:
            return
        if not info.metadata or info.store is None:
            raise NixlTransferError(
                f"peer {name} publishes no memory (it has no device tier)"
            )
        if self._peers.get(name) != info.generation:
            await self._load_peer(info)
        try:
            await self._check_path(info, check_timeout_s)
        except NixlTransferTimeout:
            raise  # the peer stays loaded: its pending READ must stay trackable
        except NixlTransferError:
            await self.forget_peer(name)
            raise

    async def _load_peer(self, info: NixlEndpointInfo) -> None:
        def load() -> None:
            name = load_published(self._agent, info.metadata, info.words_metadata)
            if name != info.agent_name:
                raise NixlTransferError(
                    f"peer metadata names agent {name!r}, expected {info.agent_name!r}"
                )
            # Connect now rather than on the first READ, whose deadline it would eat.
            self._agent.make_connection(info.agent_name)
            assert info.store is not None and self.row_lists is not None
            self.row_lists.peer_loaded(info.agent_name, info.store, info.row_bytes)

        try:
            await finish_even_if_cancelled(asyncio.to_thread(load))
        except self._nixl_errors as exc:
            raise NixlTransferError(
                f"could not load the NIXL metadata of peer {info.agent_name}: {exc!r}"
            ) from exc
        self._peers[info.agent_name] = info.generation
        self.peer_paths.pop(info.agent_name, None)

    async def _check_path(self, info: NixlEndpointInfo, timeout_s: float) -> None:
        """READ the peer's first row into the scratch row; log how it went."""
        assert info.store is not None
        probe = NixlRegion.of(self._probe)
        plan, nbytes = check_plan(probe, info.store)
        started = time.monotonic()
        try:
            await self.read(
                info.agent_name,
                plan,
                local_mem_type=probe.mem_type,
                remote_mem_type=info.store.mem_type,
                timeout_s=timeout_s,
                destination=DEST_PROBE,
            )
        except NixlTransferTimeout:
            raise
        except NixlTransferError as exc:
            raise check_failed(info, probe, exc, self.zero_copy_only) from exc
        same_host = not info.host or info.host == socket.gethostname()
        local = self.ucx_report.transports if self.ucx_report is not None else ()
        path = PeerPath(
            info.agent_name,
            probe.mem_type,
            info.store.mem_type,
            nbytes,
            time.monotonic() - started,
            self.zero_copy_only,
            peer_host=info.host,
            same_host=same_host,
            transports=pair_transports(local, info.transports, same_host),
        )
        self.peer_paths[info.agent_name] = path
        logger.info("NIXL endpoint %s: %s", self.agent_name, path.describe())

    async def forget_peer(self, agent_name: str) -> None:
        """Drop a peer's metadata (and its connection), unless a READ from it that
        missed its deadline is still pending: that one must stay trackable."""
        if agent_name not in self._peers or (
            self._reads is not None and self._reads.has_pending(agent_name)
        ):
            return
        del self._peers[agent_name]
        self.peer_paths.pop(agent_name, None)
        pending = self._reads is not None and self._reads.pending_count() > 0
        try:
            if self.row_lists is not None:
                await asyncio.to_thread(self.row_lists.forget_peer, agent_name, pending)
            await asyncio.to_thread(self._agent.remove_remote_agent, agent_name)
        except self._nixl_errors as exc:  # already gone, e.g. after a disconnect
            logger.info("NIXL peer %s was already removed: %r", agent_name, exc)

    # ---- READ -----------------------------------------------------------------------

    async def read(
        self,
        peer: str,
        plan: ReadPlan,
        *,
        local_mem_type: str,
        remote_mem_type: str,
        timeout_s: float,
        destination: str,
    ) -> None:
        """One NIXL READ of ``plan`` from ``peer`` into ``destination`` (``DEST_*``);
        returns once it is DONE (see ``reads.ReadWaiter.read``). A timed-out READ
        into the slab retires the slab: a fresh one is registered."""
        self._check_open()
        assert self._reads is not None
        await self._reads.read(
            peer,
            plan,
            local_mem_type=local_mem_type,
            remote_mem_type=remote_mem_type,
            timeout_s=timeout_s,
            destination=destination,
        )

    async def _retire(self, destination: str) -> Any:
        """A READ into ``destination`` missed its deadline: what it may still write."""
        if destination == DEST_WORDS:
            # a late write must not land in the words of a later read-back
            scratch = torch.zeros_like(self._words_scratch)
            reg = await asyncio.to_thread(self._register, [NixlRegion.of(scratch)])
            hold = (self._words_scratch, self._words_scratch_reg, None)
            self._words_scratch, self._words_scratch_reg = scratch, reg
            return hold
        if destination != DEST_SLAB:
            return None
        slab = torch.zeros_like(self._slab)
        region = NixlRegion.of(slab)
        reg = await asyncio.to_thread(self._register, [region])
        assert self.row_lists is not None
        old_list = await asyncio.to_thread(self.row_lists.new_slab, region)
        hold = (self._slab, self._slab_reg, old_list)
        self._slab, self._slab_reg, self._slab_region = slab, reg, region
        return hold

    async def _free(self, hold: Any) -> None:
        """The READ into a retired slab or words scratch ended: nothing can write
        it any more."""

        def free() -> None:
            if self.row_lists is not None and hold[2] is not None:
                self.row_lists.release([hold[2]])
            self._agent.deregister_memory(hold[1])

        await asyncio.to_thread(free)

    async def pending_reads(self) -> int:
        """READs that missed their deadline and have not ended (after reaping)."""
        if self._reads is None:
            return 0
        await self._reads.reap()
        return self._reads.pending_count()

    # ---- shutdown -------------------------------------------------------------------

    async def close(self, orphan_timeout_s: float = 0.0) -> None:
        """Wait up to ``orphan_timeout_s`` for READs that missed their deadline, then
        drop peers and deregister everything (idempotent). Memory that a READ which
        never ended may still write is quarantined for the life of the process."""
        if self._closed:
            return
        self._closed = True
        reads = self._reads
        if reads is not None:
            deadline = time.monotonic() + orphan_timeout_s
            await reads.reap()
            while reads.pending_count() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
                await reads.reap()
        for peer in list(self._peers):
            await self.forget_peer(peer)
        if reads is not None and reads.pending_count():
            _QUARANTINE.append(
                (
                    self._agent,
                    reads.holds(),
                    self._engine_layers,
                    self._slab,
                    self._probe,
                    self._words_scratch,
                )
            )
            logger.error(
                "NIXL endpoint %s closes with %d READs that never ended; their "
                "memory and the agent stay allocated for the life of this process",
                self.agent_name,
                reads.pending_count(),
            )
            return
        await asyncio.to_thread(self._deregister_all)
        self._agent = None
        logger.info(
            "NIXL endpoint %s closed (%d registrations)",
            self.agent_name,
            self.registrations,
        )

    def _deregister_all(self) -> None:
        if self.row_lists is not None and self._agent is not None:
            self.row_lists.release_all()
        if self._published is not None and self._agent is not None:
            self._published.withdraw()
        for attr in ("_engine_regs", "_words_scratch_reg", "_probe_reg", "_slab_reg"):
            reg = getattr(self, attr)
            if reg is not None and self._agent is not None:
                self._agent.deregister_memory(reg)
            setattr(self, attr, None)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NIXL endpoint {self.agent_name} is closed")
        if self._agent is None:
            raise RuntimeError(
                f"NIXL endpoint {self.agent_name} has not started (use create())"
            )
