"""Small asyncio idioms shared by the modules that move memory."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def finish_even_if_cancelled(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even if we are cancelled meanwhile, then re-raise
    the cancellation.

    For work that writes memory someone else reuses once we return (a thread copying
    into store slots, a transfer or a NIXL READ into engine blocks or a slab):
    abandoning it would let a late write land in memory that changed owner.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError()
    return result
