"""Labelled sparklines: device utilization per rank, and loss and step time over steps.

One widget drawn line by line (Textual's line API) however many series it holds: a Label and a
Sparkline widget per series would be two widgets per rank, each laid out, styled and cached
every frame.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.segment import Segment
from rich.style import Style
from textual.color import Color
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

BARS = "▁▂▃▄▅▆▇█"
MAX_BAR_ROWS = 6  # the tallest a series' bars grow where the panel has room


@dataclass(frozen=True)
class Series:
    label: str
    values: tuple[float, ...]
    unit: str = ""

    def caption(self) -> str:
        if not self.values:
            return f"{self.label}: —"
        return (f"{self.label}: {self.values[-1]:.3g}{self.unit} "
                f"(min {min(self.values):.3g}, max {max(self.values):.3g})")


def bar_levels(values: tuple[float, ...], width: int) -> list[float]:
    """Each column's height in [0, 1]: the highest value of the points it covers (a spike stays
    visible however many points share a column), scaled between the series' min and max."""
    if not values or width <= 0:
        return []
    low, high = min(values), max(values)
    n = len(values)
    levels = []
    for column in range(width):
        first = column * n // width
        last = max((column + 1) * n // width, first + 1)
        peak = max(values[first:last])
        levels.append((peak - low) / (high - low) if high > low else 0.5)
    return levels


def bar_rows_for(height: int, series: int) -> int:
    """Rows of bars each series gets in a panel ``height`` rows tall, besides its caption and a
    blank line: one where the series fill the panel (64 ranks' devices scroll), up to
    ``MAX_BAR_ROWS`` where there is room, so that two series (the loss and step time) fill a
    tall tab."""
    if series <= 0:
        return 1
    return max(1, min(MAX_BAR_ROWS, height // series - 2))


def column_glyphs(level: float, rows: int) -> list[str]:
    """One column of a bar ``rows`` tall, top row first, for a level in [0, 1]: in eighths of a
    row, at least one (the lowest value still shows), whole rows of █ under the partial one. One
    row gives a one-line sparkline's glyph."""
    return [column_glyph(level, rows, row) for row in range(rows)]


def column_glyph(level: float, rows: int, row: int) -> str:
    """Row ``row`` (0: the top) of ``column_glyphs``: a line of the panel draws one row of every
    column, so a column is not made whole for each of its rows."""
    eighths = min(int(level * rows * 8), rows * 8 - 1) + 1
    fill = min(max(eighths - (rows - 1 - row) * 8, 0), 8)
    return BARS[fill - 1] if fill else " "


class SparklineList(ScrollView):
    """Series stacked one under another, each a caption over a sparkline as tall as the panel
    gives it room for (``bar_rows_for``)."""

    COMPONENT_CLASSES = {"sparkline-list--low", "sparkline-list--high"}
    DEFAULT_CSS = """
    SparklineList { height: 1fr; }
    SparklineList > .sparkline-list--low { color: $primary-darken-2; }
    SparklineList > .sparkline-list--high { color: $primary-lighten-2; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.series: tuple[Series, ...] = ()
        self.bar_rows = 1
        self._strips: dict[tuple[int, int], tuple[object, Strip]] = {}  # (series, line) -> (what it shows, line)

    def show(self, series: tuple[Series, ...]) -> None:
        if series == self.series:
            return
        count_changed = len(series) != len(self.series)
        self.series = series
        if count_changed:
            self._lay_out()
        self.refresh()

    def on_resize(self) -> None:
        self._lay_out()

    def _lay_out(self) -> None:
        """Bar rows for this many series at this height; the virtual height follows."""
        self.bar_rows = bar_rows_for(self.size.height, len(self.series))
        self._strips.clear()
        self.virtual_size = Size(0, (self.bar_rows + 2) * len(self.series))
        self.refresh()

    def render_line(self, y: int) -> Strip:
        rows = self.bar_rows
        index, line = divmod(int(self.scroll_y) + y, rows + 2)  # caption, bars, a blank line
        width = self.size.width
        if index >= len(self.series) or line == rows + 1 or width <= 0:
            return Strip.blank(width, self.rich_style)
        series = self.series[index]
        key = (series, width, line, rows)
        cached = self._strips.get((index, line))
        if cached is None or cached[0] != key:
            strip = self._caption(series, width) if line == 0 else self._bars(series, width, line - 1, rows)
            cached = self._strips[(index, line)] = (key, strip)
        return cached[1]

    def _caption(self, series: Series, width: int) -> Strip:
        return Strip([Segment(series.caption(), self.rich_style)]).crop_extend(0, width, self.rich_style)

    def _bars(self, series: Series, width: int, row: int, rows: int) -> Strip:
        """Row ``row`` (0: the top) of the series' bars."""
        low = Color.from_rich_color(self.get_component_rich_style("sparkline-list--low").color)
        high = Color.from_rich_color(self.get_component_rich_style("sparkline-list--high").color)
        segments = []
        for level in bar_levels(series.values, width):
            colour = low.blend(high, level).rich_color
            segments.append(Segment(column_glyph(level, rows, row), self.rich_style + Style(color=colour)))
        return Strip(segments).simplify().crop_extend(0, width, self.rich_style)
