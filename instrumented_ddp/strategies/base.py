"""What every data-parallel strategy shares.

A strategy wraps a model so that the training loop can stay the same for all nine: it calls the
wrapper like the model, runs ``backward`` and then ``finish_gradient_sync()`` after every backward,
uses ``no_sync()`` for the micro-steps of an accumulation that should not communicate, and gets
its optimizer from ``make_optimizer`` (the sharded strategies own theirs). What a
strategy changes is only *when* and *how* gradients are averaged; everything else lives here so the
subclasses read as the diff between one approach and the next, in the order of the article on
multi-GPU training techniques in PyTorch that the ladder follows (simple first, then each optimisation).

Communication goes through ``_all_reduce`` and parameters/buffers through ``_broadcast_state``:
they are the single places where a collective is issued and completed, which is where the timing
layer hooks in.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from instrumented_ddp.timing.collectives import timed_collective
from instrumented_ddp.resources.memory import reset_peak
from instrumented_ddp.wire.messages import bucket_mb_problem
from instrumented_ddp.timing.timeline import NULL_TIMELINE, NullTimeline, StepTimeline


#: One dict per trainable parameter: each optimizer state entry whole (AdamW: ``step``,
#: ``exp_avg``, ``exp_avg_sq``), what a switch hands from one strategy's optimizer to the next.
FullOptimizerState = list[dict[str, torch.Tensor]]


class DataParallelStrategy(nn.Module):
    """Base of the nine strategies: broadcast at wrap time, ``no_sync``, ``make_optimizer``, ``unwrap``."""

    name: ClassVar[str]
    #: True when the strategy averages after every micro-step even while accumulating (the
    #: ladder's baseline); False when the loop may skip communication with ``no_sync``.
    syncs_every_micro_step: ClassVar[bool] = False
    #: True for the strategies whose behaviour depends on ``bucket_mb``.
    uses_bucket_mb: ClassVar[bool] = False

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_mb: float = 25.0,
        process_group: dist.ProcessGroup | None = None,
        timeline: StepTimeline | NullTimeline = NULL_TIMELINE,
    ) -> None:
        super().__init__()
        self.timeline = timeline
        if not dist.is_initialized():
            raise RuntimeError("instrumented_ddp.wrap needs an initialized torch.distributed process group")
        if (problem := bucket_mb_problem(bucket_mb)) is not None:  # before the broadcast: every rank given it stops here
            raise ValueError(problem)
        self.module = module
        self.bucket_mb = float(bucket_mb)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self._sync_enabled = True
        self._attached = False
        self._optimizer: torch.optim.Optimizer | None = None
        self._broadcast_state()
        self._attach()
        self._attached = True
        reset_peak(next(module.parameters(), torch.empty(0)).device)

    # -- what the training loop calls ------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.timeline.phase("forward"):
            return self.module(*args, **kwargs)

    @property
    def excluded_from_statistics(self) -> bool:
        """True while the current step is not representative of the strategy (warm-up)."""
        return False

    @property
    def settings(self) -> dict[str, Any]:
        """The settings that change what this strategy does (they name a segment)."""
        return {"bucket_mb": self.bucket_mb} if self.uses_bucket_mb else {}

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside the context communicates."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_gradient_sync(self) -> None:
        """Called after every backward: make averaged gradients ready for the optimizer.

        Strategies that overlap communication with backward only wait here; the others do all
        their communication here. Inside ``no_sync`` it does nothing.
        """

    def unwrap(self) -> nn.Module:
        """Remove every hook this strategy installed and hand back the bare model."""
        if self._attached:
            self._detach()
            self._attached = False
        return self.module

    # -- the optimizer: over the whole model, or over this rank's shard ---------------------------
    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], *, state: FullOptimizerState | None = None,
                       **options: Any) -> torch.optim.Optimizer:
        """The optimizer of this strategy, ``optimizer_class(parameters, **options)``: over every
        parameter for the replicated strategies, over this rank's shard for the sharded ones,
        which is why the strategy makes it. ``state``: what ``full_optimizer_state`` gave before a
        switch, so the moments of an element-wise optimizer (AdamW) carry over unchanged."""
        optimizer = optimizer_class(self.optimized_parameters(), **options)
        self._optimizer = optimizer
        if state is not None:
            self._load_full_optimizer_state(optimizer, state)
        return optimizer

    def full_optimizer_state(self) -> FullOptimizerState:
        """Per trainable parameter (``trainable_parameters`` order), its optimizer state whole, on
        every rank: a collective for the sharded strategies, which gather their shards."""
        optimizer = self._optimizer
        if optimizer is None:
            return []
        return [dict(optimizer.state.get(p, {})) for p in self.trainable_parameters()]

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The one ``make_optimizer`` made last, if any."""
        return self._optimizer

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers whose state ``memory.held_memory`` counts: that one, if made."""
        return () if self._optimizer is None else (self._optimizer,)

    def optimized_parameters(self) -> list[nn.Parameter]:
        """What this rank's optimizer steps: the model's parameters, or this rank's shards of them."""
        return self.trainable_parameters()

    def held_parameters(self) -> list[torch.Tensor]:
        """Every parameter tensor this rank holds (``memory.held_memory`` counts each storage once)."""
        return [*self.module.parameters(), *self.optimized_parameters()]

    def _load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, state: FullOptimizerState) -> None:
        for parameter, entries in zip(self.trainable_parameters(), state, strict=True):
            if entries:  # a 0-dim step stays where it was (the host): on the device, Adam syncs on it per parameter
                optimizer.state[parameter] = {k: v if v.dim() == 0 else v.to(parameter.device) for k, v in entries.items()}

    # -- what subclasses specialise -------------------------------------------------------------
    def _attach(self) -> None:
        """Install hooks; called once at wrap time."""

    def _detach(self) -> None:
        """Undo ``_attach`` so that a backward communicates nothing."""

    # -- shared machinery ------------------------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters in ``module.parameters()`` order: the order every rank agrees on."""
        return [p for p in self.module.parameters() if p.requires_grad]

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        """Start every rank from rank 0's parameters and buffers, one flat broadcast per dtype."""
        tensors = [t for t in [*self.module.parameters(), *self.module.buffers()]]
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for tensor in tensors:
            by_kind.setdefault((tensor.device, tensor.dtype), []).append(tensor)
        source = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
        for group in by_kind.values():
            flat = _flatten_dense_tensors([t.data for t in group])
            self._collective("broadcast", flat, tag="state", async_op=False, src=source)
            for tensor, synced in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                tensor.data.copy_(synced)

    def _all_reduce(self, tensor: torch.Tensor, *, tag: str, async_op: bool,
                    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, marks_ready: bool = False) -> dist.Work | None:
        """Reduce ``tensor`` across ranks in place; with the default sum the caller divides by
        the world size. ``marks_ready``: issued as its gradient became ready (see ``timed_collective``)."""
        return self._collective("all_reduce", tensor, tag=tag, async_op=async_op, op=op, marks_ready=marks_ready)

    def _collective(
        self, kind: str, tensor: torch.Tensor, *, tag: str, async_op: bool, src: int = 0,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, marks_ready: bool = False, output: torch.Tensor | None = None,
    ) -> dist.Work | None:
        """Issue and time a collective in this strategy's group (see ``timed_collective``)."""
        return timed_collective(self.timeline, kind, tensor, tag=tag, async_op=async_op, group=self.process_group,
                                src=src, op=op, marks_ready=marks_ready, output=output)

    def _wait_all(self, works: list[dist.Work | None]) -> None:
        """Block until outstanding collectives finish; that blocked time is a ``wait`` span."""
        with self.timeline.phase("wait", blocking=True):
            for work in works:
                if work is not None:
                    work.wait()

    @staticmethod
    def _gradient_or_zeros(parameter: torch.Tensor) -> torch.Tensor:
        """A parameter that got no gradient this step still joins the collective, as zeros.

        Every rank must issue the same collectives in the same order, whatever its data did.
        """
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        return parameter.grad
