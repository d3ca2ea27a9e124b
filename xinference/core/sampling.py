"""Default sampling parameters: the request's own, else the model's, else neutral.

A Hugging Face release states how it wants to be sampled in ``generation_config.json``
(Qwen2.5-Instruct: temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05).
vLLM's OpenAI server uses those values for every parameter a request leaves unset
(``--generation-config auto``, its default) and ignores them with
``--generation-config vllm``; the ``generation_config`` launch option does the same
here. The front end resolves the parameters before a request leaves for a replica,
so every replica samples a request the same way.

The eos list of ``generation_config.json`` needs nothing here: the vLLM engine adds
it to every request's stop tokens itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG_MODES = ("auto", "vllm")
DEFAULT_GENERATION_CONFIG = "auto"
GENERATION_CONFIG_FILE = "generation_config.json"

# The parameters a request leaves unset, with their neutral values (vLLM's
# SamplingParams defaults): what a request gets when the model states nothing.
NEUTRAL: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,  # 0: no top-k cut
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def load_sampling_defaults(model_path: str, mode: str) -> dict[str, float | int]:
    """The sampling defaults ``model_path``'s ``generation_config.json`` states
    (only the keys of ``NEUTRAL``); empty with ``mode`` "vllm" or without the file.

    Blocking (reads a file): the front end calls it in a thread.
    """
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(
            f"generation_config must be one of {', '.join(GENERATION_CONFIG_MODES)}, "
            f"got {mode!r}"
        )
    if mode == "vllm":
        return {}
    path = Path(model_path) / GENERATION_CONFIG_FILE
    try:
        stated = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        # vLLM itself loads the model with an unreadable generation config (it only
        # loses the defaults): so do we, and say so.
        logger.warning("ignoring %s: %s", path, error)
        return {}
    defaults: dict[str, float | int] = {}
    for name, neutral in NEUTRAL.items():
        value = stated.get(name) if isinstance(stated, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            defaults[name] = type(neutral)(value)
    return defaults


def resolve(
    requested: Mapping[str, Any], defaults: Mapping[str, float | int]
) -> dict[str, float | int]:
    """Each parameter of ``NEUTRAL``: the request's value where it set one (not
    None), else the model's default, else the neutral value."""
    resolved: dict[str, float | int] = {}
    for name, neutral in NEUTRAL.items():
        value = requested.get(name)
        resolved[name] = value if value is not None else defaults.get(name, neutral)
    return resolved
