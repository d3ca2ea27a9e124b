"""Reading CPU-tier snapshots from a holder: one RPC per batch, rows in the reply.

The holder gathers the rows of a batch of leased CPU-tier snapshots into one
contiguous buffer (``gather_cpu_rows``) and returns it as the reply of the loader's
actor call; the loader checks what arrived and scatters it (``load_cpu_rows``).

Why an RPC reply and not a NIXL DRAM write into a registered CPU slab (the way the
device tier moves rows)? Measured with ``benchmark/cpu_tier_read.py``: two ``nixl://``
sub-pools, a CPU tier of Qwen2.5-0.5B snapshots (24 layers x 8 KiB = 192 KiB a block),
rows scattered over the tier, each read ending with the rows in the loader's
destination, contents verified; median ms of 100 reads after 20 warm-up, two trials
(forward, reverse order), on the GPU machine's host CPU (16 cores, otherwise idle)::

    blocks   bytes     RPC reply    NIXL, exact-size view   NIXL, 12 MiB slab
         1   192 KiB   1.30 / 0.97  2.21 / 2.19             6.20 / 6.47
        16     3 MiB   28.2 / 22.6  25.6 / 25.9             28.6 / 29.0
        64    12 MiB   42.3 / 43.1  30.6 / 28.9             30.9 / 31.3

(This 2-core CI machine was too loaded by parallel test runs to give stable numbers;
its runs agreed in direction at 1 block.) The reply costs one actor round trip plus
the bytes through the socket; a NIXL write costs that round trip *plus* ``copy_to``'s
two control round trips, and a registration whenever the copied view changes. So the
reply wins small reads by 2-6x, ties at 16 blocks and loses by about 1.4x at 64 (the
multi-MiB rows of both paths run at 0.1-0.4 GB/s there, far below memory bandwidth,
so a host cost common to both dominates them and that gap is the less certain
number). We take the reply: the CPU tier holds colder, demoted blocks, which we
expect to be read in short runs; and it needs no per-peer receive slab, registration
state or lock. If large
CPU-tier reads come to matter, the better step is a NIXL write from the holder's CPU
tier straight into the loader's device receive slab (DRAM to VRAM on GPUs), which also
saves the host-to-device copy; the ``DeviceTierTransport`` seam can carry it. Reads are
batched into calls of at most ``MAX_READ_BYTES`` so that neither side holds more than
that per load at a time.

Bytes travel as ``uint8`` and arrive bit-exact whatever the dtype; each snapshot's
logical dtype comes back with its rows and is checked against the engine's.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xoscar as xo

from .gpu_transfer import check_logical_dtype, chunk_row_index
from .hashing import BlockHash
from .layout import wide_view
from .messages import CPU_TIER, KVGeometry
from .tiered_snapshot import TieredKVSnapshotStore
from .transport import RowScatter

MAX_READ_BYTES = 16 * 1024**2

# The reply of ``read_cpu_rows``: (logical dtype per key, rows (len(keys) * L, R)
# uint8). A plain tuple on purpose: xoscar serialises tuples and ndarrays natively
# (the array as an out-of-band buffer), while a dataclass goes through pickle, which
# measured about 0.5 ms more per call here.
CpuRowsReply = tuple[tuple[str, ...], np.ndarray]


def gather_cpu_rows(
    store: TieredKVSnapshotStore, lease_id: str, keys: Sequence[BlockHash]
) -> CpuRowsReply:
    """Holder side: every layer of ``keys`` (leased CPU-tier snapshots) in order."""
    num_layers = store.geometry.num_layers
    first_rows = []
    for key in keys:
        tier, first_row = store.locate(lease_id, key)  # KeyError if not leased
        if tier != CPU_TIER:
            raise ValueError(
                f"snapshot {key.hex()} under lease {lease_id!r} is in the {tier} "
                "tier; read it through the device-tier transport"
            )
        first_rows.append(first_row)
    index = chunk_row_index(first_rows, num_layers, 0, len(first_rows) * num_layers)
    rows = wide_view(store.cpu_rows).index_select(0, index).view(torch.uint8)
    dtypes = tuple(store.logical_dtypes[key] for key in keys)
    return dtypes, rows.numpy()


async def load_cpu_rows(
    holder_ref: Any,
    lease_id: str,
    keys: Sequence[BlockHash],
    geometry: KVGeometry,
    scatter: RowScatter,
    timeout_s: float,
    max_read_bytes: int = MAX_READ_BYTES,
) -> int:
    """Loader side: read ``keys`` from the holder's CPU tier batch by batch and hand
    each batch to ``scatter(first_row, rows)``; returns the number of rows loaded.

    ``first_row`` counts global rows over ``keys`` (layer ``r % L`` of
    ``keys[r // L]``), as the device-tier transport does. Each call to the holder
    has a deadline of ``timeout_s``.
    """
    num_layers = geometry.num_layers
    keys_per_read = max(1, max_read_bytes // geometry.block_nbytes)
    for start in range(0, len(keys), keys_per_read):
        batch = list(keys[start : start + keys_per_read])
        reply = await xo.wait_for(holder_ref.read_cpu_rows(lease_id, batch), timeout_s)
        rows = check_cpu_rows_reply(reply, batch, geometry)
        scatter(start * num_layers, rows)
    return len(keys) * num_layers


def check_cpu_rows_reply(
    reply: CpuRowsReply, keys: Sequence[BlockHash], geometry: KVGeometry
) -> torch.Tensor:
    dtypes, array = reply
    if len(dtypes) != len(keys):
        raise ValueError(
            f"the holder described {len(dtypes)} snapshots for {len(keys)} keys"
        )
    for dtype in dtypes:
        check_logical_dtype(geometry.logical_dtype, dtype)
    expected = (len(keys) * geometry.num_layers, geometry.layer_block_nbytes)
    if array.dtype != np.uint8 or tuple(array.shape) != expected:
        raise ValueError(
            f"the holder sent {array.dtype} {tuple(array.shape)} rows, expected "
            f"uint8 {expected}"
        )
    with warnings.catch_warnings():
        # The reply's buffer is read-only; we only ever read from it.
        warnings.filterwarnings("ignore", message="The given NumPy array is not")
        return torch.from_numpy(array)
