"""Writing a model directory once, safely under concurrent builders.

A builder writes into a temporary sibling directory and renames it into place, and
the marker file it writes last records the spec it was built from: a directory
with a matching marker is complete and reused, anything else is rebuilt. Two
launches of one registry name at once (the benchmarks do it) never see a
half-written directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def build_once(
    path: str | os.PathLike[str],
    spec: dict[str, Any],
    marker: str,
    write: Callable[[Path, dict[str, Any]], None],
) -> Path:
    """The directory at ``path`` built by ``write(directory, spec)``, reused when its
    ``marker`` file says it was built from an equal ``spec`` (JSON-comparable)."""
    target = Path(path)
    if is_built(target, spec, marker):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging, spec)
        (staging / marker).write_text(json.dumps(canonical(spec), sort_keys=True))
        if target.exists():
            if is_built(target, spec, marker):  # another builder finished first
                return target
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def is_built(target: Path, spec: dict[str, Any], marker: str) -> bool:
    path = target / marker
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()) == canonical(spec)
    except ValueError:
        return False


def canonical(spec: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(spec, sort_keys=True, default=str))
