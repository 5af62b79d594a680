"""The all-reduces a user's own DDP communication hook issues, timed as they are issued.

A DDP that already has a Python communication hook of the user's (fp16 or PowerSGD compression)
keeps it, since DDP takes one: what that hook issues through ``torch.distributed.all_reduce`` in
a backward is timed as it is issued, ``h<k>`` the k-th in that backward, with the bytes and dtype
it sends (``hooked_collectives``). Its buckets are not marked ready: which call belongs to which
bucket is the hook's business (PowerSGD makes up to three per bucket).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from instrumented_ddp.timing import collective_stand_ins
from instrumented_ddp.timing import hooked_collectives
from instrumented_ddp.timing.bucket_completion import BucketCompletion, launched_by_a_gradient
from instrumented_ddp.timing.collectives import queue_of
from instrumented_ddp.timing.timeline import NullTimeline, StepTimeline


class HookOwner(Protocol):
    """What the user's-hook timing reads and stamps on the DDP's timing (``DDPTiming``)."""

    timeline: StepTimeline | NullTimeline
    process_group: dist.ProcessGroup | None
    last_bucket_at: Any  # the stamp of this backward's last all-reduce issued, if any


class UsersHookTiming:
    """Times the all-reduces the user's hook on one DDP issues in each watched backward.

    Each is stamped on ``owner`` as the backward's last bucket launch, and on the CPU waited for
    at the end of backward through ``completion``."""

    def __init__(self, owner: HookOwner, ddp: DistributedDataParallel, completion: BucketCompletion) -> None:
        self._owner = owner
        self._completion = completion
        self._calls = 0  # all-reduces the user's hook issued in this backward (``h<k>``)
        self._watched_thread: int | None = None  # the thread this backward's hook runs on, watched
        self._syncs_gradients = False  # whether DDP reduces in this backward (not under ``no_sync``)
        #: Which hook calls are this DDP's where one backward runs through several (``hooked_collectives.owner``).
        self._parameter_ids = frozenset(id(p) for p in ddp.parameters())

    def resume(self) -> None:
        """Put the collective stand-ins in ``torch.distributed`` for this DDP."""
        collective_stand_ins.stand_in(self)

    def stop(self) -> None:
        """Watch no thread, and no longer need the stand-ins."""
        self._unwatch()
        collective_stand_ins.stand_down(self)

    def backward_began(self, syncs_gradients: bool) -> None:
        """Time the hook's all-reduces on this thread from now, counting from ``h0``;
        ``syncs_gradients``: whether DDP reduces in this backward."""
        self._calls = 0
        self._syncs_gradients = syncs_gradients
        self._unwatch()  # a backward that raised never ended
        self._watched_thread = hooked_collectives.watch_thread(self._time_all_reduce, self._parameter_ids)

    def backward_ended(self) -> bool:
        """Stop watching this backward's thread; True when DDP reduced in it (not ``no_sync``),
        whether its collectives were seen or not."""
        self._unwatch()
        syncs, self._syncs_gradients = self._syncs_gradients, False
        return syncs

    def _unwatch(self) -> None:
        hooked_collectives.unwatch_thread(self._watched_thread, self._time_all_reduce)
        self._watched_thread = None

    def _time_all_reduce(self, all_reduce: Callable[..., Any], tensor: torch.Tensor, op: Any, group: Any) -> Any:
        """One asynchronous all-reduce the user's hook issued in this backward, issued with
        torch's ``all_reduce`` and timed: ``h<k>``, the k-th of the backward, of the bytes and dtype
        it sends (half a bucket's under fp16 compression). On the CPU its end is waited for at the
        end of backward, looking around the wait, as for ddpwatch's own hook (DDP waits for the
        hook's future there anyway)."""
        owner = self._owner
        timeline, span = owner.timeline, None
        if isinstance(timeline, NullTimeline):  # NULL_TIMELINE, the only one
            return all_reduce(tensor, op=op, group=group, async_op=True)
        try:
            issued_at = timeline.stamp()
            span = timeline.open_collective("all_reduce", tensor.numel() * tensor.element_size(), f"h{self._calls}",
                                            str(tensor.dtype).removeprefix("torch."), False, at=issued_at,
                                            queue=queue_of(group, owner.process_group))
            self._calls += 1
            timeline.time_collectives_in(group)
        except Exception as error:  # never the user's all-reduce lost to ddpwatch's bookkeeping: issued untimed
            if span is not None:
                span.fail(error)  # its step goes out unresolved, saying why
            return all_reduce(tensor, op=op, group=group, async_op=True)
        owner.last_bucket_at = issued_at
        try:
            work = all_reduce(tensor, op=op, group=group, async_op=True)
        except Exception as error:
            span.fail(error)
            raise
        timeline.close_collective(span, work)
        if timeline.polls and launched_by_a_gradient():
            self._completion.wait_at_backward_end(work, tensor, None)
        return work
