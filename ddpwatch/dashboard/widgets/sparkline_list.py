"""Labelled sparklines: device utilization per rank, and loss and step time over steps.

One widget drawn line by line (Textual's line API) however many series it holds: as a Label
and a Sparkline widget per rank, 64 ranks made 128 widgets, each laid out, styled and cached
every frame, which cost the dashboard about a third of its frame time.
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
LINES_PER_SERIES = 3  # label, bars, a blank line between series


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


class SparklineList(ScrollView):
    """Series stacked one under another, each a caption over a one-line sparkline."""

    COMPONENT_CLASSES = {"sparkline-list--low", "sparkline-list--high"}
    DEFAULT_CSS = """
    SparklineList { height: 1fr; }
    SparklineList > .sparkline-list--low { color: $primary-darken-2; }
    SparklineList > .sparkline-list--high { color: $primary-lighten-2; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.series: tuple[Series, ...] = ()
        self._strips: dict[tuple[int, int], tuple[object, Strip]] = {}  # (series, line) -> (what it shows, line)

    def show(self, series: tuple[Series, ...]) -> None:
        if series == self.series:
            return
        if len(series) != len(self.series):
            self._strips.clear()
            self.virtual_size = Size(0, LINES_PER_SERIES * len(series))
        self.series = series
        self.refresh()

    def render_line(self, y: int) -> Strip:
        index, line = divmod(int(self.scroll_y) + y, LINES_PER_SERIES)
        width = self.size.width
        if index >= len(self.series) or line == 2 or width <= 0:
            return Strip.blank(width, self.rich_style)
        series = self.series[index]
        key = (series, width, line)
        cached = self._strips.get((index, line))
        if cached is None or cached[0] != key:
            strip = self._caption(series, width) if line == 0 else self._bars(series, width)
            cached = self._strips[(index, line)] = (key, strip)
        return cached[1]

    def _caption(self, series: Series, width: int) -> Strip:
        return Strip([Segment(series.caption(), self.rich_style)]).crop_extend(0, width, self.rich_style)

    def _bars(self, series: Series, width: int) -> Strip:
        low = Color.from_rich_color(self.get_component_rich_style("sparkline-list--low").color)
        high = Color.from_rich_color(self.get_component_rich_style("sparkline-list--high").color)
        segments = []
        for level in bar_levels(series.values, width):
            colour = low.blend(high, level).rich_color
            segments.append(Segment(BARS[min(int(level * len(BARS)), len(BARS) - 1)], self.rich_style + Style(color=colour)))
        return Strip(segments).simplify().crop_extend(0, width, self.rich_style)
