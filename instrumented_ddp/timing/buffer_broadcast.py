"""DDP's per-forward buffer broadcast, timed as a blocking ``broadcast`` span tagged ``buffers``.

A model with buffers has them broadcast from rank 0 at the start of every forward
(``broadcast_buffers=True``, DDP's default): that broadcast is inside forward, not forward compute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from instrumented_ddp.timing.timeline import NullTimeline, StepTimeline


def timed_buffer_broadcast(untimed: Callable[..., None],
                           timeline_of: Callable[[], StepTimeline | NullTimeline]) -> Callable[..., None]:
    """DDP's ``_distributed_broadcast_coalesced`` (``untimed``), timed on the timeline
    ``timeline_of`` gives at each call, and passed straight through while that is the null one.

    DDP's per-forward buffer sync goes through this one method of the instance
    (``_sync_buffers`` -> ``_default_broadcast_coalesced`` -> here). It returns once the
    broadcast is done (on NCCL, once the current stream waits for it), so it is timed like
    any synchronous collective. Under ``torch.compile`` Dynamo would trace it with DDP's
    forward (and break the graph at each stamp): it runs eagerly, as the broadcast does."""

    @torch.compiler.disable
    def timed_broadcast(tensors: list[torch.Tensor], buffer_size: int, authoritative_rank: int = 0) -> None:
        timeline = timeline_of()
        if isinstance(timeline, NullTimeline):  # not timing
            untimed(tensors, buffer_size, authoritative_rank)
            return
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors}
        span = timeline.open_collective("broadcast", nbytes, "buffers", ",".join(sorted(dtypes)), True)
        try:
            untimed(tensors, buffer_size, authoritative_rank)
        finally:
            timeline.close_collective(span, None)

    return timed_broadcast
