"""Device idioms in one place: fences, and sharing tensors between processes.

Everything else in Xavier is written once for CPU and CUDA tensors alike; what differs
between the two lives here.

Sharing keeps vLLM's process topology: the engine's worker process owns the KV cache,
the transfer actor lives in another process and maps the very same memory.

- CUDA: CUDA IPC through torch's own tensor reduction
  (``torch.multiprocessing.reductions.reduce_tensor``). We chose it over calling
  ``UntypedStorage._share_cuda_`` ourselves because the reduction and its rebuild
  function come from the same torch install and keep the producer's IPC reference
  counting and stream event in step; the private call's tuple has changed shape across
  torch releases.
- CPU: ``_share_fd_cpu_`` moves the storage into shared memory *in place* (vLLM keeps
  using the same storage object, so every layer view follows) and returns a file
  descriptor; the importer opens ``/proc/<pid>/fd/<fd>`` and maps it. This needs the
  same user and a live exporter at import time, which the topology gives us; it needs
  no authkey, unlike torch's fd-passing reductions.

Handles describe each distinct storage once, and each tensor as a view of one of
them, so layers that are views of one allocation map to one allocation in the
importer (one mmap, one IPC open), exactly as in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

logger = logging.getLogger(__name__)


def fence(device: torch.device | str) -> None:
    """Block until every copy queued on ``device`` has completed.

    CPU copies are synchronous, so this is a no-op there. Blocking: call it from a
    worker thread (``asyncio.to_thread``) inside an event loop.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Cap on torch's CPU threads in a transfer actor's process; the variable overrides.
CPU_THREADS_ENV = "XAVIER_TORCH_THREADS"
DEFAULT_CPU_THREADS = 2


def limit_cpu_threads() -> int:
    """Cap torch's intra-op CPU threads in this process (never raise them); the
    cap in force.

    A transfer actor's CPU work is copies of a few MiB (demotions into the CPU
    tier, CPU-tier reads), which gain little past a couple of threads. torch's
    default is a thread per core, and after each parallel region those threads
    spin a while before they sleep: on a 16-core GPU host the two replicas'
    processes kept 30 of them about 10% busy each while serving, beside the
    engines' CPU-bound threads.
    """
    text = os.environ.get(CPU_THREADS_ENV)
    try:
        wanted = DEFAULT_CPU_THREADS if text is None else int(text)
    except ValueError:
        raise ValueError(
            f"{CPU_THREADS_ENV} must be an integer, got {text!r}"
        ) from None
    if wanted < 1:
        raise ValueError(f"{CPU_THREADS_ENV} must be at least 1, got {wanted}")
    if torch.get_num_threads() > wanted:
        torch.set_num_threads(wanted)
    return torch.get_num_threads()


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on ``device``, queued without waiting for the device.

    ``.to(cuda)`` from pageable memory synchronises the current stream first: on
    vLLM's engine thread that waits for the step's forward, which asynchronous
    scheduling would otherwise overlap with preparing the next step. From pinned
    memory the copy is queued behind that work instead; torch's caching host
    allocator keeps the pinned buffer until the copy has run.
    """
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class DeviceWorkMark:
    """A point in the work queued on a device, to wait for later rather than now.

    ``mark()`` records where the current stream is; ``wait()`` blocks until the work
    queued up to the last mark has completed (at once if it has, or on CPU). Cheaper
    than a fence when the wait can be put off until the memory is needed again.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._event: Any = None
        self._pending = False

    def mark(self) -> None:
        if self.device.type != "cuda":
            return
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(self.device))
        self._pending = True

    def wait(self) -> None:
        if self._pending:
            self._event.synchronize()
            self._pending = False

    def done(self) -> bool:
        """Whether the work up to the last mark has completed; never blocks."""
        if self._pending and self._event.query():
            self._pending = False
        return not self._pending


# ``settle`` polls a mark on the event loop for this long before it waits in a
# thread: the last copies of a load take microseconds, a thread hop about as long.
SETTLE_POLL_S = 200e-6


