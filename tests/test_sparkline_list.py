"""How a series becomes sparkline columns."""

from __future__ import annotations

from ddpwatch.dashboard.widgets.sparkline_list import Series, bar_levels


def test_more_points_than_columns_keep_each_columns_peak() -> None:
    values = (0.0, 0.0, 10.0, 0.0, 5.0, 5.0)
    assert bar_levels(values, 3) == [0.0, 1.0, 0.5]  # the spike survives in its column


def test_fewer_points_than_columns_stretch_across_the_width() -> None:
    assert bar_levels((1.0, 3.0), 4) == [0.0, 0.0, 1.0, 1.0]


def test_a_flat_or_empty_series_draws_mid_height_or_nothing() -> None:
    assert bar_levels((7.0, 7.0), 2) == [0.5, 0.5]
    assert bar_levels((), 10) == [] and bar_levels((1.0,), 0) == []


def test_caption_says_latest_min_and_max_or_that_nothing_was_measured() -> None:
    assert Series("rank 0 GPU util %", (40.0, 90.0, 75.0), "%").caption() == "rank 0 GPU util %: 75% (min 40, max 90)"
    assert Series("loss", ()).caption() == "loss: —"
