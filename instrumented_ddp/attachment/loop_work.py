"""What an attached loop does in a step beside the model's phases, timed as the step's:

- its own synchronous collectives between the model's phases (the Trainer's gathers before each
  forward and for its log, a loop's all-reduce of its loss, a broadcast before ``step()``) are
  timed as collectives of their kind, tagged ``l<k>``, the k-th of the step
  (``collective_stand_ins``): in the data time they are not data loading, and a rank waiting in
  one for a slower rank's loader names that rank the straggler;
- its waits for its own asynchronous collectives and barriers, blocked time of the step;
- the compute it marks outside the model (``Attachment.computing``: an average of the weights
  after ``step()``, a teacher's forward), a ``loop`` span.

Only where a step is open, on the loop's thread, outside a pause of training (an evaluation's
collectives are the pause's).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from instrumented_ddp.attachment.step_boundaries import StepBoundaries
from instrumented_ddp.publish.watch import Watch
from instrumented_ddp.timing import collective_stand_ins
from instrumented_ddp.timing.collective_stand_ins import BARRIER, NOT_TIMED, LoopCall
from instrumented_ddp.timing.collectives import LooksWhenWaited, WaitedByTheLoop, gives_future, queue_of
from instrumented_ddp.wire.kinds import LOOP_COMPUTE_KIND, barrier_tag


class LoopWork:
    """The loop's own collectives, waits and marked compute in the steps of one attachment.
    ``device``: the device the model computes on, whose clock times the steps; ``strategy_group``:
    the group the model's own collectives run on (a loop's collective on it waits in their queue:
    ``queue_of``); ``attached``: whether the attachment still watches."""

    def __init__(self, boundaries: StepBoundaries, watch: Watch, device: torch.device,
                 strategy_group: dist.ProcessGroup, attached: Callable[[], bool]) -> None:
        self._boundaries, self._watch, self._attached = boundaries, watch, attached
        self.timeline = boundaries.timeline
        self.device = device
        self._strategy_group = strategy_group
        self._nccl_groups: dict[int, tuple[Any, bool]] = {}  # by id: a group, and whether NCCL reduces its CUDA tensors
        self._loop_thread: int | None = None

    def start(self) -> None:
        """Time the loop's collectives on this thread, the one it trains on, from now."""
        collective_stand_ins.stand_in(self)
        self._loop_thread = collective_stand_ins.time_loop_calls(self.time_collective)

    def stop(self) -> None:
        collective_stand_ins.stop_timing_loop_calls(self._loop_thread, self.time_collective)
        collective_stand_ins.stand_down(self)

    def _in_a_step(self) -> bool:
        """Whether what the loop does now, on this thread, is a step's: a step is open, and
        training is not paused."""
        return (self._attached() and self.timeline.in_step and not self._watch.pausing
                and threading.get_ident() == self._loop_thread)

    # -- marked compute ----------------------------------------------------------------------------
    def compute_begins(self) -> Any:
        """Where a block the loop marked with ``computing`` begins: a stamp where it is the
        step's (outside the model's forward), else None."""
        if not self._in_a_step() or self._boundaries.forward_open:
            return None
        try:
            self._boundaries.end_if_update_skipped()  # gradients cleared since the backward: this is the next step's
            return self.timeline.stamp()
        except Exception:
            return None

    def compute_ends(self, start: Any, what: str) -> None:
        """The marked block begun at ``start`` ended: a ``loop`` span tagged ``what``."""
        if not self._attached() or not self.timeline.in_step:
            return
        try:
            span = self.timeline.add_span(LOOP_COMPUTE_KIND, start, self.timeline.stamp(), blocking=False)
        except Exception:
            return
        span.tag = what
        self._boundaries.keep_if_next_steps(span)

    # -- waits ---------------------------------------------------------------------------------------
    def wait_begins(self) -> Any:
        """Where the loop begins to wait for an asynchronous collective of its own (``WaitedByTheLoop``):
        a stamp, where the wait is a step's; else None."""
        if not self._in_a_step():
            return None
        try:
            self._boundaries.end_if_update_skipped()
            return self.timeline.stamp()
        except Exception:
            return None

    def wait_ends(self, start: Any, tag: str = "") -> None:
        """The loop's wait begun at ``start`` returned: a ``wait`` span, blocked time of the step
        (``tag``: what it waited in, where that is not a collective's work: ``kinds.barrier_tag``)."""
        try:
            span = self.timeline.add_span("wait", start, self.timeline.stamp(), blocking=True, tag=tag)
        except Exception:
            return
        self._boundaries.keep_if_next_steps(span)

    # -- collectives -------------------------------------------------------------------------------
    def time_collective(self, call: LoopCall, issue: Callable[[], Any]) -> Any:
        """A collective the loop issued on its thread (``collective_stand_ins``), timed as a
        collective of its kind, ``l<k>``, where a step is open and outside a pause of training;
        ``NOT_TIMED``, issuing nothing, elsewhere (torch's own function issues it untimed, and it
        is counted). Inside the training forward too: a mixture of experts' all-to-alls, a
        ``SyncBatchNorm``'s gathers, a blocking span inside the forward's, which the figures take
        out of its compute. A synchronous one is issued asynchronously, a blocking span, and
        waited for here; an asynchronous one is a span like the ``async`` strategy's, its work
        handed back to the loop in a wrapper whose wait is the step's (``wait_begins``). A step
        whose update was skipped ends first, as at the next forward, so that what the loop
        issues after it is the next step's. ddpwatch's bookkeeping raising never loses the
        user's collective: issued untimed."""
        timeline = self.timeline
        if not self._attached() or not timeline.in_step or self._watch.pausing or not self.on_steps_clock(call):
            return NOT_TIMED
        if call.kind == BARRIER:
            return self._time_barrier(issue, call.async_op, call.group)
        try:
            self._boundaries.end_if_update_skipped()
            timeline.time_collectives_in(call.group)
            span = timeline.open_collective(call.kind, call.nbytes, self._boundaries.loop_call_tag(), call.dtype,
                                            not call.async_op, queue=queue_of(call.group, self._strategy_group))
        except Exception:
            return NOT_TIMED
        self._boundaries.loop_call_opened(span)
        try:
            work = issue()
        except Exception as error:
            span.fail(error)
            raise
        if call.async_op:
            if call.kind == "reduce_scatter" and not gives_future(work):
                return WaitedByTheLoop(work, timeline, self, ends_when_waited=span)
            timeline.close_collective(span, work)
            return WaitedByTheLoop(work, timeline, self)
        timeline.close_collective(span, work)
        LooksWhenWaited(work, timeline).wait()  # on the CPU its end is its wait's return, exactly
        return None

    def _time_barrier(self, issue: Callable[[], Any], async_op: bool, group: Any) -> Any:
        """A barrier the loop issued in a step (``time_collective`` said where): the time the
        rank sat in it, a blocked ``wait`` span tagged ``kinds.BARRIER_TAG``, one of the step's timed
        collectives. It carries nothing, so there is no transfer to tell from waiting: it is the
        wait for the last rank to arrive. On a GPU its marks are events on either side of torch's
        barrier, whose wait holds the host until the barrier's NCCL all-reduce has run: they bound
        it on the device's clock, and add no synchronisation of their own. An asynchronous one
        (``async_op=True``) is the loop's wait for its work, where the loop waits (``WaitedByTheLoop``):
        a barrier whose work is never waited for in a step stays counted, untimed. One on a group
        other than the world is tagged with the group's name (``kinds.barrier_tag``)."""
        world = group is None or group is dist.GroupMember.WORLD
        tag = barrier_tag("" if world else str(getattr(group, "group_name", "") or "group"))
        if async_op:
            return WaitedByTheLoop(issue(), self.timeline, self, wait_tag=tag)
        start = self.wait_begins()
        if start is None:
            return NOT_TIMED
        result = issue()
        self.wait_ends(start, tag)
        return result

    def on_steps_clock(self, call: LoopCall) -> bool:
        """Whether the step's clock can time ``call``. The host's clock (a model on the CPU)
        times any. On a GPU the step's marks are CUDA events and a collective's end is NCCL's
        duration or an event its future's callback records: a call on CPU tensors (a metric
        all-reduced over a gloo side group) or through another backend has neither (gloo's
        works have no duration: with NCCL timing on, a step holding one goes out unresolved), so
        it is counted, untimed."""
        if self.device.type != "cuda":
            return True
        if call.device != "cuda" and call.kind != BARRIER:  # a barrier has no tensor: its group says
            return False
        group = call.group if call.group is not None else dist.distributed_c10d._get_default_group()
        known = self._nccl_groups.get(id(group))
        if known is not None and known[0] is group:
            return known[1]
        try:
            nccl = group._get_backend(torch.device("cuda")).name() == "nccl"
        except Exception:  # no CUDA backend in that group
            nccl = False
        self._nccl_groups[id(group)] = (group, nccl)
        return nccl
