"""More ranks than GPUs on a node: each sharing rank becomes its own NCCL host (NCCL_HOSTID)."""

from instrumented_ddp.distributed import gpu_sharing_env


def test_two_ranks_on_one_gpu_get_distinct_host_ids_and_loopback() -> None:
    envs = [gpu_sharing_env(rank, 2, 2, 1, {}, "box") for rank in (0, 1)]
    assert envs[0] == {"NCCL_HOSTID": "box-ddpwatch-local-rank-0", "NCCL_SOCKET_IFNAME": "lo"}
    assert envs[1]["NCCL_HOSTID"] == "box-ddpwatch-local-rank-1"


def test_one_gpu_per_rank_changes_nothing() -> None:
    assert gpu_sharing_env(1, 2, 2, 2, {}, "host") == {}
    assert gpu_sharing_env(0, 1, 1, 8, {}, "host") == {}


def test_no_gpu_changes_nothing() -> None:
    assert gpu_sharing_env(1, 2, 2, 0, {}, "host") == {}


def test_a_users_own_nccl_settings_are_kept() -> None:
    assert gpu_sharing_env(1, 4, 4, 2, {"NCCL_HOSTID": "mine"}, "host") == {}
    assert gpu_sharing_env(1, 4, 4, 2, {"NCCL_SOCKET_IFNAME": "eth0"}, "host") == {"NCCL_HOSTID": "host-ddpwatch-local-rank-1"}


def test_several_nodes_do_not_talk_over_loopback() -> None:
    assert gpu_sharing_env(0, 2, 4, 1, {}, "host") == {"NCCL_HOSTID": "host-ddpwatch-local-rank-0"}
