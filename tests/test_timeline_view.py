"""The timeline widget's compute lane and legend for the loop's marked compute
(``Attachment.computing``), drawn without an app: a step's lanes in, its cells out."""

from __future__ import annotations

from dataclasses import replace

from ddpwatch.dashboard.timeline_lanes import timeline_of
from ddpwatch.dashboard.widgets.timeline_view import STYLES, TimelineView, legend_rows
from ddpwatch.metrics import calls_of
from instrumented_ddp.protocol import Span, StepReport


def test_the_loops_marked_compute_is_drawn_over_the_update_and_named_in_the_legend_only_where_drawn() -> None:
    """100 ms over 10 columns: data 0-20 ms, the loop's average 20-40 (after the data, cut around
    it as the rank sends it), forward 40-60, backward 60-80, the update 80-100 with a block the
    loop marked inside it at 90-100 (between the backward and ``step()``): drawn as what the
    loop said, over the update. The legend names it after the update where some rank has one."""
    spans = [Span("data", 0.0, 0.020), Span("loop", 0.020, 0.040, tag="ema"), Span("forward", 0.040, 0.060),
             Span("backward", 0.060, 0.080), Span("optimizer", 0.080, 0.100), Span("loop", 0.090, 0.100, tag="clip")]
    report = StepReport(rank=0, step=4, strategy="ddp", settings={}, start=0.0, end=0.100, spans=spans,
                        samples=1, tokens=1, loss=None)
    data = timeline_of(4, {0: report}, calls_of({0: report}))
    view = TimelineView()
    view.show(data)
    cells = view._paint_compute(data.ranks[0], 10)
    styles = {style: kind for kind, style in STYLES.items()}
    assert [styles[style] for _, style in cells] == ["data"] * 2 + ["loop"] * 2 + ["forward"] * 2 + ["backward"] * 2 + [
        "optimizer", "loop"]
    assert view._marked
    texts = [text for row in legend_rows(160, marked=True)[1] for _, _, text in row]
    assert texts[:5] == ["forward", "backward", "optimizer", "loop's own (marked)", "data"]
    unmarked = replace(report, spans=[s for s in spans if s.kind != "loop"])
    view.show(timeline_of(4, {0: unmarked}, calls_of({0: unmarked})))
    assert not view._marked and "loop's own (marked)" not in [t for row in legend_rows(160)[1] for _, _, t in row]
