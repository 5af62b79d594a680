"""Process-group setup that works the same under torchrun, on several nodes, and as one process.

A single ``python train.py`` still gets a (one-rank) process group, so the strategies, the
checksum and the telemetry run one code path whatever the world size.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(choice: str, local_rank: int) -> torch.device:
    """``auto`` means this rank's GPU when CUDA is there, else the CPU."""
    if choice not in {"auto", "cpu", "cuda"}:
        raise ValueError(f"--device must be auto, cpu or cuda, not {choice!r}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine (use --device auto or cpu)")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def gpu_sharing_env(local_rank: int, local_world_size: int, world_size: int, device_count: int,
                    environ: Mapping[str, str], hostname: str) -> dict[str, str]:
    """The environment that lets more ranks than GPUs on a node run NCCL, or ``{}`` if none is needed.

    NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), judging
    "one GPU" by bus id on one host, and a host by ``NCCL_HOSTID`` where that is set. So each
    rank that shares a GPU is given its own host id: NCCL then joins the ranks through its
    socket transport, as if they were on different machines, and the GPU time-slices their
    kernels. Right for checking what is counted and timed (``ddpwatch doctor --ranks 2`` on a
    one-GPU machine), wrong for judging speed. One node only talks over loopback; a user's own
    ``NCCL_HOSTID`` or ``NCCL_SOCKET_IFNAME`` is kept.
    """
    if device_count < 1 or local_world_size <= device_count or "NCCL_HOSTID" in environ:
        return {}
    sharing = {"NCCL_HOSTID": f"{hostname}-ddpwatch-local-rank-{local_rank}"}
    if world_size == local_world_size and "NCCL_SOCKET_IFNAME" not in environ:
        sharing["NCCL_SOCKET_IFNAME"] = "lo"
    return sharing


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device_choice: str = "auto", timeout_s: float = 300.0) -> DistributedContext:
    """Join the process group torchrun describes in the environment, or make a one-rank group."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_choice, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        sharing = gpu_sharing_env(local_rank, local_world_size, int(os.environ.get("WORLD_SIZE", "1")),
                                  torch.cuda.device_count(), os.environ, socket.gethostname())
        os.environ.update(sharing)
        if sharing and local_rank == 0:
            print(f"{local_world_size} ranks share {torch.cuda.device_count()} GPU(s) on this node: each rank is its own "
                  "NCCL host (NCCL_HOSTID), so collectives go through sockets and kernels time-slice - "
                  "right for checking ddpwatch's counts and timings, not for speed", file=sys.stderr, flush=True)
    timeout = timedelta(seconds=timeout_s)
    if launched_by_torchrun():
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistributedContext(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def shutdown_distributed() -> None:
    """Leave together: a rank that tears gloo down while a peer still talks to it can abort."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a training process without interpreter shutdown, after flushing its output.

    A gloo worker thread can still be destroying the last step's collective work objects after
    ``destroy_process_group`` (the barrier holds weak references to them); those destructors take
    the GIL, and a thread that takes it during ``Py_FinalizeEx`` is forced to exit inside a
    ``noexcept`` destructor: ``terminate called without an active exception``, SIGABRT, and a
    run that finished reads as failed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
