"""``simple`` and ``ga``: average every gradient after backward, one all-reduce per parameter."""

from __future__ import annotations

from typing import ClassVar

from instrumented_ddp.strategies.base import DataParallelStrategy


class SimpleAllReduce(DataParallelStrategy):
    """The ladder's baseline: after each backward, all-reduce every gradient, then average.

    It communicates after every micro-step, even while accumulating: averaging the running sum
    again is still exact, because the part already averaged is equal on every rank.
    A parameter without a gradient joins as zeros.
    """

    name: ClassVar[str] = "simple"
    syncs_every_micro_step: ClassVar[bool] = True

    def finish_gradient_sync(self) -> None:
        if not self._sync_enabled:
            return
        for index, parameter in enumerate(self.trainable_parameters()):
            gradient = self._gradient_or_zeros(parameter)
            self._all_reduce(gradient, tag=f"p{index}", async_op=False)
            gradient.div_(self.world_size)


class GradientAccumulation(SimpleAllReduce):
    """``simple`` plus gradient accumulation: ``no_sync`` skips the first K-1 micro-steps."""

    name: ClassVar[str] = "ga"
    syncs_every_micro_step: ClassVar[bool] = False
