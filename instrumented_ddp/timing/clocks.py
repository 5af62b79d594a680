"""The clocks that turn a rank's marks into seconds on its host clock, and the span they end.

On the CPU the mark *is* the time (``HostClock``); on a GPU a mark is a CUDA event resolved a
step or two later with ``query()`` (``CudaEventClock``), so timing never synchronises the device.
An asynchronous collective ends when it completes: on the CPU the rank's own thread sees it
complete (``HostClock.poll``), on a GPU an event or NCCL's own duration says when. Where such a
collective starts is found later, from its issue mark and the ends before it
(``step_reports.start_when_a_worker_is_free``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

Stamp = Any  # a float (host clock) or whatever a clock's resolve() understands


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
    def on_completion(self, work: Any, span: PendingSpan) -> None: ...
    def running_works(self) -> dict[int, Any]:
        """The works of spans whose ends this clock still looks for, by ``id`` of their span:
        read from another thread (the stall probe), which asks each ``is_completed()`` itself."""
        ...
    def result_on_completion(self, work: Any, span: PendingSpan) -> Any: ...
    def time_collectives_in(self, group: Any) -> None: ...


def first_tensor(future: Any) -> Any:
    """A collective work's future holds a list of tensors; a DDP communication hook must return
    a future of one tensor."""
    return future.value()[0]


def _ending(span: PendingSpan, stamp: Callable[[], Stamp]) -> Callable[[Any], None]:
    """A completion callback that ends ``span`` at ``stamp()``, never raising on the backend's
    thread: a span that cannot be stamped fails, and its step says so (a raising callback would
    leave the span open forever)."""

    def completed(_future: Any) -> None:
        try:
            span.complete(stamp())
        except Exception as error:
            span.fail(error)

    return completed


def _ending_then_first_tensor(span: PendingSpan, stamp: Callable[[], Stamp]) -> Callable[[Any], Any]:
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
    the GIL from the training thread, a handoff per collective paid in step time (as it is by a
    thread of ours waiting on the works). The rank's thread looks at every mark (``stamp``), at every gradient hook that polls
    (``StepTimeline.poll``), and before and after every ``wait()`` on a work
    (``collectives.LooksWhenWaited``). A collective the rank waited for ended when its wait
    returned: that end is exact. One seen completed at a look ended between the look before,
    when it was still running, and this one: it is given the middle, off by at most half the
    time between two looks (a parameter's backward, in a hook-driven strategy). Gloo has no
    per-work start time, and a collective issued while gloo's worker threads are busy waits in
    its queue: see ``step_reports.start_when_a_worker_is_free``.

    Used from one thread only, the training thread: nothing here runs on gloo's threads.
    """

    #: ProcessGroupGloo's worker threads (its default): collectives run this many at a time, FIFO.
    worker_threads = 2
    #: Collective ends come from ``poll``: who waits for a collective calls it around the wait.
    polls = True

    def __init__(self) -> None:
        self._running: list[tuple[Any, PendingSpan]] = []  # issued, not yet seen completed
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
        none issued after on that queue has even started: they are passed over, and a rank many
        collectives behind looks at two of them, not all, at each mark and around each wait."""
        running: list[tuple[Any, PendingSpan]] = []
        busy: dict[str, int] = {}  # per queue: works seen still running in this pass
        ended: dict[str, list[PendingSpan]] = {}  # per queue: works seen completed in this pass, in issue order
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

    def _spread_ends(self, spans: list[PendingSpan], now: float) -> None:
        """Ends for the works of one queue seen completed at this look, in issue order: the i-th
        of k at i/(k+1) of the time since the look before (or since it was issued), never
        before the one issued before it. One alone ends in the middle. Several given the same
        end would have the replay (``step_reports.start_when_a_worker_is_free``) start the later
        ones at that end: all-reduces 0 ms long, left out of busbw, and every other rank's time
        in them read as a wait for this one."""
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

    def on_completion(self, work: Any, span: PendingSpan) -> None:
        self._running.append((work, span))

    def running_works(self) -> dict[int, Any]:
        return {id(span): work for work, span in self._running}  # ``_running`` is rebound whole, never edited

    def result_on_completion(self, work: Any, span: PendingSpan) -> Any:
        """A future of the work's tensor, as a DDP communication hook returns; the span ends
        when a poll sees the work completed. (``ddp_timing`` completes DDP's futures itself on
        the CPU, so no callback runs on gloo's thread there: see ``DDPTiming``.)"""
        self.on_completion(work, span)
        return work.get_future().then(first_tensor)

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
      the event recorded in it would cost host time on every collective).
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
        made earlier: where the step before was found to have ended), that mark's own. A new one
        there would read the step's start against the old reference and its spans against the
        new, and however far the GPU fell behind the host between the two would land in the
        step's window."""
        if isinstance(at, tuple):
            self._reference, self._reference_host = at[0], at[1]
            return
        self._reference = self._event()
        self._reference_host = time.perf_counter()

    def _current_stream(self) -> Any:
        """The current stream, as ``torch.cuda.current_stream()`` gives it, built once per stream.

        ``Event.record()`` with no stream calls ``torch.cuda.current_stream()``, which builds a
        new ``Stream`` object every time, most of what a mark costs. The raw handle of the
        current stream is one C call, so the ``Stream`` is looked up by it; a mark inside a ``.then`` callback or a user's ``torch.cuda.stream(...)`` block still
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

    def running_works(self) -> dict[int, Any]:
        """None: a span here knows its own end (``timed_work``, or an end event to ``query()``)."""
        return {}

    def on_completion(self, work: Any, span: PendingSpan) -> None:
        if self.nccl_timing:
            span.complete_after(work)
            return
        work.get_future().then(_ending(span, self.stamp))

    def result_on_completion(self, work: Any, span: PendingSpan) -> Any:
        """A future of the work's tensor (what a DDP hook returns) that also times the span: with
        NCCL timing on the span is the work's own, and the ``.then`` only hands the tensor on;
        with it off, the one ``.then`` both stamps the end and hands the tensor on."""
        if self.nccl_timing:
            span.complete_after(work)
            return work.get_future().then(first_tensor)
        return work.get_future().then(_ending_then_first_tensor(span, self.stamp))

    def time_collectives_in(self, group: Any) -> None:
        """With NCCL timing on, a work's end is its duration, which ProcessGroupNCCL records only
        in groups whose timing is on: ``Watch`` turns it on in the default group, and this in any
        other group an asynchronous collective is timed in (a DDP's own ``process_group``, HSDP's
        replicate groups, a subgroup given to ``wrap``), once, before its first one. Else every
        step with such a collective goes out unresolved. A group that refuses is left as it is: its spans fail, and their
        steps say why."""
        if not self.nccl_timing or group is None or id(group) in self._timed_groups:
            return
        self._timed_groups[id(group)] = group  # held: an id is unique only while its object lives
        try:
            group._enable_collectives_timing()
        except (RuntimeError, AttributeError):
            pass



class PendingSpan:
    __slots__ = ("kind", "start", "end", "blocking", "nbytes", "tag", "dtype", "queue", "timed_work", "failure", "seq")

    def __init__(self, kind: str, start: Stamp, blocking: bool, nbytes: int = 0, tag: str = "", dtype: str = "",
                 queue: str = "") -> None:
        self.kind, self.start, self.end, self.blocking = kind, start, None, blocking
        self.nbytes, self.tag, self.dtype = nbytes, tag, dtype
        self.queue = queue  # the process group's queue it waits in: "" the strategy's own
        self.timed_work: Any = None  # a NCCL work whose own duration ends the span: it has no end mark
        self.failure: str | None = None
        self.seq = 0  # a collective's number on its queue (``StepTimeline.open_collective``)

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
        still cannot say (timing is off after all) fails the span."""
        try:
            return self.timed_work._get_duration() / 1000.0
        except Exception as error:
            if self.timed_work.is_completed():
                self.fail(error)
            return None
