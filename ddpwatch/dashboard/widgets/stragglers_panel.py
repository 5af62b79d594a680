"""The stragglers tab: the ranks the others waited for longest over the last complete steps,
with how long, whether or not one crosses the warning's threshold (``metrics.waited_for``)."""

from __future__ import annotations

from textual.widgets import Static

from ..snapshot import StragglerRow


class StragglersPanel(Static):
    def show(self, rows: tuple[StragglerRow, ...]) -> None:
        text = "\n".join(describe(row) for row in rows) if rows else \
            "nobody kept the others waiting in the last complete steps (or there is one rank)"
        if text != getattr(self, "_shown", None):
            self._shown = text
            self.update(text)


def describe(row: StragglerRow) -> str:
    return (f"rank {row.rank} (node {row.node}): the others waited {row.waited_for_ms:.1f} ms a step for it "
            f"({row.share_pct:.1f} % of the step time), steps {row.first_step}-{row.last_step}")
