"""The heatmap tab: a row per rank (or per node, collapsed) and a cell per recent step, coloured
from the lowest to the highest value shown (``ddpwatch/dashboard/views/heatmap.py`` builds the grid)."""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget

from ddpwatch.dashboard.views.heatmap import HEATMAP_METRICS, Heatmap, HeatRow, level

LABEL_WIDTH = 12
#: The metric and the steps shown, then its scale; then the rows. The scale has a line of its own:
#: beside the metric, 80 columns with its key, a narrow side tab would cut its high end and "h".
#: The steps share the metric's line, so that a short terminal keeps rank rows in view.
HEADER_ROWS = 2
#: Low to high: cool to hot.
RAMP = tuple(Style(color=c) for c in ("rgb(40,70,140)", "rgb(50,120,180)", "rgb(70,170,160)",
                                      "rgb(220,200,60)", "rgb(240,130,40)", "rgb(230,50,50)"))
MISSING = Style(color="rgb(90,90,90)")
TEXT = Style(color="rgb(200,200,200)")


class RankHeatmap(Widget):
    """One ``Strip`` per line: the metric and its steps, its scale, then the rows; the newest step at the right."""

    DEFAULT_CSS = "RankHeatmap { height: auto; }"

    class RowClicked(Message):
        """A row was clicked: the app opens or closes its node, or selects its rank."""

        def __init__(self, row: HeatRow) -> None:
            super().__init__()
            self.row = row

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 (Textual's name)
        super().__init__(id=id)
        self.data: Heatmap | None = None

    def show(self, data: Heatmap | None) -> None:
        if data == self.data:
            return
        rows_changed = (len(data.rows) if data else 0) != (len(self.data.rows) if self.data else 0)
        self.data = data
        self.refresh(layout=rows_changed)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return HEADER_ROWS + (len(self.data.rows) if self.data else 0)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        data = self.data
        if data is None or not data.rows:
            return Strip([Segment("no steps yet" if y == 0 else "", TEXT)]).crop(0, width)
        if y == 0:  # the steps last: a narrow tab cuts them, the least needed
            steps = data.steps[-self._columns(width):]
            shown = [Segment(f" · steps {steps[0]}…{steps[-1]}", MISSING)] if steps else []
            return Strip([Segment(HEATMAP_METRICS[data.metric], TEXT), *shown]).crop(0, width)
        if y == 1:
            segments = [Segment(f"{'scale':<{LABEL_WIDTH}}{data.low:.1f} ", TEXT), *(Segment("█", style) for style in RAMP),
                        Segment(f" {data.high:.1f}   h: next metric", TEXT)]
            return Strip(segments).crop(0, width)
        index = y - HEADER_ROWS
        if index >= len(data.rows):
            return Strip.blank(width)
        row = data.rows[index]
        segments = [Segment(row.label[: LABEL_WIDTH - 1].ljust(LABEL_WIDTH), TEXT)]
        for value in row.values[-self._columns(width):]:
            if value is None:
                segments.append(Segment("·", MISSING))
            else:
                segments.append(Segment("█", RAMP[level(value, data.low, data.high, len(RAMP))]))
        return Strip(segments).crop(0, width)

    @staticmethod
    def _columns(width: int) -> int:
        return max(1, width - LABEL_WIDTH)

    def on_click(self, event: Click) -> None:
        if self.data is not None and 0 <= event.y - HEADER_ROWS < len(self.data.rows):
            self.post_message(self.RowClicked(self.data.rows[event.y - HEADER_ROWS]))
