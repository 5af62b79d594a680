"""The one place a collective is issued and timed, for the strategies and for ``attach`` alike."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def timed_collective(
    timeline: Any, kind: str, tensor: torch.Tensor, *, tag: str, async_op: bool,
    group: dist.ProcessGroup | None = None, src: int = 0, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> dist.Work | None:
    """Issue an ``all_reduce`` or a ``broadcast`` of ``tensor`` and record it on ``timeline``.

    A synchronous collective ends at the mark made right after the call: on a GPU that mark
    is an event on the current stream, which the call made wait for NCCL's end event, so it
    completes when the collective does, with no work object or completion callback to pay
    for (on one H100 host, 16 us a call against 58 us through ``async_op=True`` and ``.then``).
    An asynchronous one is closed on its work: the clock times its end (``CudaEventClock``).
    """
    nbytes = tensor.numel() * tensor.element_size()
    span = timeline.open_collective(kind, nbytes, tag, str(tensor.dtype).removeprefix("torch."), not async_op)
    if kind == "all_reduce":
        work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    else:
        work = dist.broadcast(tensor, src=src, group=group, async_op=async_op)
    timeline.close_collective(span, work)
    return work
