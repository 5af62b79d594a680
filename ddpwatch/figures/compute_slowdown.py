"""How much the run's all-reduces slow backward's compute, measured from the caps it ran.

On two CPU ranks sharing two cores, gloo's threads take the cores backward computes on; on a GPU,
NCCL's kernels take SMs. So a cap whose all-reduces run inside backward lengthens backward, and
an advisor that replays backward as measured at a large cap (nothing beside it) predicts the small
caps too fast, and points at caps too small.

Each counted step of a ``bucket``/``ddp`` segment gives, on its first rank, a ``BackwardBeside``:
the forward's duration, backward's (its start to the last gradient-ready mark) and the time an
all-reduce ran beside it (the union of their spans inside it). Across the caps a run has trained
at, backward grows with that time: while an all-reduce runs, compute goes at ``1 - lost_share``
of its speed. The forward is the yardstick: it runs with nothing beside it (a bucketed strategy's
all-reduces end before the optimizer), and it moves with the machine's speed as backward does,
so the line is fitted to

    backward / forward = quiet_ratio + lost_share · (communication beside backward / forward)

over each segment's medians. Why time and not bytes: per MB, many small all-reduces beside
backward slow it more than one large one, while per second they run, both take about the same
share of its compute. Pure: no torch, no UI.
"""

from __future__ import annotations

import bisect
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from instrumented_ddp.wire.messages import Span, StepReport
from instrumented_ddp.wire.kinds import READY_KIND

#: The strategies whose all-reduces run beside backward's compute, a bucket at a time (the advisor's).
MEASURED_STRATEGIES = ("bucket", "ddp")
#: Newest steps kept of each segment, and segments kept (the oldest go first): a median over a few
#: steps lets the share, and the Advisor tab's best cap, swing as a run goes on at one cap; over 200
#: they hold. ``ddpwatch tune`` measures 10-14 steps a cap: all of them either way.
REMEMBERED_PER_SEGMENT = 200
REMEMBERED_SEGMENTS = 64
#: Two segments whose communication beside backward differs by less than this share of the most
#: any segment had cannot tell a slope from the steps' noise (0.05 and 0.1 MB both communicate
#: through nearly all of backward): a smaller share lets such caps fit a slope to noise.
MIN_SPREAD = 0.5
#: The most compute a slope may say is lost: some always goes on.
MAX_LOST_SHARE = 0.95


@dataclass(frozen=True)
class BackwardBeside:
    """One step's backward and what ran beside it, on the rank's clock."""

    forward_s: float
    backward_s: float  # backward's start to its last gradient-ready mark
    communicating_s: float  # of that, the time an all-reduce ran


def communicating_s(spans: Iterable[Span], start: float, end: float) -> float:
    """How long, inside ``start``-``end``, at least one all-reduce ran (the union of their spans)."""
    return CommunicationClock(spans).busy_between(start, end)


class CommunicationClock:
    """A report's all-reduce spans merged into the times at least one ran, with their running
    total, so that how long they ran before any instant is a binary search: a run at a 1 KB cap
    has hundreds of buckets, and each gradient-ready mark asks (``quiet_time``)."""

    def __init__(self, spans: Iterable[Span]) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.before: list[float] = []  # communication in the merged ranges before each one
        for begin, finish in sorted((s.start, s.end) for s in spans if s.kind == "all_reduce" and s.end > s.start):
            if self.ends and begin <= self.ends[-1]:
                self.ends[-1] = max(self.ends[-1], finish)
                continue
            self.before.append(self.before[-1] + self.ends[-1] - self.starts[-1] if self.starts else 0.0)
            self.starts.append(begin)
            self.ends.append(finish)

    def busy_until(self, at: float) -> float:
        """How long at least one all-reduce ran before ``at``."""
        index = bisect.bisect_right(self.starts, at) - 1
        if index < 0:
            return 0.0
        return self.before[index] + min(at, self.ends[index]) - self.starts[index]

    def busy_between(self, start: float, end: float) -> float:
        return max(0.0, self.busy_until(end) - self.busy_until(start)) if end > start else 0.0


NO_COMMUNICATION = CommunicationClock(())


