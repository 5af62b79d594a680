"""Which of a rank's collectives are still running, read from another thread without a sync.

The stall probe (``publish.stall_probing``) asks this from the sender thread while the main
thread may sit inside one of them. A collective is in flight while:

* its NCCL work says it is not completed (``timed_work.is_completed()``, an event query);
* or, on a GPU, its end event has not happened (``event.query()``, never a wait);
* or, on the CPU, its end is not stamped and its gloo work, if the clock still looks for one,
  is not completed (``is_completed()``: gloo's works are safe to ask from any thread); a
  synchronous call, whose end is stamped when it returns, is in flight until then.
"""

from __future__ import annotations

from typing import Any

from instrumented_ddp.timing.clocks import PendingSpan
from instrumented_ddp.timing.timeline import StepTimeline
from instrumented_ddp.wire.stall_probe import MAX_IN_FLIGHT, MAX_NAME, InFlight


def collectives_in_flight(timeline: StepTimeline, now: float) -> list[InFlight]:
    """The rank's collectives in flight, the longest waited first, at most ``MAX_IN_FLIGHT``.
    ``now``: ``time.perf_counter()``, the host clock both of the timeline's clocks stamp on."""
    running = timeline.clock.running_works()
    found = []
    for step, span in timeline.unreported_collectives():
        if span.failure is None and _running(span, running):
            waited = max(0.0, now - timeline.clock.host_time(span.start))
            found.append(InFlight(span.kind[:MAX_NAME], span.tag[:MAX_NAME], max(int(span.nbytes), 0), span.queue[:MAX_NAME],
                                  span.seq, step, waited))
    found.sort(key=lambda call: -call.waited_s)
    return found[:MAX_IN_FLIGHT]


def _running(span: PendingSpan, running: dict[int, Any]) -> bool:
    try:
        if span.timed_work is not None:
            return not span.timed_work.is_completed()
        if span.end is None:
            work = running.get(id(span))
            return work is None or not work.is_completed()
        if isinstance(span.end, tuple):  # a GPU stamp: (reference, reference_host, event, host)
            return not span.end[2].query()
    except Exception:  # a work or an event that cannot say: not counted as running
        return False
    return False
