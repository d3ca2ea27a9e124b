"""What a holder's NIXL agent lets peers READ: its device tier rows and their
generation words.

Each is registered on its own, with its own partial agent metadata: NIXL registers
one memory type per call, and the words (``store/generations.py``) stay in host
memory while the rows may be on a GPU. The rows' metadata carries the connection
info, the words' does not; a peer loads the rows' first, then the words' (NIXL
merges a second partial metadata of a known agent into what it has), and loads both
again whenever the rows are registered anew. The same two registrations are made
whether the rows are in host or device memory: one path to test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .wire import NixlRegion

# register(regions) -> NIXL registration (the endpoint counts them)
Register = Callable[[Sequence[NixlRegion]], Any]


class PublishedMemory:
    """The device tier rows and generation words one agent publishes, with their
    registrations and partial metadata. Not thread-safe: the endpoint calls it
    from one thread at a time (registration is blocking)."""

    def __init__(self, agent: Any, register: Register) -> None:
        self._agent = agent
        self._register = register
        self._rows_reg: Any = None
        self._words_reg: Any = None
        self.rows: NixlRegion | None = None  # None: no device tier
        self.metadata = b""  # the rows', with connection info
        self.words: NixlRegion | None = None  # None: no generation words
        self.words_metadata = b""

    def publish(self, rows: torch.Tensor, words: torch.Tensor | None) -> None:
        """Register ``rows`` and, alongside a device tier only, ``words``. A
        failure leaves what was registered for ``withdraw``."""
        self.replace_rows(rows)
        if self.rows is None or words is None or not words.numel():
            return
        self._words_reg = self._register([NixlRegion.of(words)])
        self.words_metadata = self._metadata(self._words_reg, with_connection=False)
        self.words = NixlRegion.of(words)

    def replace_rows(self, rows: torch.Tensor) -> None:
        """Register ``rows`` in place of the rows registered before (the words
        keep their registration: the slots they describe stay)."""
        if self._rows_reg is not None:
            self._agent.deregister_memory(self._rows_reg)
            self._rows_reg, self.rows, self.metadata = None, None, b""
        if not rows.numel():
            return
        self._rows_reg = self._register([NixlRegion.of(rows)])
        self.metadata = self._metadata(self._rows_reg, with_connection=True)
        self.rows = NixlRegion.of(rows)

    def _metadata(self, reg: Any, *, with_connection: bool) -> bytes:
        """Partial metadata of one registration (the rows' carry the connection
        info; the words' are loaded after them, on a connection made)."""
        return bytes(
            self._agent.get_partial_agent_metadata(reg, inc_conn_info=with_connection)
        )

    @property
    def published_words(self) -> NixlRegion | None:
        """The words peers may READ: only with a device tier to read them for."""
        return self.words if self.rows is not None else None

    def withdraw(self) -> None:
        """Deregister both (idempotent)."""
        for attr in ("_words_reg", "_rows_reg"):
            reg = getattr(self, attr)
            setattr(self, attr, None)
            if reg is not None:
                self._agent.deregister_memory(reg)
        self.rows = self.words = None
        self.metadata = self.words_metadata = b""


def load_published(agent: Any, metadata: bytes, words_metadata: bytes) -> str:
    """Load a peer's published memory (rows, then words); returns the agent
    name its metadata gives."""
    name = agent.add_remote_agent(metadata)
    if words_metadata:
        agent.add_remote_agent(words_metadata)
    return name.decode() if isinstance(name, bytes) else name