def communicating_backward(report: StepReport) -> tuple[float, float] | None:
    """The start of the backward holding the gradient-ready marks and its last mark, or None
    where the report has no marks."""
    marks = [span.start for span in report.spans if span.kind == READY_KIND]
    if not marks:
        return None
    first = min(marks)
    backwards = [span.start for span in report.spans if span.kind == "backward" and span.start <= first]
    return (max(backwards), max(marks)) if backwards else None


def backward_beside(report: StepReport) -> BackwardBeside | None:
    """The step's point: None without marks or without a forward before the backward."""
    found = communicating_backward(report)
    if found is None:
        return None
    start, end = found
    forwards = [span for span in report.spans if span.kind == "forward" and span.end <= start]
    if not forwards or end <= start:
        return None
    forward = max(forwards, key=lambda span: span.start)
    if forward.duration <= 0:
        return None
    return BackwardBeside(forward.duration, end - start, communicating_s(report.spans, start, end))


def quiet_time(at_s: float, clock: CommunicationClock, start: float, lost_share: float) -> float:
    """``at_s`` seconds into the backward starting at ``start``, less the compute lost while the
    report's all-reduces (``clock``) ran before then: when that gradient would have been ready
    with nothing beside backward (the inverse of ``bucket_sim.SlowedBackward``)."""
    if lost_share <= 0:
        return at_s
    return at_s - lost_share * clock.busy_between(start, start + at_s)


@dataclass(frozen=True)
class SlowdownFit:
    """``backward / forward = quiet_ratio + lost_share · communicating / forward``, over ``segments``."""

    quiet_ratio: float
    lost_share: float  # 0 to MAX_LOST_SHARE: communication does not speed compute
    segments: int


def segment_point(points: Sequence[BackwardBeside]) -> tuple[float, float, float]:
    """A segment's medians: forward, backward / forward, communication beside backward / forward."""
    forward = statistics.median(p.forward_s for p in points)
    return (forward, statistics.median(p.backward_s for p in points) / forward,
            statistics.median(p.communicating_s for p in points) / forward)


def fit_slowdown(segments: Sequence[Sequence[BackwardBeside]]) -> SlowdownFit | None:
    """The line through each segment's median backward / forward against its median
    communication beside backward / forward, robustly: the median of the slopes between every two
    segments whose communication differs by ``MIN_SPREAD`` of the most or more (Theil and Sen's
    estimator: a segment the box ran slow through moves it less than it moves least squares), and
    the median of the intercepts it leaves. None with no such pair (one cap run, or caps that
    communicate through about as much of backward). A negative slope (noise: communication does
    not speed compute) reads as none."""
    medians = [segment_point(points) for points in segments if points]
    if len(medians) < 2:
        return None
    widest = max(x for _, _, x in medians)
    slopes = [(y2 - y1) / (x2 - x1) for k, (_, y1, x1) in enumerate(medians) for _, y2, x2 in medians[k + 1:]
              if widest > 0 and abs(x2 - x1) >= MIN_SPREAD * widest]
    if not slopes:
        return None
    slope = min(MAX_LOST_SHARE, max(0.0, statistics.median(slopes)))
    return SlowdownFit(statistics.median(y - slope * x for _, y, x in medians), slope, len(medians))


class SlowdownMemory:
    """The newest ``REMEMBERED_PER_SEGMENT`` points of each segment, kept whatever became of its
    steps' reports (the dashboard keeps 120 steps; the caps run before still say how communication
    slowed backward). The session adds each counted step of a bucketed segment as it folds it."""

    def __init__(self, per_segment: int = REMEMBERED_PER_SEGMENT, segments: int = REMEMBERED_SEGMENTS) -> None:
        self.per_segment = per_segment
        self.segments = segments
        self._points: OrderedDict[int, deque[BackwardBeside]] = OrderedDict()

    def add(self, segment: int, point: BackwardBeside) -> None:
        kept = self._points.get(segment)
        if kept is None:
            kept = self._points[segment] = deque(maxlen=self.per_segment)
        kept.append(point)
        while len(self._points) > self.segments:
            self._points.popitem(last=False)

    def points(self, segment: int) -> list[BackwardBeside]:
        return list(self._points.get(segment, ()))

    def by_segment(self) -> list[list[BackwardBeside]]:
        return [list(points) for points in self._points.values()]
