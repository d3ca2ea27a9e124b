"""Replica placement and the environment each replica's sub-pool starts with."""

import pytest

from xinference.core.placement import (
    DEFAULT_UCX_TLS,
    describe_ucx,
    device_budget_refusal,
    plan_replicas,
    replica_environment,
)


def test_xavier_replicas_on_a_cuda_host_get_nixl_pools_and_the_cuda_transports():
    plan = plan_replicas(2, gpus=("0", "1"), xavier=True, user_env={})
    assert [p.rank for p in plan] == [0, 1]
    for placement in plan:
        assert placement.address_scheme == "nixl"
        assert placement.env_dict() == {
            "CUDA_VISIBLE_DEVICES": placement.gpu,
            "UCX_MEMTYPE_CACHE": "n",
            "UCX_TLS": DEFAULT_UCX_TLS,
        }
        assert placement.ucx == f"UCX_TLS={DEFAULT_UCX_TLS} (CUDA host)"
    assert DEFAULT_UCX_TLS == "tcp,cuda_copy,cuda_ipc"


def test_without_cuda_ucx_picks_its_own_transports():
    """No CUDA transports forced on a CPU host: UCX would warn that they are
    missing, and a fixed list would shut out its shared-memory transports."""
    plan = plan_replicas(2, gpus=(), xavier=True, user_env={})
    for placement in plan:
        assert placement.address_scheme == "nixl"
        assert placement.gpu is None
        assert "UCX_TLS" not in placement.env_dict()
        assert "UCX picks its transports" in placement.ucx


def test_cpu_xavier_replicas_keep_the_cpus_vllm_keeps_without_a_connector():
    """With a KV connector vLLM's CPU backend reserves a second CPU per rank;
    a CPU replica with Xavier reserves one per rank, as vLLM does without one,
    unless the user says; GPU hosts and plain replicas are left alone."""
    for ranks in (1, 2):
        plan = plan_replicas(
            2, gpus=(), xavier=True, user_env={}, devices_per_replica=ranks
        )
        for placement in plan:
            assert placement.env_dict()["VLLM_CPU_NUM_OF_RESERVED_CPU"] == str(ranks)
    user = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    (kept,) = plan_replicas(1, gpus=(), xavier=True, user_env=user)
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in kept.env_dict()  # inherited
    (plain,) = plan_replicas(1, gpus=(), xavier=False, user_env={})
    (gpu,) = plan_replicas(1, gpus=("0",), xavier=True, user_env={})
    for placement in (plain, gpu):
        assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in placement.env_dict()


def test_a_user_ucx_tls_is_kept_and_reported():
    user = {"UCX_TLS": "rc,cuda_copy"}
    env = replica_environment(xavier=True, gpu=None, user_env=user, cuda_host=True)
    assert env["UCX_TLS"] == "rc,cuda_copy"
    assert env["UCX_MEMTYPE_CACHE"] == "n"
    # Without CUDA the sub-pool inherits the user's UCX_TLS from the worker.
    assert "UCX_TLS" not in replica_environment(
        xavier=True, gpu=None, user_env=user, cuda_host=False
    )
    for cuda_host in (True, False):
        assert (
            describe_ucx(xavier=True, user_env=user, cuda_host=cuda_host)
            == "UCX_TLS=rc,cuda_copy (set by you)"
        )
    assert describe_ucx(xavier=False, user_env=user, cuda_host=True) == ""


def test_plain_replicas_get_plain_pools_and_no_ucx_settings():
    (placement,) = plan_replicas(1, gpus=(), xavier=False, user_env={})
    assert placement.address_scheme is None
    assert placement.env_dict() == {}


def test_replicas_spread_over_gpus_round_robin():
    plan = plan_replicas(3, gpus=("2", "5"), xavier=True, user_env={})
    assert [p.gpu for p in plan] == ["2", "5", "2"]
    assert [p.env_dict()["CUDA_VISIBLE_DEVICES"] for p in plan] == ["2", "5", "2"]


def test_at_least_one_replica():
    with pytest.raises(ValueError, match="num_replicas"):
        plan_replicas(0, gpus=(), xavier=False, user_env={})


def test_replicas_sharing_a_gpu_split_its_memory_and_load_one_by_one():
    plan = plan_replicas(2, gpus=("0",), xavier=True, user_env={})
    assert [p.gpu for p in plan] == ["0", "0"]
    assert all(p.shares_gpu for p in plan)
    assert [p.gpu_memory_utilization for p in plan] == [0.4, 0.4]
    alone = plan_replicas(2, gpus=("0", "1"), xavier=True, user_env={})
    assert not any(p.shares_gpu for p in alone)
    assert [p.gpu_memory_utilization for p in alone] == [None, None]


GiB = 1024**3


def test_a_device_budget_beyond_the_memory_that_holds_it_is_refused():
    """Two replicas on one GPU of 80 GiB: 40 GiB each fits, 41 GiB each does not;
    the refusal names the budget, the need and what the GPU has."""
    shared = plan_replicas(2, gpus=["0"], xavier=True, user_env={})
    memory = {"0": 80 * GiB}
    fits = device_budget_refusal(
        shared, 40 * GiB, gpu_memory=memory, host_available_bytes=0, worker="w:1"
    )
    assert fits is None
    refusal = device_budget_refusal(
        shared, 41 * GiB, gpu_memory=memory, host_available_bytes=0, worker="w:1"
    )
    assert refusal == (
        "xavier_gpu_cache_bytes 41.0 GiB per replica does not fit: 2 replica(s) on "
        "GPU 0 of worker w:1 need 82.0 GiB of its memory, and it has 80.0 GiB in all"
    )
    # spread over two GPUs, each holds one replica's budget
    spread = plan_replicas(2, gpus=["0", "1"], xavier=True, user_env={})
    two = {"0": 80 * GiB, "1": 80 * GiB}
    assert (
        device_budget_refusal(
            spread, 41 * GiB, gpu_memory=two, host_available_bytes=0, worker="w:1"
        )
        is None
    )


