"""``ddp``: PyTorch's own DistributedDataParallel, for reference."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from instrumented_ddp.timing.ddp_timing import DDPTiming
from instrumented_ddp.timing.forwarding_group import ForwardingGroup
from instrumented_ddp.timing.timeline import NULL_TIMELINE
from instrumented_ddp.strategies.base import DataParallelStrategy


class NativeDDP(DataParallelStrategy):
    """``torch.nn.parallel.DistributedDataParallel`` with ``bucket_cap_mb`` passed through.

    DDP broadcasts the state itself when it is built and averages inside backward, so
    ``finish_gradient_sync`` has nothing to do. Parameters that get no gradient in a step hang
    plain DDP; models that have them need ``find_unused_parameters=True`` (pass it to ``wrap``).
    The DDP object is kept out of the module tree, so dropping it on ``unwrap`` removes its hooks
    and the state dict keeps the bare model's keys under ``module.``.

    When timed, DDP gets ``DDPTiming``: its buckets' all-reduces timed (on the CPU seen through
    a ``ForwardingGroup``, elsewhere through a communication hook that does what DDP's default
    does), its buffer broadcast timed, and the wait after its last bucket. DDP's
    first iteration reduces one bucket holding every gradient, before it rebuilds buckets in
    gradient-ready order: that step is marked excluded from the statistics.
    """

    name: ClassVar[str] = "ddp"
    uses_bucket_mb: ClassVar[bool] = True
    #: The DDP object, from ``_attach`` to ``_detach`` (set with ``object.__setattr__``: no submodule).
    ddp: DistributedDataParallel

    def __init__(self, module: Any, *, find_unused_parameters: bool = False, **settings: Any) -> None:
        self._find_unused_parameters = find_unused_parameters
        super().__init__(module, **settings)

    def _broadcast_state(self) -> None:
        """DistributedDataParallel's constructor broadcasts rank 0's state."""

    @property
    def bucket_layout(self) -> list[list[int]]:
        """DDP's own buckets once it has rebuilt them, from about the third step
        (``DDPTiming.bucket_layout``); [] before, and when not timed."""
        return self._timing.bucket_layout() if self._timing is not None else []

    def _attach(self) -> None:
        self._synced_backwards = 0
        device = next(self.module.parameters()).device
        ddp = DistributedDataParallel(
            self.module,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=self._group_for_ddp(),
            bucket_cap_mb=self.bucket_mb,
            find_unused_parameters=self._find_unused_parameters,
        )
        object.__setattr__(self, "ddp", ddp)  # not a submodule: see the class docstring
        self._timing = DDPTiming(ddp, self.timeline) if self.timeline is not NULL_TIMELINE else None
        if self._timing is not None:
            self._timing.install()

    def _group_for_ddp(self) -> dist.ProcessGroup | None:
        """The group DDP is built on: when timed on the CPU, a ``ForwardingGroup`` over ours,
        which shows ``DDPTiming`` each bucket DDP launches without a communication hook (and
        so without the hook's second pass over every gradient: see ``forwarding_group``).
        Not with ``find_unused_parameters``: DDP then all-reduces its map of used parameters
        on the same group, which is not a bucket; the hook sees buckets only."""
        group = self.process_group or dist.group.WORLD
        assert group is not None, "DataParallelStrategy.__init__ checked that torch.distributed is initialized"
        if self.timeline.polls and not self._find_unused_parameters and dist.get_backend(group) == "gloo":
            return ForwardingGroup(group)
        return self.process_group

    def finish_gradient_sync(self) -> None:
        """Called right after backward returned: DDP's in-backward wait ends about now."""
        if not self._sync_enabled:
            return
        self._synced_backwards += 1
        if self._timing is not None:
            self._timing.backward_ended()

    @property
    def excluded_from_statistics(self) -> bool:
        return self._synced_backwards <= 1

    def _detach(self) -> None:
        if self._timing is not None:
            self._timing.stop_timing()  # its gradient hooks are on the model's own parameters
        object.__delattr__(self, "ddp")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.timeline.phase("forward"):
            return self.ddp(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.ddp.no_sync(), super().no_sync():
            yield

