"""Which UCX transports can join two NIXL agents: the one-host transports drop out
between hosts (pure; no NIXL needed)."""

from xinference.model.llm.vllm.xavier.transports.nixl.ucx import pair_transports

HOST_A = ("self", "tcp", "cma", "posix", "sysv", "rc_mlx5", "cuda_copy", "cuda_ipc")
HOST_B = ("self", "tcp", "cma", "posix", "rc_mlx5", "cuda_copy", "cuda_ipc")


def test_on_one_host_shared_memory_and_cuda_ipc_can_join_the_pair():
    assert pair_transports(HOST_A, HOST_B, same_host=True) == (
        "cma",
        "cuda_copy",
        "cuda_ipc",
        "posix",
        "rc_mlx5",
        "tcp",
    )


def test_across_hosts_only_network_transports_remain():
    assert pair_transports(HOST_A, HOST_B, same_host=False) == (
        "cuda_copy",
        "rc_mlx5",
        "tcp",
    )
    # a peer without RDMA: TCP it is
    assert pair_transports(HOST_A, ("self", "tcp", "cma"), same_host=False) == ("tcp",)


def test_nothing_in_common_is_an_empty_answer():
    assert pair_transports(("tcp",), ("rc_mlx5",), same_host=False) == ()
