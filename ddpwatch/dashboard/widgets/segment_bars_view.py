"""Beside the segments table: each segment's step window as one bar, the comparison of the article
the strategies follow at a glance (``ddpwatch/export/segment_bars.py`` says what the parts are;
summary.svg draws the same)."""

from __future__ import annotations

from textual.content import Content
from textual.geometry import Size
from textual.widget import Widget

from ddpwatch.export.segment_bars import NOT_MEASURED, SegmentBar, cells, lengths, segment_bar
from ddpwatch.dashboard.views.snapshot_parts import SegmentRow

#: (glyph, style) per part, in ``segment_bars.PARTS`` order.
GLYPHS: tuple[tuple[str, str], ...] = (("█", "green"), ("▓", "bright_green"), ("█", "red"), ("░", "grey50"))
LEGEND = (("█", "green", "compute"), ("▓", "bright_green", "compute beside comm (Overlap)"),
          ("█", "red", "exposed comm"), ("░", "grey50", "idle"))
LABEL_CELLS = 16
OVERLAP_CELLS = 8  # " ov  86%" (" ov 100%"): the percentage takes three cells


def legend() -> Content:
    """What each glyph is, and what a bar's length is, one line where the panel is wide enough."""
    parts: list[str | tuple[str, str]] = []
    for glyph, style, what in LEGEND:
        parts += [(glyph, style), f" {what}  "]
    parts.append(("length: time per sample", "grey50"))
    return Content.assemble(*parts).rstrip()


class SegmentBarsView(Widget):
    DEFAULT_CSS = """
    SegmentBarsView { height: auto; }
    """

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 (Textual's name)
        super().__init__(id=id)
        self._bars: tuple[SegmentBar, ...] = ()

    def show(self, rows: tuple[SegmentRow, ...]) -> None:
        """A bar per segment, labelled by its strategy and steps (the table beside it has the rest)."""
        bars = tuple(segment_bar(f"{r.label.split(' (')[0]} {r.steps}", r.compute_pct, r.non_compute_pct,
                                 r.idle_pct, r.hidden_comm_pct, r.overlap_pct, length)
                     for r, length in zip(rows, lengths([r.samples_per_s if r.counted_steps else 0.0 for r in rows]), strict=True))
        if bars != self._bars:
            self._bars = bars
            self.refresh(layout=True)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        """The legend's lines as they wrap at this width (two in a narrow panel), then a line a bar."""
        return len(legend().wrap(max(1, width))) + max(1, len(self._bars))

    def render(self) -> Content:
        width = max(1, self.content_region.width - LABEL_CELLS - OVERLAP_CELLS)
        parts: list[str | tuple[str, str] | Content] = [legend()]
        if not self._bars:
            parts.append("\nno segment yet")
        for bar in self._bars:
            parts.append("\n" + bar.label[: LABEL_CELLS - 1].ljust(LABEL_CELLS))
            if not bar.measured:
                parts.append((NOT_MEASURED[:width + OVERLAP_CELLS], "grey50"))
                continue
            counts = cells(bar, width)
            for (glyph, style), count in zip(GLYPHS, counts, strict=True):
                if count:
                    parts.append((glyph * count, style))
            parts.append(" " * (width - sum(counts)) + f" ov {bar.overlap_pct:3.0f}%")  # under the longest bar's end
        return Content.assemble(*parts)
