"""What the timeline tests share: the host's clock, a gloo work and its future as the test
decides they complete, and reading a timeline's one report."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from instrumented_ddp.wire.messages import Span, StepReport
from instrumented_ddp.timing.timeline import StepTimeline


class FakeHostTime:
    """Stands in for the ``time`` module inside ``instrumented_ddp.timing.clocks``: the test sets the clock."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def perf_counter(self) -> float:
        return self.now


class FakeFuture:
    """Keeps the callbacks so the test decides when the collective completes."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], Any]] = []

    def add_done_callback(self, callback: Callable[[Any], Any]) -> None:
        self.callbacks.append(callback)

    def then(self, callback: Callable[[Any], Any]) -> FakeFuture:
        self.callbacks.append(callback)
        return FakeFuture()

    def fire(self) -> None:
        for callback in self.callbacks:
            callback(self)


class FakeWork:
    """A gloo work as the CPU clock sees it: ``is_completed()`` turns true when the test says."""

    def __init__(self, duration_ms: float | None = None) -> None:
        self.future = FakeFuture()
        self.duration_ms = duration_ms
        self.completed = False

    def is_completed(self) -> bool:
        return self.completed

    def get_future(self) -> FakeFuture:
        return self.future

    def _get_duration(self) -> float:
        if self.duration_ms is None:
            raise RuntimeError("TORCH_NCCL_ENABLE_TIMING is not set")
        return self.duration_ms


def only_report(timeline: StepTimeline) -> StepReport:
    reports = timeline.completed_reports()
    assert len(reports) == 1, reports
    return reports[0]


def kinds_of(report: StepReport, kind: str) -> list[Span]:
    return [span for span in report.spans if span.kind == kind]


def inside(inner: Span, outer: Span) -> bool:
    return outer.start <= inner.start and inner.end <= outer.end
