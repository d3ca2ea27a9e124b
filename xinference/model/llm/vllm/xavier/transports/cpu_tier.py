"""Reading CPU-tier snapshots from a holder: one RPC per batch, rows in the reply.

The holder gathers the rows of a batch of leased CPU-tier snapshots into one
contiguous buffer (``gather_cpu_rows``) and returns it as the reply of the loader's
actor call; the loader checks what arrived and scatters it (``load_cpu_rows``).

Why an RPC reply and not a NIXL DRAM write into a registered CPU slab (the way the
device tier moves rows)? The reply costs one actor round trip plus the bytes through
the socket; a NIXL write through xoscar costs that round trip plus ``copy_to``'s two
control round trips, and a registration whenever the copied view changes. The CPU
tier holds colder, demoted blocks, read in short runs, where the reply wins
(``benchmark/cpu_tier_read.py``; figures in ``benchmark/results/h200.md``), and it
needs no per-peer receive slab, registration state or lock. If large CPU-tier reads
come to matter, the better step is a NIXL write from the holder's CPU tier straight
into the loader's device receive slab, which the transport seam can carry. Reads
are batched into calls of at most ``MAX_READ_BYTES`` so that neither side holds
more than that per load at a time.

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

from ..engine.layout import wide_view
from ..hashing import BlockHash
from ..stats import TransportStats
from ..store.tiered import TieredKVSnapshotStore
from ..wire import CPU_TIER, KVGeometry
from .base import RowScatter
from .xoscar.gpu_transfer import check_logical_dtype, chunk_row_index

MAX_READ_BYTES = 16 * 1024**2

# The reply of ``read_cpu_rows``: (logical dtype per key, rows (len(keys) * L, R)
# uint8). A plain tuple on purpose: xoscar serialises tuples and ndarrays natively
# (the array as an out-of-band buffer), while a dataclass goes through pickle, which
# costs a copy of the rows more per call.
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
    counters: TransportStats | None = None,
) -> int:
    """Loader side: read ``keys`` from the holder's CPU tier batch by batch and hand
    each batch to ``scatter(first_row, rows)``; returns the number of rows loaded.

    ``first_row`` counts global rows over ``keys`` (layer ``r % L`` of
    ``keys[r // L]``), as the device-tier transport does. Each call to the holder
    has a deadline of ``timeout_s``. ``counters`` (the loader's CPU-tier counts)
    get each reply's bytes as ``received_*``, a completed read as a load, a missed
    deadline as a timeout and any other failed read as a failure.
    """
    num_layers = geometry.num_layers
    keys_per_read = max(1, max_read_bytes // geometry.block_nbytes)
    counts = TransportStats() if counters is None else counters
    for start in range(0, len(keys), keys_per_read):
        batch = list(keys[start : start + keys_per_read])
        try:
            reply = await xo.wait_for(
                holder_ref.read_cpu_rows(lease_id, batch), timeout_s
            )
            rows = check_cpu_rows_reply(reply, batch, geometry)
        except TimeoutError:
            counts.transfer_timeouts += 1
            raise
        except Exception:
            counts.transfer_failures += 1
            raise
        count_cpu_rows(counts, reply, received=True)
        scatter(start * num_layers, rows)
    counts.loads += 1
    return len(keys) * num_layers


def count_cpu_rows(
    counters: TransportStats, reply: CpuRowsReply, *, received: bool
) -> None:
    """Count one ``read_cpu_rows`` reply: received by a loader or sent by a holder.

    The rows are the payload and all that crosses besides a few dtype names, so
    wire bytes equal useful bytes here.
    """
    nbytes = int(reply[1].nbytes)
    if received:
        counters.received_copies += 1
        counters.received_wire_bytes += nbytes
        counters.received_useful_bytes += nbytes
    else:
        counters.sent_copies += 1
        counters.sent_wire_bytes += nbytes
        counters.sent_useful_bytes += nbytes


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
