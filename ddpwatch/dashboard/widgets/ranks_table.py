"""One row per rank; selecting a row highlights that rank in the timeline."""

from __future__ import annotations

from textual.message import Message
from textual.widgets import DataTable

from ..snapshot import RankRow

COLUMNS = ("rank", "node", "host", "device", "status", "step", "step ms", "Compute%", "Non_Compute%", "Overlap%",
           "waited ms", "utilization", "memory", "dropped")
STATUS_STYLE = {"live": "green", "finished": "blue", "lost": "bold red"}


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


class RanksTable(DataTable):
    class RankSelected(Message):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        self.add_columns(*COLUMNS)
        self._shown: dict[int, list[str]] = {}

    def show(self, rows: tuple[RankRow, ...]) -> None:
        """Only cells that changed are updated: with 64 ranks a full refresh costs a frame."""
        if list(self._shown) != [r.rank for r in rows]:
            self.clear()
            self._shown = {row.rank: self._cells(row) for row in rows}
            for rank, cells in self._shown.items():
                self.add_row(*cells, key=str(rank))
            return
        for row in rows:
            cells, shown = self._cells(row), self._shown[row.rank]
            for index, (column, cell) in enumerate(zip(self.columns, cells)):
                if cell != shown[index]:
                    self.update_cell(str(row.rank), column, cell)
            self._shown[row.rank] = cells

    @staticmethod
    def _cells(row: RankRow) -> list[str]:
        status = f"[{STATUS_STYLE.get(row.status, '')}]{row.status}[/]"
        return [str(row.rank), "?" if row.node is None else str(row.node), row.host, row.device, status, str(row.step), _num(row.step_ms),
                _num(row.compute_pct), _num(row.non_compute_pct), _num(row.overlap_pct), _num(row.waited_ms),
                row.utilization, row.memory, str(row.dropped)]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.post_message(self.RankSelected(int(event.row_key.value)))
