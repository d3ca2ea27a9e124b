"""Xavier: cross-replica prefix KV-cache sharing for vLLM replicas.

One replica that has computed the KV blocks of a prompt prefix publishes them; the
other replicas copy those blocks instead of recomputing the prefill. See
``docs/internals.md`` for how the pieces fit.
"""
