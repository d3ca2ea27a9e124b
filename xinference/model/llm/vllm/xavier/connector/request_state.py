"""What the scheduler half knows about one request, from vLLM's first question
about it to ``request_finished``.

``scheduler.py`` decides; this module only holds the answers: the request's tokens
and block keys, its reservation (standing or unanswered), the load planned for it
and where that load writes, how far its blocks were staged, and the counts a
benchmark reads from the request's output. Kept apart so the scheduler's flow
(lookup, allocation, step, failure) reads without the field list in the way, and
so the output a request reports is defined next to the fields it is made of.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..hashing import BlockHash, hash_full_blocks
from ..wire import StageItem
from .reservations import PendingReservation, Reservation


@dataclass(slots=True)
class RequestState:
    # The request's tokens, prompt first: a read-only view that vLLM extends with
    # each generated token (or a copy of the prompt when none was handed over).
    tokens: Sequence[int]
    num_prompt_tokens: int
    # Chain hashes of the full blocks of ``tokens`` hashed so far (the prompt's
    # from the start, generated blocks as they fill): keys[i] names exactly the
    # tokens of block i and everything before it.
    keys: list[BlockHash]
    staged_upto: int = 0  # blocks [0, staged_upto) need no staging here
    # full blocks of generated tokens waiting for a batched staging (scheduler.py:
    # GENERATED_BATCH_PASSES), with the engine blocks that hold them now
    held_back: list[StageItem] = field(default_factory=list)
    reservation: Reservation | None = None
    # asked of a holder, not answered yet (vLLM was told to ask again)
    pending: PendingReservation | None = None
    holder_rank: int | None = None
    loaded_into: tuple[int, ...] = ()  # the engine blocks its load writes
    # The worker reported its load ended (and its failed blocks, if any, came
    # with the report): the blocks computed on top of the loaded ones are right.
    load_ended: bool = False
    # The load planned for the request, started or not: its first block position
    # and the engine blocks from there (None: no destination). A failed one is
    # recomputed by vLLM from its first failed block, which is staged again.
    load_first: int = 0
    load_blocks: tuple[int | None, ...] = ()
    # group 0's block table, position -> block id, rebuilt from each step's
    # scheduler output; None until vLLM has sent the whole table once
    block_ids: list[int] | None = None
    # A load was planned (or failed to be): the request never gets a second one,
    # so a load that keeps failing cannot make vLLM retry it forever.
    load_attempted: bool = False
    # Counted for benchmarks (reported with the request's output): the engine
    # pass in which vLLM first asked about the request, the passes from there
    # until its first forward, and the round trips to actors on that path.
    asked_at_pass: int = 0
    passes_waited: int | None = None
    passes_deferred: int = 0  # of those, answered "ask again" (holder slow)
    round_trips: int = 0
    load_s: float | None = None  # its load's own time, as the worker measured it
    # How vLLM was told the request's hit loads: asynchronously, or synchronously
    # within ``answered_bound_s`` (None: the whole load deadline)
    answered_async: bool = False
    answered_bound_s: float | None = None
    load_holder_address: str | None = None
    # its lease-free load found stale locations: not its holder's fault
    load_stale: bool = False
    # vLLM's per-request cache salt (None: unsalted): the root of ``keys``, and
    # of the generated blocks' keys when the prompt has no full block
    cache_salt: str | None = None

    @classmethod
    def first_asked(
        cls,
        req_id: str,
        prompt_token_ids: Sequence[int],
        all_token_ids: Sequence[int] | None,
        block_size: int,
        namespace: str,
        asked_at_pass: int,
        cache_salt: str | None = None,
    ) -> RequestState:
        """The state of a request vLLM asks about for the first time: its
        prompt's full blocks hashed once (under its cache salt, as vLLM hashes
        them), its live token sequence kept as a view."""
        prompt = list(prompt_token_ids)
        if all_token_ids is not None and list(all_token_ids[: len(prompt)]) != prompt:
            raise ValueError(
                f"request {req_id}: its token sequence does not start with its prompt"
            )
        keys = hash_full_blocks(prompt, block_size, namespace, cache_salt)
        tokens = prompt if all_token_ids is None else all_token_ids
        return cls(
            tokens,
            len(prompt),
            keys,
            asked_at_pass=asked_at_pass,
            cache_salt=cache_salt or None,
        )

    def first_failed(self, block_ids: set[int]) -> int | None:
        """The position of the first block of the planned load that is among
        ``block_ids`` (None: the load wrote none of them)."""
        return next(
            (
                self.load_first + offset
                for offset, block in enumerate(self.load_blocks)
                if block in block_ids
            ),
            None,
        )

    def output(self, block_size: int) -> dict[str, Any]:
        """What the request reports with its output about its load."""
        return {
            "xavier_external_tokens": len(self.loaded_into) * block_size,
            "xavier_holder_rank": self.holder_rank,
            # counted, for benchmarks: passes from vLLM's first question to the
            # request's first forward, and actor round trips on that path
            "xavier_passes_waited": self.passes_waited,
            "xavier_passes_deferred": self.passes_deferred,
            "xavier_round_trips": self.round_trips,
            # from start_load_kv taking the load up to its blocks landed (None:
            # not reported, e.g. an older worker)
            "xavier_load_ms": None if self.load_s is None else self.load_s * 1e3,
        }
