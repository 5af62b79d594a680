"""Per-rank compute and communication lanes of one step on a shared time axis."""

from __future__ import annotations

from itertools import groupby

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.strip import Strip
from textual.widget import Widget

from ddpwatch.dashboard.views.timeline_lanes import RankLanes, TimelineData

LABEL_WIDTH = 11
STYLES = {
    "forward": Style(color="rgb(90,140,255)"),
    "backward": Style(color="rgb(80,200,120)"),
    "optimizer": Style(color="rgb(200,110,230)"),
    "loop": Style(color="rgb(235,140,180)"),
    "data": Style(color="rgb(150,150,150)"),
    "hidden": Style(color="rgb(80,200,210)"),
    "hidden_alt": Style(color="rgb(40,130,150)"),
    "exposed": Style(color="rgb(255,80,80)", bold=True),
    "exposed_waiting": Style(color="rgb(255,150,40)", bold=True),
    "wait": Style(color="rgb(240,200,60)"),
    "axis": Style(color="rgb(140,140,140)"),
    "label": Style(color="rgb(200,200,200)"),
    "selected": Style(color="rgb(255,255,255)", bold=True),
}
#: The loop's marked compute (``Attachment.computing``) first: one marked between the last
#: backward and ``step()`` lies inside the update's span, and is drawn as what the loop said.
COMPUTE_PRECEDENCE = ("loop", "backward", "forward", "optimizer")
#: Named in the legend only where a drawn rank has one: most loops mark none.
LOOP_LEGEND = ("█", "loop", "loop's own (marked)")
LEGEND = [("█", "forward", "forward"), ("█", "backward", "backward"), ("█", "optimizer", "optimizer"),
          ("░", "data", "data"),
          ("▆", "hidden", "collective hidden by compute"), ("▆", "exposed", "exposed: transfer"),
          ("▆", "exposed_waiting", "exposed: waiting for other ranks"), ("▁", "wait", "wait")]


