"""Sharing tensors with another process: CPU shared memory and CUDA IPC.

The cross-process tests spawn a real child process (the transfer actor's side of
the topology) and check that writes on either side are seen on the other.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading

import pytest
import torch

from xinference.model.llm.vllm.xavier.engine import device as device_module
from xinference.model.llm.vllm.xavier.engine.device import (
    CpuStorageHandle,
    export_tensors,
    fence,
    import_tensors,
    settle,
)

from .._support import DEVICES, exchange_with_child

pytestmark = pytest.mark.timeout(120)

CHILD_TIMEOUT_S = 90.0


def make_tensors(device: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """a and b: views of one allocation; c: a transposed view of another."""
    flat = torch.arange(64, dtype=torch.float32, device=device).to(torch.bfloat16)
    a = flat[:32].view(4, 8)
    b = flat[32:].view(2, 16)
    c = torch.arange(15, dtype=torch.float32, device=device).view(5, 3).t()
    return flat, [a, b, c]


def test_export_moves_cpu_memory_into_shared_memory_in_place():
    flat, tensors = make_tensors("cpu")
    a, b, c = tensors
    handles = export_tensors(tensors)
    # Layers that are views of one allocation are one shared storage.
    assert len(handles.storages) == 2
    assert [v.storage for v in handles.views] == [0, 0, 1]
    assert all(isinstance(s, CpuStorageHandle) for s in handles.storages)
    assert flat.is_shared() and a.is_shared() and c.is_shared()
    # The views still alias the original allocation, now in shared memory.
    flat[33] = 5
    assert float(b[0, 1]) == 5
    # Handles are frozen dataclasses that pickle (they cross xoscar calls).
    assert pickle.loads(pickle.dumps(handles)) == handles


def test_import_in_the_same_process_maps_one_storage_per_allocation():
    flat, tensors = make_tensors("cpu")
    a2, b2, c2 = import_tensors(export_tensors(tensors))
    assert a2.untyped_storage().data_ptr() == b2.untyped_storage().data_ptr()
    assert torch.equal(c2, tensors[2]) and c2.stride() == tensors[2].stride()
    b2[1, 3] = -2
    assert float(flat[32 + 16 + 3]) == -2
    fence("cpu")  # a no-op on CPU, but callable


def run_exchange(device: str) -> None:
    flat, tensors = make_tensors(device)
    a, b, c = tensors
    expected = [t.float().cpu().tolist() for t in tensors]
    handles = export_tensors(tensors)
    ctx = multiprocessing.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=exchange_with_child, args=(handles, child_end))
    child.start()
    try:
        assert parent.poll(CHILD_TIMEOUT_S), "the child did not answer in time"
        reply = parent.recv()
        assert not isinstance(reply, str), reply
        seen, same_storage, devices = reply
        assert seen == expected
        assert same_storage, "a and b are views of one allocation in the exporter"
        assert all(d.startswith(device) for d in devices)

        assert parent.poll(CHILD_TIMEOUT_S)
        assert parent.recv() == "written"
        assert float(a[0, 0]) == 7  # the child's writes reached our memory
        assert float(c[1, 2]) == 3.5
        b[1, 3] = 11
        fence(device)
        parent.send("go")
        assert parent.poll(CHILD_TIMEOUT_S)
        assert parent.recv() == 11.0  # ours reached the child's mapping
    finally:
        child.join(CHILD_TIMEOUT_S)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_cpu_tensors_shared_with_another_process_both_ways():
    run_exchange("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA IPC needs a CUDA device (torch sees none)",
)
def test_cuda_tensors_shared_through_ipc_both_ways():
    run_exchange("cuda")


def test_empty_and_mixed_inputs_are_refused():
    with pytest.raises(ValueError, match="empty"):
        export_tensors([])
    with pytest.raises(ValueError, match="meta"):
        export_tensors([torch.empty(2, device="meta")])


def test_cpu_threads_are_capped_never_raised(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        monkeypatch.setenv(device_module.CPU_THREADS_ENV, "3")
        assert device_module.limit_cpu_threads() == 3 == torch.get_num_threads()
        monkeypatch.setenv(device_module.CPU_THREADS_ENV, "8")
        assert device_module.limit_cpu_threads() == 3  # a cap, not a raise
        monkeypatch.delenv(device_module.CPU_THREADS_ENV)
        assert device_module.limit_cpu_threads() == min(
            3, device_module.DEFAULT_CPU_THREADS
        )
        for bad in ("0", "two"):
            monkeypatch.setenv(device_module.CPU_THREADS_ENV, bad)
            with pytest.raises(ValueError, match=device_module.CPU_THREADS_ENV):
                device_module.limit_cpu_threads()
    finally:
        torch.set_num_threads(before)


def test_host_to_device_leaves_host_tensors_on_a_cpu_cache():
    ids = torch.tensor([3, 1, 2])
    assert device_module.host_to_device(ids, torch.device("cpu")) is ids


@pytest.mark.parametrize("device", DEVICES)
def test_a_work_mark_says_when_the_work_before_it_is_done(device):
    mark = device_module.DeviceWorkMark(device)
    assert mark.done()  # nothing marked yet
    n = 4096 if device == "cuda" else 64
    big = torch.ones(n, n, device=device)
    for _ in range(8):
        big = big @ big / n  # queued work on a GPU
    mark.mark()
    while not mark.done():  # never blocks; the GPU finishes on its own
        pass
    mark.wait()  # and waiting after it is done returns at once
    assert mark.done() and float(big[0, 0]) == 1.0


class ScriptedMark:
    """A mark whose work completes after ``polls`` queries, or only when waited
    for (``polls`` None); records where each wait ran."""

    def __init__(self, polls: int | None) -> None:
        self.polls = polls
        self.queries = 0
        self.waited_in: list[str] = []

    def done(self) -> bool:
        self.queries += 1
        return self.polls is not None and self.queries > self.polls

    def wait(self) -> None:
        self.waited_in.append(threading.current_thread().name)


@pytest.mark.parametrize("polls", [0, 3])
async def test_settle_returns_on_the_loop_once_the_work_has_completed(polls: int):
    mark = ScriptedMark(polls)
    await settle(mark)  # type: ignore[arg-type]
    assert mark.queries == polls + 1
    assert mark.waited_in == []


async def test_settle_waits_in_a_thread_for_work_that_takes_longer():
    mark = ScriptedMark(None)
    await settle(mark)  # type: ignore[arg-type]
    assert len(mark.waited_in) == 1
    assert mark.waited_in[0] != threading.main_thread().name
