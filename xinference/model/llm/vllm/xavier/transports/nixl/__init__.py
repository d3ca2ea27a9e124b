"""The direct NIXL device-tier transport: what endpoints exchange (``wire.py``), UCX
settings and reports (``ucx.py``), READ descriptor plans (``plan.py``), one agent
per actor with its memory registered once (``endpoint.py``), posting and awaiting
READs (``reads.py``), and the seam's implementation (``transport.py``)."""
