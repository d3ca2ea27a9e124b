"""The tiered snapshot store: published KV blocks by content hash, in a device tier
bounded by a byte budget and a CPU tier below it (``tiered.py``), and the order in
which unpinned snapshots are demoted or dropped (``eviction.py``)."""
