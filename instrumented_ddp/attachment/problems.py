"""What is wrong with an ``attach``, found before anything is installed, in one line that names
the fix (``attach_problem``); and what ``attach`` looks through to find the model and the
optimizer the loop really runs (a ``torch.compile`` wrapper, Accelerate's optimizer wrapper).

Kept apart from ``attachment`` so that the rules a user meets first read in one place, each with
the case it answers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["attach_problem", "builtin_comm_hook", "compiled_module", "innermost_optimizer", "is_fsdp2",
           "optimizer_problem", "optimizers_given", "sharded_model_problem", "training_began"]


def attach_problem(model: Any, optimizer: Any) -> str | None:
    """What is wrong with attaching to ``model`` and ``optimizer`` (one, or a list of each that
    steps the model), in words that name the fix."""
    if not dist.is_available() or not dist.is_initialized():
        return "no process group: call torch.distributed.init_process_group() (torchrun sets it up) before attach"
    resumed = getattr(model, "_ddpwatch_timing", None) is not None  # ddpwatch's own hook or comms, kept since an attach
    if is_fsdp2(model):
        problem = None if resumed else sharded_model_problem(model)
        if problem is not None:
            return problem
    elif not isinstance(model, DistributedDataParallel):
        kind = type(model).__name__
        if isinstance(model, nn.Module) and any(is_fsdp2(m) for m in model.modules()):
            return (f"the model is a {kind} whose layers are sharded with fully_shard but not the model itself: "
                    "call fully_shard(model) on the root too (FSDP2 wants it), and attach that")
        if kind == "FullyShardedDataParallel":
            return ("the model is FSDP1's FullyShardedDataParallel, which ddpwatch cannot time: "
                    "shard with FSDP2's fully_shard (torch.distributed.fsdp.fully_shard) to watch it")
        if isinstance(model, nn.Module):
            return (f"the model is a {kind}, not DistributedDataParallel: wrap it first, "
                    "model = DistributedDataParallel(model), and attach that")
        return f"the model is a {kind}, not a DistributedDataParallel module"
    if getattr(model, "_ddpwatch_attached", False):
        return f"this {type(model).__name__} is already attached: call attach once per model"
    hook = builtin_comm_hook(model) if isinstance(model, DistributedDataParallel) and not resumed else None
    if hook is not None:
        return (f"this DistributedDataParallel has the built-in communication hook {hook!r}, which runs in C++ where "
                "ddpwatch cannot see its all-reduces: register its Python equivalent instead "
                "(torch.distributed.algorithms.ddp_comm_hooks.default_hooks: allreduce_hook, fp16_compress_hook), "
                "or none, to watch this run")
    given = optimizers_given(optimizer)
    if not given:
        return "no optimizer given: pass the one that steps this model, or a list of each that does"
    for each in given:
        problem = optimizer_problem(each)
        if problem is not None:
            return problem
    if len({id(innermost_optimizer(each)) for each in given}) < len(given):
        return "an optimizer is given twice: list each optimizer that steps this model once"
    if training_began(model) and not resumed:
        return "training has already begun (gradients exist): call attach right after wrapping in DDP, before the first backward"
    return None


def optimizers_given(optimizer: Any) -> list[Any]:
    """What ``attach`` was given as ``optimizer``: one, or a list or tuple of them (a loop that
    steps several over one model: Muon's matrices and AdamW's rest), as the loop holds each."""
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def optimizer_problem(optimizer: Any) -> str | None:
    """What keeps ``optimizer`` from marking the updates of ``model``: not a torch optimizer (under
    the wrappers ``innermost_optimizer`` looks through), or none of its step hooks. Whose
    parameters it holds is not asked: a stand-in that updates none (transformers' layer-wise
    optimizers, which update each parameter in its gradient's hook, keep a dummy tensor) still
    marks each update with its ``step()``."""
    inner = innermost_optimizer(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        return f"the optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer: pass the one that steps this model"
    if not hasattr(inner, "_optimizer_step_pre_hooks"):
        return (f"the optimizer is a {type(inner).__name__} that never ran torch.optim.Optimizer.__init__, so it has no "
                "step hooks to end a step with: pass the torch optimizer it wraps, whose step() it calls")
    return None


def is_fsdp2(model: Any) -> bool:
    """Whether ``model`` was sharded with FSDP2's ``fully_shard`` (which makes its class a subclass
    of ``FSDPModule``), read by name: FSDP2 is imported only for a model that uses it, so a DDP
    run is attached on a torch whose FSDP2 ddpwatch cannot time."""
    return any(cls.__name__ == "FSDPModule" for cls in type(model).__mro__)


def sharded_model_problem(model: nn.Module) -> str | None:
    """What keeps a ``fully_shard`` model from being timed: a torch without FSDP2's custom comms,
    comms someone already set, or per-parameter meshes (FSDP refuses a custom comm on more than
    one param group)."""
    try:
        from instrumented_ddp.timing.fsdp_timing import custom_comms, fsdp_units, param_groups
    except ImportError:  # FSDPModule.set_custom_all_gather came with torch 2.9
        return (f"torch {torch.__version__} has no FSDP custom comms (FSDPModule.set_custom_all_gather, torch 2.9), "
                "through which ddpwatch times FSDP: upgrade torch to watch this run")
    for unit in fsdp_units(model):
        taken = custom_comms(unit)
        if taken:
            return (f"FSDP unit {type(unit).__name__} already has the custom comm {taken[0]} (set_custom_all_gather, "
                    "set_custom_reduce_scatter or symmetric memory), and ddpwatch times FSDP through those hooks: "
                    "leave FSDP's default comms to watch this run")
        if param_groups(unit) > 1:
            return (f"FSDP unit {type(unit).__name__} has parameters on more than one mesh (shard_placement_fn), "
                    "where FSDP takes no custom comm, and ddpwatch times FSDP through one: not supported")
    return None


def compiled_module(model: Any) -> Any:
    """The module ``torch.compile`` compiled, where ``model`` is its ``OptimizedModule`` (which
    keeps it as ``_orig_mod`` and calls it: hooks on it run, DDP's forward eagerly around the
    compiled module inside it); else ``model`` itself. ``torch.compile(ddp_model)`` is how a
    loop, and Accelerate under the Trainer's ``torch_compile``, compiles a DDP model."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(model, nn.Module) and isinstance(inner, nn.Module) else model


