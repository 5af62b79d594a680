"""``ddp``: PyTorch's own DistributedDataParallel, for reference."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..timeline import NULL_TIMELINE
from .base import DataParallelStrategy


class NativeDDP(DataParallelStrategy):
    """``torch.nn.parallel.DistributedDataParallel`` with ``bucket_cap_mb`` passed through.

    DDP broadcasts the state itself when it is built and averages inside backward, so
    ``finish_gradient_sync`` has nothing to do. Parameters that get no gradient in a step hang
    plain DDP; models that have them need ``find_unused_parameters=True`` (pass it to ``wrap``).
    The DDP object is kept out of the module tree, so dropping it on ``unwrap`` removes its hooks
    and the state dict keeps the bare model's keys under ``module.``.

    When timed, each bucket goes through a communication hook that does what DDP's default
    all-reduce does (average, async) through ``_collective``. DDP waits for its
    last buckets inside ``backward()`` itself: the time from the last bucket's launch (DDP
    launches it as soon as its last gradient is ready, so that is when backward's compute ended)
    to the end of backward is recorded as a blocking ``wait`` (blocked is not busy). DDP's first
    iteration reduces one bucket holding every gradient, before it rebuilds buckets in
    gradient-ready order: that step is marked excluded from the statistics. A model with buffers
    has them broadcast from rank 0 at the start of every forward (``broadcast_buffers=True``,
    DDP's default, which our own strategies do only at wrap time): that broadcast is recorded as
    a blocking ``broadcast`` span tagged ``buffers`` inside forward, so it is not counted as
    forward compute.
    """

    name: ClassVar[str] = "ddp"
    uses_bucket_mb: ClassVar[bool] = True

    def __init__(self, module: Any, *, find_unused_parameters: bool = False, **settings: Any) -> None:
        self._find_unused_parameters = find_unused_parameters
        super().__init__(module, **settings)

    def _broadcast_state(self) -> None:
        """DistributedDataParallel's constructor broadcasts rank 0's state."""

    def _attach(self) -> None:
        self._synced_backwards = 0
        device = next(self.module.parameters()).device
        ddp = DistributedDataParallel(
            self.module,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=self.process_group,
            bucket_cap_mb=self.bucket_mb,
            find_unused_parameters=self._find_unused_parameters,
        )
        object.__setattr__(self, "ddp", ddp)  # not a submodule: see the class docstring
        self._last_bucket_at: Any = None
        if self.timeline is not NULL_TIMELINE:
            ddp.register_comm_hook(state=None, hook=self._timed_all_reduce_hook())
            ddp._distributed_broadcast_coalesced = self._timed_buffer_broadcast(ddp._distributed_broadcast_coalesced)

    def _timed_all_reduce_hook(self) -> Callable[..., torch.futures.Future]:
        """DDP checks a hook's annotations against real types, which postponed (string)
        annotations are not; hence an unannotated closure.

        DDP's C++ default divides each gradient by the world size while it copies it into its
        bucket (one pass); a hook gets the bucket already filled, so dividing it is a second pass
        over every gradient, a cost watching would add. NCCL averages inside the all-reduce
        (``ReduceOp.AVG``), so there the hook makes no extra pass; gloo has no average, so there
        it divides first, as DDP's own Python default hook does."""
        averaging = averaging_op(self.process_group)

        def timed_all_reduce(state, bucket):  # noqa: ANN001, ANN202
            self._last_bucket_at = self.timeline.stamp()
            buffer = bucket.buffer()
            if averaging is None:
                buffer.div_(self.world_size)
            work = self._all_reduce(buffer, tag=f"b{bucket.index()}", async_op=True, op=averaging or dist.ReduceOp.SUM)
            return work.get_future().then(lambda future: future.value()[0])

        return timed_all_reduce

    def _timed_buffer_broadcast(self, untimed: Callable[..., None]) -> Callable[..., None]:
        """DDP's per-forward buffer sync goes through this one method of the instance
        (``_sync_buffers`` -> ``_default_broadcast_coalesced`` -> here). It returns once the
        broadcast is done (on NCCL, once the current stream waits for it), so it is timed like
        any synchronous collective."""

        def timed_broadcast(tensors, buffer_size, authoritative_rank=0):  # noqa: ANN001, ANN202
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors}
            span = self.timeline.open_collective("broadcast", nbytes, "buffers", ",".join(sorted(dtypes)), True)
            try:
                untimed(tensors, buffer_size, authoritative_rank)
            finally:
                self.timeline.close_collective(span, None)

        return timed_broadcast

    def finish_gradient_sync(self) -> None:
        """Called right after backward returned: DDP's in-backward wait ends about now."""
        if not self._sync_enabled:
            return
        self._synced_backwards += 1
        if self._last_bucket_at is not None:
            self.timeline.add_span("wait", self._last_bucket_at, self.timeline.stamp(), blocking=True)
            self._last_bucket_at = None

    @property
    def excluded_from_statistics(self) -> bool:
        return self._synced_backwards <= 1

    def _detach(self) -> None:
        object.__delattr__(self, "ddp")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.timeline.phase("forward"):
            return self.ddp(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.ddp.no_sync(), super().no_sync():
            yield


def averaging_op(process_group: dist.ProcessGroup | None) -> dist.ReduceOp.RedOpType | None:
    """``ReduceOp.AVG`` where the group's backend averages inside the all-reduce (NCCL), else
    None: the caller divides and sums (gloo refuses AVG)."""
    return dist.ReduceOp.AVG if dist.get_backend(process_group) == "nccl" else None
