"""``zero1``: ``bucket``'s gradients, with the optimizer state sharded (ZeRO stage 1)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from instrumented_ddp.timing.collectives import all_gather
from instrumented_ddp.strategies.base import FullOptimizerState
from instrumented_ddp.strategies.bucket import BucketedAsyncHook, GradientBucket


@dataclass
class ParameterShard:
    """One bucket's parameters as one flat tensor they are views of, and this rank's slice of it.

    The flat tensor has the bucket's layout (the gradient buffer's, padded to a multiple of the
    world size), so slice ``r`` of the averaged gradients is exactly the gradient of slice ``r``
    of the parameters. ``shard`` is a view: the optimizer updates the parameters in place, and
    one all-gather hands every rank the slices the others updated.
    """

    flat: torch.Tensor
    shard: nn.Parameter
    start: int  # where ``shard`` begins in ``flat``: rank x its size
    offsets: list[tuple[int, int]]  # (start, numel) of each of the bucket's parameters in ``flat``

    def slice_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of a tensor laid out like ``flat`` (a view)."""
        return whole[self.start : self.start + self.shard.numel()]


def _after_step_of(strategy: weakref.ref[ShardedOptimizerState]) -> Callable[..., None]:
    """The optimizer's step hook, holding its strategy weakly. The strategy holds the optimizer
    (``_optimizer``), so a hook holding the strategy would make a cycle that keeps both, with
    every parameter, gradient buffer and moment they hold, alive after ``del`` or ``unwrap`` until
    Python's cyclic collector runs, and the strategy wrapped next would count them in its memory
    peak."""
    def after_step(*_: Any) -> None:
        if (alive := strategy()) is not None:
            alive._after_step()
    return after_step