async def settle(mark: DeviceWorkMark) -> None:
    """``mark.wait()`` for an event loop: at once when the work has completed (or
    on CPU), else polled briefly, yielding to the loop, then waited for in a
    thread."""
    if mark.done():
        return
    until = time.perf_counter() + SETTLE_POLL_S
    while time.perf_counter() < until:
        await asyncio.sleep(0)
        if mark.done():
            return
    await asyncio.to_thread(mark.wait)


class PinnedIds:
    """Lists of integers copied to a CUDA device without a blocking copy: written
    into persistent pinned host buffers, copied with ``non_blocking=True``.

    A buffer is written again only once the copy out of it has run (its own
    ``DeviceWorkMark``); ``slots`` buffers are used in turn, so that wait is
    normally over before it starts. A buffer that grows is replaced, and torch's
    pinned-memory allocator keeps the old one until the copies out of it have run.
    (``host_to_device`` pins a fresh buffer per call instead; on a load's path the
    ids are staged here, without that allocation and copy.)
    Not thread-safe: one thread (the transfer actor's event loop) stages.
    """

    def __init__(self, device: torch.device, slots: int = 8) -> None:
        if device.type != "cuda":
            raise ValueError(f"pinned staging is for CUDA devices, not {device}")
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._copied = [DeviceWorkMark(device) for _ in range(slots)]
        self._next = 0

    def to_device(self, values: Sequence[int]) -> torch.Tensor:
        """``values`` as a 1-D ``torch.long`` tensor on the device; the copy is
        queued on the current stream."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        self._copied[slot].wait()  # the last copy out of this buffer has run
        n = len(values)
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < n:
            size = max(n, 64, 0 if buffer is None else 2 * buffer.numel())
            buffer = torch.empty(size, dtype=torch.long, pin_memory=True)
            self._buffers[slot] = buffer
        buffer.numpy()[:n] = values
        out = buffer[:n].to(self.device, non_blocking=True)
        self._copied[slot].mark()
        return out


@dataclass(frozen=True, slots=True)
class CpuStorageHandle:
    """A CPU storage in shared memory, reachable as ``/proc/<pid>/fd/<fd>``."""

    pid: int
    fd: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class CudaStorageHandle:
    """A CUDA storage: torch's rebuild function and its arguments for a flat
    ``uint8`` tensor over the whole storage (CUDA IPC handle inside)."""

    rebuild: Callable[..., torch.Tensor]
    args: tuple[Any, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class TensorView:
    """One exported tensor: a view of ``storages[storage]`` (offset in elements)."""

    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class SharedTensorHandles:
    """Picklable description of tensors shared by one process with another."""

    device_type: str  # "cpu" or "cuda"
    storages: tuple[CpuStorageHandle | CudaStorageHandle, ...]
    views: tuple[TensorView, ...]


def export_tensors(tensors: Sequence[torch.Tensor]) -> SharedTensorHandles:
    """Share ``tensors`` with another process of the same user on this host.

    On CPU this moves each storage into shared memory in place (a one-time copy;
    tensors and views keep working and see the shared memory afterwards). The
    exporting process must stay alive until the importer has imported.
    """
    if not tensors:
        raise ValueError("nothing to export: the tensor list is empty")
    device_types = {t.device.type for t in tensors}
    if len(device_types) != 1:
        raise ValueError(f"tensors on mixed device types {sorted(device_types)}")
    (device_type,) = device_types
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"cannot share tensors on {device_type!r}")

    # storage data_ptr -> index into `storages`; views of one allocation share it.
    index_of: dict[int, int] = {}
    storages: list[CpuStorageHandle | CudaStorageHandle] = []
    views: list[TensorView] = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if device_type == "cpu":
            # Must precede reading data_ptr: the move into shared memory is in place
            # but changes the storage's address.
            fd, nbytes = storage._share_fd_cpu_()
            key = storage.data_ptr()
            if key not in index_of:
                index_of[key] = len(storages)
                storages.append(CpuStorageHandle(os.getpid(), int(fd), int(nbytes)))
        else:
            key = storage.data_ptr()
            if key not in index_of:
                index_of[key] = len(storages)
                storages.append(_export_cuda_storage(storage))
        views.append(
            TensorView(
                storage=index_of[key],
                offset=int(tensor.storage_offset()),
                shape=tuple(tensor.shape),
                stride=tuple(tensor.stride()),
                dtype=tensor.dtype,
            )
        )
    return SharedTensorHandles(device_type, tuple(storages), tuple(views))


def import_tensors(handles: SharedTensorHandles) -> list[torch.Tensor]:
    """Map tensors exported by another process, in export order.

    The returned tensors keep the mapped memory alive: hold them for as long as the
    memory is used. Writes through them are seen by the exporter and vice versa.
    """
    storages = [_import_storage(h) for h in handles.storages]
    tensors = []
    for view in handles.views:
        storage = storages[view.storage]
        tensor = torch.empty(0, dtype=view.dtype, device=storage.device)
        tensor.set_(storage, view.offset, view.shape, view.stride)
        tensors.append(tensor)
    return tensors


def _export_cuda_storage(storage: torch.UntypedStorage) -> CudaStorageHandle:
    nbytes = storage.nbytes()
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, 0, (nbytes,), (1,))
    rebuild, args = reduce_tensor(flat)
    return CudaStorageHandle(rebuild, tuple(args), nbytes)


def _import_storage(
    handle: CpuStorageHandle | CudaStorageHandle,
) -> torch.UntypedStorage:
    if isinstance(handle, CpuStorageHandle):
        path = f"/proc/{handle.pid}/fd/{handle.fd}"
        try:
            storage = torch.UntypedStorage.from_file(
                path, shared=True, nbytes=handle.nbytes
            )
        except (OSError, RuntimeError) as exc:
            raise RuntimeError(
                f"cannot map shared tensor memory {path} ({handle.nbytes} bytes): "
                "the exporting process must be alive and run as the same user"
            ) from exc
        return storage  # type: ignore[return-value]
    flat = handle.rebuild(*handle.args)
    return flat.untyped_storage()  # type: ignore[return-value]


class HostPin:
    """A host tensor's memory page-locked in place for CUDA copies.

    Device-to-host copies into pageable memory go through the driver's bounce
    buffers and block the calling thread (and the first write to each page
    faults it in); into page-locked memory they are DMA at the link's speed and
    asynchronous. ``torch.empty(..., pin_memory=True)`` would round a large
    tier up to the next power of two in torch's pinned cache, so the tier's own
    allocation is registered instead. Registering touches every page: seconds
    for tens of GiB, so call ``pin`` from a worker thread.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self.pinned = False

    def pin(self) -> bool:
        """Page-lock the tensor (no-op without CUDA or for an empty tensor);
        False, with a warning, where the system refuses (a memlock limit)."""
        tensor = self._tensor
        nbytes = tensor.numel() * tensor.element_size()
        if self.pinned or nbytes == 0 or not torch.cuda.is_available():
            return self.pinned
        try:
            _in_own_thread(
                lambda: torch.cuda.cudart().cudaHostRegister(
                    tensor.data_ptr(), nbytes, 0
                )
            )
        except Exception as exc:
            logger.warning(
                "Xavier: could not page-lock %.1f GiB of host memory (%s); copies to "
                "it stay synchronous and slower",
                nbytes / 1024**3,
                exc,
            )
            return False
        self.pinned = True
        return True

    def unpin(self) -> None:
        """Undo ``pin`` (before the memory is freed)."""
        if not self.pinned:
            return
        self.pinned = False
        try:
            _in_own_thread(
                lambda: torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
            )
        except Exception as exc:  # the process is going anyway
            logger.warning("Xavier: could not unlock host memory: %s", exc)


def _in_own_thread(call: Callable[[], Any]) -> None:
    """Run a CUDA runtime call that returns an error code in a thread of its own,
    and raise that error here. The runtime also keeps a failed call's error as
    its thread's last error, which a later kernel launch check on that thread
    would report as its own; a thread that ends takes it along."""
    results: list[Any] = []
    worker = threading.Thread(target=lambda: results.append(call()))
    worker.start()
    worker.join()
    if not results:
        raise RuntimeError("the CUDA runtime call raised in its thread")
    torch.cuda.check_error(results[0])


def release_memory(device: torch.device | str) -> None:
    """Hand memory freed by dropped tensors back to the system.

    CUDA keeps freed blocks in its caching allocator and closed IPC mappings until
    asked; CPU memory (including unmapped shared memory) is returned on release.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
