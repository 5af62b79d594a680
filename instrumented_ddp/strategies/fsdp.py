"""``fsdp``: PyTorch's own FSDP2 (``fully_shard``), the native sharded reference, as ``ddp`` is for ours."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from instrumented_ddp.timing.fsdp_timing import FSDPTiming
from instrumented_ddp.timing.timeline import NULL_TIMELINE
from instrumented_ddp.strategies.base import DataParallelStrategy, FullOptimizerState


def sharding_units(module: nn.Module) -> list[nn.Module]:
    """One FSDP unit per decoder layer (a Hugging Face model's ``model.layers``, or any
    ``ModuleList``'s children), then the root, which takes what is left (embeddings, head)."""
    layers = next((m for m in module.modules() if isinstance(m, nn.ModuleList)), None)
    return [*(layers if layers is not None else []), module]


class FullyShardedFSDP2(DataParallelStrategy):
    """Parameters, gradients and optimizer state are all sharded: each unit's parameters are
    all-gathered before its forward and again before its backward, freed after each, and its
    gradients reduce-scattered as backward leaves it. Every all-gather and reduce-scatter goes
    through ``TimedAllGather``/``TimedReduceScatter`` (``fsdp_timing.FSDPTiming``), so no profiler
    is needed to see them. A parameter that gets no gradient on any rank is left out of the
    reduce-scatter and not stepped (FSDP's rule); one that gets a gradient on some ranks only
    is not supported by FSDP.

    FSDP changes the module it shards (its class, its parameters become ``DTensor`` shards) and
    has no way back, so the strategy shards a copy and empties the original's tensors; ``unwrap``
    all-gathers the shards into the original and drops the copy, leaving no hook behind.
    """

    name: ClassVar[str] = "fsdp"
    #: The sharded copy, from ``_attach`` to ``_detach`` (set with ``object.__setattr__``: no submodule).
    sharded: nn.Module

    def _attach(self) -> None:
        sharded = copy.deepcopy(self.module)
        units = sharding_units(sharded)
        device = next(self.module.parameters()).device
        group = self.process_group or dist.group.WORLD
        assert group is not None, "DataParallelStrategy.__init__ checked that torch.distributed is initialized"
        mesh = DeviceMesh.from_group(group, device_type=device.type)
        for unit in units:
            fully_shard(unit, mesh=mesh)
        if self.timeline is not NULL_TIMELINE:
            FSDPTiming(sharded, self.timeline).install()  # the units numbered as here: the layers, then the root
        object.__setattr__(self, "sharded", sharded)  # not a submodule: the state dict stays the bare model's
        for tensor in [*self.module.parameters(), *self.module.buffers()]:  # the copy holds them now
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            tensor.grad = None  # zeros at a step boundary; left, the strategy before's full gradients (or bucket views) would stay held

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.timeline.phase("forward"):
            return self.sharded(*args, **kwargs)

    def train(self, mode: bool = True) -> FullyShardedFSDP2:
        """``train()``/``eval()`` reach the sharded copy, which is what runs (it is no submodule)."""
        super().train(mode)
        if "sharded" in self.__dict__:
            self.sharded.train(mode)
        return self

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """FSDP keeps accumulating unsharded gradients and reduce-scatters at the next synced backward."""
        sharded = self.sharded
        assert isinstance(sharded, FSDPModule), "_attach's fully_shard made the copy's root an FSDPModule"
        sharded.set_requires_gradient_sync(False)
        try:
            with super().no_sync():
                yield
        finally:
            sharded.set_requires_gradient_sync(True)

    def optimized_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.sharded.parameters() if p.requires_grad]

    @torch.no_grad()
    def _detach(self) -> None:
        sharded = self.sharded
        for original, shard in zip(self.module.parameters(), sharded.parameters(), strict=True):
            original.data = shard.full_tensor() if isinstance(shard, DTensor) else shard.detach().clone()
        for original_buffer, buffer in zip(self.module.buffers(), sharded.buffers(), strict=True):
            original_buffer.data = buffer.detach().clone()
        object.__delattr__(self, "sharded")

    def full_optimizer_state(self) -> FullOptimizerState:
        """Each DTensor state entry all-gathered whole (a collective), per parameter."""
        optimizer = self._optimizer
        if optimizer is None:
            return []
        return [{key: value.full_tensor() if isinstance(value, DTensor) else value.clone()
                 for key, value in optimizer.state.get(p, {}).items()} for p in self.optimized_parameters()]

    def _load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, state: FullOptimizerState) -> None:
        for parameter, entries in zip(self.optimized_parameters(), state, strict=True):
            if entries:
                assert isinstance(parameter, DTensor), "fully_shard made every parameter of the copy a DTensor shard"
                optimizer.state[parameter] = {
                    key: distribute_tensor(value.to(parameter.device), parameter.device_mesh, parameter.placements)
                    if value.dim() > 0 else value.clone() for key, value in entries.items()
                }
