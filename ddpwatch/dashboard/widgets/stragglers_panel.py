"""The stragglers tab: the ranks the others waited for longest over the last complete steps,
with how long, beside how long each waited itself, and which one the straggler rule names
(``metrics.waited_for``, ``metrics.find_straggler``)."""

from __future__ import annotations

from textual.widgets import Static

from ddpwatch.figures.metrics import STRAGGLER_SHARE
from ddpwatch.dashboard.views.snapshot import StragglerRow


class StragglersPanel(Static):
    def show(self, rows: tuple[StragglerRow, ...]) -> None:
        text = panel_text(rows)
        if text != getattr(self, "_shown", None):
            self._shown = text
            self.update(text, layout=True)


def panel_text(rows: tuple[StragglerRow, ...]) -> str:
    """A line a rank, then the window and the rule (below: in the 30 columns of an 80-column
    terminal the rule first pushed every rank out of view). Each rank's own waiting stands beside
    the others' for it: two ranks that wait for each other by turns each read "the others waited
    29 ms a step for it", as if both straggled, where the rule (which names neither) saw 29 against 28."""
    if not rows:
        return "nobody kept the others waiting in the last complete steps (or there is one rank)"
    rule = (f"ms a step over steps {rows[0].first_step}-{rows[0].last_step}, % of the step time. A straggler: the others "
            f"waited for it more than it waited, by over {STRAGGLER_SHARE:.0%} of the step time.")
    return "\n".join([*(describe(row) for row in rows), rule])


def describe(row: StragglerRow) -> str:
    return (f"{'straggler: ' if row.named else ''}rank {row.rank} (node {row.node}): the others waited "
            f"{row.waited_for_ms:.1f} ms for it ({row.share_pct:.1f} %), it {row.waited_ms:.1f} ms")
