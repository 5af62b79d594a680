"""One rank's record of every phase and collective, step by step.

The strategies and the training loop mark where things start and end; a clock turns the marks
into seconds on this rank's clock. On the CPU the mark *is* the time; on a GPU a mark is a CUDA
event resolved a step or two later with ``query()``, so timing never synchronises the device.
An asynchronous collective ends when it completes: its future's callback stamps the end.
Reports wait in ``pending`` until every mark of their step has resolved.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

from .protocol import Span, StepReport

Stamp = Any  # a float (host clock) or whatever a clock's resolve() understands


class Clock(Protocol):
    def begin_step(self) -> None: ...
    def stamp(self) -> Stamp: ...
    def resolve(self, stamp: Stamp) -> float | None: ...
    def on_completion(self, work: Any, done: Callable[[Stamp, float | None], None]) -> None: ...


class HostClock:
    """CPU/gloo: ``perf_counter`` now; a collective's end from its future's completion callback.

    The callback runs on a gloo thread (or at once, if the work already finished): it only
    stamps the time, which is thread-safe under the GIL. Gloo has no per-work start time, and a
    collective issued while gloo's worker threads are busy waits in its queue: see
    ``StepTimeline._start_when_a_worker_was_free``.
    """

    #: ProcessGroupGloo's worker threads (its default): collectives run this many at a time, FIFO.
    worker_threads = 2

    def begin_step(self) -> None:
        pass

    def stamp(self) -> float:
        return time.perf_counter()

    def resolve(self, stamp: Stamp) -> float | None:
        return stamp

    def on_completion(self, work: Any, done: Callable[[Stamp, float | None], None]) -> None:
        work.get_future().add_done_callback(lambda _future: done(time.perf_counter(), None))


class CudaEventClock:
    worker_threads = None  # NCCL reports each collective's own duration
    """GPU: CUDA events on the current stream, converted to the host clock against a reference
    event recorded at each step's start. A collective's end is an event recorded inside
    ``work.get_future().then(...)``, whose stream has already waited for NCCL; its start is the
    end minus NCCL's own duration (``TORCH_NCCL_ENABLE_TIMING=1``) where available, since an event
    at issue time would also count the queueing behind earlier buckets."""

    def __init__(self, torch_module: Any) -> None:
        self._torch = torch_module
        self._reference: Any = None
        self._reference_host = 0.0

    def begin_step(self) -> None:
        self._reference = self._event()
        self._reference_host = time.perf_counter()

    def _event(self) -> Any:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stamp(self) -> Stamp:
        if self._reference is None:
            self.begin_step()
        return (self._reference, self._reference_host, self._event())

    def resolve(self, stamp: Stamp) -> float | None:
        if not isinstance(stamp, tuple):
            return stamp
        reference, reference_host, event = stamp
        if not (event.query() and reference.query()):
            return None
        return reference_host + reference.elapsed_time(event) / 1000.0

    def on_completion(self, work: Any, done: Callable[[Stamp, float | None], None]) -> None:
        def completed(future: Any) -> None:
            try:
                duration = work._get_duration() / 1000.0
            except Exception:  # timing not enabled: the span then starts at issue time
                duration = None
            done(self.stamp(), duration)

        work.get_future().then(completed)


class _PendingSpan:
    __slots__ = ("kind", "start", "end", "blocking", "nbytes", "tag", "dtype", "duration")

    def __init__(self, kind: str, start: Stamp, blocking: bool, nbytes: int = 0, tag: str = "", dtype: str = "") -> None:
        self.kind, self.start, self.end, self.blocking = kind, start, None, blocking
        self.nbytes, self.tag, self.dtype, self.duration = nbytes, tag, dtype, None

    def complete(self, end: Stamp, duration: float | None = None) -> None:
        self.duration = duration
        self.end = end


class _PendingStep:
    def __init__(self, step: int, strategy: str, settings: dict[str, Any], start: Stamp, spans: list[_PendingSpan]) -> None:
        self.step, self.strategy, self.settings, self.start = step, strategy, settings, start
        self.spans = spans
        self.end: Stamp = None
        self.samples = self.tokens = 0
        self.loss: Any = None
        self.excluded = False


class StepTimeline:
    """Collects spans into one ``StepReport`` per optimizer step."""

    def __init__(self, rank: int, clock: Clock | None = None) -> None:
        self.rank = rank
        self.clock: Clock = clock or HostClock()
        self._current: _PendingStep | None = None
        self._outside_step: list[_PendingSpan] = []  # e.g. the wrap-time broadcast, given to the next step
        self._pending: deque[_PendingStep] = deque()
        self._lock = threading.Lock()

    # -- marking ---------------------------------------------------------------------------------
    def begin_step(self, step: int, strategy: str, settings: dict[str, Any]) -> None:
        self.clock.begin_step()
        early, self._outside_step = self._outside_step, []
        self._current = _PendingStep(step, strategy, dict(settings), self.clock.stamp(), early)

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

    def add_span(self, kind: str, start: Stamp, end: Stamp, blocking: bool) -> None:
        """A span whose ends were stamped elsewhere (e.g. in a gradient hook)."""
        span = _PendingSpan(kind, start, blocking)
        span.complete(end)
        self._spans().append(span)

    def open_collective(self, kind: str, nbytes: int, tag: str, dtype: str, blocking: bool) -> _PendingSpan:
        span = _PendingSpan(kind, self.clock.stamp(), blocking, nbytes, tag, dtype)
        self._spans().append(span)
        return span

    def close_collective(self, span: _PendingSpan, work: Any | None) -> None:
        """Synchronous (``work`` is None): ends now. Asynchronous: ends when the work completes."""
        if work is None:
            span.complete(self.clock.stamp())
        else:
            self.clock.on_completion(work, span.complete)

    def end_step(self, samples: int, tokens: int, loss: Any = None, excluded: bool = False) -> None:
        """``loss`` may be a device tensor: it is read only once the step's marks resolved,
        when reading it no longer waits for the device."""
        step = self._current
        if step is None:
            return
        step.end, step.samples, step.tokens, step.loss, step.excluded = self.clock.stamp(), samples, tokens, loss, excluded
        with self._lock:
            self._pending.append(step)
        self._current = None

    def _spans(self) -> list[_PendingSpan]:
        return self._current.spans if self._current is not None else self._outside_step

    # -- reading ---------------------------------------------------------------------------------
    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def completed_reports(self) -> list[StepReport]:
        """Reports of finished steps whose every mark has resolved, oldest first."""
        ready: list[StepReport] = []
        with self._lock:
            while self._pending:
                report = self._resolve(self._pending[0])
                if report is None:
                    break
                ready.append(report)
                self._pending.popleft()
        return ready

    def _resolve(self, step: _PendingStep) -> StepReport | None:
        start, end = self.clock.resolve(step.start), self.clock.resolve(step.end)
        if start is None or end is None:
            return None
        spans: list[Span] = []
        for pending in step.spans:
            if pending.end is None:
                return None
            span_end = self.clock.resolve(pending.end)
            span_start = self.clock.resolve(pending.start)
            if span_end is None or span_start is None:
                return None
            if pending.duration is not None:
                span_start = span_end - pending.duration
            spans.append(Span(pending.kind, span_start, max(span_start, span_end), pending.blocking, pending.nbytes, pending.tag, pending.dtype))
        workers = getattr(self.clock, "worker_threads", None)
        if workers:
            spans = self._start_when_a_worker_was_free(spans, workers)
        first = min([start, *(s.start for s in spans)])
        loss = None if step.loss is None else float(step.loss)
        return StepReport(
            rank=self.rank, step=step.step, strategy=step.strategy, settings=step.settings, start=first,
            end=max(end, first), spans=spans, samples=step.samples, tokens=step.tokens, loss=loss, excluded=step.excluded,
        )


    @staticmethod
    def _start_when_a_worker_was_free(spans: list[Span], workers: int) -> list[Span]:
        """A collective starts when it is issued or when one of gloo's FIFO workers frees up,
        whichever is later: replaying the queue over the completion stamps gives that time, so
        the span measures the transfer, not the queueing behind earlier buckets."""
        free_at = [float("-inf")] * workers
        adjusted = list(spans)
        for index in sorted((i for i, s in enumerate(spans) if s.kind in ("all_reduce", "broadcast")), key=lambda i: spans[i].start):
            span = spans[index]
            start = min(max(span.start, heapq.heappop(free_at)), span.end)
            heapq.heappush(free_at, span.end)
            adjusted[index] = span._replace(start=start)
        return adjusted


class NullTimeline:
    """What strategies talk to when nobody watches: the same calls, doing nothing."""

    def begin_step(self, step: int, strategy: str, settings: dict[str, Any]) -> None:
        pass

    def end_step(self, samples: int, tokens: int, loss: Any = None, excluded: bool = False) -> None:
        pass

    def completed_reports(self) -> list[StepReport]:
        return []

    def has_pending(self) -> bool:
        return False

    def phase(self, kind: str, blocking: bool = False) -> nullcontext[None]:
        return nullcontext()

    def open_collective(self, kind: str, nbytes: int, tag: str, dtype: str, blocking: bool) -> None:
        return None

    def close_collective(self, span: Any, work: Any | None) -> None:
        pass


NULL_TIMELINE = NullTimeline()
