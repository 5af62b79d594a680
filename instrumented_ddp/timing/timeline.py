"""One rank's record of every phase and collective, step by step.

The strategies and the training loop mark where things start and end; a clock turns the marks
into seconds on this rank's clock. On the CPU the mark *is* the time; on a GPU a mark is a CUDA
event resolved a step or two later with ``query()``, so timing never synchronises the device.
An asynchronous collective ends when it completes: on the CPU the rank's own thread sees it
complete (``HostClock.poll``), on a GPU an event or NCCL's own duration says when.
Reports wait in ``pending`` until every mark of their step has resolved; a step whose marks
cannot all resolve (a completion callback that failed, one that never came) is sent marked
``unresolved`` rather than holding back every later step.

Where a collective *starts* is the subtle part. Both backends queue collectives: gloo runs two
at a time on its worker threads, NCCL one at a time on the process group's NCCL stream. A
collective issued while the queue is busy waits, and that wait is not transfer: the span starts
when it was issued or when a worker (the stream) became free, whichever is later, found by
replaying the queue over the completion stamps (``_start_when_a_worker_was_free``). Each process
group is a queue of its own (gloo's threads and NCCL's stream belong to a group): a collective on
another group (HSDP's all-reduce across replicas, ``fsdp_timing``) is opened with its ``queue``
named and is replayed apart. On NCCL with timing on, a collective's duration is NCCL's own, read
once it has completed, and the same replay run forward from the issue marks gives its start and
end: no completion callback at all.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

from instrumented_ddp.timing.compile_counter import dynamo_graphs_compiled
from instrumented_ddp.wire.time_ranges import subtract
from instrumented_ddp.wire.protocol import COMM_KINDS, LOOP_COMPUTE_KIND, MAX_PAUSED_FOR, MODEL_COMPUTE_KINDS, READY_KIND, Span, StepReport, is_barrier_wait

Stamp = Any  # a float (host clock) or whatever a clock's resolve() understands

#: A step still unresolved when this many later steps have ended is sent marked ``unresolved``.
#: On a GPU the host runs ahead of the device by a few steps at most (the launch queue is
#: bounded), so this is far beyond any step that is merely late.
UNRESOLVED_AFTER_STEPS = 32


class Clock(Protocol):
    @property
    def worker_threads(self) -> int | None:
        """Collectives the backend runs at once, in issue order (None: the clock knows true starts).
        Read-only here, so a clock may say ``int`` (a settable ``int | None`` member would not match it)."""
        ...

    #: Whether ends of asynchronous collectives are found by ``poll`` on this rank's thread.
    polls: bool

    def begin_step(self, at: Stamp = None) -> None: ...
    def poll(self, waited: Any = None) -> None: ...
    def stamp(self) -> Stamp: ...
    def resolve(self, stamp: Stamp) -> float | None: ...
    def host_time(self, stamp: Stamp) -> float: ...
    def capture(self, value: Any) -> Any: ...
    def on_completion(self, work: Any, span: _PendingSpan) -> None: ...
    def result_on_completion(self, work: Any, span: _PendingSpan) -> Any: ...
    def time_collectives_in(self, group: Any) -> None: ...


def _first_tensor(future: Any) -> Any:
    """A collective work's future holds a list of tensors; a DDP communication hook must return
    a future of one tensor."""
    return future.value()[0]


def _ending(span: _PendingSpan, stamp: Callable[[], Stamp]) -> Callable[[Any], None]:
    """A completion callback that ends ``span`` at ``stamp()``, never raising on the backend's
    thread: a span that cannot be stamped fails, and its step says so (a raising callback would
    leave the span open forever)."""

    def completed(_future: Any) -> None:
        try:
            span.complete(stamp())
        except Exception as error:
            span.fail(error)

    return completed


def _ending_then_first_tensor(span: _PendingSpan, stamp: Callable[[], Stamp]) -> Callable[[Any], Any]:
    """A ``.then`` callback that ends ``span`` (``_ending``) and hands the tensor on."""
    ending = _ending(span, stamp)

    def completed(future: Any) -> Any:
        ending(future)
        return future.value()[0]

    return completed


class HostClock:
    """CPU/gloo: ``perf_counter`` now; a collective's end is found by this rank's own thread,
    looking at its work with ``is_completed()``.

    Not in a completion callback: a Python callback runs on gloo's worker thread and must take
    the GIL from the training thread, and on two CPU cores shared by two ranks each handoff cost
    about 85 us of step time (one per collective: 3.5 % of an ``async`` step of the tiny model;
    a callback doing nothing cost the same, and so did a thread of ours waiting on the works).
    The rank's thread looks at every mark (``stamp``), at every gradient hook that polls
    (``StepTimeline.poll``), and before and after every ``wait()`` on a work
    (``collectives.LooksWhenWaited``). A collective the rank waited for ended when its wait
    returned: that end is exact. One seen completed at a look ended between the look before,
    when it was still running, and this one: it is given the middle, off by at most half the
    time between two looks (a parameter's backward, in a hook-driven strategy). Gloo has no
    per-work start time, and a collective issued while gloo's worker threads are busy waits in
    its queue: see ``StepTimeline._start_when_a_worker_was_free``.

    Used from one thread only, the training thread: nothing here runs on gloo's threads.
    """

    #: ProcessGroupGloo's worker threads (its default): collectives run this many at a time, FIFO.
    worker_threads = 2
    #: Collective ends come from ``poll``: who waits for a collective calls it around the wait.
    polls = True

    def __init__(self) -> None:
        self._running: list[tuple[Any, _PendingSpan]] = []  # issued, not yet seen completed
        self._last_look = float("-inf")  # when the running ones were last seen running

    def begin_step(self, at: Stamp = None) -> None:
        pass

    def stamp(self) -> float:
        now = time.perf_counter()
        if self._running:
            self._look(now)
        return now

    def poll(self, waited: Any = None) -> None:
        """Stamp the end of every collective that has completed since the last look; ``waited``,
        a work whose ``wait()`` has just returned, ended now."""
        if self._running:
            self._look(time.perf_counter(), waited)

    def _look(self, now: float, waited: Any = None) -> None:
        """One pass over the running works, in issue order. Gloo's workers take a group's
        collectives in that order, so once ``worker_threads`` of a queue are seen still running,
        none issued after on that queue has even started: they are passed over, and a rank 57
        collectives behind looks at two of them, not 57, at each mark and around each wait."""
        running: list[tuple[Any, _PendingSpan]] = []
        busy: dict[str, int] = {}  # per queue: works seen still running in this pass
        ended: dict[str, list[_PendingSpan]] = {}  # per queue: works seen completed in this pass, in issue order
        for work, span in self._running:
            if busy.get(span.queue, 0) >= self.worker_threads:
                running.append((work, span))
                continue
            try:
                if work is waited:
                    span.complete(now)
                elif work.is_completed():
                    ended.setdefault(span.queue, []).append(span)
                else:
                    running.append((work, span))
                    busy[span.queue] = busy.get(span.queue, 0) + 1
            except Exception as error:  # a work that cannot say: its span cannot end
                span.fail(error)
        for spans in ended.values():
            self._spread_ends(spans, now)
        self._running = running
        self._last_look = now

    def _spread_ends(self, spans: list[_PendingSpan], now: float) -> None:
        """Ends for the works of one queue seen completed at this look, in issue order: the i-th
        of k at i/(k+1) of the time since the look before (or since it was issued), never
        before the one issued before it. One alone ends in the middle, as before; given one
        end, the middle, several did, and the replay (``_start_when_a_worker_was_free``) started
        the third of them at its own end: on 2 CPU ranks 1-14 of an ``async`` step's 24
        all-reduces were 0 ms long, which left them out of busbw and made every other rank's
        time in them a wait for this one."""
        previous = float("-inf")
        for index, span in enumerate(spans, start=1):
            since = max(self._last_look, span.start)
            previous = max(previous, since + (now - since) * index / (len(spans) + 1))
            span.complete(previous)

    def resolve(self, stamp: Stamp) -> float | None:
        return stamp

    def host_time(self, stamp: Stamp) -> float:
        return stamp

    def capture(self, value: Any) -> Any:
        """A CPU loss tensor is read with ``float()`` when its step resolves: no device involved."""
        return value

    def on_completion(self, work: Any, span: _PendingSpan) -> None:
        self._running.append((work, span))

    def result_on_completion(self, work: Any, span: _PendingSpan) -> Any:
        """A future of the work's tensor, as a DDP communication hook returns; the span ends
        when a poll sees the work completed. (``ddp_timing`` completes DDP's futures itself on
        the CPU, so no callback runs on gloo's thread there: see ``DDPTiming``.)"""
        self.on_completion(work, span)
        return work.get_future().then(_first_tensor)

    def time_collectives_in(self, group: Any) -> None:
        """Gloo's works need nothing turned on: their ends are looked for."""


class CudaEventClock:
    """GPU: CUDA events on the current stream, converted to the host clock against a reference
    event recorded at each step's start; resolved with ``query()``, never ``synchronize()``.

    An asynchronous NCCL collective is timed one of two ways:

    - *NCCL timing on* (``TORCH_NCCL_ENABLE_TIMING=1`` or ``pg._enable_collectives_timing()``;
      ``Watch`` turns it on unless the variable says 0): ProcessGroupNCCL records a start and an
      end event around each collective on its NCCL stream, and ``work._get_duration()`` reads
      their distance once the end event has completed (it raises before). ProcessGroupNCCL runs
      a group's collectives one after another on that stream, each after the compute stream
      reached its issue point, so a collective starts at its issue mark or at the previous
      one's end, whichever is later, and ends its duration after that: the issue marks and the
      durations give every start and end, and nothing is chained on the work (a ``.then`` and
      the event recorded in it cost 57 us of host time a collective on an H100 host).
    - *timing off*: the end is an event recorded in a callback chained with ``.then``. A NCCL
      work's future is marked complete when the collective is *enqueued*
      (``ProcessGroupNCCL::collective`` calls ``future_->markCompleted`` right after the kernel
      is launched), and ``.then`` runs its callback at once, on a pool stream made to wait for
      NCCL's end event (``ivalue::Future::invokeCallback``), so that event completes when the
      collective does. The start is the same replay over those ends (``worker_threads = 1``).
    """

    worker_threads = 1
    #: Ends are events (or NCCL's own durations), resolved with ``query()``: nothing to poll.
    polls = False

    STREAM_CACHE_LIMIT = 256  # distinct streams marked on; past it the cache starts afresh

    def __init__(self, torch_module: Any, nccl_timing: bool = False) -> None:
        self._torch = torch_module
        self.nccl_timing = nccl_timing
        self._reference: Any = None
        self._reference_host = 0.0
        self._streams: dict[tuple[int, int], Any] = {}
        self._raw_stream: Callable[[int], int] | None = getattr(getattr(torch_module, "_C", None), "_cuda_getCurrentRawStream", None)
        self._timed_groups: dict[int, Any] = {}  # groups whose NCCL timing this clock turned on (``time_collectives_in``)

    def poll(self, waited: Any = None) -> None:
        pass

    def begin_step(self, at: Stamp = None) -> None:
        """A step's reference event, recorded now; or, for a step that begins at ``at`` (a mark
        made earlier: where the step before was found to have ended), that mark's own. Given a
        new one, the step's start was read against the old reference and its spans against the
        new, and however far the GPU fell behind the host between the two landed in its window
        (a step of 30 ms on the GPU read 10, its forward before its own start)."""
        if isinstance(at, tuple):
            self._reference, self._reference_host = at[0], at[1]
            return
        self._reference = self._event()
        self._reference_host = time.perf_counter()

    def _current_stream(self) -> Any:
        """The current stream, as ``torch.cuda.current_stream()`` gives it, built once per stream.

        ``Event.record()`` with no stream calls ``torch.cuda.current_stream()``, which builds a
        new ``Stream`` object every time: on an H100 host that was 7 µs of a 15 µs mark. The raw
        handle of the current stream is one C call (0.2 µs), so the ``Stream`` is looked up by
        it; a mark inside a ``.then`` callback or a user's ``torch.cuda.stream(...)`` block still
        records on the stream current there."""
        if self._raw_stream is None:
            return self._torch.cuda.current_stream()
        device = self._torch.cuda.current_device()
        key = (device, self._raw_stream(device))
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) >= self.STREAM_CACHE_LIMIT:
                self._streams.clear()
            stream = self._streams[key] = self._torch.cuda.current_stream()
        return stream

    def _event(self) -> Any:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._current_stream())
        return event

    def stamp(self) -> Stamp:
        if self._reference is None:
            self.begin_step()
        return (self._reference, self._reference_host, self._event(), time.perf_counter())

    def resolve(self, stamp: Stamp) -> float | None:
        if not isinstance(stamp, tuple):
            return stamp
        reference, reference_host, event, _host = stamp
        if not (event.query() and reference.query()):
            return None
        return reference_host + reference.elapsed_time(event) / 1000.0

    def host_time(self, stamp: Stamp) -> float:
        """When the host made the mark: all an unresolved step can still say."""
        return stamp[3] if isinstance(stamp, tuple) else stamp

    def capture(self, value: Any) -> Any:
        """A CUDA loss is copied, without waiting, into pinned host memory; the step's end event
        is recorded after the copy, so once the step resolves the copy is there to read.
        (``float()`` or ``.item()`` on the CUDA tensor would make the host wait for the GPU.)"""
        if not getattr(value, "is_cuda", False):
            return value
        host = self._torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value.detach(), non_blocking=True)
        return host

    def on_completion(self, work: Any, span: _PendingSpan) -> None:
        if self.nccl_timing:
            span.complete_after(work)
            return
        work.get_future().then(_ending(span, self.stamp))

    def result_on_completion(self, work: Any, span: _PendingSpan) -> Any:
        """A future of the work's tensor (what a DDP hook returns) that also times the span: with
        NCCL timing on the span is the work's own, and the ``.then`` only hands the tensor on;
        with it off, the one ``.then`` both stamps the end and hands the tensor on."""
        if self.nccl_timing:
            span.complete_after(work)
            return work.get_future().then(_first_tensor)
        return work.get_future().then(_ending_then_first_tensor(span, self.stamp))

    def time_collectives_in(self, group: Any) -> None:
        """With NCCL timing on, a work's end is its duration, which ProcessGroupNCCL records only
        in groups whose timing is on: ``Watch`` turns it on in the default group, and this in any
        other group an asynchronous collective is timed in (a DDP's own ``process_group``, HSDP's
        replicate groups, a subgroup given to ``wrap``), once, before its first one. Else every
        step with such a collective goes out unresolved, as every step of an attached HSDP run
        did on a lent H200. A group that refuses is left as it is: its spans fail, and their
        steps say why."""
        if not self.nccl_timing or group is None or id(group) in self._timed_groups:
            return
        self._timed_groups[id(group)] = group  # held: an id is unique only while its object lives
        try:
            group._enable_collectives_timing()
        except (RuntimeError, AttributeError):
            pass


