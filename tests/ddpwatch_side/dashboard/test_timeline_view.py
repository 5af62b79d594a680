"""The timeline widget drawn without an app: its legend packed to the width, its axis labels,
and the loop's marked compute (``Attachment.computing``) in the compute lane and the legend."""

from __future__ import annotations

from msgspec.structs import replace

from ddpwatch.dashboard.views.timeline_lanes import timeline_of
from ddpwatch.dashboard.widgets.timeline_view import STYLES, TimelineView, axis_text, legend_rows
from ddpwatch.figures.cross_rank import calls_of
from instrumented_ddp.wire.messages import Span, StepReport


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


def test_the_timeline_legend_wraps_so_every_colour_is_named() -> None:
    """Items are mark, space, text and two spaces: forward 11, backward 12, optimizer 13, data 8,
    "collective hidden by compute" 32, "exposed: transfer" 21, "exposed: waiting for other ranks"
    36, wait 8: 141 columns, the last item's two spaces free to pass the edge. At 160 columns all
    fit in one row after the 12-column label indent (12 + 139 = 151). At 78 (an 80-column screen
    inside the box's border) one row was cut after "collective hidden"; indented they would take
    three rows (44 + 12 = 56, then 32 + 21 = 53, then 36 + 8), from the left edge two (11 + 12 + 13
    + 8 + 32 = 76, less 2 = 74 <= 78; then 21 + 36 + 8): so from the left edge."""
    indent, rows = legend_rows(160)
    assert (indent, [len(row) for row in rows]) == (12, [8])
    indent, rows = legend_rows(78)
    assert (indent, [[text for _, _, text in row] for row in rows]) == (0, [
        ["forward", "backward", "optimizer", "data", "collective hidden by compute"],
        ["exposed: transfer", "exposed: waiting for other ranks", "wait"]])


def test_the_timeline_axis_leaves_out_a_label_that_would_run_into_the_next() -> None:
    """At 40 columns the ¾ tick's "|395ms" would end where "526ms|" begins: it was cut to
    "|395m526ms|"; now it is left out. Wide enough, every label shows, as before."""
    assert axis_text(526.4, 40) == "|0ms      |132ms    |263ms        526ms|"
    assert axis_text(526.4, 60) == "|0ms           |132ms         |263ms         |395ms   526ms|"
    assert axis_text(526.4, 4) == "    "
