"""``bucket``: async all-reduce over size-capped flat buckets, fixed at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from instrumented_ddp.wire.bucket_plan import TensorSize, plan_bucket_strategy
from instrumented_ddp.strategies.base import DataParallelStrategy


@dataclass
class GradientBucket:
    """Parameters whose gradients live as views in one flat buffer and travel in one all-reduce."""

    index: int
    parameters: list[nn.Parameter]
    numel: int  # of the flat buffer: the gradients', or more where a strategy pads it
    buffer: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    ready: set[int] = field(default_factory=set)
    work: dist.Work | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.parameters[0].element_size()

    @property
    def allocated_buffer(self) -> torch.Tensor:
        """``buffer``, where the caller's bucket has one: allocated at wrap time, and where
        ``zero2`` released it, allocated again by its first ready gradient, before it launches."""
        if self.buffer is None:
            raise RuntimeError(f"bucket b{self.index} has no buffer: released and not allocated again")
        return self.buffer

    def allocate(self) -> None:
        """A zeroed flat buffer, and each parameter's gradient-shaped view of it, in order."""
        first = self.parameters[0]
        self.buffer = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        self.views, offset = [], 0
        for parameter in self.parameters:
            self.views.append(self.buffer[offset : offset + parameter.numel()].view_as(parameter))
            offset += parameter.numel()

    def release(self) -> None:
        """Drop the buffer and the gradients that are views of it (``zero2``, once they are sent)."""
        for parameter in self.parameters:
            parameter.grad = None
        self.buffer, self.views = None, []


def plan_buckets(parameters: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Reverse parameter order (roughly the order backward produces gradients), as PyTorch's
    Reducer does, split where a bucket would pass ``cap_bytes`` or change device or dtype
    (``bucket_plan.plan_bucket_strategy``, the rule the advisor simulates too).

    The plan depends only on the model, so every rank builds the same buckets and launches them
    in the same order whatever order its hooks fire in (buckets built in hook-firing order could
    pair mismatched gradients across ranks).
    """
    sizes = [TensorSize(p.numel() * p.element_size(), f"{p.device}/{p.dtype}") for p in parameters]
    return [[parameters[index] for index in bucket] for bucket in plan_bucket_strategy(sizes, cap_bytes)]


class BucketedAsyncHook(DataParallelStrategy):
    """A bucket launches as soon as all its gradients are ready and every earlier bucket has
    launched; ``finish_gradient_sync`` launches the rest (a gradient no rank produced is zeros),
    waits, and averages every bucket not settled yet (``_settle``). Gradients are views into the
    bucket buffers, so there is no copy per step while the optimizer zeroes gradients in place
    (``zero_grad(set_to_none=False)``); a gradient that was set to ``None`` is copied into its
    view once, when it is ready again.
    """

    name: ClassVar[str] = "bucket"
    uses_bucket_mb: ClassVar[bool] = True

    @property
    def bucket_layout(self) -> list[list[int]]:
        """Parameter indices of each bucket, in launch order: among the trainable parameters, as
        the hello's ``parameter_layout`` lists them (indexed among all, a frozen parameter would
        shift every index after it, and the advisor would read the wrong sizes)."""
        index_of = {id(p): i for i, p in enumerate(self.trainable_parameters())}
        return [[index_of[id(p)] for p in bucket.parameters] for bucket in self.buckets]

    def _attach(self) -> None:
        cap_bytes = max(1, int(self.bucket_mb * 1024 * 1024))
        self.buckets: list[GradientBucket] = []
        self._location: dict[int, tuple[GradientBucket, int]] = {}
        for index, members in enumerate(plan_buckets(self.trainable_parameters(), cap_bytes)):
            bucket = GradientBucket(index, members, self._buffer_numel(sum(p.numel() for p in members)))
            bucket.allocate()
            for parameter, view in zip(members, bucket.views, strict=True):
                if parameter.grad is not None:
                    view.copy_(parameter.grad)
                    parameter.grad = view
            for position, parameter in enumerate(members):
                self._location[id(parameter)] = (bucket, position)
            self.buckets.append(bucket)
        self._next_to_launch = 0
        #: Buckets before this one were settled in this backward already (``zero2`` settles each as
        #: soon as its collective has completed, to give its full buffer back): never waited again.
        self._next_to_settle = 0
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._on_gradient_ready) for p in self.trainable_parameters()
        ]

    def _buffer_numel(self, gradient_numel: int) -> int:
        """Elements of a bucket's flat buffer holding ``gradient_numel`` gradients (ZeRO pads it)."""
        return gradient_numel

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_gradient_ready(self, parameter: torch.Tensor) -> None:
        if not self._sync_enabled:
            return
        self.timeline.poll()  # on the CPU, where this rank's thread sees earlier buckets complete
        bucket, position = self._location[id(parameter)]
        self._place_gradient_in_view(bucket, position)
        bucket.ready.add(position)
        if len(bucket.ready) == len(bucket.parameters):
            self.timeline.mark_ready(f"b{bucket.index}", bucket.nbytes)
        self._launch_ready_buckets()

    def _place_gradient_in_view(self, bucket: GradientBucket, position: int) -> None:
        if bucket.buffer is None:
            bucket.allocate()
        parameter, view = bucket.parameters[position], bucket.views[position]
        if parameter.grad is None:
            view.zero_()
        elif parameter.grad.data_ptr() != view.data_ptr():
            view.copy_(parameter.grad)
        else:
            return
        parameter.grad = view

    def _launch_ready_buckets(self) -> None:
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if len(bucket.ready) < len(bucket.parameters):
                return
            self._launch(bucket)

    def _average(self, bucket: GradientBucket) -> None:
        """The bucket's collective summed it: divide by the world size."""
        bucket.allocated_buffer.div_(self.world_size)

    def _launch(self, bucket: GradientBucket) -> None:
        bucket.work = self._all_reduce(bucket.allocated_buffer, tag=f"b{bucket.index}", async_op=True)
        self._next_to_launch += 1

    def finish_gradient_sync(self) -> None:
        if not self._sync_enabled:
            return
        for bucket in self.buckets[self._next_to_launch :]:
            for position in range(len(bucket.parameters)):
                if position not in bucket.ready:
                    self._place_gradient_in_view(bucket, position)
            self._launch(bucket)
        unsettled = self.buckets[self._next_to_settle :]
        self._wait_all([bucket.work for bucket in unsettled])
        for bucket in unsettled:
            self._settle(bucket)
        self._next_to_launch = self._next_to_settle = 0

    def _settle(self, bucket: GradientBucket) -> None:
        """The bucket's collective has been waited for: average it, and ready it for the next backward."""
        self._average(bucket)
        bucket.ready.clear()
        bucket.work = None
