"""``bench/overhead.py``'s statistic: the median paired ratio and its distribution-free interval."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("bench_overhead", Path(__file__).resolve().parents[1] / "bench" / "overhead.py")
assert _SPEC is not None and _SPEC.loader is not None
bench_overhead = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_overhead)


def test_interval_of_sixteen_ratios_is_their_fourth_and_thirteenth() -> None:
    """n = 16: k = floor(8 - 1.645 * 4 / 2) = floor(4.71) = 4, so the 4th and 13th smallest."""
    ratios = [1.0 + i / 100 for i in range(16)]  # 1.00 ... 1.15, given shuffled
    median, low, high = bench_overhead.median_with_interval(ratios[::-1])
    assert median == pytest.approx(1.075) and low == pytest.approx(1.03) and high == pytest.approx(1.12)


def test_interval_of_few_ratios_is_their_whole_range() -> None:
    """n = 4 (a GPU run in blocks): k = floor(2 - 1.645) = 0, taken as 1: the extremes."""
    assert bench_overhead.median_with_interval([1.2, 0.9, 1.0, 1.1]) == pytest.approx((1.05, 0.9, 1.2))
