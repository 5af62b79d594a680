"""Which of a DDP's parameters each of its buckets holds, once DDP has rebuilt them."""

from __future__ import annotations

from collections.abc import Callable

from torch.nn.parallel import DistributedDataParallel


#: Steps in which DDP's rebuilt buckets are looked for (its logging data has them a few
#: iterations in); past these the advisor takes them by bytes in reverse module order.
BUCKET_LAYOUT_STEPS = 20


class BucketLayout:
    """DDP's buckets in gradient-ready order, from its logging data, kept once found.

    ``ddp_of`` gives the DDP to ask (``DDPTiming.ddp``)."""

    def __init__(self, ddp_of: Callable[[], DistributedDataParallel]) -> None:
        self._ddp_of = ddp_of
        self._layout: list[list[int]] = []

    def find(self, reduced_backwards: int) -> list[list[int]]:
        """The parameter indices of each bucket, bucket ``b<i>`` the i-th; [] before DDP has
        rebuilt them. Looked for while ``reduced_backwards`` (backwards that reduced gradients)
        is at most ``BUCKET_LAYOUT_STEPS`` only, so a DDP that never logs them is not asked every step."""
        if not self._layout and reduced_backwards <= BUCKET_LAYOUT_STEPS:
            text = self._ddp_of()._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
            self._layout = [[int(i) for i in bucket.split()] for bucket in str(text).split(",")] if text else []
        return self._layout