class TimelineView(Widget):
    """Draws one ``Strip`` per line: an axis, then two lanes per rank, then the legend."""

    DEFAULT_CSS = "TimelineView { height: auto; }"

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.data: TimelineData | None = None
        self.selected_rank: int | None = None
        self._marked = False  # a drawn rank has the loop's marked compute: the legend names it

    def show(self, data: TimelineData | None, selected_rank: int | None = None) -> None:
        new_data = data is not self.data
        changed = new_data or selected_rank != self.selected_rank
        rows_changed = (data is None) != (self.data is None) or (data and self.data and (
            (len(data.ranks), bool(data.roles)) != (len(self.data.ranks), bool(self.data.roles))))
        self.data, self.selected_rank = data, selected_rank
        if new_data:  # a frame shows the same step's lanes again and again: look at their bars once
            marked = data is not None and any(bar.kind == "loop" for rank in data.ranks for bar in rank.compute)
            rows_changed = rows_changed or marked != self._marked
            self._marked = marked
        if rows_changed:
            self.refresh(layout=True)
        elif changed:
            self.refresh()

    @property
    def title(self) -> str:
        """Which step, under which strategy and settings: its box's border title, whole (the axis's
        label column would cut it to ``LABEL_WIDTH`` characters)."""
        if self.data is None:
            return ""
        notes = f" · {self.data.notes}" if self.data.notes else ""
        return f"step {self.data.step} · {self.data.label or self.data.strategy}{notes}"

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        if self.data is None:
            return 1
        return 1 + 2 * len(self.data.ranks) + len(legend_rows(width, self._marked)[1]) + (1 if self.data.roles else 0)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if self.data is None:
            return Strip([Segment("waiting for the first complete step…" if y == 0 else "", STYLES["axis"])]).crop(0, width)
        lanes = 2 * len(self.data.ranks)
        if y == 0:
            return self._axis(width)
        if 1 <= y <= lanes:
            rank = self.data.ranks[(y - 1) // 2]
            return self._lane(rank, compute=(y - 1) % 2 == 0, width=width)
        indent, legend = legend_rows(width, self._marked)
        if y <= lanes + len(legend):
            return self._legend(indent, legend[y - lanes - 1], width)
        if y == lanes + len(legend) + 1 and self.data.roles:
            return self._drawn_ranks(width)
        return Strip.blank(width)

    # -- lines -------------------------------------------------------------------------------------
    def _columns(self, width: int) -> int:
        return max(1, width - LABEL_WIDTH - 1)

    def _axis(self, width: int) -> Strip:
        assert self.data is not None
        return Strip([Segment(" " * (LABEL_WIDTH + 1), STYLES["label"]),  # the step and strategy: ``title``
                      Segment(axis_text(1000 * self.data.span_s, self._columns(width)), STYLES["axis"])]).crop(0, width)

    def _lane(self, rank: RankLanes, compute: bool, width: int) -> Strip:
        assert self.data is not None
        columns = self._columns(width)
        label = f"r{rank.rank} compute" if compute else "   comm"
        label_style = STYLES["selected"] if rank.rank == self.selected_rank else STYLES["label"]
        cells = self._paint_compute(rank, columns) if compute else self._paint_comm(rank, columns)
        segments = [Segment(label.ljust(LABEL_WIDTH) + "│", label_style)]
        segments += [Segment(char * len(list(run)), style) for (char, style), run in groupby(cells)]
        return Strip(segments).crop(0, width)

    def _column_range(self, start: float, end: float, columns: int) -> range:
        """The columns an interval touches (every interval gets at least one)."""
        assert self.data is not None
        scale = columns / self.data.span_s
        first = min(max(int(start * scale), 0), columns - 1)
        last = min(max(int(end * scale - 1e-9), first), columns - 1)
        return range(first, last + 1)

    def _paint_compute(self, rank: RankLanes, columns: int) -> list[tuple[str, Style]]:
        """Paint bars in reverse precedence so the loop's marked compute shows over backward over
        forward over optimizer, all of them over ``data`` (the loader, a loop's work between
        steps: shaded, since it is neither compute nor communication, but a slow loader is a slow
        step); the rest is idle."""
        cells: list[tuple[str, Style]] = [(" ", STYLES["axis"])] * columns
        for bar in rank.data:
            for column in self._column_range(bar.start, bar.end, columns):
                cells[column] = ("░", STYLES["data"])
        for kind in reversed(COMPUTE_PRECEDENCE):
            for bar in rank.compute:
                if bar.kind == kind:
                    for column in self._column_range(bar.start, bar.end, columns):
                        cells[column] = ("█", STYLES[kind])
        return cells

    def _paint_comm(self, rank: RankLanes, columns: int) -> list[tuple[str, Style]]:
        """Wait under collectives (alternating shades, so neighbours read as separate bars) under
        exposed communication: its transfer in red, the part spent waiting for the other ranks to
        arrive in orange (``metrics.waiting_intervals``). O(bars + columns) per lane."""
        cells: list[tuple[str, Style]] = [(" ", STYLES["axis"])] * columns
        for bar in rank.communication:
            if bar.kind == "wait":
                for column in self._column_range(bar.start, bar.end, columns):
                    cells[column] = ("▁", STYLES["wait"])
        collectives = [bar for bar in rank.communication if bar.kind != "wait"]
        for index, bar in enumerate(collectives):
            style = STYLES["hidden" if index % 2 == 0 else "hidden_alt"]
            for column in self._column_range(bar.start, bar.end, columns):
                cells[column] = ("▆", style)
        for part, ranges in (("exposed", rank.exposed), ("exposed_waiting", rank.exposed_waiting)):
            for start, end in ranges:
                for column in self._column_range(start, end, columns):
                    cells[column] = ("▆", STYLES[part])
        return cells

    def _drawn_ranks(self, width: int) -> Strip:
        """Which ranks a large job's timeline draws, and why."""
        assert self.data is not None
        why = ", ".join(f"r{rank} {role}" for rank, role in self.data.roles)
        text = f"{len(self.data.ranks)} of {self.data.reported} ranks drawn: {why} (select a rank in the ranks table or heatmap to add it)"
        return Strip([Segment(" " * (LABEL_WIDTH + 1)), Segment(text, STYLES["label"])]).crop(0, width)

    def _legend(self, indent: int, items: list[tuple[str, str, str]], width: int) -> Strip:
        segments = [Segment(" " * indent)]
        for char, style, text in items:
            segments += [Segment(char, STYLES[style]), Segment(f" {text}  ", STYLES["axis"])]
        return Strip(segments).crop(0, width)


def legend_rows(width: int, marked: bool = False) -> tuple[int, list[list[tuple[str, str, str]]]]:
    """The legend's indent and its items packed into rows of ``width`` (each item its mark, a
    space, its text and two spaces): under the lanes, indented past the labels, where that takes
    no more rows than from the left edge. Packed into rows, not one row cut at the screen's edge,
    so that at 80 columns too the two exposed colours, the ones a reader most needs named, are
    named. ``marked``: the loop's own compute is drawn, and named after the update."""
    items = [*LEGEND[:3], LOOP_LEGEND, *LEGEND[3:]] if marked else LEGEND

    def packed(indent: int) -> list[list[tuple[str, str, str]]]:
        rows: list[list[tuple[str, str, str]]] = [[]]
        used = indent
        for item in items:
            size = len(item[0]) + len(item[2]) + 3
            if rows[-1] and used + size - 2 > width:  # the trailing two spaces may pass the edge
                rows.append([])
                used = indent
            rows[-1].append(item)
            used += size
        return rows

    indented, flush = packed(LABEL_WIDTH + 1), packed(0)
    return (LABEL_WIDTH + 1, indented) if len(indented) == len(flush) else (0, flush)


def axis_text(span_ms: float, columns: int) -> str:
    """Ticks at 0, ¼, ½ and ¾ of the step and its end, each label whole or left out: in a narrow
    panel a label that would run into the next is left out, not cut by it ("|395m526ms|")."""
    ticks = [" "] * columns
    end = f"{span_ms:.0f}ms|"
    if len(end) > columns:  # not even the step's length fits: no label rather than a cut one
        return "".join(ticks)
    labels = [(int(fraction * columns), f"|{span_ms * fraction:.0f}ms") for fraction in (0.0, 0.25, 0.5, 0.75)]
    starts = [at for at, _ in labels[1:]] + [columns - len(end)]
    for (at, text), next_start in zip(labels, starts, strict=True):
        if at + len(text) < next_start:  # a column of space before the next label
            ticks[at:at + len(text)] = text
    ticks[columns - len(end):] = end
    return "".join(ticks)

