"""The stragglers tab: the ranks the others waited for longest over the last complete steps,
with how long, beside how long each waited itself, and which one the straggler rule names
(``metrics.waited_for``, ``metrics.find_straggler``)."""

from __future__ import annotations

from textual.widgets import Static

from ddpwatch.figures.cross_rank import STRAGGLER_SHARE
from ddpwatch.dashboard.views.snapshot_parts import StragglerRow


class StragglersPanel(Static):
    def show(self, rows: tuple[StragglerRow, ...]) -> None:
        text = panel_text(rows)
        if text != getattr(self, "_shown", None):
            self._shown = text
            self.update(text, layout=True)


def panel_text(rows: tuple[StragglerRow, ...]) -> str:
    """A line a rank, then the window and the rule (below them: first, in a narrow tab, it would
    push every rank out of view). Each rank's own waiting stands beside the others' for it: two
    ranks that wait for each other by turns would otherwise each read as a straggler, where the
    rule (which names neither) weighs what the others waited for each against what it waited."""
    if not rows:
        return "nobody kept the others waiting in the last complete steps (or there is one rank)"
    rule = (f"ms a step over steps {rows[0].first_step}-{rows[0].last_step}, % of the step time. A straggler: the others "
            f"waited for it more than it waited, by over {STRAGGLER_SHARE:.0%} of the step time.")
    return "\n".join([*(straggler_line(row) for row in rows), rule])


def straggler_line(row: StragglerRow) -> str:
    return (f"{'straggler: ' if row.named else ''}rank {row.rank} (node {row.node}): the others waited "
            f"{row.waited_for_ms:.1f} ms for it ({row.share_pct:.1f} %), it {row.waited_ms:.1f} ms")
