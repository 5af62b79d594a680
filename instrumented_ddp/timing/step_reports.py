"""A step's marks until they resolve, and the report they resolve into.

Where a collective *starts* is the subtle part. Both backends queue collectives: gloo runs two
at a time on its worker threads, NCCL one at a time on the process group's NCCL stream. A
collective issued while the queue is busy waits, and that wait is not transfer: the span starts
when it is issued or when a worker (the stream) frees up, whichever is later, found by replaying
the queue over the completion stamps (``start_when_a_worker_is_free``). Each process group is a
queue of its own (gloo's threads and NCCL's stream belong to a group): a collective on another
group (HSDP's all-reduce across replicas, ``fsdp_timing``) is opened with its ``queue`` named
and is replayed apart. On NCCL with timing on, a collective's duration is NCCL's own, read once
it has completed, and the same replay run forward from the issue marks gives its start and end:
no completion callback at all.
"""

from __future__ import annotations

import heapq
from typing import Any

from instrumented_ddp.timing.clocks import Clock, PendingSpan, Stamp
from instrumented_ddp.timing.compile_counter import dynamo_graphs_compiled
from instrumented_ddp.wire.messages import MAX_PAUSED_FOR, Span, StepReport
from instrumented_ddp.wire.kinds import COMM_KINDS, LOOP_COMPUTE_KIND
from instrumented_ddp.wire.time_ranges import subtract


class PendingStep:
    """One step's marks and what ``end_step`` was told, until the step resolves into its report."""

    def __init__(self, step: int, strategy: str, settings: dict[str, Any], start: Stamp, spans: list[PendingSpan]) -> None:
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
        self.unwatched = False  # timed as its window alone (``StepTimeline``'s unwatched steps)
        self.trained = False  # an unwatched step's model compute began (its spans, which would say, are not kept)
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


def unreadable_report(step: PendingStep, rank: int, clock: Clock, error: Exception) -> StepReport | None:
    """The report of a step that raised as it was read: its window alone, unresolved, and
    what raised; None where its window cannot be read either."""
    try:
        start, end = clock.host_time(step.start), clock.host_time(step.end)
    except Exception:
        return None
    if start is None or end is None:
        return None
    first_line = next(iter(str(error).splitlines()), "")
    reason = f"could not be read: {type(error).__name__}: {first_line}"[:200]
    return StepReport(rank=rank, step=step.step, strategy=step.strategy, settings=step.settings, start=start,
                      end=max(end, start), spans=[], samples=step.samples, tokens=0, excluded=step.excluded, unresolved=True,
                      unresolved_reason=reason)


def step_report(step: PendingStep, rank: int, clock: Clock, overdue: bool,
                unresolved_after_steps: int) -> StepReport | None:
    """``rank``'s report of ``step``, or None while a mark may still resolve. A mark that failed,
    or any mark once the step is ``overdue`` (``unresolved_after_steps`` later steps have ended),
    is left out and the report marked unresolved."""
    resolve = clock.resolve
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
                  f"{unresolved_after_steps} steps later")
    paused_s = 0.0
    if step.paused_from is not None:
        began, ended = resolve(step.paused_from), resolve(step.paused_to)
        if (began is None or ended is None) and not overdue:
            return None
        paused_s = max(ended - began, 0.0) if began is not None and ended is not None else 0.0
    unresolved = bool(reason)
    start = clock.host_time(step.start) if start is None else start
    end = clock.host_time(step.end) if end is None else end
    spans = data_outside_loop_compute(start_when_a_worker_is_free(resolved, clock.worker_threads))
    first = min([start, *(s.start for s in spans)])
    loss = None if step.loss is None or unresolved else float(step.loss)
    tokens = step.tokens if isinstance(step.tokens, int) else 0 if unresolved else int(step.tokens)
    return StepReport(
        rank=rank, step=step.step, strategy=step.strategy, settings=step.settings, start=first,
        end=max(end, first), spans=spans, samples=step.samples, tokens=tokens, loss=loss,
        excluded=step.excluded, unresolved=unresolved, memory=step.memory, update_skipped=step.update_skipped,
        compiling=step.compiling, unresolved_reason=reason, untimed_collectives=step.untimed_collectives,
        untimed_in_data=step.untimed_in_data, nograd_forwards=step.nograd_forwards, paused_s=paused_s, paused_for=", ".join(step.paused_for)[:MAX_PAUSED_FOR],
        unwatched=step.unwatched,
    )


def start_when_a_worker_is_free(spans: list[tuple[Span, float | None, str]], workers: int | None) -> list[Span]:
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
