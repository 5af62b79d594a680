"""The comparison table of the article the strategies follow, one row per segment, filling in live."""

from __future__ import annotations

from textual.widgets import DataTable

from ddpwatch.wording.figure_text import calls_text
from ddpwatch.dashboard.views.snapshot_parts import SegmentRow

# The segment as "bucket 1 MB" (``SegmentRow.short_label``), and the step's time and the throughput
# right after the steps: what a switch bought is the first thing read, and at 160 columns the long
# label and the article's five percentages would push both out of view.
# "calls/rank/step": all-reduce calls per rank per step, what summary.json's all_reduce_calls and
# summary.md's "all_reduce calls / rank / step" mean; that long a name would push the next columns
# off a 160-column screen.
# "other calls": reduce-scatters (RS), all-gathers (AG), broadcasts (BC), reduces (RD), all-to-alls (A2A),
# gathers (GA), scatters (SC) per rank per step;
# "held P/G/O MiB": parameters/gradients/optimizer state the fullest rank held (the sharded
# strategies' staircase); "busbw GB/s": each collective kind's, as ``AR 3.12 AG 0.32 RS 0.16``.
# "Data wait%": the part of Idle% spent waiting for the next batch (``data_wait``), after the
# article's five so that they stay in view at 160 columns.
COLUMNS = ("segment", "steps", "step ms p50", "samples/s", "Compute%", "Non_Compute%", "Idle%", "Overlap%",
           "Comm_overhead%", "Data wait%", "calls/rank/step", "all_reduce_ms", "busbw GB/s", "other calls", "held P/G/O MiB")


class SegmentsTable(DataTable):
    """Each column exactly as wide as the longest value it shows now, set when the rows are
    built: a DataTable sizing its columns itself does it when its message queue runs dry
    (``on_idle``), which a dashboard busy with many ranks can put off past a frame, a label cut
    to its header's width meanwhile."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.add_columns(*COLUMNS)
        self._shown: list[list[str]] = []
        self._widths: list[int] = []

    def show(self, rows: tuple[SegmentRow, ...]) -> None:
        cells = [_cells(r) for r in rows]
        if cells == self._shown:
            return
        widths = [max([len(name), *(len(row[index]) for row in cells)]) for index, name in enumerate(COLUMNS)]
        if widths != self._widths or len(cells) != len(self._shown):  # a column never keeps the width of a value gone
            self.clear(columns=True)
            for name, width in zip(COLUMNS, widths, strict=True):
                self.add_column(name, width=width)
            for index, row in enumerate(cells):
                self.add_row(*row, key=str(index))
            self._widths = widths
            if len(cells) > len(self._shown):  # a new segment: in view, even where only two rows show
                self.call_after_refresh(self.scroll_end, animate=False)
        else:
            for index, (row, shown) in enumerate(zip(cells, self._shown, strict=True)):
                for column, cell, old in zip(self.columns, row, shown, strict=True):
                    if cell != old:  # as wide as before: the column's width holds it
                        self.update_cell(str(index), column, cell)
        self._shown = cells


def _cells(row: SegmentRow) -> list[str]:
    """A segment without a counted step yet (a switch has just opened it, or every step it ran was
    excluded) shows dashes, not zeros: 0.00 Compute% would read as a measurement."""
    if row.counted_steps == 0:
        return [row.short_label, row.steps, *("—" for _ in COLUMNS[2:])]
    return [row.short_label, row.steps, f"{row.step_ms_p50:.1f}", f"{row.samples_per_s:.1f}",
            *(f"{v:.2f}" for v in (row.compute_pct, row.non_compute_pct, row.idle_pct, row.overlap_pct,
                                   row.comm_overhead_pct, row.data_wait_pct)),
            calls_text(row.all_reduce_calls), f"{row.all_reduce_ms:.1f}", row.busbw, row.other_calls, row.held]