class _PendingSpan:
    __slots__ = ("kind", "start", "end", "blocking", "nbytes", "tag", "dtype", "queue", "timed_work", "failure")

    def __init__(self, kind: str, start: Stamp, blocking: bool, nbytes: int = 0, tag: str = "", dtype: str = "",
                 queue: str = "") -> None:
        self.kind, self.start, self.end, self.blocking = kind, start, None, blocking
        self.nbytes, self.tag, self.dtype = nbytes, tag, dtype
        self.queue = queue  # the process group's queue it waits in: "" the strategy's own
        self.timed_work: Any = None  # a NCCL work whose own duration ends the span: it has no end mark
        self.failure: str | None = None

    def complete(self, end: Stamp) -> None:
        self.end = end

    def complete_after(self, work: Any) -> None:
        """The span ends NCCL's duration of ``work`` after it starts (see ``CudaEventClock``)."""
        self.timed_work = work

    def fail(self, error: BaseException) -> None:
        """The completion could not be stamped: the span will never resolve."""
        first_line = (str(error).strip().splitlines() or [""])[0]  # torch's C++ errors go on with a stack trace
        self.failure = f"{type(error).__name__}: {first_line}"[:300]

    def read_duration(self) -> float | None:
        """NCCL's duration in seconds, or None while the collective may still be running.
        ``_get_duration()`` raises until the work has completed; a work that has completed and
        still cannot say (timing was off after all) fails the span."""
        try:
            return self.timed_work._get_duration() / 1000.0
        except Exception as error:
            if self.timed_work.is_completed():
                self.fail(error)
            return None


