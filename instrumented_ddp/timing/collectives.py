"""The one place a collective is issued and timed, for the strategies and for ``attach`` alike."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist


#: torch's own collective functions, never a stand-in put in ``torch.distributed`` for a loop's
#: (``collective_stand_ins``): what ddpwatch issues here it times itself, and must not be taken
#: for the loop's and timed twice (an FSDP2 unit's all-gather outside a forward, ``unshard()``).
_c10d = dist.distributed_c10d
#: torch 2.13 names them ``*_single`` and deprecates the ``*_tensor`` names, which are all torch < 2.13 has.
reduce_scatter = getattr(_c10d, "reduce_scatter_single", None) or _c10d.reduce_scatter_tensor
all_gather = getattr(_c10d, "all_gather_single", None) or _c10d.all_gather_into_tensor


def timed_collective(
    timeline: Any, kind: str, tensor: torch.Tensor, *, tag: str, async_op: bool,
    group: dist.ProcessGroup | None = None, src: int = 0,
    op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,  # a ReduceOp: FSDP's ``AllreduceOptions.reduceOp``
    marks_ready: bool = False, output: torch.Tensor | None = None, blocking: bool | None = None, queue: str = "",
) -> dist.Work | None:
    """Issue an ``all_reduce`` or a ``broadcast`` of ``tensor`` in place, or a ``reduce_scatter``
    of ``tensor`` into the shard ``output`` or an ``all_gather`` of the shard ``tensor`` into
    ``output``, and record it on ``timeline``. Its bytes are the whole tensor's (``step_figures.COMM_KINDS``).
    ``blocking`` (default: a synchronous call): whether the thread or stream that computes sits
    in it; FSDP's synchronous calls on its own GPU streams do not (``strategies.fsdp``).

    A synchronous collective ends at the mark made right after the call: on a GPU that mark
    is an event on the current stream, which the call made wait for NCCL's end event, so it
    completes when the collective does, with no work object or completion callback to pay
    for.
    An asynchronous one is closed on its work: the clock times its end (``CudaEventClock``), or,
    on the CPU, the work handed back looks for ended collectives as soon as it has been waited
    (``HostClock``: the rank's own thread sees them complete; ``LooksWhenWaited``).
    ``marks_ready``: issued the moment its gradient became ready (a per-parameter hook), so its
    issue stamp also marks that gradient ready (``StepTimeline.mark_ready``). ``queue``: where
    ``group`` is not the one the strategy's other collectives share, a name for its queue
    (``StepTimeline.open_collective``).
    """
    whole = tensor
    if kind == "all_gather":
        if output is None:
            raise ValueError("an all_gather needs the tensor it gathers into (output)")
        whole = output
    span = _open(timeline, kind, whole, tag, blocking=not async_op if blocking is None else blocking, queue=queue)
    if marks_ready and span is not None:
        timeline.mark_ready(tag, span.nbytes, at=span.start)
    if async_op and span is not None:
        timeline.time_collectives_in(group)
    if kind == "all_reduce":
        work = _c10d.all_reduce(tensor, op=op, group=group, async_op=async_op)
    elif kind == "broadcast":
        work = _c10d.broadcast(tensor, src=src, group=group, async_op=async_op)
    elif kind == "reduce_scatter":
        work = reduce_scatter(output, tensor, op=op, group=group, async_op=async_op)
    elif kind == "all_gather":
        work = all_gather(output, tensor, group=group, async_op=async_op)
    else:
        raise ValueError(f"unknown collective {kind!r}")
    if work is None or span is None:
        timeline.close_collective(span, work)
        return work
    if kind == "reduce_scatter" and not gives_future(work):
        return EndsWhenWaited(work, lambda: timeline.close_collective(span, None))
    timeline.close_collective(span, work)
    return LooksWhenWaited(work, timeline) if timeline.polls else work


def queue_of(group: dist.ProcessGroup | None, own_group: dist.ProcessGroup | None) -> str:
    """The queue a collective on ``group`` waits in (``StepTimeline.open_collective``; None: the
    default group), for a model whose own collectives (DDP's buckets, FSDP's gathers and
    scatters) run on ``own_group``: theirs, "", on that group, named or not; else that group's.
    Each group has its own gloo threads and its own NCCL stream, so a call on another (a loop's
    metric on a group of its own, PostLocalSGD's intra-node subgroup) does not start after the
    model's buckets, nor they after it."""
    default = None
    if group is None or own_group is None:
        default = dist.distributed_c10d._get_default_group()
    if (group if group is not None else default) is (own_group if own_group is not None else default):
        return ""
    return f"group {getattr(group, 'group_name', id(group))}"


def gives_future(work: dist.Work) -> bool:
    try:
        work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        return False
    return True


class ForwardingWork(dist.Work):
    """A ``Work`` that stands for torch's ``work``, whose ``wait()`` a subclass times. It is a
    ``dist.Work`` itself, since code waits only on what is one: FSDP2 waits for an asynchronous
    all-gather (``FSDPModule.unshard(async_op=True)``, a prefetch) only where
    ``isinstance(work, dist.Work)`` (``foreach_all_gather_copy_out``): handed a plain wrapper,
    it reads the gathered parameters before gloo has written them. Every other
    method and property of ``dist.Work`` is the work's (``forward_members``: the base's own would
    answer for an empty work that never completes), ``wait`` included where the subclass does not time
    it, as is any other attribute; ``boxed()`` boxes this one, so ``Work.unbox`` gives it back,
    timed wait and all."""

    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        self.work = work

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def forward_members(stand_in: type, base: type, kept: frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
    """Make each public method and property of ``base`` (but those ``kept``) on ``stand_in`` the
    one of the object it stands for, its ``work``; returns the names of both. Read off ``base``,
    so that a later torch's are handed on too (``dist.Work.timeout``, which the base class
    answers for an empty work by raising)."""
    methods, properties = [], []
    for name, member in sorted(vars(base).items()):
        if name.startswith("__") or name in kept:
            continue
        if isinstance(member, property):
            setattr(stand_in, name, _forwarded_property(name, settable=member.fset is not None))
            properties.append(name)
        elif callable(member):
            setattr(stand_in, name, _forwarded_method(name))
            methods.append(name)
    return methods, properties


def _forwarded_method(name: str) -> Callable[..., Any]:
    def forwarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.work, name)(*args, **kwargs)

    forwarded.__name__ = forwarded.__qualname__ = name
    return forwarded


def _forwarded_property(name: str, settable: bool) -> property:
    def read(self: Any) -> Any:
        return getattr(self.work, name)

    def write(self: Any, value: Any) -> None:
        setattr(self.work, name, value)

    return property(read, write if settable else None, doc=f"the work's own ``{name}``")


#: ``dist.Work``'s methods and properties a ``ForwardingWork`` hands to the work it stands for:
#: all but ``boxed`` and ``unbox``, which box and unbox the stand-in itself (and pybind11's own).
FORWARDED_WORK_METHODS, FORWARDED_WORK_PROPERTIES = forward_members(
    ForwardingWork, dist.Work, kept=frozenset({"boxed", "unbox", "_pybind11_conduit_v1_"}))


class LooksWhenWaited(ForwardingWork):
    """On the CPU, a ``Work`` whose ``wait()`` is bracketed by two looks at the rank's running
    collectives (``HostClock.poll``): one that completed before the wait ends before it, and
    the one waited for, if it was still running, ends as its wait returns: exactly."""

    def __init__(self, work: dist.Work, timeline: Any) -> None:
        super().__init__(work)
        self._timeline = timeline

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self._timeline.poll()
        done = self.work.wait(*args, **kwargs)
        self._timeline.poll(waited=self.work)
        return done


class EndsWhenWaited(ForwardingWork):
    """gloo's reduce-scatter returns a ``Work`` with no future (torch 2.13): nothing can call back
    when it completes, and waiting on it from a second thread races the copy into the output
    that its ``wait`` does. So its span ends when the rank's own ``wait()`` returns: a late end
    when the rank waits after it finished (gloo does most of it inside the call anyway)."""

    def __init__(self, work: dist.Work, on_waited: Any) -> None:
        super().__init__(work)
        self._on_waited = on_waited

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        done = self.work.wait(*args, **kwargs)
        if self._on_waited is not None:
            self._on_waited()
            self._on_waited = None
        return done


class LoopWaits(Protocol):
    """Who says whether a wait of the loop's is a step's (``Attachment``)."""

    def wait_begins(self) -> Any:
        """A stamp where this wait is blocked time of a step; None where it is no step's."""

    def wait_ends(self, start: Any, tag: str = "") -> None:
        """The wait begun at ``start`` has returned: a ``wait`` span of the step, tagged ``tag``."""


class WaitedByTheLoop(ForwardingWork):
    """An asynchronous collective a user's loop issued (``collective_stand_ins``), as handed back
    to it. The loop's ``wait()`` is blocked time, not compute (else ZeRO's broadcasts waited
    for inside ``optimizer.step()`` would read as the optimizer's compute), so it is a ``wait``
    span of the step it falls in, where ``waits`` says it is one's. Around it, on the CPU, the
    looks of ``LooksWhenWaited`` (the work's end is the wait's return, exactly, if it was still
    running); a work with no future (gloo's reduce-scatter, see ``EndsWhenWaited``) ends there.
    Made on the loop's thread; a wait on another (a script's logging thread) looks at nothing,
    since the CPU clock's looks are the loop thread's alone (``HostClock``). Everything else is
    the work's own. ``wait_tag``: what the wait span says it waited in, where that is not a
    collective's work (``kinds.BARRIER_TAG``: an asynchronous barrier, whose wait is all of it)."""

    def __init__(self, work: dist.Work, timeline: Any, waits: LoopWaits, ends_when_waited: Any = None,
                 wait_tag: str = "") -> None:
        super().__init__(work)
        self._timeline, self._waits = timeline, waits
        self._ends_when_waited = ends_when_waited
        self._wait_tag = wait_tag
        self._loop_thread = threading.get_ident()

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if threading.get_ident() != self._loop_thread:
            return self._wait_elsewhere(*args, **kwargs)
        start = self._waits.wait_begins()
        self._timeline.poll()
        span, self._ends_when_waited = self._ends_when_waited, None
        try:
            done = self.work.wait(*args, **kwargs)
        except Exception as error:  # the collective failed: its span cannot end
            if span is not None:
                span.fail(error)
            raise
        if span is not None:
            self._timeline.close_collective(span, None)
        self._timeline.poll(waited=self.work)
        if start is not None:
            self._waits.wait_ends(start, self._wait_tag)
        return done

    def _wait_elsewhere(self, *args: Any, **kwargs: Any) -> bool:
        """A wait off the loop's thread: no span of a step, no look; a span that ends at its
        wait ends here, on the host's clock alone (only gloo's reduce-scatter, whose end no
        future gives)."""
        span, self._ends_when_waited = self._ends_when_waited, None
        done = self.work.wait(*args, **kwargs)
        if span is not None:
            span.complete(time.perf_counter())
        return done


def timed_all_reduce_result(timeline: Any, tensor: torch.Tensor, *, tag: str, group: dist.ProcessGroup | None,
                            op: dist.ReduceOp.RedOpType, at: Any = None) -> torch.futures.Future:
    """An asynchronous all-reduce of ``tensor`` whose future holds the reduced tensor, as a DDP
    communication hook must return, and ends its span: one completion callback does both.
    ``at``: the issue stamp, where the caller made one this moment (``open_collective``)."""
    span = _open(timeline, "all_reduce", tensor, tag, blocking=False, at=at)
    timeline.time_collectives_in(group)
    work = _c10d.all_reduce(tensor, op=op, group=group, async_op=True)
    return timeline.close_collective_with_result(span, work)


def _open(timeline: Any, kind: str, tensor: torch.Tensor, tag: str, blocking: bool, at: Any = None, queue: str = "") -> Any:
    nbytes = tensor.numel() * tensor.element_size()
    return timeline.open_collective(kind, nbytes, tag, str(tensor.dtype).removeprefix("torch."), blocking, at=at,
                                    queue=queue)
