"""The seed's import path for the slab choice policy.

``SlabSelector`` lives in ``transports/xoscar/slab_selector.py``; this module keeps
``xavier.slab_selector.SlabSelector`` importable where the seed has it.
"""

from .transports.xoscar.slab_selector import (
    DEFAULT_SMALL_BYTES,
    DEFAULT_STREAK,
    SlabPolicy,
    SlabSelector,
)

__all__ = ["DEFAULT_SMALL_BYTES", "DEFAULT_STREAK", "SlabPolicy", "SlabSelector"]
