"""The direct NIXL device-tier transport: what endpoints exchange (``wire.py``), UCX
settings and reports (``ucx.py``), READ descriptor plans (``plan.py``), one agent
per actor with its memory registered once (``endpoint.py``), posting and awaiting
READs (``reads.py``), which loads READ straight into engine blocks
(``placement.py`` the rules, ``engine_placement.py`` their use per peer), and the
seam's implementation (``transport.py``)."""
