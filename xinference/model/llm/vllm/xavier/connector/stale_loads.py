"""Lease-free loads that found their locations stale: which blocks fail, and what
the scheduler half forgets.

A lease-free load (``direct_reads.py``) READs the rows its mirror located, then
each slot's generation word (``store/generations.py``). A word that is not the
published generation means that slot was reused after its location was
published: the index was stale, the holder did nothing wrong. So

- that block and every block after it fail (vLLM recomputes a request from its
  first failed block on, whatever it is told about the later ones); the blocks
  before it stay loaded: each one's own word was read after its rows landed and
  matched, which is exactly what makes a lease-free block valid;
- its holder is not backed off (``SyncLoadPolicy.missed``): a timeout or a
  transport error is a holder fault and is, a stale location is not;
- the scheduler half drops the stale locations from its mirror
  (``TrackerMirror.forget_locations``), so the next hit on those keys reserves
  instead of failing the same way, until the holder publishes them anew.

The worker hands the report to the scheduler half with the step's worker
metadata, beside the failed block ids, so both arrive in the same
``update_connector_output``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..change_log import Location
from ..wire import LeaseGrant


@dataclass(frozen=True, slots=True)
class StaleLoad:
    """A lease-free load some of whose generation words had changed."""

    first: int  # position in the load of its first stale block
    holder_rank: int
    # (key, row, generation) as the load had them, of every stale block
    stale: tuple[Location, ...]
    num_blocks: int  # the whole load's

    @classmethod
    def of(cls, grant: LeaseGrant, positions: Sequence[int]) -> StaleLoad:
        """The report for ``grant``'s blocks at ``positions`` (non-empty), whose
        words were not the generations it carries."""
        if not positions:
            raise ValueError("a stale load has at least one stale block")
        assert grant.transport_hint is not None and grant.generations is not None
        rows = grant.transport_hint.per_key
        stale = tuple(
            (grant.keys[i], rows[i], grant.generations[i]) for i in sorted(positions)
        )
        return cls(min(positions), grant.holder_rank, stale, len(grant.keys))

    def failed_blocks(self, dst_block_ids: Sequence[int]) -> tuple[int, ...]:
        """The destination blocks to report failed: from the first stale on."""
        return tuple(dst_block_ids[self.first :])

    def describe(self) -> str:
        return (
            f"{len(self.stale)} of {self.num_blocks} snapshots changed on the holder "
            f"since their locations were published (blocks {self.first} on are "
            "recomputed)"
        )


def merge_stale_loads(
    mine: Mapping[str, StaleLoad], theirs: Mapping[str, StaleLoad]
) -> dict[str, StaleLoad]:
    """Two engine ranks' reports: per request, the one failing from the earlier
    block (vLLM recomputes from the first block any rank failed), with every
    stale location of both."""
    merged = dict(mine)
    for req_id, report in theirs.items():
        other = merged.get(req_id)
        if other is not None:
            first = min(other.first, report.first)
            stale = tuple(dict.fromkeys(other.stale + report.stale))
            report = StaleLoad(first, report.holder_rank, stale, report.num_blocks)
        merged[req_id] = report
    return merged
