"""One row per rank (a large job: per node, opened to its ranks); selecting a rank's row
highlights that rank in the timeline, choosing a node's row opens or closes it.

The figures that tell ranks apart (status, step, step ms, Compute%, ..., waited ms) come right
after the rank, and where each rank runs (node, host, device) last: in a panel narrower than the
table, as on an 80- or 120-column terminal, the figures show and what scrolls out of view is the
part that is the same on every rank of a node. The rank column stays put when the table scrolls
sideways, so a row scrolled to its host still says whose it is.

Drawn line by line (Textual's line API) rather than with a ``DataTable``: a DataTable renders
every visible cell through Rich again whenever any one cell changes, and with many ranks some
cell changes every frame. Here a row is one ``Strip``, rebuilt only when its own text changes.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from ddpwatch.dashboard.views.rank_rows import RankRow

COLUMNS = ("rank", "status", "step", "step ms", "Compute%", "Non_Compute%", "Overlap%", "waited ms",
           "utilization", "memory", "held P/G/O MiB", "dropped", "node", "host", "device")
STATUS_COLUMN = COLUMNS.index("status")
STATUS_STYLE = {"live": Style(color="green"), "finished": Style(color="blue"), "lost": Style(color="red", bold=True),
                "failed": Style(color="red", bold=True), "interrupted": Style(color="yellow"),
                "cut": Style(color="yellow", dim=True), "detached": Style(color="magenta")}
NUMERIC = frozenset(range(COLUMNS.index("step"), COLUMNS.index("waited ms") + 1)) | {COLUMNS.index("dropped")}
GAP = 2


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def row_cells(row: RankRow) -> tuple[str, ...]:
    """A node's row names the node and how many ranks it stands for, with ▸ (closed) or ▾
    (opened): its node column is at the far end, often scrolled out of view."""
    node = "?" if row.node is None else str(row.node)
    rank = f"{'▾' if row.opened else '▸'} node {node}: {len(row.group)} ranks" if row.group else str(row.rank)
    return (rank, row.status, str(row.step), _num(row.step_ms), _num(row.compute_pct), _num(row.non_compute_pct),
            _num(row.overlap_pct), _num(row.waited_ms), row.utilization, row.memory, row.held, str(row.dropped),
            node, row.host, row.device)


class RanksTable(ScrollView, can_focus=True):
    """A header line that stays put, then one line per rank; arrows move the cursor, Enter or a
    click selects the rank under it."""

    COMPONENT_CLASSES = {"ranks-table--header", "ranks-table--cursor", "ranks-table--even"}
    DEFAULT_CSS = """
    RanksTable { height: auto; background: $surface; }
    RanksTable > .ranks-table--header { text-style: bold; background: $panel; }
    RanksTable > .ranks-table--cursor { background: $block-cursor-blurred-background; }
    RanksTable:focus > .ranks-table--cursor { background: $block-cursor-background; color: $block-cursor-foreground; }
    RanksTable > .ranks-table--even { background: $surface-darken-1 40%; }
    """
    BINDINGS = [
        Binding("up", "cursor(-1)", "up", show=False),
        Binding("down", "cursor(1)", "down", show=False),
        Binding("pageup", "cursor(-10)", "page up", show=False),
        Binding("pagedown", "cursor(10)", "page down", show=False),
        Binding("enter", "select", "select rank", show=False),
        # ← and → are the app's (previous / next step); shift with them moves a column sideways
        Binding("shift+right", "columns(1)", "columns right", show=False),
        Binding("shift+left", "columns(-1)", "columns left", show=False),
    ]

    cursor_row: reactive[int] = reactive(0)

    class RankSelected(Message):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

    class NodeToggled(Message):
        """A node's row chosen: open it to its ranks, or close it."""

        def __init__(self, node: int) -> None:
            super().__init__()
            self.node = node

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows: list[tuple[str, ...]] = []
        self.ranks: list[int] = []
        self.nodes: list[int | None] = []  # per row: the node a node's row stands for, None on a rank's row
        self.widths = [len(name) for name in COLUMNS]
        self._strips: dict[int, tuple[tuple[object, ...], Strip]] = {}  # row index -> (what it shows, line)

    @property
    def row_count(self) -> int:
        return len(self.rows)

    @property
    def has_node_rows(self) -> bool:
        """Whether rows stand for nodes (a large job), whose opening adds their ranks' rows."""
        return any(node is not None for node in self.nodes)

    def show(self, rows: tuple[RankRow, ...]) -> None:
        cells = [row_cells(row) for row in rows]
        if cells == self.rows:
            return
        self.rows, self.ranks = cells, [row.rank for row in rows]
        self.nodes = [row.node if row.group else None for row in rows]
        widths = [max([len(name)] + [len(c[i]) for c in cells]) for i, name in enumerate(COLUMNS)]
        if widths != self.widths or self.virtual_size.height != len(cells) + 1:
            self.widths = widths
            self.virtual_size = Size(sum(widths) + GAP * (len(widths) - 1), len(cells) + 1)
        self.cursor_row = min(self.cursor_row, max(len(cells) - 1, 0))
        self.refresh()

    # -- drawing -----------------------------------------------------------------------------------
    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        if y == 0:
            strip = self._line(COLUMNS, self.get_component_rich_style("ranks-table--header"), header=True)
        else:
            index = scroll_y + y - 1
            if index >= len(self.rows):
                return Strip.blank(self.size.width, self.rich_style)
            strip = self._row_strip(index)
        return self._scrolled(strip, scroll_x)

    def _scrolled(self, strip: Strip, scroll_x: int) -> Strip:
        """The line as the viewport shows it: the rank column fixed, the rest scrolled by ``scroll_x``."""
        width, fixed = self.size.width, self.widths[0] + GAP
        if scroll_x == 0 or width <= fixed:
            return strip.crop_extend(0, width, self.rich_style)
        rest = strip.crop_extend(fixed + scroll_x, scroll_x + width, self.rich_style)
        return Strip.join([strip.crop_extend(0, fixed, self.rich_style), rest])

    def _row_strip(self, index: int) -> Strip:
        base = self.rich_style
        if index == self.cursor_row:
            base += self.get_component_rich_style("ranks-table--cursor")
        elif index % 2 == 0:
            base += self.get_component_rich_style("ranks-table--even")
        key = (self.rows[index], tuple(self.widths), base)
        cached = self._strips.get(index)
        if cached is None or cached[0] != key:
            cached = self._strips[index] = (key, self._line(self.rows[index], base))
        return cached[1]

    def _line(self, cells: tuple[str, ...], style: Style, header: bool = False) -> Strip:
        segments = []
        for column, (text, width) in enumerate(zip(cells, self.widths, strict=True)):
            padded = text.rjust(width) if column in NUMERIC else text.ljust(width)
            cell_style = style + STATUS_STYLE[text] if column == STATUS_COLUMN and not header and text in STATUS_STYLE else style
            segments.append(Segment(padded, cell_style))
            segments.append(Segment(" " * GAP, style))
        return Strip(segments[:-1])

    # -- cursor and selection ----------------------------------------------------------------------
    def watch_cursor_row(self, old: int, new: int) -> None:
        visible = max(self.size.height - 1, 1)
        if new < self.scroll_y:
            self.scroll_to(y=new, animate=False)
        elif new >= self.scroll_y + visible:
            self.scroll_to(y=new - visible + 1, animate=False)
        self.refresh()

    def action_cursor(self, delta: int) -> None:
        if self.rows:
            self.cursor_row = min(max(self.cursor_row + delta, 0), len(self.rows) - 1)

    def action_columns(self, delta: int) -> None:
        """Scroll sideways to the next (or previous) column's left edge, past the rank column,
        which stays put: a keyboard's way to the columns a narrow panel leaves out of view."""
        edges, at = [0], 0
        for width in self.widths[1:-1]:
            at += width + GAP
            edges.append(at)
        x = int(self.scroll_x)
        target = (next((edge for edge in edges if edge > x), x) if delta > 0
                  else next((edge for edge in reversed(edges) if edge < x), 0))
        self.scroll_to(x=min(target, self.max_scroll_x), animate=False)

    def action_select(self) -> None:
        if self.rows:
            self._choose(self.cursor_row)

    def _choose(self, index: int) -> None:
        node = self.nodes[index]
        self.post_message(self.RankSelected(self.ranks[index]) if node is None else self.NodeToggled(node))

    def on_click(self, event: Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y < 1:
            return
        index = int(self.scroll_y) + offset.y - 1
        if 0 <= index < len(self.rows):
            self.cursor_row = index
            self._choose(index)

    def on_focus(self) -> None:
        self.refresh()  # the cursor's colour says whether the keys go here

    def on_blur(self) -> None:
        self.refresh()
