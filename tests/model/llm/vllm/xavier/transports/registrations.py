"""Counting this process's NIXL memory registrations, for benchmarks and tests.

xoscar registers memory inside its NIXL channel and reports nothing, so whether a
copy re-registered can only be seen at NIXL itself. ``install_registration_counter``
wraps ``nixl_agent.register_memory`` with a counter that calls the real method:
nothing in the transfer changes. Install it inside each process whose registrations
matter (an actor's sub-pool), once; installing again is a no-op.
"""

from __future__ import annotations

from typing import Any

_calls = [0]  # register_memory calls in this process since installation


def install_registration_counter() -> None:
    from nixl._api import nixl_agent

    if getattr(nixl_agent.register_memory, "_counted", False):
        return
    real = nixl_agent.register_memory

    def counted(agent: Any, *args: Any, **kwargs: Any) -> Any:
        _calls[0] += 1
        return real(agent, *args, **kwargs)

    counted._counted = True  # type: ignore[attr-defined]
    nixl_agent.register_memory = counted


def registration_calls() -> int:
    """NIXL ``register_memory`` calls in this process since the counter was installed."""
    return _calls[0]
