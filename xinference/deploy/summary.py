"""A replica's final Xavier counters as a few words for a person (``terminate``).

The full counters (``XavierStats.as_dict()``: about 60 numbers, histogram buckets
included) stay in ``GET /v1/models/{uid}/stats`` and ``xinference terminate
--json``; this says what a user asks after a run: how much was loaded from peers,
from which tier, how fast, and whether anything went wrong.
"""

from __future__ import annotations

from typing import Any

from ..model.llm.vllm.xavier.config import format_size

# ActorCounters / TransportStats fields that count something going wrong, and how
# the summary names them
_FAULTS = (
    ("actor", "loads_failed", "loads failed"),
    ("actor", "connector_faults", "connector faults"),
    ("actor", "stage_failures", "stage failures"),
    ("actor", "lease_release_failures", "lease releases failed"),
    ("actor", "tracker_failures", "tracker updates failed"),
    ("transport", "transfer_timeouts", "device-tier transfer timeouts"),
    ("transport", "transfer_failures", "device-tier transfer failures"),
    ("cpu_tier_transport", "transfer_timeouts", "CPU-tier read timeouts"),
    ("cpu_tier_transport", "transfer_failures", "CPU-tier read failures"),
)


def summarize_xavier(stats: dict[str, Any]) -> str:
    """One line from ``XavierStats.as_dict()``: hits by tier, tokens and bytes
    loaded, loads by path (with the actor's p50/p95 and the lease-free READs'
    mean), snapshots served to peers, and faults. Every figure counts both tiers
    and both load paths (``totals``, ``XavierStats.totals``)."""
    totals = stats.get("totals") or {}
    device = int(totals.get("device_tier_blocks", 0))
    cpu = int(totals.get("cpu_tier_blocks", 0))
    block_size = int((stats.get("engine") or {}).get("block_size", 0))
    hits = f"hits {device} device-tier + {cpu} CPU-tier blocks"
    if block_size:
        hits += f" ({(device + cpu) * block_size:,} tokens)"
    loaded = format_size(int(totals.get("received_useful_bytes", 0)))
    parts = [hits, f"{loaded} loaded", _loads(stats)]
    store = stats.get("store") or {}
    served = int(store.get("device_hits", 0)) + int(store.get("cpu_hits", 0))
    parts.append(f"served {served} snapshots to peers")
    faults = [
        f"{count} {name}"
        for section, field_name, name in _FAULTS
        if (count := int((stats.get(section) or {}).get(field_name, 0)))
    ]
    parts.append("faults: " + (", ".join(faults) if faults else "none"))
    if stats.get("mapping_error"):
        parts.append(f"mapping failed: {stats['mapping_error']}")
    return "; ".join(parts)


def _loads(stats: dict[str, Any]) -> str:
    """How many loads completed, by path: through the transfer actor (timed
    by it: p50/p95) and lease-free READs by the engine (their mean)."""
    totals = stats.get("totals") or {}
    actor = stats.get("actor") or {}
    through_actor = int(totals.get("actor_loads", 0))
    lease_free = int(totals.get("lease_free_loads", 0))
    if not through_actor + lease_free:
        return "no loads"
    paths = []
    latency = stats.get("load_latency") or {}
    if through_actor:
        timed = ""
        if latency.get("p50_s") is not None:
            timed = f" (p50 {_ms(latency['p50_s'])}, p95 {_ms(latency['p95_s'])})"
        paths.append(f"{through_actor} through the transfer actor{timed}")
    if lease_free:
        reads = int(actor.get("direct_reads", 0))
        mean = float(actor.get("direct_read_seconds", 0.0)) / reads if reads else 0.0
        paths.append(f"{lease_free} lease-free by the engine (mean {_ms(mean)})")
    count = through_actor + lease_free
    return f"{count} load{'' if count == 1 else 's'}: " + ", ".join(paths)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"