class _PendingStep:
    def __init__(self, step: int, strategy: str, settings: dict[str, Any], start: Stamp, spans: list[_PendingSpan]) -> None:
        self.step, self.strategy, self.settings, self.start = step, strategy, settings, start
        self.spans = spans
        self.end: Stamp = None
        self.samples = self.tokens = 0
        self.loss: Any = None
        self.excluded = False
        self.update_skipped = False
        self.compiling = False
        self.untimed_collectives = 0
        self.untimed_in_data = 0
        self.nograd_forwards = 0
        #: ``spans`` as ``timed_collectives`` last counted it: the list, its length, its collectives.
        self.collectives_counted: tuple[list[Any] | None, int, int] = (None, 0, 0)
        self.memory: dict[str, int] = {}
        self.paused_from: Stamp = None  # where the loop's pause before the step began and ended (``paused_until``)
        self.paused_to: Stamp = None
        self.paused_for: list[str] = []
        self.paused_inside = False  # a pause after the step's training began: its window holds it
        #: A mark made after the loss and tokens were captured, where the step ended at an earlier
        #: one (``end_step``'s ``at``): they are read once it resolves, not at the step's end.
        self.values_at: Stamp = None
        self.carries_outside_spans = bool(spans)  # it starts with marks made before it began (a wrap-time broadcast)
        self.graphs_compiled_at_start = dynamo_graphs_compiled()  # torch.compile's count: ``compile_counter``


