"""What a holder's NIXL endpoint publishes for lease-free reads (``published.py``)
and how a loader READs the generation words back (``generation_words.py``).

Two real agents in this process: a holder with a device tier and its words, and a
loader with no tier. The words are registered on their own whatever the rows'
memory type, so the CPU tests below run the same registrations a holder with its
tier on a GPU makes; the ``cuda`` test puts the rows there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from xinference.model.llm.vllm.xavier.store.generations import SlotGenerations
from xinference.model.llm.vllm.xavier.transports.nixl.endpoint import NixlAgentEndpoint
from xinference.model.llm.vllm.xavier.transports.nixl.generation_words import (
    read_words,
)
from xinference.model.llm.vllm.xavier.transports.nixl.wire import (
    NixlRegion,
    NixlTransferTimeout,
)

from ..._support import CUDA_SKIP

pytestmark = pytest.mark.nixl
api = pytest.importorskip("nixl._api", reason="NIXL is not installed")

ROW_BYTES = 256
SLOTS = 4
LAYERS = 2


class Registrations:
    """Every registration NIXL agents make and drop while a test runs."""

    def __init__(self) -> None:
        self.made: list[tuple[Any, list[tuple[int, int]], str]] = []
        self.dropped: list[Any] = []

    def of(self, tensor: torch.Tensor) -> list[Any]:
        region = NixlRegion.of(tensor)
        return [
            reg
            for reg, ranges, _ in self.made
            if ranges == [(region.address, region.nbytes)]
        ]

    def live(self) -> list[Any]:
        return [
            reg
            for reg, _, _ in self.made
            if not any(reg is gone for gone in self.dropped)
        ]


@pytest.fixture
def registrations(monkeypatch: pytest.MonkeyPatch) -> Registrations:
    seen = Registrations()
    register = api.nixl_agent.register_memory
    deregister = api.nixl_agent.deregister_memory

    def tracked_register(agent: Any, descs: Any, mem_type: Any = None, **kw: Any):
        reg = register(agent, descs, mem_type=mem_type, **kw)
        seen.made.append((reg, [(d[0], d[1]) for d in descs], mem_type))
        return reg

    def tracked_deregister(agent: Any, reg: Any, *args: Any, **kw: Any) -> None:
        deregister(agent, reg, *args, **kw)
        seen.dropped.append(reg)

    monkeypatch.setattr(api.nixl_agent, "register_memory", tracked_register)
    monkeypatch.setattr(api.nixl_agent, "deregister_memory", tracked_deregister)
    return seen


async def make_holder(
    generations: SlotGenerations, device: str = "cpu"
) -> tuple[NixlAgentEndpoint, torch.Tensor]:
    rows = torch.arange(SLOTS * LAYERS * ROW_BYTES, dtype=torch.int64)
    rows = (rows % 251).to(torch.uint8).view(SLOTS * LAYERS, ROW_BYTES).to(device)
    holder = await NixlAgentEndpoint.create(
        "holder",
        row_bytes=ROW_BYTES,
        store_rows=rows,
        slab_bytes=ROW_BYTES,
        words=generations.words,
    )
    return holder, rows


async def make_loader() -> NixlAgentEndpoint:
    return await NixlAgentEndpoint.create(
        "loader",
        row_bytes=ROW_BYTES,
        store_rows=torch.empty((0, ROW_BYTES), dtype=torch.uint8),
        slab_bytes=ROW_BYTES,
    )


@pytest.fixture
async def pair() -> AsyncIterator[tuple[NixlAgentEndpoint, NixlAgentEndpoint, Any]]:
    generations = SlotGenerations(SLOTS)
    holder, _ = await make_holder(generations)
    loader = await make_loader()
    try:
        await loader.add_peer(holder.info, check_timeout_s=10.0)
        yield holder, loader, generations
    finally:
        await loader.close()
        await holder.close()


async def test_the_words_have_a_registration_and_metadata_of_their_own(
    registrations: Registrations,
) -> None:
    generations = SlotGenerations(SLOTS)
    holder, rows = await make_holder(generations)
    try:
        info = holder.info
        assert info.words == NixlRegion.of(generations.words)
        assert info.words_metadata and info.words_metadata != info.metadata
        (words_reg,) = registrations.of(generations.words)
        (rows_reg,) = registrations.of(rows)
        assert words_reg is not rows_reg
    finally:
        await holder.close()


async def test_a_holder_without_a_device_tier_publishes_no_words() -> None:
    generations = SlotGenerations(SLOTS)
    holder = await NixlAgentEndpoint.create(
        "tierless",
        row_bytes=ROW_BYTES,
        store_rows=torch.empty((0, ROW_BYTES), dtype=torch.uint8),
        slab_bytes=ROW_BYTES,
        words=generations.words,
    )
    try:
        assert holder.info.words is None and holder.info.words_metadata == b""
    finally:
        await holder.close()


async def test_a_loader_reads_the_words_as_they_are_now(pair) -> None:
    holder, loader, generations = pair
    before = generations.read([3, 0, 2])
    assert await read_words(loader, holder.info, [3, 0, 2], 5.0) == before
    generations.begin_rewrite(0)
    after = await read_words(loader, holder.info, [3, 0, 2], 5.0)
    assert after == [before[0], before[1] + 1, before[2]]


async def test_more_words_than_the_scratch_holds_are_read_in_parts(pair) -> None:
    holder, loader, generations = pair
    per_read = loader.words_scratch.numel() // 8
    slots = [i % SLOTS for i in range(per_read * 2 + 3)]
    for slot in range(SLOTS):  # a different word in each slot
        for _ in range(slot):
            generations.begin_rewrite(slot)
    assert len(set(generations.read(range(SLOTS)))) == SLOTS
    words = await read_words(loader, holder.info, slots, 5.0)
    assert words == generations.read(slots)


async def test_the_words_stay_readable_after_the_rows_are_registered_anew(
    pair, registrations: Registrations
) -> None:
    """A new device tier is a new registration and new rows metadata; the words'
    registration is kept (over shared memory a READ of memory no longer
    registered may still work, hence the registrations' check) and a peer loads
    both again."""
    holder, loader, generations = pair
    rows = torch.full((SLOTS * LAYERS, ROW_BYTES), 9, dtype=torch.uint8)
    await holder.replace_store_rows(rows)
    assert registrations.of(rows) and len(registrations.dropped) == 1
    await loader.add_peer(holder.info, check_timeout_s=10.0)
    assert loader.peer_paths[holder.agent_name].nbytes > 0
    assert await read_words(loader, holder.info, [1, 2], 5.0) == generations.read(
        [1, 2]
    )


class StallingAgent:
    """The loader's agent as its READs see it: while ``stalled``, every READ
    stays in flight (whatever NIXL did with it)."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.stalled = False

    def transfer(self, handle: Any) -> str:
        state = self._agent.transfer(handle)
        return "PROC" if self.stalled else state

    def check_xfer_state(self, handle: Any) -> str:
        state = self._agent.check_xfer_state(handle)
        return "PROC" if self.stalled else state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


async def test_a_words_read_past_its_deadline_retires_the_scratch(
    pair, registrations: Registrations
) -> None:
    """The late READ may still write the old scratch: a later read-back goes into
    a fresh one, and the old one is deregistered only once that READ ended."""
    holder, loader, generations = pair
    stalling = StallingAgent(loader._reads._agent)  # type: ignore[union-attr]
    loader._reads._agent = stalling  # type: ignore[union-attr]
    old, old_reg = loader.words_scratch, loader._words_scratch_reg
    stalling.stalled = True
    with pytest.raises(NixlTransferTimeout):
        await read_words(loader, holder.info, [1], 0.05)
    assert loader.words_scratch is not old
    assert await loader.pending_reads() == 1
    assert not any(reg is old_reg for reg in registrations.dropped)
    stalling.stalled = False
    assert await loader.pending_reads() == 0
    assert any(reg is old_reg for reg in registrations.dropped)
    (fresh,) = registrations.of(loader.words_scratch)
    assert any(reg is fresh for reg in registrations.live())
    assert await read_words(loader, holder.info, [1], 5.0) == generations.read([1])


async def test_close_deregisters_the_words_with_everything_else(
    registrations: Registrations,
) -> None:
    generations = SlotGenerations(SLOTS)
    holder, _ = await make_holder(generations)
    assert registrations.of(generations.words)
    assert registrations.live()
    await holder.close()
    assert registrations.live() == []


def fail_at(
    monkeypatch: pytest.MonkeyPatch, what: str, when: Callable[[Any], bool]
) -> None:
    real = getattr(api.nixl_agent, what)

    def failing(agent: Any, first: Any, *args: Any, **kw: Any) -> Any:
        if when(first):
            raise RuntimeError(f"{what} refused (test)")
        return real(agent, first, *args, **kw)

    monkeypatch.setattr(api.nixl_agent, what, failing)


@pytest.mark.parametrize("step", ["words metadata", "after the words"])
async def test_a_failed_start_deregisters_the_words(
    registrations: Registrations, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """Registration fails after the words were registered (their metadata, or a
    later region): the start fails and nothing stays registered."""
    generations = SlotGenerations(SLOTS)
    if step == "words metadata":
        fail_at(
            monkeypatch,
            "get_partial_agent_metadata",
            lambda reg: any(reg is w for w in registrations.of(generations.words)),
        )
    else:  # the first registration once the words' is made (the receive slab)
        fail_at(
            monkeypatch,
            "register_memory",
            lambda descs: bool(registrations.of(generations.words)),
        )
    with pytest.raises(RuntimeError, match="refused"):
        await make_holder(generations)
    assert registrations.of(generations.words), "the words were never registered"
    assert registrations.live() == []


@pytest.mark.cuda
@CUDA_SKIP
async def test_a_holder_with_its_rows_on_a_gpu_serves_its_words() -> None:
    """The rows are VRAM, the words host memory: both are published, a loader
    READs a row and the words, and sees a rewrite's word."""
    generations = SlotGenerations(SLOTS)
    holder, _ = await make_holder(generations, "cuda")
    loader = await make_loader()
    try:
        info = holder.info
        assert info.store is not None and info.store.mem_type == "VRAM"
        assert info.words is not None and info.words.mem_type == "DRAM"
        await loader.add_peer(info, check_timeout_s=30.0)
        before = generations.read([2, 1])
        assert await read_words(loader, info, [2, 1], 5.0) == before
        generations.begin_rewrite(1)
        assert await read_words(loader, info, [2, 1], 5.0) == [before[0], before[1] + 1]
    finally:
        await loader.close()
        await holder.close()