class ShardedOptimizerState(BucketedAsyncHook):
    """Gradients are averaged exactly as ``bucket`` does, but each rank's optimizer holds only
    its 1/N slice of every bucket, so AdamW's two moments take 1/N of the memory. After the
    step the updated slices are all-gathered (one call per bucket, in the optimizer phase) and
    the full gradients, which the step consumed, are zeroed. A parameter that got no gradient
    is averaged as zeros, as in ``bucket``.

    The strategy owns the optimizer: make it with ``make_optimizer``, whose step runs the
    all-gather. An element-wise optimizer (SGD, Adam, AdamW) steps a slice as it would the
    whole; one that reads whole tensors (a norm, LAMB) would not be ZeRO-1's to shard.
    """

    name: ClassVar[str] = "zero1"

    def _buffer_numel(self, gradient_numel: int) -> int:
        return -(-gradient_numel // self.world_size) * self.world_size

    def _attach(self) -> None:
        super()._attach()
        self.rank = dist.get_rank(self.process_group)
        self.shards = [self._shard(bucket) for bucket in self.buckets]
        self._step_hook: RemovableHandle | None = None

    def _shard(self, bucket: GradientBucket) -> ParameterShard:
        flat = torch.zeros_like(bucket.allocated_buffer)
        offsets, offset = [], 0
        with torch.no_grad():
            for parameter in bucket.parameters:
                numel = parameter.numel()
                flat[offset : offset + numel].copy_(parameter.reshape(-1))
                parameter.data = flat[offset : offset + numel].view_as(parameter)
                offsets.append((offset, numel))
                offset += numel
        size = flat.numel() // self.world_size
        start = self.rank * size
        return ParameterShard(flat, nn.Parameter(flat[start : start + size]), start, offsets)

    def _detach(self) -> None:
        super()._detach()
        if self._step_hook is not None:  # a step after unwrap all-gathers nothing
            self._step_hook.remove()
            self._step_hook = None
        for bucket in self.buckets:
            for parameter in bucket.parameters:  # the bare model owns its storage again
                parameter.data = parameter.data.clone()

    # -- the optimizer steps this rank's slices -----------------------------------------------
    def optimized_parameters(self) -> list[nn.Parameter]:
        return [shard.shard for shard in self.shards]

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **options: Any) -> torch.optim.Optimizer:
        optimizer = super().make_optimizer(optimizer_class, **options)
        if self._step_hook is not None:
            self._step_hook.remove()  # the optimizer made before (a second make_optimizer) gathers no more
        self._step_hook = optimizer.register_step_post_hook(_after_step_of(weakref.ref(self)))
        return optimizer

    def finish_gradient_sync(self) -> None:
        if self._sync_enabled and self._optimizer is None:
            raise RuntimeError(f"{self.name} shards the optimizer state: make the optimizer with "
                               f"model.make_optimizer(torch.optim.AdamW, lr=...)")
        super().finish_gradient_sync()
        if self._sync_enabled:
            self._point_shard_gradients()

    def _point_shard_gradients(self) -> None:
        """Each slice's gradient is its slice of the averaged bucket (a view: no copy)."""
        for bucket, shard in zip(self.buckets, self.shards, strict=True):
            shard.shard.grad = shard.slice_of(bucket.allocated_buffer)

    @torch.no_grad()
    def _after_step(self) -> None:
        """All-gather each bucket in place: the input is the output's own slice (``shard.shard``
        is a view of ``flat`` at rank x its size), which NCCL gathers in place by design and gloo
        correctly (2 and 3 ranks, pinned by the float64 tests), so no copy of the slice is made."""
        works = [self._collective("all_gather", shard.shard.detach(), output=shard.flat, tag=f"g{index}",
                                  async_op=True) for index, shard in enumerate(self.shards)]
        self._wait_all(works)
        self._zero_full_gradients()

    def _zero_full_gradients(self) -> None:
        for bucket in self.buckets:
            bucket.allocated_buffer.zero_()

    # -- the whole state, for a switch ----------------------------------------------------------
    def full_optimizer_state(self) -> FullOptimizerState:
        """Each slice's state all-gathered and cut back into parameters (a collective)."""
        optimizer = self._optimizer
        whole: FullOptimizerState = []
        for bucket, shard in zip(self.buckets, self.shards, strict=True):
            entries = optimizer.state.get(shard.shard, {}) if optimizer is not None else {}
            gathered: dict[str, torch.Tensor] = {}
            for key, value in entries.items():
                if value.dim() > 0:
                    full = torch.empty_like(shard.flat, dtype=value.dtype)
                    all_gather(full, value.contiguous(), group=self.process_group)
                    gathered[key] = full
                else:
                    gathered[key] = value.clone()
            for parameter, (start, numel) in zip(bucket.parameters, shard.offsets, strict=True):
                whole.append({key: value[start : start + numel].view_as(parameter).clone()
                              if value.shape == shard.flat.shape else value.clone() for key, value in gathered.items()})
        order = {id(p): i for i, p in enumerate(p for bucket in self.buckets for p in bucket.parameters)}
        return [whole[order[id(p)]] for p in self.trainable_parameters()]

    def _load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, state: FullOptimizerState) -> None:
        by_parameter = dict(zip((id(p) for p in self.trainable_parameters()), state, strict=True))
        for bucket, shard in zip(self.buckets, self.shards, strict=True):
            entries = [by_parameter[id(p)] for p in bucket.parameters]
            stepped = next((entry for entry in entries if entry), None)
            if stepped is None:
                continue  # none of the bucket's parameters ever stepped: the slice starts fresh
            # A parameter never stepped (FSDP steps none that no rank gave a gradient) has zero
            # moments in the slice and shares its step count; the other parameters' moments are kept.
            sliced: dict[str, torch.Tensor] = {}
            for key, first in stepped.items():
                if first.dim() == 0:
                    sliced[key] = first.clone()
                    continue
                full = torch.zeros(shard.flat.numel(), dtype=first.dtype, device=shard.flat.device)
                for parameter_state, (start, numel) in zip(entries, shard.offsets, strict=True):
                    if key in parameter_state:
                        full[start : start + numel].copy_(parameter_state[key].reshape(-1))
                sliced[key] = shard.slice_of(full).clone()
            optimizer.state[shard.shard] = sliced
