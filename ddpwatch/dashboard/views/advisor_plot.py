"""The advisor's picture as characters: predicted step time against bucket cap on a log axis,
the current cap and PyTorch's 25 MB as columns, the predicted best, and each cap the run
measured with a whisker over its 90 % interval (clipped to the plot). Pure (the panel colours
the characters; the tests read them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddpwatch.advisor.advice import Advice
from ddpwatch.advisor.bucket_sim import MIB

PREDICTED, EXTRAPOLATED, BEST, MEASURED = "•", "·", "★", "◆"
CURRENT_COLUMN, DEFAULT_COLUMN = "│", "┆"
WHISKER = "¦"  # a measured cap's 90 % interval, above and below its point
TICKS = ((1024, "1K"), (32 * 1024, "32K"), (MIB, "1M"), (32 * MIB, "32M"), (1024 * MIB, "1G"))


@dataclass(frozen=True)
class AdvisorPlot:
    rows: tuple[str, ...]  # top row first, ``width`` characters each
    top_ms: float  # the step time of the top row
    bottom_ms: float  # ... and of the bottom row
    x_axis: str  # the cap ticks under the plot


def plot(advice: Advice, width: int, height: int) -> AdvisorPlot:
    caps = [p.cap_bytes for p in advice.predictions]
    times = [p.step_s for p in advice.predictions] + [m.step_s for m in advice.measured]
    low_cap, high_cap = math.log(min(caps)), math.log(max(caps))
    fastest, slowest = min(times), max(times)

    def column(cap_bytes: int) -> int:
        share = (math.log(cap_bytes) - low_cap) / (high_cap - low_cap) if high_cap > low_cap else 0.0
        return min(width - 1, max(0, round(share * (width - 1))))

    def row(step_s: float) -> int:
        share = (slowest - step_s) / (slowest - fastest) if slowest > fastest else 0.5
        return min(height - 1, max(0, round(share * (height - 1))))

    grid = [[" "] * width for _ in range(height)]
    for cap, mark in ((advice.default.cap_bytes, DEFAULT_COLUMN), (advice.current.cap_bytes, CURRENT_COLUMN)):
        for line in grid:
            line[column(cap)] = mark
    for measured in advice.measured:
        if measured.interval_s is not None:
            for index in range(row(measured.interval_s[1]), row(measured.interval_s[0]) + 1):
                grid[index][column(measured.cap_bytes)] = WHISKER
    for prediction in advice.predictions:
        grid[row(prediction.step_s)][column(prediction.cap_bytes)] = EXTRAPOLATED if prediction.extrapolated else PREDICTED
    grid[row(advice.best.step_s)][column(advice.best.cap_bytes)] = BEST
    for measured in advice.measured:
        grid[row(measured.step_s)][column(measured.cap_bytes)] = MEASURED
    axis = [" "] * width
    for cap, label in TICKS:
        if min(caps) <= cap <= max(caps):
            start = min(column(cap), width - len(label))
            axis[start:start + len(label)] = label
    return AdvisorPlot(tuple("".join(line) for line in grid), slowest * 1e3, fastest * 1e3, "".join(axis))
