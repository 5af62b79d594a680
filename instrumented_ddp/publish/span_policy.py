"""What a rank sends for each step: its full spans, or a summary of them, as the listener asked.

What a step report costs the listener grows with the spans in it, so a rank sends a step's full
spans only where the listener asked for them (a ``SpanRequest``: every step, every N-th step, or
steps the user pinned, from the last ``HELD_STEPS`` kept here), and otherwise a ``StepSummary``:
the step's figures, computed by the same ``step_figures`` the dashboard runs on full spans (a
sampled step: its summary, then its spans). Until a listener says otherwise, every step goes out
in full.

Pure (no socket, no thread): the rank's sender thread runs it, and ``bench/dashboard_load.py``'s
simulated ranks run the same policy, so the bench's stream is what a real job's would be.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from instrumented_ddp.wire.messages import HELD_STEPS, SpanRequest, StepReport, StepSummary
from instrumented_ddp.wire.step_figures import summarize

class SpanPolicy:
    """One rank's choice between spans and a summary, and the recent reports it holds for pins."""

    def __init__(self, world_size: int, summarize: Callable[[StepReport, int], StepSummary] = summarize) -> None:
        self.world_size = world_size
        self._summarize = summarize  # the bench's simulated ranks pass a cheaper one (see bench/dashboard_load.py)
        self.request = SpanRequest(full=True)  # the listener's latest wish
        self.summaries = 0  # steps sent as a summary
        self._held: deque[tuple[StepReport, list[bool]]] = deque(maxlen=HELD_STEPS)  # (report, [spans sent])

    def wants_spans(self, step: int) -> bool:
        request = self.request
        return request.full or (request.sample_every > 0 and step % request.sample_every == 0)

    def messages_for(self, report: StepReport) -> list[StepReport | StepSummary]:
        """What to send for a finished step, held either way for a later pin: the report alone
        where the listener wants every span (``full``); else its summary, followed by the report
        on a sampled step. A sampled step's figures then come from the rank, like every other
        step's, and its spans are only kept by the listener, which would otherwise compute the
        figures of every rank's report of that step at once. An unwatched step's report, its
        window alone, goes out as it is and is not held: it has no spans to pin."""
        if report.unwatched:
            return [report]
        request = self.request
        sent = [request.full]
        self._held.append((report, sent))
        if request.full:
            return [report]
        try:
            summary = self._summarize(report, self.world_size)
        except Exception:  # a report the figures cannot take: sent whole, the receiver judges it
            sent[0] = True
            return [report]
        self.summaries += 1
        if self.wants_spans(report.step):
            sent[0] = True
            return [summary, report]
        return [summary]

    def on_request(self, request: SpanRequest) -> list[StepReport]:
        """Take the listener's new wish; returns the pinned steps' reports still held and not sent
        in full yet (a request is repeated every few seconds: each step's spans go out once)."""
        self.request = request
        pinned = set(request.pinned_steps)
        due: list[StepReport] = []
        for report, sent in self._held:
            if report.step in pinned and not sent[0]:
                sent[0] = True
                due.append(report)
        return due
