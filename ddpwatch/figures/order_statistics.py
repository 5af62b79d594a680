"""Distribution-free intervals for a median, from order statistics alone: how far one run's
median step time (or median paired ratio) can be trusted without assuming how the values are
spread, which on a loaded box they are not normally. Pure; used by the segment figures
(``metrics``), ``ddpwatch tune`` through them, and the benches. The interval's rule and the
median of a plain list are ``instrumented_ddp.wire.median_interval``'s (standard library only: the
benches that run on the ranks use it); here, what a dashboard refresh needs from one numpy
partial sort."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from instrumented_ddp.wire.median_interval import MEDIAN_INTERVAL_Z, median_interval_positions


def percentiles_and_median_interval(values: np.ndarray, percents: Sequence[float],
                                    z: float = MEDIAN_INTERVAL_Z) -> tuple[list[float], tuple[float, float]]:
    """Each of ``percents`` of ``values`` (linear interpolation between the closest ranks, as
    ``numpy.percentile`` by default) and the median's interval (``median_interval_positions``),
    from one partial sort: a segment's step times ask for them at every refresh of the
    dashboard, and each rank's at every export, where a ``numpy.percentile`` call each would
    sort the values again. Empty: zeros."""
    n = len(values)
    if not n:
        return [0.0] * len(percents), (0.0, 0.0)
    low, high = median_interval_positions(n, z)
    ranks = [percent / 100 * (n - 1) for percent in percents]
    wanted = {low, high} | {math.floor(rank) for rank in ranks} | {math.ceil(rank) for rank in ranks}
    ordered = np.partition(values, sorted(wanted))
    found = []
    for rank in ranks:
        below, above = float(ordered[math.floor(rank)]), float(ordered[math.ceil(rank)])
        found.append(below + (above - below) * (rank - math.floor(rank)))
    return found, (float(ordered[low]), float(ordered[high]))


def median_of(values: np.ndarray) -> float:
    """``numpy.median`` of a non-empty array from one partial sort, without its per-call overhead
    (each segment's and each rank's median bandwidth, at every refresh)."""
    n = len(values)
    middle = np.partition(values, [(n - 1) // 2, n // 2])
    return (float(middle[(n - 1) // 2]) + float(middle[n // 2])) / 2


def intervals_apart(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two medians differ by more than their values' spread: their intervals
    (``median_interval.median_with_interval``'s low and high) do not overlap. Conservative: overlapping
    intervals may still differ, so "not apart" is "not told apart", never "the same"."""
    (a_low, a_high), (b_low, b_high) = a, b
    return a_high < b_low or b_high < a_low
