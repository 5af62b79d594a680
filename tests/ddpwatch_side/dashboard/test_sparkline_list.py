"""How a series becomes sparkline columns."""

from __future__ import annotations

from ddpwatch.dashboard.widgets.sparkline_list import MAX_BAR_ROWS, Series, bar_levels, bar_rows_for, column_glyphs


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


def test_a_series_gets_the_rows_the_panel_has_room_for() -> None:
    """Each series is a caption, its bars and a blank line. Two trends in a 30-row panel: 15 rows
    each, 13 for bars, capped at MAX_BAR_ROWS; 64 ranks' devices in 30 rows: one row, as before."""
    assert bar_rows_for(30, 2) == MAX_BAR_ROWS == 6
    assert bar_rows_for(12, 2) == 4  # 6 rows each: caption, 4 of bars, blank
    assert bar_rows_for(30, 64) == 1 and bar_rows_for(0, 2) == 1 and bar_rows_for(30, 0) == 1


def test_a_tall_bar_stacks_whole_rows_under_its_partial_one() -> None:
    """Three rows are 24 eighths: level 0.5 is 13 of them (int(12) + 1, at least one eighth so the
    lowest value shows): a full bottom row, ▅ (5 eighths) above it, nothing on top."""
    assert column_glyphs(0.5, 3) == [" ", "▅", "█"]
    assert column_glyphs(0.0, 3) == [" ", " ", "▁"] and column_glyphs(1.0, 3) == ["█", "█", "█"]
    # one row draws exactly what the one-line sparkline drew: BARS[min(int(level * 8), 7)]
    assert [column_glyphs(k / 8, 1)[0] for k in range(9)] == list("▁▂▃▄▅▆▇██")
