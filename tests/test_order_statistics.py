"""The median's distribution-free interval (``ddpwatch.order_statistics``), worked by hand."""

from __future__ import annotations

from pytest import approx

from ddpwatch.order_statistics import median_with_interval


def test_median_interval_of_sixteen_values_is_their_fourth_and_thirteenth() -> None:
    """n = 16: k = floor(8 - 1.645 * 4 / 2) = floor(4.71) = 4, so the 4th and 13th smallest."""
    values = [1.0 + i / 100 for i in range(16)]  # 1.00 ... 1.15, given shuffled
    assert median_with_interval(values[::-1]) == approx((1.075, 1.03, 1.12))


def test_median_interval_of_few_values_is_their_whole_range() -> None:
    """n = 4 (a GPU bench run in blocks): k = floor(2 - 1.645) = 0, taken as 1: the extremes."""
    assert median_with_interval([1.2, 0.9, 1.0, 1.1]) == approx((1.05, 0.9, 1.2))
    assert median_with_interval([]) == (0.0, 0.0, 0.0)
