"""``InstrumentedXavierConnector``: the production connector with two test controls.

Loaded by vLLM in place of ``XavierConnector`` (``kv_connector_module_path`` names
this module), so production code keeps no test branches. Both controls are files
in a directory named by ``kv_connector_extra_config["xavier_test_dir"]``, read at
each call so a test can switch them while the engine runs:

- ``corrupt_keys``: hex block keys, one per line. Before staging a listed key, the
  worker overwrites its block with noise, so a peer that loads it must produce
  other tokens: the proof that a loader really uses the transferred bytes.
- ``faults``: names of methods of the connector's halves (``SchedulerSide``,
  ``WorkerSide``), one per line. Each call of a listed method raises
  ``InjectedFault`` instead of running: the facade must contain it and the engine
  must go on. ``method@tp1`` raises only in the worker of tensor-parallel rank 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from xinference.model.llm.vllm.xavier.connector.scheduler import StepMetadata
from xinference.model.llm.vllm.xavier.connector.vllm_facade import XavierConnector
from xinference.model.llm.vllm.xavier.engine.blocks import BlockMajorCache
from xinference.model.llm.vllm.xavier.engine.layout import detect_layout

TEST_DIR_KEY = "xavier_test_dir"
CORRUPT_KEYS_FILE = "corrupt_keys"
FAULTS_FILE = "faults"


class InjectedFault(RuntimeError):
    """Raised in place of a connector-half method that the test listed."""


@contextlib.contextmanager
def injected_faults(test_dir: Path, *methods: str) -> Iterator[None]:
    """Make the listed connector-half methods of the engine whose test directory
    is ``test_dir`` raise, for the block's duration (``method@tpN``: rank N only)."""
    path = test_dir / FAULTS_FILE
    path.write_text("\n".join(methods) + "\n")
    try:
        yield
    finally:
        path.unlink()


def _listed(path: Path) -> set[str]:
    try:
        return {line.strip() for line in path.read_text().splitlines() if line.strip()}
    except FileNotFoundError:
        return set()


class _FaultyHalf:
    """Forwards to a connector half, raising for the methods listed in ``faults``."""

    def __init__(self, half: Any, faults: Path, tp_rank: int = 0) -> None:
        self._half = half
        self._faults = faults
        self._tp_rank = tp_rank

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._half, name)
        if not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            listed = _listed(self._faults)
            if name in listed or f"{name}@tp{self._tp_rank}" in listed:
                raise InjectedFault(f"injected fault in {name}")
            return target(*args, **kwargs)

        return call


class InstrumentedXavierConnector(XavierConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._test_dir = Path(extra[TEST_DIR_KEY])
        self._num_blocks = kv_cache_config.num_blocks
        self._layers: list[torch.Tensor] = []
        faults = self._test_dir / FAULTS_FILE
        if self._scheduler is not None:
            self._scheduler = _FaultyHalf(self._scheduler, faults)  # type: ignore
        if self._worker is not None:
            self._worker = _FaultyHalf(  # type: ignore
                self._worker, faults, self._tp_rank
            )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = [kv_caches[name] for name in sorted(kv_caches, key=_layer)]
        super().register_kv_caches(kv_caches)

    def wait_for_save(self) -> None:
        listed = _listed(self._test_dir / CORRUPT_KEYS_FILE)
        meta = self._get_connector_metadata()
        step: StepMetadata = meta.step  # type: ignore[attr-defined]
        block_ids = [item.block_id for item in step.stage if item.key.hex() in listed]
        if block_ids:
            self._corrupt(block_ids)
        super().wait_for_save()

    def _corrupt(self, block_ids: list[int]) -> None:
        layout = detect_layout(self._layers, self._num_blocks)
        cache = BlockMajorCache(self._layers, layout)
        index = torch.tensor(block_ids, dtype=torch.long)
        generator = torch.Generator().manual_seed(7)
        dtype = self._layers[0].dtype
        per_row = layout.layer_block_nbytes // self._layers[0].element_size()
        for layer in range(cache.num_layers):
            noise = torch.randn(len(block_ids), per_row, generator=generator)
            cache.scatter(layer, index, noise.to(dtype).view(torch.uint8))


def _layer(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return int(extract_layer_index(name))
