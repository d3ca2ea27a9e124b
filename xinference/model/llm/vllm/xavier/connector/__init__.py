"""The vLLM v1 KV connector: the class vLLM loads and its two halves.

``vllm_facade.py`` is the class vLLM loads (the only one vLLM calls) and
``vllm_compat.py`` everything else read from vLLM; ``scheduler.py`` decides what
to load from whom and what to stage, ``worker.py`` does it next to the engine's KV
cache; ``step.py`` is what passes between them each step; ``faults.py`` counts the
faults the facade contains. Importing this package does not import vLLM.
"""
