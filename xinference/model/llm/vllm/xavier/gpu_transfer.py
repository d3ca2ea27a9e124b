"""The seed's import path for the xoscar GPU transfer runtime.

``GPUTransfer`` lives in ``transports/xoscar/gpu_transfer.py``; this module keeps
``xavier.gpu_transfer.GPUTransfer`` importable where the seed has it.
"""

from .transports.xoscar.gpu_transfer import (
    FULL_SLAB_BLOCKS,
    MAX_FULL_SLAB_BYTES,
    SMALL_VIEW_BYTES,
    GPUTransfer,
    GPUTransferCounters,
    full_slab_bytes,
    small_view_bytes,
)

__all__ = [
    "FULL_SLAB_BLOCKS",
    "MAX_FULL_SLAB_BYTES",
    "SMALL_VIEW_BYTES",
    "GPUTransfer",
    "GPUTransferCounters",
    "full_slab_bytes",
    "small_view_bytes",
]