class StepTimeline:
    """Collects spans into one ``StepReport`` per optimizer step."""

    def __init__(self, rank: int, clock: Clock | None = None,
                 unresolved_after_steps: int = UNRESOLVED_AFTER_STEPS) -> None:
        self.rank = rank
        self.clock: Clock = clock or HostClock()
        self.unresolved_after_steps = unresolved_after_steps
        self.unresolved_steps = 0  # sent marked unresolved so far
        self._current: _PendingStep | None = None
        self._outside_step: list[_PendingSpan] = []  # e.g. the wrap-time broadcast, given to the next step
        self._carried: list[_PendingSpan] = []  # spans the step before gave the next one (``end_step``'s ``carried``)
        self._pending: deque[_PendingStep] = deque()
        self._lock = threading.Lock()

    # -- marking ---------------------------------------------------------------------------------
    def begin_step(self, step: int, strategy: str, settings: dict[str, Any], at: Stamp = None) -> None:
        """A step begins now, or at ``at`` (a stamp made a moment ago: where the step before ended)."""
        self.clock.begin_step(at)
        early, self._outside_step = self._outside_step, []
        carried, self._carried = self._carried, []
        self._current = _PendingStep(step, strategy, dict(settings), self.clock.stamp() if at is None else at, early + carried)
        self._current.carries_outside_spans = bool(early)

    @contextmanager
    def phase(self, kind: str, blocking: bool = False) -> Iterator[None]:
        span = _PendingSpan(kind, self.clock.stamp(), blocking)
        try:
            yield
        finally:
            span.complete(self.clock.stamp())
            self._spans().append(span)

    def stamp(self) -> Stamp:
        return self.clock.stamp()

    @property
    def polls(self) -> bool:
        """Whether collective ends are found by polling on this thread (``HostClock``): then a
        gradient hook that calls ``poll`` sharpens them, and a wait is bracketed by two."""
        return self.clock.polls

    def poll(self, waited: Any = None) -> None:
        """Look, now, for collectives that have completed; ``waited`` ended now (``HostClock.poll``;
        nothing on a GPU)."""
        self.clock.poll(waited)

    def add_span(self, kind: str, start: Stamp, end: Stamp, blocking: bool, tag: str = "") -> _PendingSpan:
        """A span whose ends were stamped elsewhere (e.g. in a gradient hook)."""
        span = _PendingSpan(kind, start, blocking, tag=tag)
        span.complete(end)
        self._spans().append(span)
        return span

    def open_collective(self, kind: str, nbytes: int, tag: str, dtype: str, blocking: bool, at: Stamp = None,
                        queue: str = "") -> _PendingSpan:
        """A collective issued now, or at ``at`` (a stamp made for something else at that moment,
        as ``mark_ready`` takes one: on the CPU one look fewer, on a GPU one event fewer), on the
        process group whose queue is ``queue`` ("": the one the strategy's collectives share)."""
        span = _PendingSpan(kind, self.clock.stamp() if at is None else at, blocking, nbytes, tag, dtype, queue)
        self._spans().append(span)
        return span

    def mark_ready(self, tag: str, nbytes: int, at: Stamp = None) -> None:
        """Gradients ``tag`` (``p<i>``, ``b<i>``) were all ready at ``at`` (a stamp made for
        something else at that moment, so a GPU records no extra event), or now."""
        span = _PendingSpan(READY_KIND, self.clock.stamp() if at is None else at, False, nbytes, tag)
        span.complete(span.start)
        self._spans().append(span)

    def paused_until(self, what: str, end: Stamp) -> bool:
        """The loop paused training until ``end`` to do ``what`` (evaluate, save a checkpoint),
        its own work between steps. Before the step's training began: the step now begins at
        ``end``, and the time from its old start (the step before's end) is reported as paused
        (``StepReport.paused_s``), in no figure, with the collectives the pause issued (an
        evaluation's gathers); a pause after it runs on from the first. After (between micro-steps),
        the pause is in the step's window, and the step is excluded (``paused_for`` named,
        ``paused_s`` 0): it holds time that was not training. Between steps (no step begun) there
        is nothing to keep apart. Returns whether the step now begins at ``end``."""
        step = self._current
        if step is None:
            return False
        if what not in step.paused_for:
            step.paused_for.append(what)
        if step.paused_inside or any(span.kind in MODEL_COMPUTE_KINDS for span in step.spans):
            step.paused_inside = True
            return False
        if step.paused_from is None:  # else a second pause runs on from the first: one, however many parts
            step.paused_from = step.start
        step.start = step.paused_to = end
        step.spans = []  # what the pause issued is the pause's, and what it compiled (an evaluation under no_grad)
        step.carries_outside_spans = False
        step.graphs_compiled_at_start = dynamo_graphs_compiled()
        return True

    def time_collectives_in(self, group: Any) -> None:
        """About to time an asynchronous collective in ``group`` (None: the default group): see
        ``CudaEventClock.time_collectives_in``."""
        self.clock.time_collectives_in(group)

    def close_collective(self, span: _PendingSpan, work: Any | None) -> None:
        """Synchronous (``work`` is None): ends now. Asynchronous: ends when the work completes."""
        if work is None:
            span.complete(self.clock.stamp())
            return
        try:
            self.clock.on_completion(work, span)
        except Exception as error:  # e.g. a future that refuses callbacks: the span cannot end
            span.fail(error)

    def close_collective_with_result(self, span: _PendingSpan, work: Any) -> Any:
        """Asynchronous, for a DDP communication hook: the future of the work's tensor that the
        hook returns, which also ends the span (``Clock.result_on_completion``)."""
        try:
            return self.clock.result_on_completion(work, span)
        except Exception as error:  # e.g. a future that refuses callbacks: the span cannot end
            span.fail(error)
            return work.get_future().then(_first_tensor)

    def end_step(self, samples: int, tokens: Any, loss: Any = None, excluded: bool = False,
                 settings: dict[str, Any] | None = None, memory: dict[str, int] | None = None, at: Stamp = None,
                 update_skipped: bool = False, issued_collectives: int | None = None, untimed_in_data: int = 0,
                 nograd_forwards: int = 0, carried: Sequence[Any] = ()) -> None:
        """The step ends now, or at ``at`` (a stamp made earlier, where an attached loop's step is
        found to have ended only later, its update skipped: ``update_skipped``). ``loss`` and
        ``tokens`` may be device tensors: they are captured without waiting for the device and
        read once the step's marks resolved. ``settings`` known only at the end (the
        micro-steps of an attached loop) are added to those given at ``begin_step``. ``memory``:
        the bytes the rank holds now (``memory.MemorySampler``), when measured. A step that
        carries collectives issued outside any step (the wrap-time state broadcast after a
        switch) is excluded from the statistics: it is not a step of the strategy alone; so is a
        step in which torch.compile compiled (``compile_counter``), marked ``compiling``.
        ``issued_collectives``: how many the rank issued in the step, all process groups together
        (``issued_collectives``), where counted: those beyond the step's timed ones are reported
        as ``untimed_collectives``, and ``untimed_in_data`` of them (at most) as issued in the
        step's data time (``StepReport.untimed_in_data``). ``nograd_forwards``: forwards without
        gradients the loop ran in the step's data gap, outside a marked pause
        (``StepReport.nograd_forwards``). ``carried``: spans of this step that are the next
        one's, opened after ``at`` (the loop's collectives after a backward found, only now, to
        have ended a step whose update was skipped): they begin the next step instead."""
        step = self._current
        if step is None:
            return
        if carried:
            given = {id(span) for span in carried}
            step.spans = [span for span in step.spans if id(span) not in given]
            self._carried = list(carried)
        step.loss = self.clock.capture(loss) if loss is not None else None
        step.tokens = tokens if isinstance(tokens, int) else self.clock.capture(tokens)
        step.end, step.samples = self.clock.stamp() if at is None else at, samples
        if at is not None and (not isinstance(tokens, int) or loss is not None):
            # the copies were queued now, after ``at``: on a GPU, read once a mark after them resolved
            step.values_at = self.clock.stamp()
        step.settings.update(settings or {})
        step.compiling = dynamo_graphs_compiled() != step.graphs_compiled_at_start
        step.excluded = excluded or step.carries_outside_spans or step.compiling or step.paused_inside
        step.update_skipped = update_skipped
        if issued_collectives is not None:
            step.untimed_collectives = max(0, issued_collectives - self.timed_collectives())
            step.untimed_in_data = min(untimed_in_data, step.untimed_collectives)
        step.nograd_forwards = nograd_forwards
        step.memory = memory or {}
        with self._lock:
            self._pending.append(step)
        self._current = None

    @property
    def in_step(self) -> bool:
        return self._current is not None

    def timed_collectives(self) -> int:
        """How many collectives the current step has timed so far (0 outside a step; a barrier the
        loop issued is one, its ``wait`` span tagged ``BARRIER_TAG``). Asked at
        each data gap's ends of an attached loop, so only the spans added since the last ask are
        looked at (a step of an FSDP model holds hundreds)."""
        step = self._current
        if step is None:
            return 0
        counted_in, seen, count = step.collectives_counted
        if counted_in is not step.spans:  # a pause between steps starts the step's spans afresh
            seen, count = 0, 0
        spans = step.spans
        end = len(spans)  # once: a completion callback on another thread may append meanwhile
        count += sum(spans[i].kind in COMM_KINDS or is_barrier_wait(spans[i]) for i in range(seen, end))
        step.collectives_counted = (spans, end, count)
        return count

    def _spans(self) -> list[_PendingSpan]:
        return self._current.spans if self._current is not None else self._outside_step

    # -- reading ---------------------------------------------------------------------------------
    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def completed_reports(self) -> list[StepReport]:
        """Reports of finished steps whose every mark has resolved, oldest first; a step that
        can no longer resolve goes out marked ``unresolved`` instead of holding the rest. One
        that cannot be read at all (a figure that raises when it is read) goes out with nothing
        but its window, unresolved and saying why, or where not even that can be read is left
        out and counted (``unresolved_steps``): this runs inside the loop's ``optimizer.step()``,
        which telemetry must never make raise, and a step left at the head of the queue would
        raise again at every step after it."""
        ready: list[StepReport] = []
        self.clock.poll()
        with self._lock:
            while self._pending:
                overdue = len(self._pending) > self.unresolved_after_steps
                try:
                    report = self._resolve(self._pending[0], overdue)
                except Exception as error:
                    report = self._unreadable(self._pending[0], error)
                    if report is None:
                        self._pending.popleft()
                        self.unresolved_steps += 1
                        continue
                if report is None:
                    break
                ready.append(report)
                self._pending.popleft()
                self.unresolved_steps += report.unresolved
        return ready

    def _unreadable(self, step: _PendingStep, error: Exception) -> StepReport | None:
        """The report of a step that raised as it was read: its window alone, unresolved, and
        what raised; None where its window cannot be read either."""
        try:
            start, end = self.clock.host_time(step.start), self.clock.host_time(step.end)
        except Exception:
            return None
        if start is None or end is None:
            return None
        first_line = next(iter(str(error).splitlines()), "")
        reason = f"could not be read: {type(error).__name__}: {first_line}"[:200]
        return StepReport(rank=self.rank, step=step.step, strategy=step.strategy, settings=step.settings, start=start,
                          end=max(end, start), spans=[], samples=step.samples, tokens=0, excluded=step.excluded, unresolved=True,
                          unresolved_reason=reason)

    def _resolve(self, step: _PendingStep, overdue: bool) -> StepReport | None:
        """The step's report, or None while a mark may still resolve. A mark that failed, or any
        mark once the step is ``overdue``, is left out and the report marked unresolved."""
        resolve = self.clock.resolve
        start, end = resolve(step.start), resolve(step.end)
        values_ready = step.values_at is None or resolve(step.values_at) is not None
        if (start is None or end is None or not values_ready) and not overdue:
            return None
        reason = ""  # why the step is unresolved: its first mark that failed, else that marks were still pending
        pending_marks = int(start is None) + int(end is None) + int(not values_ready)
        resolved: list[tuple[Span, float | None, str]] = []  # (span, NCCL's duration: its end is to be found, queue)
        for pending in step.spans:
            span_start = resolve(pending.start)
            duration = None
            if pending.timed_work is not None:
                duration = None if pending.failure is not None else pending.read_duration()
                span_end = span_start if duration is not None else None
            else:
                span_end = None if pending.end is None else resolve(pending.end)
            if pending.failure is not None or span_start is None or span_end is None:
                if pending.failure is None and not overdue:
                    return None
                if pending.failure is not None and not reason:
                    reason = f"{pending.kind} {pending.tag}".rstrip() + f" could not be timed: {pending.failure}"
                pending_marks += pending.failure is None
                continue
            resolved.append((Span(pending.kind, span_start, max(span_start, span_end), pending.blocking,
                                  pending.nbytes, pending.tag, pending.dtype), duration, pending.queue))
        if pending_marks and not reason:
            reason = (f"{pending_marks} timing mark{'s' if pending_marks != 1 else ''} had not completed "
                      f"{self.unresolved_after_steps} steps later")
        paused_s = 0.0
        if step.paused_from is not None:
            began, ended = resolve(step.paused_from), resolve(step.paused_to)
            if (began is None or ended is None) and not overdue:
                return None
            paused_s = max(ended - began, 0.0) if began is not None and ended is not None else 0.0
        unresolved = bool(reason)
        start = self.clock.host_time(step.start) if start is None else start
        end = self.clock.host_time(step.end) if end is None else end
        spans = data_outside_loop_compute(self._start_when_a_worker_was_free(resolved, self.clock.worker_threads))
        first = min([start, *(s.start for s in spans)])
        loss = None if step.loss is None or unresolved else float(step.loss)
        tokens = step.tokens if isinstance(step.tokens, int) else 0 if unresolved else int(step.tokens)
        return StepReport(
            rank=self.rank, step=step.step, strategy=step.strategy, settings=step.settings, start=first,
            end=max(end, first), spans=spans, samples=step.samples, tokens=tokens, loss=loss,
            excluded=step.excluded, unresolved=unresolved, memory=step.memory, update_skipped=step.update_skipped,
            compiling=step.compiling, unresolved_reason=reason, untimed_collectives=step.untimed_collectives,
            untimed_in_data=step.untimed_in_data, nograd_forwards=step.nograd_forwards, paused_s=paused_s, paused_for=", ".join(step.paused_for)[:MAX_PAUSED_FOR],
        )

    @staticmethod
    def _start_when_a_worker_was_free(spans: list[tuple[Span, float | None, str]], workers: int | None) -> list[Span]:
        """A collective starts when it is issued or when one of its group's FIFO workers
        (gloo's threads; NCCL's one stream) frees up, whichever is later: replaying the queue
        over the completion stamps gives that time, so the span measures the transfer, not the
        queueing behind earlier buckets. A span whose duration NCCL measured has no end stamp:
        the same replay starts it, and it ends its duration later. Spans are kept in issue order
        (``open_collective`` appends them as they are issued), which is the order both backends
        serve them in; each queue (process group) has ``workers`` of its own and is replayed
        apart, so a collective on another group never waits behind this one's."""
        if not workers:
            return [span if duration is None else span._replace(end=span.start + duration) for span, duration, _ in spans]
        adjusted = [span for span, _, _ in spans]
        free_at: dict[str, list[float]] = {}
        for index, (span, duration, queue) in enumerate(spans):  # issue order: the order every queue serves
            if span.kind not in COMM_KINDS:
                continue
            workers_free_at = free_at.setdefault(queue, [float("-inf")] * workers)
            start = max(span.start, heapq.heappop(workers_free_at))
            end = start + duration if duration is not None else span.end
            start = min(start, end)
            heapq.heappush(workers_free_at, end)
            adjusted[index] = span._replace(start=start, end=end)
        return adjusted


