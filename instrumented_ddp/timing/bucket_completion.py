"""The completion of a watched DDP's bucket futures on the CPU, at the end of backward.

No Python runs on gloo's threads (see ``clocks.HostClock``): a bucket's future completed by a
``.then`` on its work's future would need the GIL on gloo's thread. ``BucketCompletion`` instead
waits for each bucket launched in a backward on this rank's thread, from an end-of-backward
callback queued before DDP's, and completes the bucket's future there (``DDPTiming`` says why
DDP's reducer sees no difference).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from instrumented_ddp.timing.timeline import NullTimeline, StepTimeline


class BucketCompletion:
    """The buckets launched in one backward, waited for and completed at that backward's end.

    ``timeline_of`` gives the timeline the buckets are timed on at the moment of asking (it
    changes as timing resumes and stops)."""

    def __init__(self, timeline_of: Callable[[], StepTimeline | NullTimeline]) -> None:
        self._timeline_of = timeline_of
        #: This backward's launched buckets, completed by ``_complete_buckets``.
        self._awaiting: list[tuple[Any, torch.Tensor, torch.futures.Future | None]] = []
        self._completion_task: int | None = None  # the autograd graph task whose end runs ``_complete_buckets``
        self._backward_task: int | None = None  # the step's own backward's graph task, where ``backward_began`` says

    def backward_began(self) -> None:
        """The step's backward begins on the current autograd graph task: buckets launched in a
        backward nested in it are told apart (``wait_at_backward_end``)."""
        self._backward_task = torch._C._current_graph_task_id()

    def backward_ended(self) -> None:
        """The step's backward has ended: no graph task is the step's until the next begins."""
        self._backward_task = None

    def wait_at_backward_end(self, work: dist.Work, buffer: torch.Tensor, future: torch.futures.Future | None) -> bool:
        """Have ``_complete_buckets`` wait for ``work`` at the end of this backward, before DDP's
        own end of backward, and complete ``future`` (if any) with ``buffer``; False where no
        end-of-backward callback can be queued (not inside a backward), or where the bucket is
        launched in a backward nested in this one.

        Reentrant activation checkpointing runs each checkpointed segment's backward as a
        backward of its own (an autograd graph task), nested in the step's. DDP queues its end of
        backward in whichever one launches its last bucket, and a callback queued in a nested one
        runs at *its* end: so a bucket launched there is left to its work's own future (the
        caller's ``.then``: waiting at the nested end would hold the step's backward until the
        all-reduce is done), and the buckets already waiting for the outer end are completed by
        their works (``_settle_on_their_own``), since DDP may wait for them before that end."""
        task = torch._C._current_graph_task_id()
        home = self._backward_task if self._backward_task is not None else self._completion_task
        if home is not None and task != home:
            self._settle_on_their_own()
            return False
        if self._completion_task is None:
            try:
                Variable._execution_engine.queue_callback(self._complete_buckets)
            except RuntimeError:
                return False
            self._completion_task = task
        self._awaiting.append((work, buffer, future))
        return True

    def _settle_on_their_own(self) -> None:
        """Complete the futures of the buckets waiting for ``_complete_buckets`` when their works
        complete (a callback on gloo's thread), and leave that callback nothing to wait for."""
        awaiting, self._awaiting = self._awaiting, []
        for work, buffer, future in awaiting:
            if future is not None:
                work.get_future().add_done_callback(
                    lambda done, future=future, buffer=buffer: settle(future, buffer, done))

    def _complete_buckets(self) -> None:
        """Wait, on this rank's thread, for each bucket launched in this backward and complete
        its future; before the first wait and after each the clock looks at the running
        collectives, so a bucket still running ends as its wait returns (``HostClock``). A
        collective that failed fails its future, and DDP's end of backward raises it, as with
        DDP's own hook; a watched bucket has no future of ours, and DDP's wait for its work
        raises the failure again."""
        awaiting, self._awaiting = self._awaiting, []
        self._completion_task = None
        timeline = self._timeline_of()
        timeline.poll()  # before the first wait; the look after each wait is the one before the next
        for work, buffer, future in awaiting:
            try:
                work.wait()
            except Exception as error:
                if future is not None:
                    future.set_exception(error)
                continue
            timeline.poll(waited=work)
            if future is not None:
                future.set_result(buffer)


def settle(future: torch.futures.Future, buffer: torch.Tensor, done: torch.futures.Future) -> None:
    """Complete ``future`` with ``buffer`` as the all-reduce ``done`` completed, or with its error."""
    try:
        done.wait()
    except Exception as error:
        future.set_exception(error)
        return
    future.set_result(buffer)


def launched_by_a_gradient() -> bool:
    """Whether DDP launches this bucket from a gradient's hook, while the autograd engine runs
    a node of the graph. Static graph's first iteration (``static_graph=True``) launches every
    bucket from an end-of-backward callback instead (``Reducer::delay_all_reduce``) and waits
    for them in the same call (``finalize_backward``), before any callback queued then could
    run: there a bucket's future must complete without one."""
    return torch._C._current_autograd_node() is not None
