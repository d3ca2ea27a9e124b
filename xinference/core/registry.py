"""A small local model registry: names a user can launch instead of a path.

Built-in entries are random-weight models built offline on first use (nothing is
downloaded); users add their own local directories in a JSON file
(``$XINFERENCE_HOME/models.json``: ``{"name": "/path/to/model", ...}``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class UnknownModelError(LookupError):
    """The registry has no model of that name."""


@dataclass(frozen=True, slots=True)
class RegisteredModel:
    name: str
    description: str
    # Builds the model into the given directory (reusing a complete one) and
    # returns it; None for user entries, which name an existing directory.
    build: Callable[[Path], Path] | None = None
    path: str | None = None


def _tiny_qwen2(directory: Path) -> Path:
    from ..model.llm.tiny_model import build_tiny_qwen2

    return build_tiny_qwen2(directory)


def _qwen25_05b_shaped(directory: Path) -> Path:
    from ..model.llm.tiny_model import qwen25_05b_shaped

    return qwen25_05b_shaped(directory)


def _llama31_8b_shaped(directory: Path) -> Path:
    from ..model.llm.llama_shaped import build_llama31_8b_shaped

    return build_llama31_8b_shaped(directory)


def _llama31_shaped_mini(directory: Path) -> Path:
    from ..model.llm.llama_shaped import LLAMA31_MINI, build_llama31_8b_shaped

    return build_llama31_8b_shaped(directory, **LLAMA31_MINI)


BUILTIN_MODELS: dict[str, RegisteredModel] = {
    model.name: model
    for model in (
        RegisteredModel(
            "tiny-qwen2",
            "random 2-layer Qwen2 with a local tokenizer (tests, demo)",
            build=_tiny_qwen2,
        ),
        RegisteredModel(
            "qwen2.5-0.5b-shaped",
            "random weights with Qwen2.5-0.5B's attention shape (benchmarks)",
            build=_qwen25_05b_shaped,
        ),
        RegisteredModel(
            "llama-3.1-8b-shaped",
            "Llama-3.1-8B's config and vocabulary, no weights: serve it with "
            "--load-format dummy (GPU benchmarks)",
            build=_llama31_8b_shaped,
        ),
        RegisteredModel(
            "llama-3.1-shaped-mini",
            "the same tokenizer and vocabulary, 2 small layers, no weights: "
            "--load-format dummy (CPU dry runs of the 8B benchmarks)",
            build=_llama31_shaped_mini,
        ),
    )
}


def xinference_home() -> Path:
    return Path(os.environ.get("XINFERENCE_HOME", Path.home() / ".xinference"))


def registered_models(home: Path | None = None) -> dict[str, RegisteredModel]:
    """Built-in entries plus the user's ``models.json`` (user entries win)."""
    models = dict(BUILTIN_MODELS)
    user_file = (home or xinference_home()) / "models.json"
    if user_file.is_file():
        try:
            entries = json.loads(user_file.read_text())
        except ValueError as error:
            raise ValueError(f"{user_file} is not valid JSON: {error}") from None
        if not isinstance(entries, dict):
            raise ValueError(f"{user_file} must map model names to directories")
        for name, path in entries.items():
            models[name] = RegisteredModel(name, f"local model at {path}", path=path)
    return models


def resolve_model(name: str, home: Path | None = None) -> Path:
    """The directory of a registered model, building a built-in one if needed.

    Blocking (a build takes seconds): call it from a thread in async code.
    """
    home = home or xinference_home()
    models = registered_models(home)
    model = models.get(name)
    if model is None:
        raise UnknownModelError(
            f"unknown model name {name!r}; known: {', '.join(sorted(models))} "
            f"(or pass model_path)"
        )
    if model.path is not None:
        path = Path(model.path)
        if not path.is_dir():
            raise UnknownModelError(f"model {name!r} points at missing {path}")
        return path
    assert model.build is not None
    return model.build(home / "models" / name)