def builtin_comm_hook(ddp: DistributedDataParallel) -> str | None:
    """The name of a built-in (C++) communication hook registered on ``ddp``, or None. A Python
    hook is kept in ``_comm_hooks``; a built-in one only in DDP's logging data."""
    if ddp._comm_hooks:
        return None
    name = ddp._get_ddp_logging_data().get("comm_hook")
    return str(name) if name else None


def training_began(model: nn.Module) -> bool:
    """A gradient exists, or DDP has prepared a second training forward (its ``iteration`` counts
    forwards with gradients after the first): a backward has run."""
    if any(p.grad is not None for p in model.parameters()):
        return True
    return isinstance(model, DistributedDataParallel) and int(model._get_ddp_logging_data().get("iteration", 0)) > 0


def innermost_optimizer(optimizer: Any) -> Any:
    """The torch optimizer whose step hooks fire once per step of the loop's ``optimizer``: under
    a wrapper that keeps it as ``.optimizer`` and calls its ``step()`` (Accelerate's
    ``AcceleratedOptimizer``), that one; under one with no step hooks of its own that keeps it as
    ``.optim`` (PyTorch's ``PostLocalSGDOptimizer``, which never runs ``Optimizer.__init__``), that
    one. Not under one that has them: ``ZeroRedundancyOptimizer`` keeps its shard's optimizer as
    ``.optim`` too, and broadcasts the parameters after that one's step, inside its own."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) and not hasattr(optimizer, "_optimizer_step_pre_hooks"):
            inner = getattr(optimizer, "optim", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer
