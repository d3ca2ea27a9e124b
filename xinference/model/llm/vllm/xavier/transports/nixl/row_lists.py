"""Descriptor lists of whole rows that NIXL prepares once, per endpoint.

One for the endpoint's receive slab and one for each peer's device tier. With them
a READ into the slab is a list of row indices (``plan.plan_slab_rows``,
``make_prepped_xfer``) and no descriptor list is built on a load's path. They are
used only with ``RowLists.enabled``: on a CPU they save about 2 us of NIXL's time
per READ and cost as much in building the indices
(``benchmark/transport_benchmark.py``, ``nixl-read`` against ``nixl-read-rows``);
on a GPU they are not measured yet. Where NIXL refuses to prepare one, READs carry
their descriptors.

Calls NIXL synchronously: the endpoint runs them in a thread where they may be long.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .plan import row_descriptors
from .wire import NixlRegion

logger = logging.getLogger(__name__)


class RowLists:
    """The prepared row lists of one NIXL agent (not thread-safe)."""

    def __init__(
        self,
        agent: Any,
        owner: str,
        row_bytes: int,
        nixl_errors: tuple[type[BaseException], ...],
    ) -> None:
        self.enabled = False  # READs into the slab use the lists (see above)
        self._agent = agent
        self._owner = owner  # the endpoint's agent name, for the logs
        self._row_bytes = row_bytes
        self._nixl_errors = nixl_errors
        self._slab: Any = None
        self._peers: dict[str, Any] = {}  # remote agent name -> its rows' list
        self._stale: list[Any] = []  # replaced lists a pending READ may still use

    def for_reads_from(self, peer: str) -> tuple[Any, Any] | None:
        """(the receive slab's, ``peer``'s device tier's) lists, when enabled and
        both exist."""
        peer_list = self._peers.get(peer)
        if not self.enabled or peer_list is None or self._slab is None:
            return None
        return self._slab, peer_list

    @property
    def peers(self) -> tuple[str, ...]:
        """The peers that have a list."""
        return tuple(name for name, rows in self._peers.items() if rows)

    def new_slab(self, region: NixlRegion) -> Any:
        """Prepare the list of a (new) receive slab; returns the old slab's list,
        which a READ that missed its deadline may still use (``release`` it once
        that READ ended)."""
        old, self._slab = self._slab, self._prepare("", region)
        return old

    def peer_loaded(self, peer: str, store: NixlRegion, row_bytes: int) -> None:
        """A peer's metadata was loaded (again): prepare its device tier's list. The
        list of its earlier generation is kept until no READ may use it."""
        old = self._peers.pop(peer, None)
        if old is not None:
            self._stale.append(old)
        if row_bytes == self._row_bytes:
            self._peers[peer] = self._prepare(peer, store)

    def forget_peer(self, peer: str, reads_pending: bool) -> None:
        """Release ``peer``'s list, and the stale ones unless a READ that missed
        its deadline is still pending."""
        handles = [self._peers.pop(peer, None)]
        if not reads_pending:
            handles, self._stale = handles + self._stale, []
        self.release(handles)

    def release_all(self) -> None:
        self.release([self._slab, *self._peers.values(), *self._stale])
        self._slab, self._peers, self._stale = None, {}, []

    def release(self, handles: Sequence[Any]) -> None:
        for handle in handles:
            if handle is not None:
                self._agent.release_dlist_handle(handle)

    def _prepare(self, agent_name: str, region: NixlRegion) -> Any:
        """The list of ``region``'s rows (``agent_name`` "": this agent's memory), or
        None where NIXL refuses (logged)."""
        try:
            return self._agent.prep_xfer_dlist(
                agent_name, row_descriptors(region, self._row_bytes), region.mem_type
            )
        except self._nixl_errors as exc:
            logger.warning(
                "NIXL endpoint %s could not prepare the row list of %s (%r); its "
                "READs carry their descriptors",
                self._owner,
                agent_name or "its receive slab",
                exc,
            )
            return None
