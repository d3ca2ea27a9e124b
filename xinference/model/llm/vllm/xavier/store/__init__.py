"""The tiered snapshot store: published KV blocks by content hash, in a device tier
bounded by a byte budget and a CPU tier below it (``tiered.py``), the order in
which unpinned snapshots are demoted or dropped (``eviction.py``), and the batch
of demotions that makes room for new snapshots (``demotions.py``)."""