def test_without_a_gpu_the_device_tier_must_fit_in_available_host_memory():
    cpu = plan_replicas(2, gpus=[], xavier=True, user_env={})
    refusal = device_budget_refusal(
        cpu, 1024 * GiB, gpu_memory={}, host_available_bytes=20 * GiB, worker="w:1"
    )
    assert refusal is not None
    assert "xavier_gpu_cache_bytes 1.0 TiB per replica does not fit" in refusal
    assert "host memory" in refusal and "need 2.0 TiB" in refusal
    assert "20.0 GiB is available" in refusal
    assert (
        device_budget_refusal(
            cpu, 10 * GiB, gpu_memory={}, host_available_bytes=20 * GiB, worker="w"
        )
        is None
    )
    # a tensor-parallel replica without a GPU: each of its ranks keeps a tier
    # in host memory (2 replicas x 2 ranks x 6 GiB > 20 GiB; one rank each fits)
    two_ranks = device_budget_refusal(
        cpu,
        6 * GiB,
        gpu_memory={},
        host_available_bytes=20 * GiB,
        worker="w",
        ranks_per_replica=2,
    )
    assert two_ranks is not None and "4 engine rank(s)" in two_ranks
    assert "need 24.0 GiB" in two_ranks
    assert (
        device_budget_refusal(
            cpu, 6 * GiB, gpu_memory={}, host_available_bytes=20 * GiB, worker="w"
        )
        is None
    )
    # no budget (CPU tier only) or a zero one: nothing to hold
    for budget in (0, None):
        assert (
            device_budget_refusal(
                cpu, budget or 0, gpu_memory={}, host_available_bytes=0, worker="w"
            )
            is None
        )


def test_tensor_parallel_replicas_get_their_own_devices():
    plan = plan_replicas(
        2, gpus=("0", "1", "2", "3"), xavier=True, user_env={}, devices_per_replica=2
    )
    assert [p.gpu for p in plan] == ["0,1", "2,3"]
    assert [p.env_dict()["CUDA_VISIBLE_DEVICES"] for p in plan] == ["0,1", "2,3"]
    assert not any(p.shares_gpu for p in plan)
    # Fewer GPUs than replicas * ranks: whole groups are shared, never split.
    shared = plan_replicas(
        2, gpus=("0", "1", "2"), xavier=True, user_env={}, devices_per_replica=2
    )
    assert [p.gpu for p in shared] == ["0,1", "0,1"]
    assert all(p.shares_gpu for p in shared)


def test_a_tensor_parallel_replica_needs_that_many_gpus():
    with pytest.raises(ValueError, match="needs 2 GPUs, and 1 are available"):
        plan_replicas(2, gpus=("0",), xavier=True, user_env={}, devices_per_replica=2)


def test_cpu_tensor_parallel_ranks_get_their_threads_bound():
    """vLLM's CPU backend refuses 2 ranks on a host without 2 NUMA nodes unless
    each rank's CPUs are named; the user's own choice is kept."""
    plan = plan_replicas(
        2, gpus=(), xavier=True, user_env={}, devices_per_replica=2, host_cpus=2
    )
    assert [p.env_dict()["VLLM_CPU_OMP_THREADS_BIND"] for p in plan] == ["0|1", "0|1"]
    big = plan_replicas(
        2, gpus=(), xavier=True, user_env={}, devices_per_replica=2, host_cpus=16
    )
    assert [p.env_dict()["VLLM_CPU_OMP_THREADS_BIND"] for p in big] == [
        "0-3|4-7",
        "8-11|12-15",
    ]
    user = {"VLLM_CPU_OMP_THREADS_BIND": "all"}
    (kept,) = plan_replicas(
        1, gpus=(), xavier=False, user_env=user, devices_per_replica=2, host_cpus=2
    )
    assert "VLLM_CPU_OMP_THREADS_BIND" not in kept.env_dict()  # inherited
    (single,) = plan_replicas(1, gpus=(), xavier=True, user_env={}, host_cpus=2)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in single.env_dict()


def test_each_rank_of_a_tensor_parallel_replica_holds_its_budget_on_its_gpu():
    plan = plan_replicas(
        2, gpus=("0", "1"), xavier=True, user_env={}, devices_per_replica=2
    )
    # both replicas share GPUs 0 and 1: each GPU holds two ranks' device tiers
    refusal = device_budget_refusal(
        plan,
        600,
        gpu_memory={"0": 1000, "1": 1000},
        host_available_bytes=10**12,
        worker="w",
    )
    assert refusal is not None and "2 replica(s) on GPU 0" in refusal
    assert (
        device_budget_refusal(
            plan,
            500,
            gpu_memory={"0": 1000, "1": 1000},
            host_available_bytes=0,
            worker="w",
        )
        is None
    )
