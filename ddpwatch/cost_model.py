"""The run's own collective cost model: t(S) = α + (S / busbw) · f(n), fitted by least squares.

``f(n)`` is nccl-tests' bus factor (2(n−1)/n for an all-reduce), so ``busbw`` is comparable
across world sizes and with the figures the dashboard shows. The samples are the *transfer*
parts of the run's collectives (the shortest duration over the ranks of each paired call, so
time spent waiting for a straggler does not read as a slow link). Pure: no torch, no UI.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from instrumented_ddp.step_figures import bus_factor


class TransferSample(NamedTuple):
    nbytes: int
    seconds: float


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
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    alpha, through_origin = mean_y - slope * mean_x, False
    if alpha < 0:
        slope, alpha, through_origin = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0, True
    if slope <= 0:
        return None
    residuals = [y - (alpha + slope * x) for x, y in zip(xs, ys)]
    relative = [abs(r) / y for r, y in zip(residuals, ys) if y > 0]
    return CostModel(world_size, alpha, 1.0 / slope, factor, len(points), min(n for n, _ in points),
                     max(n for n, _ in points), statistics.fmean(r * r for r in residuals) ** 0.5,
                     statistics.median(relative) if relative else 0.0, through_origin)
