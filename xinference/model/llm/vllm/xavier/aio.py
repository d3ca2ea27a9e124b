"""Small asyncio idioms shared by Xavier's modules: deadlines on peer calls, work
that must not be abandoned, a loop thread for synchronous vLLM code, and actor refs
made once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

import xoscar as xo

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


class BackgroundLoop:
    """An asyncio loop in a daemon thread, for xoscar calls from synchronous vLLM code.

    vLLM calls the connector from plain threads; xoscar's client API is async. Every
    call through ``run`` carries a deadline, enforced inside the loop, so a dead peer
    costs at most that long.
    """

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=name, daemon=True
        )
        self._thread.start()
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop and return at once."""
        if self._closed:
            coro.close()
            raise RuntimeError("the Xavier background loop is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, awaitable: Awaitable[T], timeout: float) -> T:
        """Run ``awaitable`` on the loop and wait for it, at most ``timeout`` seconds.

        Raises ``TimeoutError`` (and cancels the work) past the deadline.
        """
        future = self.submit(with_deadline(awaitable, timeout))
        # The deadline is enforced in the loop; the extra second only guards
        # against a loop that is itself stuck.
        return future.result(timeout + 1.0)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what still runs on the loop (client connections...), then stop it."""
        if self._closed:
            return
        self._closed = True

        async def cancel_the_rest() -> None:
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)

        try:
            asyncio.run_coroutine_threadsafe(cancel_the_rest(), self._loop).result(
                timeout + 1.0
            )
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # stopping the loop below is all that is left to do
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()


async def with_deadline(awaitable: Awaitable[T], timeout: float) -> T:
    # xo.wait_for, not asyncio.wait_for: it gives up on time even when cancelling
    # an actor call cannot reach a peer that stopped answering.
    result: T = await xo.wait_for(awaitable, timeout)
    return result


class ActorRefs:
    """xoscar actor refs by (address, uid), made once and reused: making one costs
    a round trip to the actor's pool. Use it from one event loop."""

    def __init__(self) -> None:
        self._refs: dict[tuple[str, str], Any] = {}

    async def get(self, address: str, uid: str) -> Any:
        ref = self._refs.get((address, uid))
        if ref is None:
            ref = await xo.actor_ref(address, uid)
            self._refs[(address, uid)] = ref
        return ref


class Tracked:
    """``async with``: the current task is in ``tasks`` for the block's duration."""

    def __init__(self, tasks: set[asyncio.Task[Any]]) -> None:
        self._tasks = tasks
        self._task: asyncio.Task[Any] | None = None

    async def __aenter__(self) -> None:
        self._task = asyncio.current_task()
        if self._task is not None:
            self._tasks.add(self._task)

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._tasks.discard(self._task)
