"""What ddpwatch reads of a model the user attached (a DDP or an FSDP2 model): the process
group its collectives run on and the ranks its all-reduces meet, the device and backend it
computes and communicates on, and the bucket caps DDP was given. ``Attachment`` asks these once,
at ``attach``; each is a question about torch's objects, kept apart from the hooks that time
the loop."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from instrumented_ddp.timing.fsdp_timing import FSDPTiming


def all_reduce_group(model: nn.Module, sharded: bool) -> list[int]:
    """The ranks the model's all-reduces meet (``Hello.all_reduce_group``), where not the world:
    an HSDP model's replicas of this rank's shard, or the subgroup a DDP was built on; [] else."""
    if sharded:
        from instrumented_ddp.timing.fsdp_timing import replica_ranks

        return replica_ranks(model)
    group = cast(DistributedDataParallel, model).process_group
    return dist.get_process_group_ranks(group) if group.size() != dist.get_world_size() else []


def strategy_group(model: nn.Module, sharded: bool) -> dist.ProcessGroup:
    """The process group the model's own collectives run on: DDP's buckets, FSDP's all-gathers
    and reduce-scatters (its mesh's shard dimension; the default group where FSDP keeps none)."""
    if sharded:
        from instrumented_ddp.timing.fsdp_timing import shard_group

        return shard_group(model) or dist.distributed_c10d._get_default_group()
    return cast(DistributedDataParallel, model).process_group


def sharded_timing(model: nn.Module, timeline: Any) -> FSDPTiming:
    """``FSDPTiming`` for a model ``sharded_model_problem`` passed (so FSDP2's comms import)."""
    from instrumented_ddp.timing.fsdp_timing import FSDPTiming

    return FSDPTiming(model, timeline)


def compute_device(model: nn.Module, module: nn.Module, sharded: bool) -> torch.device:
    """The device the model computes on, whose clock times its steps: its parameters', but for
    an FSDP2 model FSDP's own (``FSDPState._device``): with ``CPUOffloadPolicy`` its sharded
    parameters stay on the host while it computes on the GPU, and read from them a GPU run was
    timed on the host's clock (launch times for compute, a device sync at each step's end to read
    its loss) and sampled as a CPU's."""
    if sharded:
        try:
            return torch.device(cast("FSDPModule", model)._get_fsdp_state()._device)  # ``sharded``: an FSDP2 model
        except Exception:  # FSDP's internals as a later torch may name them
            pass
    return next(module.parameters()).device


def first_bucket_setting(ddp: DistributedDataParallel) -> dict[str, float]:
    """``{"first_bucket_mb": ...}`` where DDP caps its first bucket below the others: at 1 MiB
    where ``bucket_cap_mb`` was not given (torch's ``_BucketCapacityConfig``; a torch without it
    always did); else nothing. The advisor simulates it: the Trainer's DDP, at its default, was
    simulated as one of 25 MB first buckets."""
    config = getattr(ddp, "_bucket_config", None)
    first = getattr(config, "first_bucket_bytes_cap", None) if config is not None else dist._DEFAULT_FIRST_BUCKET_BYTES
    if not isinstance(first, int) or first <= 0 or first >= ddp.bucket_bytes_cap:
        return {}
    return {"first_bucket_mb": megabytes_given(first)}


def backend_of(group: dist.ProcessGroup | None, device: torch.device) -> str:
    """The backend the model's collectives run on: the group's for the model's device. A group
    made with no backend named (``init_process_group()``, torch's default of gloo for the CPU and
    NCCL for CUDA) calls itself ``undefined``, and the advisor simulated a GPU run's buckets on
    gloo's two workers instead of NCCL's one stream."""
    try:
        return str((group or dist.distributed_c10d._get_default_group())._get_backend(device).name())
    except Exception:  # no backend for that device, or a torch that names it otherwise
        return str(dist.get_backend(group))


def steps_any_of(optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor]) -> bool:
    """Whether ``optimizer`` holds any of ``parameters`` (the very tensors: a model's, FSDP's
    sharded ones), so that its ``step()`` updates them."""
    held = {id(p) for p in parameters}
    return any(id(p) in held for group in optimizer.param_groups for p in group["params"])


def megabytes_given(cap_bytes: int) -> float:
    """The ``bucket_cap_mb`` a DDP was most likely given: the shortest decimal that DDP's
    ``int(bucket_cap_mb * 1024 * 1024)`` turns into ``cap_bytes`` (0.3, where the bytes alone read
    0.2999992370605469 MB)."""
    exact = cap_bytes / 2**20
    for digits in range(10):
        given = round(exact, digits)
        if int(given * 1024 * 1024) == cap_bytes:
            return given
    return exact
