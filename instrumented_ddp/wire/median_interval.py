"""A median and a distribution-free interval for it, from order statistics alone: how far one
run's median (a bench's paired ratios, a segment's step times) can be trusted without assuming
how the values are spread, which on a loaded box they are not normally.

Standard library only, so that both sides stand on it: the benches that run on the ranks
(``instrumented_ddp.selfcheck.overhead_bench``, which ``ddpwatch doctor`` runs from an installed package)
and ddpwatch's figures (``ddpwatch.figures.order_statistics``, which adds the numpy partial sort a
dashboard refresh needs)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

#: ``median_with_interval``'s z: a two-sided 90 % interval.
MEDIAN_INTERVAL_Z = 1.645


def median_interval_positions(n: int, z: float = MEDIAN_INTERVAL_Z) -> tuple[int, int]:
    """Where, in ``n`` sorted values (0-based), a distribution-free interval for their
    population's median lies: the order statistics k and n−k+1 with k = floor(n/2 − z·√n/2),
    the normal approximation to the binomial (Conover, *Practical Nonparametric Statistics*,
    3.2), k at least 1. At z = 1.645, 90 %; under 5 values the interval is their whole range,
    which covers the median less often than that (4 values: 87.5 %, 3: 75 %)."""
    k = max(1, math.floor(n / 2 - z * math.sqrt(n) / 2))
    return k - 1, n - k


def median_with_interval(values: Iterable[float], z: float = MEDIAN_INTERVAL_Z) -> tuple[float, float, float]:
    """The median of ``values`` (the mean of the middle two of an even count) and its interval
    (``median_interval_positions``): how far one run's median can be trusted. (0, 0, 0) for none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0, 0.0, 0.0
    low, high = median_interval_positions(len(ordered), z)
    return float(statistics.median(ordered)), float(ordered[low]), float(ordered[high])
