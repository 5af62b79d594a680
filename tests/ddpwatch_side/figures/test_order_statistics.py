"""The median's distribution-free interval (``instrumented_ddp.wire.median_interval``, and
``ddpwatch.figures.order_statistics``'s partial sort), hand-worked."""

from __future__ import annotations

import numpy as np
from pytest import approx

from ddpwatch.figures.order_statistics import median_of, percentiles_and_median_interval
from instrumented_ddp.wire.median_interval import median_interval_positions, median_with_interval


def test_median_interval_of_sixteen_values_is_their_fourth_and_thirteenth() -> None:
    """n = 16: k = floor(8 - 1.645 * 4 / 2) = floor(4.71) = 4, so the 4th and 13th smallest."""
    values = [1.0 + i / 100 for i in range(16)]  # 1.00 ... 1.15, given shuffled
    assert median_with_interval(values[::-1]) == approx((1.075, 1.03, 1.12))


def test_median_interval_of_few_values_is_their_whole_range() -> None:
    """n = 4 (a GPU bench run in blocks): k = floor(2 - 1.645) = 0, taken as 1: the extremes."""
    assert median_with_interval([1.2, 0.9, 1.0, 1.1]) == approx((1.05, 0.9, 1.2))
    assert median_with_interval([]) == (0.0, 0.0, 0.0)


def test_percentiles_and_the_interval_from_one_partial_sort() -> None:
    """Walls 40, 10, 30, 20 ms: p50 at rank 1.5 is 25; p95 at rank 2.85 is 30 + 0.85 * 10 = 38.5;
    4 values, so the interval is their range, 10 to 40. None: zeros."""
    assert percentiles_and_median_interval(np.array([40.0, 10.0, 30.0, 20.0]), (50, 95)) == (approx([25.0, 38.5]), (10.0, 40.0))
    assert percentiles_and_median_interval(np.array([]), (50, 95)) == ([0.0, 0.0], (0.0, 0.0))


def test_percentiles_and_median_read_as_numpys_and_the_interval_as_the_sorted_values() -> None:
    generator = np.random.default_rng(0)
    for n in (1, 2, 5, 9, 60, 4096):
        values = generator.lognormal(4.0, 0.3, n)
        (p50, p95), (low, high) = percentiles_and_median_interval(values, (50, 95))
        assert (p50, p95) == approx((np.percentile(values, 50), np.percentile(values, 95)), rel=1e-12)
        assert median_of(values) == approx(np.median(values), rel=1e-12)
        ordered = sorted(values.tolist())
        first, last = median_interval_positions(n)
        assert (low, high) == (ordered[first], ordered[last])


def test_a_median_of_an_even_count_is_the_mean_of_the_middle_two() -> None:
    assert median_of(np.array([4.0, 1.0, 3.0, 2.0])) == 2.5 and median_of(np.array([7.0])) == 7.0
