"""The run's own collective cost model: t(S) = α + (S / busbw) · f(n), fitted by least squares.

``f(n)`` is nccl-tests' bus factor (2(n−1)/n for an all-reduce), so ``busbw`` is comparable
across world sizes and with the figures the dashboard shows. The samples are the *transfer*
parts of the run's collectives (the shortest duration over the ranks of each paired call, so
time spent waiting for a straggler does not read as a slow link). Pure: no torch, no UI.

A run's recent steps may all issue one size (a segment whose gradients fit one bucket), which
cannot tell latency from bandwidth; the sizes earlier steps issued still say what the link costs,
so a ``TransferMemory`` keeps the newest transfers of each size after those steps are forgotten.
"""

from __future__ import annotations

import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from instrumented_ddp.wire.messages import StepReport
from instrumented_ddp.wire.step_figures import CallTimes, bus_factor

from ddpwatch.figures.cross_rank import Groups, all_reduce_ranks, collective_key, transfers

#: Newest transfers kept of each all-reduce size, and sizes kept (the least recently issued go
#: first): a model's per-parameter all-reduces come in a few dozen sizes, a bucketed run's in a few.
REMEMBERED_PER_SIZE = 16
REMEMBERED_SIZES = 64


class TransferSample(NamedTuple):
    nbytes: int
    seconds: float


class StepCollectives(NamedTuple):
    """One step's all-reduces as the cost model reads them: every rank's durations in issue
    order (``CallTimes``, which a rank's summary carries too) and their bytes by tag and
    occurrence, read from any one rank's full report (a call moves the same bytes on every rank)."""

    calls: Mapping[int, CallTimes]
    sizes: Mapping[tuple[str, int], int]


def call_sizes(report: StepReport) -> dict[tuple[str, int], int]:
    """Each all-reduce's bytes, keyed as ``cross_rank.transfers`` keys it: the k-th call with its tag."""
    seen: Counter[str] = Counter()
    return {collective_key(span.tag, seen): span.nbytes for span in report.spans if span.kind == "all_reduce"}


def transfer_samples_of(steps: Sequence[StepCollectives], world_size: int, groups: Groups | None = None) -> list[TransferSample]:
    """Each all-reduce of each step every rank reported, paired across ranks by tag and
    occurrence: its bytes and its shortest duration over the ranks (the transfer; the rest of a
    longer one was waiting for the slowest rank). ``groups``: who meets whom
    (``Session.all_reduce_groups``; None, the world): each group's all-reduce is a transfer of
    its own, paired within the group, and a call's sample is the mean over the groups
    (``cross_rank.transfers``). A step some rank is missing from, or with no full report to give
    the sizes, gives none."""
    samples: list[TransferSample] = []
    for step in steps:
        if len(step.calls) < world_size or not step.sizes:
            continue
        samples.extend(TransferSample(step.sizes[key], seconds) for key, seconds in transfers(step.calls, groups) if key in step.sizes)
    return samples


class TransferMemory:
    """The newest ``REMEMBERED_PER_SIZE`` transfers of each all-reduce size the run issued, by
    how many ranks each call spanned, kept whatever became of the steps that carried them.

    Why: the cost model needs two sizes or more. After ``simple`` (every parameter's size) a
    switch to ``bucket`` at a cap over the model issues one size, and once the steps before the
    switch leave the fit's recent window, those steps alone cannot fit it. The link does not
    change with the strategy: the sizes it moved still say what it costs. The session adds each
    step's transfers as it folds it (``Session.transfer_memory``).
    """

    def __init__(self, per_size: int = REMEMBERED_PER_SIZE, sizes: int = REMEMBERED_SIZES) -> None:
        self.per_size = per_size
        self.sizes = sizes
        self._seconds: OrderedDict[tuple[int, int], deque[float]] = OrderedDict()  # (ranks a call spans, bytes)

    def add(self, samples: Iterable[TransferSample], meeting: int) -> None:
        """``meeting``: how many ranks each of these all-reduces spanned (``all_reduce_ranks``)."""
        for sample in samples:
            key = (meeting, sample.nbytes)
            seconds = self._seconds.pop(key, None)
            if seconds is None:
                seconds = deque(maxlen=self.per_size)
            seconds.append(sample.seconds)
            self._seconds[key] = seconds  # the newest size last
        while len(self._seconds) > self.sizes:
            self._seconds.popitem(last=False)

    def add_step(self, step: StepCollectives, world_size: int, groups: Groups | None = None) -> None:
        self.add(transfer_samples_of([step], world_size, groups), all_reduce_ranks(groups, world_size))

    def samples(self, meeting: int, besides: Iterable[int] = ()) -> list[TransferSample]:
        """The transfers kept of calls spanning ``meeting`` ranks, less the sizes in ``besides``
        (those the recent steps measured again)."""
        skip = set(besides)
        return [TransferSample(nbytes, seconds) for (ranks, nbytes), kept in self._seconds.items()
                if ranks == meeting and nbytes not in skip for seconds in kept]


@dataclass(frozen=True)
class CostModel:
    """``seconds(S) = alpha_s + S · factor / (busbw_gbps · 1e9)``, with what it was fitted on."""

    world_size: int
    alpha_s: float
    busbw_gbps: float
    factor: float  # the bus factor f(n) of the collective kind
    samples: int
    min_bytes: int
    max_bytes: int
    rms_error_s: float  # root mean square of the residuals
    relative_error: float  # median |residual| / measured
    through_origin: bool = False  # the free fit gave a negative latency: refitted with α = 0

    def seconds(self, nbytes: int) -> float:
        return self.alpha_s + nbytes * self.factor / (self.busbw_gbps * 1e9)

    def extrapolated(self, nbytes: int) -> bool:
        """A size outside those the run issued: the model's line, not a measurement, says it."""
        return not self.min_bytes <= nbytes <= self.max_bytes


def fit_cost_model(samples: Iterable[TransferSample], world_size: int, kind: str = "all_reduce") -> CostModel | None:
    """Ordinary least squares of seconds on bytes · f(n). None where the samples cannot tell
    latency from bandwidth: fewer than two distinct sizes, one rank (no transfer at all), or
    time that does not grow with size. A negative latency (noise at small sizes) is refitted
    through the origin and marked."""
    points = [(s.nbytes, s.seconds) for s in samples if s.nbytes > 0 and s.seconds >= 0]
    factor = bus_factor(kind, world_size)
    if not factor or len({nbytes for nbytes, _ in points}) < 2:
        return None
    xs = [nbytes * factor / 1e9 for nbytes, _ in points]  # bus gigabytes
    ys = [seconds for _, seconds in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx <= 0:  # distinct sizes, one float once scaled (a byte apart at ~1e18): no line through them
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    alpha, through_origin = mean_y - slope * mean_x, False
    if alpha < 0:
        slope, alpha, through_origin = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs), 0.0, True
    if slope <= 0:
        return None
    residuals = [y - (alpha + slope * x) for x, y in zip(xs, ys, strict=True)]
    relative = [abs(r) / y for r, y in zip(residuals, ys, strict=True) if y > 0]
    return CostModel(world_size, alpha, 1.0 / slope, factor, len(points), min(n for n, _ in points),
                     max(n for n, _ in points), statistics.fmean(r * r for r in residuals) ** 0.5,
                     statistics.median(relative) if relative else 0.0, through_origin)
