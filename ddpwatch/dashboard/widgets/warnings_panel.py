"""Desyncs, lost ranks, stragglers, unresolved steps, dropped or rejected telemetry, said in plain
words; below them, marked apart, what is worth knowing but not wrong (late reports, device notes,
switch notices)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.markup import escape
from textual.content import Content
from textual.widgets import Static

#: A line's rows at a width: how Textual wraps it (``Content.wrap``), swappable in tests.
Wrap = Callable[[str, int], list[str]]


def textual_wrap(text: str, width: int) -> list[str]:
    return [line.plain for line in Content(text).wrap(width)] or [""]


def fitted_rows(lines: Sequence[tuple[str, str]], width: int, rows: int, wrap: Wrap = textual_wrap) -> list[tuple[str, str]]:
    """``lines`` (a mark, then its text) as rows of at most ``width`` columns, at most ``rows`` of
    them: each line whole, in order, while they fit; where some do not, the last row says how many
    are left out, and a line that would not fit whole before it is cut with ``…`` (so the first
    warning, a desync say, is never left out for being long). A row is (mark, text), the mark on
    a line's first row only."""
    body = [[(mark if index == 0 else " ", row) for index, row in enumerate(wrap(text, width - 2))] for mark, text in lines]
    if sum(map(len, body)) <= rows:
        return [row for line in body for row in line]
    shown: list[tuple[str, str]] = []
    for index, line in enumerate(body):
        room = rows - 1 - len(shown)  # the last row is kept for the count
        if len(line) <= room:
            shown += line
            continue
        if room > 0:  # this line in part, its last row shown cut
            shown += line[:room - 1] + [(line[room - 1][0], cut(line[room - 1][1], width - 2))]
        left_out = len(body) - index - (room > 0)
        return shown + [("+", f"{left_out} more not shown: a taller terminal shows them")]
    return shown


def cut(text: str, width: int) -> str:
    """``text`` ending with ``…`` within ``width`` columns."""
    return text[:max(width - 1, 0)].rstrip() + "…"


class WarningsPanel(Static):
    DEFAULT_CSS = "WarningsPanel { text-wrap: nowrap; }"  # the rows are wrapped here, to count them

    MARKS = {"!": "[b red]![/]", "i": "[b cyan]i[/]", "+": "[b]+[/]", " ": " "}
    _lines: tuple[tuple[str, str], ...] = ()  # (mark, text), as last shown
    _drawn: tuple[tuple[tuple[str, str], ...], int, int] | None = None  # what the rows were figured from

    def show(self, warnings: tuple[str, ...], notices: tuple[str, ...] = ()) -> None:
        """``warnings`` in red (a desync, the run's one error, comes first); ``notices`` in cyan.
        Both are escaped: a device note or a refusal's detail is text a rank sent, not markup."""
        self._lines = tuple(("!", w) for w in warnings) + tuple(("i", n) for n in notices)
        self.set_class(bool(warnings), "has-warnings")
        self._draw()

    def on_resize(self) -> None:
        self._draw()

    def _draw(self) -> None:
        """Every frame calls ``show``: the rows are figured again only when the lines, the width or
        the rows allowed changed (a resize, the short layout coming or going)."""
        key = (self._lines, max(self.size.width, 20), self._rows_allowed())
        if key == self._drawn:
            return
        self._drawn = key
        if not self._lines:
            text = "[green]no warnings[/green]"
        else:
            text = "\n".join(f"{self.MARKS[mark]} {escape(row)}" for mark, row in fitted_rows(*key))
        self.update(text)  # a layout pass: the panel's height follows its rows

    def _rows_allowed(self) -> int:
        """The panel's ``max-height`` in rows (``dashboard.tcss``: fewer on a short terminal)."""
        max_height = self.styles.max_height
        if max_height is None:
            return 10_000
        terminal = self.app.size  # not the screen's: a frame may come while the screen is torn down
        return max(1, int(max_height.resolve(terminal, terminal)))
