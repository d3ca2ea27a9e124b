"""Where each replica runs and with which environment (pure functions).

Every replica gets its own sub-pool process. With Xavier on, that pool listens on a
``nixl://`` address, so ``xo.copy_to`` between replicas' transfer actors is a NIXL
write, and UCX is configured the way the GPU-first path needs it on a CUDA host; on
a host without CUDA, UCX picks its own transports (shared memory between the local
replicas' processes) unless the user set ``UCX_TLS``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..model.llm.vllm.xavier.config import format_size

# The GPU-first path registers device memory with NIXL. UCX's memory-type cache can
# misclassify CUDA IPC-mapped pointers, so it is switched off; the transport list keeps
# TCP for control and host memory and adds the CUDA copy and IPC transports. Neither
# is set on a host without CUDA: there UCX would only complain that the CUDA
# transports are missing, and a fixed list would shut out its shared-memory ones.
UCX_MEMTYPE_CACHE = "n"
DEFAULT_UCX_TLS = "tcp,cuda_copy,cuda_ipc"


# Of a GPU's memory, the share vLLM may take when several replicas share the GPU and
# the user did not say: split evenly, leaving headroom for the CUDA contexts and for
# Xavier's device tier and slabs.
SHARED_GPU_BUDGET = 0.8

# vLLM's CPU backend binds each rank's OpenMP threads to CPUs; with several ranks per
# engine it wants the CPUs named per rank ("0|1": rank 0 on CPU 0, rank 1 on CPU 1)
# unless it finds one NUMA node per rank, which a small host has not.
CPU_THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
# vLLM's CPU backend keeps a CPU per engine rank off its OpenMP threads for the
# scheduler process, and with any KV connector one more per rank (meant for
# NixlConnector's threads in disaggregated serving). On a small host that second
# reservation leaves no CPU to keep (2 of 2), so vLLM keeps none and binds two
# OpenMP threads per engine instead of one, spinning on both CPUs: on the 2-core
# CPU machine two replicas with Xavier served x0.4-0.8 of what they served
# without it, before any of Xavier's own work. Xavier's connector runs no such
# threads in the engine (its transfers are in the transfer actor's process), so a
# CPU replica with Xavier reserves what vLLM reserves without a connector.
CPU_RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"


@dataclass(frozen=True, slots=True)
class ReplicaPlacement:
    """One replica's slot: its rank, its device (None: CPU or the default device),
    the sub-pool address scheme and the environment the sub-pool starts with.

    ``gpu_memory_utilization`` is set when replicas share the GPU (each engine would
    otherwise claim vLLM's default 90% of it); ``shares_gpu`` says the engines must
    load one after the other, since vLLM measures free memory while it starts.
    """

    rank: int
    gpu: str | None  # a CUDA_VISIBLE_DEVICES entry ("0,1": a tensor-parallel replica)
    address_scheme: str | None  # "nixl" with Xavier, None for a plain socket pool
    env: tuple[tuple[str, str], ...]
    gpu_memory_utilization: float | None = None
    shares_gpu: bool = False
    # which UCX transports the replica's NIXL agent may use, and why (start-up report)
    ucx: str = ""

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


def replica_environment(
    *, xavier: bool, gpu: str | None, user_env: Mapping[str, str], cuda_host: bool
) -> dict[str, str]:
    """Variables a replica's sub-pool adds to the worker's own environment.

    ``user_env`` is the environment the user started the worker with: a ``UCX_TLS``
    there is the user's choice and is kept. ``cuda_host``: the worker sees CUDA
    devices.
    """
    env: dict[str, str] = {}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if xavier and cuda_host:
        env["UCX_MEMTYPE_CACHE"] = UCX_MEMTYPE_CACHE
        env["UCX_TLS"] = user_env.get("UCX_TLS") or DEFAULT_UCX_TLS
    return env


def describe_ucx(*, xavier: bool, user_env: Mapping[str, str], cuda_host: bool) -> str:
    """One line for the start-up report: the UCX transports replicas may use."""
    if not xavier:
        return ""
    if user_env.get("UCX_TLS"):
        return f"UCX_TLS={user_env['UCX_TLS']} (set by you)"
    if cuda_host:
        return f"UCX_TLS={DEFAULT_UCX_TLS} (CUDA host)"
    return (
        "UCX picks its transports (no CUDA here: shared memory between local replicas)"
    )


def device_groups(gpus: Sequence[str], devices_per_replica: int) -> list[str]:
    """``gpus`` cut into CUDA_VISIBLE_DEVICES entries of ``devices_per_replica``
    devices each, in order (a device left over is not used)."""
    if devices_per_replica < 1:
        raise ValueError(f"devices_per_replica must be >= 1, got {devices_per_replica}")
    if gpus and len(gpus) < devices_per_replica:
        raise ValueError(
            f"a replica of tensor_parallel_size {devices_per_replica} needs "
            f"{devices_per_replica} GPUs, and {len(gpus)} are available "
            f"({', '.join(gpus)})"
        )
    count = len(gpus) // devices_per_replica
    return [
        ",".join(gpus[i * devices_per_replica : (i + 1) * devices_per_replica])
        for i in range(count)
    ]


def cpu_threads_bind(
    replica_index: int, ranks: int, host_cpus: int, num_replicas: int
) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for one CPU replica of ``ranks`` engine ranks:
    every rank of every replica on this host gets its own CPUs while there are
    enough, and they wrap around (shared) when there are not."""
    per_rank = max(1, host_cpus // max(1, num_replicas * ranks))
    parts = []
    for tp_rank in range(ranks):
        first = ((replica_index * ranks + tp_rank) * per_rank) % host_cpus
        last = min(first + per_rank, host_cpus) - 1
        parts.append(str(first) if first == last else f"{first}-{last}")
    return "|".join(parts)


def plan_replicas(
    num_replicas: int,
    *,
    gpus: Sequence[str],
    xavier: bool,
    user_env: Mapping[str, str],
    devices_per_replica: int = 1,
    host_cpus: int = 1,
) -> list[ReplicaPlacement]:
    """Ranks 0..N-1, spread round-robin over ``gpus`` (empty: no device pinning),
    ``devices_per_replica`` of them each (a tensor-parallel replica's ranks)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    groups = device_groups(gpus, devices_per_replica)
    assigned = [
        groups[rank % len(groups)] if groups else None for rank in range(num_replicas)
    ]
    cuda_host = bool(gpus)
    ucx = describe_ucx(xavier=xavier, user_env=user_env, cuda_host=cuda_host)
    placements = []
    for rank, gpu in enumerate(assigned):
        env = replica_environment(
            xavier=xavier, gpu=gpu, user_env=user_env, cuda_host=cuda_host
        )
        if (
            not cuda_host
            and devices_per_replica > 1
            and CPU_THREADS_BIND not in user_env
        ):
            env[CPU_THREADS_BIND] = cpu_threads_bind(
                rank, devices_per_replica, host_cpus, num_replicas
            )
        if xavier and not cuda_host and CPU_RESERVED not in user_env:
            env[CPU_RESERVED] = str(devices_per_replica)
        sharing = assigned.count(gpu) if gpu is not None else 1
        placements.append(
            ReplicaPlacement(
                rank=rank,
                gpu=gpu,
                address_scheme="nixl" if xavier else None,
                env=tuple(sorted(env.items())),
                gpu_memory_utilization=(
                    round(SHARED_GPU_BUDGET / sharing, 3) if sharing > 1 else None
                ),
                shares_gpu=sharing > 1,
                ucx=ucx,
            )
        )
    return placements


def device_budget_refusal(
    placements: Sequence[ReplicaPlacement],
    budget_bytes: int,
    *,
    gpu_memory: Mapping[str, int],
    host_available_bytes: int,
    worker: str,
    ranks_per_replica: int = 1,
) -> str | None:
    """Why a device tier of ``budget_bytes`` per replica cannot be held by the memory
    these placements put it in; None when it can.

    A replica on a GPU keeps its device tier in that GPU's memory, so the replicas
    sharing a GPU need the sum of their budgets there: compared with the GPU's total
    memory (``gpu_memory``: CUDA_VISIBLE_DEVICES entry -> bytes), as nothing else of
    the launch runs there yet. A replica without a GPU keeps its "device" tier where
    its engine's KV cache lives, in host memory: the budgets of all such replicas on
    this host, one per engine rank (``ranks_per_replica``, the tensor-parallel
    size), are compared with its available memory. Checked before any engine
    loads; a budget that does not fit would fail only when the connector maps the
    engine's cache, minutes later.
    """
    if budget_bytes <= 0:
        return None
    per_replica = f"xavier_gpu_cache_bytes {format_size(budget_bytes)} per replica"
    # Each engine rank keeps its own device tier of the budget, on its own GPU.
    # Without a GPU all ranks of a replica keep theirs in this host's memory.
    sharing: dict[str | None, int] = {}
    for placement in placements:
        if placement.gpu:
            for gpu_entry in placement.gpu.split(","):
                sharing[gpu_entry] = sharing.get(gpu_entry, 0) + 1
        else:
            sharing[None] = sharing.get(None, 0) + ranks_per_replica
    for gpu, count in sharing.items():
        needed = count * budget_bytes
        if gpu is None:
            if needed > host_available_bytes:
                return (
                    f"{per_replica} does not fit: without a GPU the device tier "
                    f"lives in host memory, and {count} engine rank(s) on worker "
                    f"{worker} need {format_size(needed)} of it while "
                    f"{format_size(host_available_bytes)} is available"
                )
            continue
        total = gpu_memory.get(gpu)
        if total is not None and needed > total:
            return (
                f"{per_replica} does not fit: {count} replica(s) on GPU {gpu} of "
                f"worker {worker} need {format_size(needed)} of its memory, and it "
                f"has {format_size(total)} in all"
            )
    return None
