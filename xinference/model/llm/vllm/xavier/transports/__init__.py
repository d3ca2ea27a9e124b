"""Device-tier transports, by the name ``XavierConfig.transport`` gives.

``base.py`` is the seam every transport implements; ``xoscar/`` is the seed's path
(persistent slabs, ``xo.copy_to``); ``nixl/`` READs rows straight from the holder's
registered device tier with an agent of its own; ``cpu_tier.py`` reads CPU-tier
snapshots in batched actor replies (any transport).
"""

from __future__ import annotations

import importlib

from ..config import TRANSPORTS
from .base import DeviceTierTransport, TransportContext

# transport name -> module with ``async def create(context) -> DeviceTierTransport``
# (imported on use: the NIXL agent pulls in NIXL and UCX)
_MODULES = {
    "xoscar": "xinference.model.llm.vllm.xavier.transports.xoscar.transport",
    "nixl": "xinference.model.llm.vllm.xavier.transports.nixl.transport",
}
assert set(_MODULES) == set(TRANSPORTS), "every configurable transport is registered"


async def create_device_tier_transport(
    name: str, context: TransportContext
) -> DeviceTierTransport:
    """The transport named ``name``, started for ``context``."""
    module = _MODULES.get(name)
    if module is None:
        raise ValueError(
            f"unknown device-tier transport {name!r}; choose one of {sorted(_MODULES)}"
        )
    transport: DeviceTierTransport = await importlib.import_module(module).create(
        context
    )
    return transport
