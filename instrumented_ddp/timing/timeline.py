"""One rank's record of every phase and collective, step by step.

The strategies and the training loop mark where things start and end; a clock
(``clocks.HostClock``, ``clocks.CudaEventClock``) turns the marks into seconds on this rank's
clock. Reports wait in ``pending`` until every mark of their step has resolved
(``step_reports``); a step whose marks cannot all resolve (a completion callback that failed,
one that never came) is sent marked ``unresolved`` rather than holding back every later step.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import TracebackType
from typing import Any

from instrumented_ddp.timing.clocks import Clock, HostClock, PendingSpan, Stamp, first_tensor
from instrumented_ddp.timing.compile_counter import dynamo_graphs_compiled
from instrumented_ddp.timing.step_reports import PendingStep, step_report, unreadable_report
from instrumented_ddp.timing.unwatched_blocks import NEVER_UNWATCHED, UnwatchedBlocks
from instrumented_ddp.wire.messages import StepReport
from instrumented_ddp.wire.kinds import COMM_KINDS, MODEL_COMPUTE_KINDS, READY_KIND, is_barrier_wait

#: A step still unresolved when this many later steps have ended is sent marked ``unresolved``.
#: On a GPU the host runs ahead of the device by a few steps at most (the launch queue is
#: bounded), so this is far beyond any step that is merely late.
UNRESOLVED_AFTER_STEPS = 32

#: The start of a span made in an unwatched step (``UnwatchedBlocks``): a span handed back to
#: its caller, as every span is, and never kept, stamped or timed.
UNWATCHED = object()


class StepTimeline:
    """Collects spans into one ``StepReport`` per optimizer step.

    A step that ``unwatched`` holds records its window alone: every marking call returns at
    once (a span it must hand back is made and dropped), so the step costs what it would
    unwatched, and its report, with no spans, says ``unwatched`` (see ``unwatched_blocks``). A
    step that begins with spans made before it (a wrap-time broadcast, a skipped update's
    collectives) is watched whatever the schedule says: those spans are the step's to report."""

    def __init__(self, rank: int, clock: Clock | None = None,
                 unresolved_after_steps: int = UNRESOLVED_AFTER_STEPS,
                 unwatched: UnwatchedBlocks = NEVER_UNWATCHED) -> None:
        self.rank = rank
        self.unwatched_blocks = unwatched
        #: Whether the current step is timed in full (True between steps, where a span made is
        #: the next step's).
        self.watching = True
        self.clock: Clock = clock or HostClock()
        self.unresolved_after_steps = unresolved_after_steps
        self.unresolved_steps = 0  # sent marked unresolved so far
        self._current: PendingStep | None = None
        self._outside_step: list[PendingSpan] = []  # e.g. the wrap-time broadcast, given to the next step
        self._carried: list[PendingSpan] = []  # spans the step before gave the next one (``end_step``'s ``carried``)
        self._pending: deque[PendingStep] = deque()
        self._lock = threading.Lock()
        #: What the main thread is in (``phase``'s kind, "" outside every phase): read by the
        #: sender thread for the heartbeat, so a plain attribute, stored twice a phase.
        self.current_phase = ""
        #: Collectives opened on each queue since the rank started: each span's ``seq`` is its
        #: number on its queue, the same on every rank of the group (``stall_probe.InFlight.seq``).
        self.issued: dict[str, int] = {}

    # -- marking ---------------------------------------------------------------------------------
    def begin_step(self, step: int, strategy: str, settings: dict[str, Any], at: Stamp = None) -> None:
        """A step begins now, or at ``at`` (a stamp made a moment ago: where the step before ended)."""
        self.clock.begin_step(at)
        early, self._outside_step = self._outside_step, []
        carried, self._carried = self._carried, []
        self._current = PendingStep(step, strategy, dict(settings), self.clock.stamp() if at is None else at, early + carried)
        self._current.carries_outside_spans = bool(early)
        self._current.unwatched = not self._current.spans and self.unwatched_blocks.holds(step)
        self.watching = not self._current.unwatched

    def phase(self, kind: str, blocking: bool = False) -> AbstractContextManager[None]:
        """The block is the step's ``kind`` phase; in an unwatched step, only ``current_phase``
        says so (the heartbeat's, for a rank that hangs in it)."""
        if not self.watching:
            self._note_training(kind)
            return _PhaseNamed(self, kind)
        return self._timed_phase(kind, blocking)

    def _note_training(self, kind: str) -> None:
        """An unwatched step keeps no spans: whether its training began (``paused_until``) is kept instead."""
        if kind in MODEL_COMPUTE_KINDS and self._current is not None:
            self._current.trained = True

    @contextmanager
    def _timed_phase(self, kind: str, blocking: bool) -> Iterator[None]:
        span = PendingSpan(kind, self.clock.stamp(), blocking)
        outer, self.current_phase = self.current_phase, kind
        try:
            yield
        finally:
            self.current_phase = outer
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
        if self.watching:
            self.clock.poll(waited)

    def add_span(self, kind: str, start: Stamp, end: Stamp, blocking: bool, tag: str = "") -> PendingSpan:
        """A span whose ends were stamped elsewhere (e.g. in a gradient hook)."""
        if not self.watching:
            self._note_training(kind)
            return PendingSpan(kind, UNWATCHED, blocking, tag=tag)
        span = PendingSpan(kind, start, blocking, tag=tag)
        span.complete(end)
        self._spans().append(span)
        return span

    def open_collective(self, kind: str, nbytes: int, tag: str, dtype: str, blocking: bool, at: Stamp = None,
                        queue: str = "") -> PendingSpan:
        """A collective issued now, or at ``at`` (a stamp made for something else at that moment,
        as ``mark_ready`` takes one: on the CPU one look fewer, on a GPU one event fewer), on the
        process group whose queue is ``queue`` ("": the one the strategy's collectives share).
        Counted on its queue in an unwatched step too: a ``seq`` is the same on every rank."""
        seq = self.issued[queue] = self.issued.get(queue, 0) + 1
        if not self.watching:
            span = PendingSpan(kind, UNWATCHED, blocking, nbytes, tag, dtype, queue)
            span.seq = seq
            return span
        span = PendingSpan(kind, self.clock.stamp() if at is None else at, blocking, nbytes, tag, dtype, queue)
        span.seq = seq
        self._spans().append(span)
        return span

    def mark_ready(self, tag: str, nbytes: int, at: Stamp = None) -> None:
        """Gradients ``tag`` (``p<i>``, ``b<i>``) were all ready at ``at`` (a stamp made for
        something else at that moment, so a GPU records no extra event), or now."""
        if not self.watching:
            return
        span = PendingSpan(READY_KIND, self.clock.stamp() if at is None else at, False, nbytes, tag)
        span.complete(span.start)
        self._spans().append(span)

    def paused_until(self, what: str, end: Stamp) -> bool:
        """The loop paused training until ``end`` to do ``what`` (evaluate, save a checkpoint),
        its own work between steps. A pause before the step's training began moves the step's
        start to ``end``: the time from its first start (the step before's end) is reported as
        paused (``StepReport.paused_s``), in no figure, with the collectives the pause issued (an
        evaluation's gathers); a second such pause runs on from the first. A pause after it
        (between micro-steps) stays in the step's window, and the step is excluded (``paused_for``
        named, ``paused_s`` 0): it holds time that is not training. Between steps (no step begun)
        there is nothing to keep apart. An unwatched step, which keeps no spans, tells the two
        apart by whether a compute phase began in it. Returns whether the step's start moved to ``end``."""
        step = self._current
        if step is None:
            return False
        if what not in step.paused_for:
            step.paused_for.append(what)
        if step.paused_inside or step.trained or any(span.kind in MODEL_COMPUTE_KINDS for span in step.spans):
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

    def close_collective(self, span: PendingSpan, work: Any | None) -> None:
        """Synchronous (``work`` is None): ends now. Asynchronous: ends when the work completes."""
        if span.start is UNWATCHED:
            return
        if work is None:
            span.complete(self.clock.stamp())
            return
        try:
            self.clock.on_completion(work, span)
        except Exception as error:  # e.g. a future that refuses callbacks: the span cannot end
            span.fail(error)

    def close_collective_with_result(self, span: PendingSpan, work: Any) -> Any:
        """Asynchronous, for a DDP communication hook: the future of the work's tensor that the
        hook returns, which also ends the span (``Clock.result_on_completion``)."""
        if span.start is UNWATCHED:
            return work.get_future().then(first_tensor)
        try:
            return self.clock.result_on_completion(work, span)
        except Exception as error:  # e.g. a future that refuses callbacks: the span cannot end
            span.fail(error)
            return work.get_future().then(first_tensor)

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
        self.watching = True
        if carried and not step.unwatched:  # an unwatched step's spans were never kept
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
        if issued_collectives is not None and not step.unwatched:
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

    def _spans(self) -> list[PendingSpan]:
        return self._current.spans if self._current is not None else self._outside_step

    def unreported_collectives(self) -> list[tuple[int, PendingSpan]]:
        """(step, span) of each collective not yet reported: the current step's, those issued
        outside a step (step 0), and the finished steps' still pending. For the sender thread's
        stall probe: the main thread only appends to these lists meanwhile, so copies suffice."""
        current = self._current
        found = [(0, span) for span in list(self._outside_step)]
        if current is not None:
            found += [(current.step, span) for span in list(current.spans)]
        with self._lock:
            found += [(step.step, span) for step in self._pending for span in list(step.spans)]
        return [(step, span) for step, span in found if span.kind in COMM_KINDS]

    @property
    def current_step(self) -> int:
        """The step begun and not ended (0 between steps)."""
        current = self._current
        return current.step if current is not None else 0

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
                    report = step_report(self._pending[0], self.rank, self.clock, overdue, self.unresolved_after_steps)
                except Exception as error:
                    report = unreadable_report(self._pending[0], self.rank, self.clock, error)
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


class _PhaseNamed:
    """An unwatched step's phase: named in ``current_phase`` while it runs, never timed."""

    __slots__ = ("_timeline", "_kind", "_outer")

    def __init__(self, timeline: StepTimeline, kind: str) -> None:
        self._timeline, self._kind, self._outer = timeline, kind, ""

    def __enter__(self) -> None:
        self._outer, self._timeline.current_phase = self._timeline.current_phase, self._kind

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self._timeline.current_phase = self._outer


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
        return work.get_future().then(first_tensor)


NULL_TIMELINE = NullTimeline()