def data_outside_loop_compute(spans: list[Span]) -> list[Span]:
    """``spans`` with each ``data`` span cut around the loop's marked compute (``LOOP_COMPUTE_KIND``:
    a teacher's forward, an average of the weights), in its place, in pieces where one falls inside
    it: the gap before a forward is taken whole when the forward begins, and what the loop marked
    in it computed, it did not load data."""
    marked = [(s.start, s.end) for s in spans if s.kind == LOOP_COMPUTE_KIND]
    if not marked:
        return spans
    cut: list[Span] = []
    for span in spans:
        if span.kind != "data":
            cut.append(span)
            continue
        cut.extend(span._replace(start=start, end=end) for start, end in subtract([(span.start, span.end)], marked))
    return cut


class NullTimeline:
    """What strategies talk to when nobody watches: the same calls, doing nothing."""

    def begin_step(self, step: int, strategy: str, settings: dict[str, Any], at: Any = None) -> None:
        pass

    def end_step(self, samples: int, tokens: Any, loss: Any = None, excluded: bool = False,
                 settings: dict[str, Any] | None = None, memory: dict[str, int] | None = None, at: Any = None,
                 update_skipped: bool = False, issued_collectives: int | None = None, untimed_in_data: int = 0,
                 nograd_forwards: int = 0, carried: Sequence[Any] = ()) -> None:
        pass

    def completed_reports(self) -> list[StepReport]:
        return []

    def timed_collectives(self) -> int:
        return 0

    def has_pending(self) -> bool:
        return False

    polls = False

    def poll(self, waited: Any = None) -> None:
        pass

    def phase(self, kind: str, blocking: bool = False) -> nullcontext[None]:
        return nullcontext()

    def open_collective(self, kind: str, nbytes: int, tag: str, dtype: str, blocking: bool, at: Any = None,
                        queue: str = "") -> None:
        return None

    def mark_ready(self, tag: str, nbytes: int, at: Any = None) -> None:
        pass

    def paused_until(self, what: str, end: Any) -> bool:
        return False

    def time_collectives_in(self, group: Any) -> None:
        pass

    def close_collective(self, span: Any, work: Any | None) -> None:
        pass

    def close_collective_with_result(self, span: Any, work: Any) -> Any:
        return work.get_future().then(_first_tensor)


NULL_TIMELINE = NullTimeline()
