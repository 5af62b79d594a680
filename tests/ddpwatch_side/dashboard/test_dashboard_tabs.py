"""The dashboard's side tabs driven through Textual's pilot: the loss and evaluations, the
heatmap, the stragglers, the devices' series and the bucket advisor."""
from __future__ import annotations

from msgspec.structs import replace

import pytest
from textual.content import Content
from textual.widgets import TabbedContent

from ddpwatch.dashboard.app import DashboardApp
from ddpwatch.dashboard.feeds import StaticFeed
from ddpwatch.dashboard.views.snapshot import SnapshotBuilder
from ddpwatch.dashboard.widgets.rank_heatmap import HEADER_ROWS, RankHeatmap
from ddpwatch.dashboard.widgets.timeline_view import TimelineView
from ddpwatch.ingest.receiver import ingest
from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.codec import encode
from instrumented_ddp.wire.messages import Evaluation, StepReport, SwitchCommand
from synthetic_session import (hello, session_messages, waiting_ranks)
from dashboard_pilot import draw_every_message


async def test_the_runs_evaluations_are_drawn_under_the_training_loss() -> None:
    """A Trainer's eval_loss was in its log alone: now a series per metric, losses first, captioned
    with how many evaluations and the step the last followed; every rank's copy is one point."""
    evaluations = [encode(Evaluation(rank, step, {"eval_accuracy": 0.5 + step / 20, "eval_loss": 1.0 / step}), 100 + step, 0)
                   for step in (3, 6) for rank in (0, 1)]
    app = DashboardApp(StaticFeed([*session_messages(steps=6, goodbye=False), *evaluations]), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        app.side_tabs.active = "trends-tab"
        await draw_every_message(app, pilot)
        series = app.trends_panel.series
        assert [s.label for s in series] == ["loss (mean over ranks)", "step time", "eval_loss (2 evaluations, the last after step 6)",
                                             "eval_accuracy (2 evaluations, the last after step 6)"]
        assert series[2].values == (pytest.approx(1 / 3), pytest.approx(1 / 6)) and series[3].values == (0.65, 0.8)
        assert series[2].caption().startswith("eval_loss (2 evaluations, the last after step 6): 0.167 (min 0.167, max 0.333)")


async def test_heatmap_tab_gives_every_rank_a_row_and_h_switches_its_metric() -> None:
    app = DashboardApp(StaticFeed(session_messages()), export_on_exit=False)
    async with app.run_test(size=(160, 28)) as pilot:  # too short to stack the ranks: the tabs beside them, 64 columns
        await draw_every_message(app, pilot)
        app.query_one("#side", TabbedContent).active = "heatmap-tab"
        await pilot.pause(0.2)
        heatmap = app.query_one(RankHeatmap)
        assert heatmap.data is not None and [row.label for row in heatmap.data.rows] == ["r0", "r1"]
        assert not heatmap.data.collapsible and heatmap.data.metric == "exposed"
        assert len(heatmap.data.steps) == 10 and heatmap.render_line(HEADER_ROWS).text.startswith("r0")
        # the steps shown end the metric's line, so the rows begin on the third line (the fourth
        # before: at 80 x 24 one rank's row was left in view)
        assert HEADER_ROWS == 2 and heatmap.render_line(0).text.rstrip().endswith("(Non_Compute%) · steps 1…10")
        # the scale's high end and its key, on a line of their own: after the metric's name they were cut at 64 columns
        assert heatmap.size.width <= 64 and heatmap.render_line(1).text.rstrip().endswith(f"{heatmap.data.high:.1f}   h: next metric")
        await pilot.press("h")
        await pilot.pause(0.2)
        assert heatmap.data.metric == "step"
        await pilot.click(RankHeatmap, offset=(2, HEADER_ROWS + 1))  # the r1 row: selects rank 1, as the ranks table does
        assert app.selected_rank == 1


async def test_a_large_job_shows_a_row_per_node_and_the_timeline_draws_picked_ranks() -> None:
    world = 80  # above 64 ranks the timeline draws the slowest, the fastest and the selected rank
    hellos = {rank: replace(hello(rank, world_size=world), node_rank=rank // 8) for rank in range(world)}
    app = DashboardApp(StaticFeed(session_messages(steps=4, world_size=world, hellos=hellos)), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        app.query_one("#side", TabbedContent).active = "heatmap-tab"
        await pilot.pause(0.2)
        timeline = app.query_one(TimelineView).data  # every rank's step equally long: rank 0 is both
        assert timeline is not None and timeline.reported == world and timeline.roles == ((0, "slowest+fastest"),)
        heatmap = app.query_one(RankHeatmap)
        assert heatmap.data is not None and heatmap.data.collapsible
        assert [row.label for row in heatmap.data.rows] == [f"node {n} ×8" for n in range(10)]
        await pilot.click(RankHeatmap, offset=(2, HEADER_ROWS + 1))  # node 1
        await pilot.pause(0.3)
        labels = [row.label for row in heatmap.data.rows]
        assert labels == ["node 0 ×8", *(f"r{r}" for r in range(8, 16)), *(f"node {n} ×8" for n in range(2, 10))]
        await pilot.click(RankHeatmap, offset=(2, HEADER_ROWS + 3))  # rank 9's row: closes node 1 again
        await pilot.pause(0.3)
        assert len(heatmap.data.rows) == 10
        app.selected_rank = 40  # as a click in the ranks table does: the timeline draws it too
        await pilot.pause(0.3)
        assert app.query_one(TimelineView).data.roles == ((0, "slowest+fastest"), (40, "selected"))


async def test_stragglers_tab_names_the_rank_the_others_waited_for_and_how_long() -> None:
    def rank1_arrives_late(report: StepReport) -> StepReport:
        # rank 1 enters every all-reduce 2 ms late and leaves with the others: they wait 2 ms a call
        if report.rank != 1:
            return report
        spans = [s._replace(start=s.start + 0.002) if s.kind == "all_reduce" else s for s in report.spans]
        return replace(report, spans=spans)

    app = DashboardApp(StaticFeed(session_messages(edit=rank1_arrives_late)), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        assert len(app.snapshot.stragglers) == 0  # made only while its tab is on screen
        app.query_one("#side", TabbedContent).active = "stragglers-tab"
        await pilot.pause(0.2)
        (row,) = app.snapshot.stragglers
        # steps 1-10: 4 calls a step under simple (1-5), 2 under bucket (6-10): 30 calls x 2 ms / 10 steps
        assert (row.rank, row.first_step, row.last_step) == (1, 1, 10)
        # steps of 185 ms (simple) and 170 (bucket): 6 ms of 177.5 is 3.4 %, under the rule's 10 %
        assert row.waited_for_ms == pytest.approx(6.0) and row.waited_ms == 0.0 and not row.named
        lines = str(app.query_one("#stragglers").render()).splitlines()
        assert lines[0] == "rank 1 (node 0): the others waited 6.0 ms for it (3.4 %), it 0.0 ms"
        assert lines[1].startswith("ms a step over steps 1-10, % of the step time. A straggler:")


async def test_stragglers_tab_shows_each_ranks_own_waiting_and_marks_the_rank_the_rule_names() -> None:
    """Rank 1 waits 30 ms a step in its first all-reduce for rank 0 (17 % of a 177.5 ms step): rank 0
    is named, as in the warnings, and rank 1, which the others (rank 0) waited for in the rest
    of its calls, shows that it waited far longer itself. Before, the tab gave the others' waiting
    alone: two ranks that wait by turns both read as stragglers."""
    app = DashboardApp(StaticFeed(session_messages(edit=waiting_ranks(30.0))), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        app.query_one("#side", TabbedContent).active = "stragglers-tab"
        await pilot.pause()
        app.refresh_frame()  # the frame that makes the tab's rows, whatever the machine's load
        await pilot.pause()
        rows = {row.rank: row for row in app.snapshot.stragglers}
        assert rows[0].named and rows[0].waited_for_ms == pytest.approx(30.0, abs=0.5) and rows[0].waited_ms < 1.0
        assert any(warning.startswith("rank 0 is a straggler") for warning in app.snapshot.warnings)
        assert 1 not in rows or (not rows[1].named and rows[1].waited_ms == pytest.approx(30.0, abs=0.5))
        lines = str(app.query_one("#stragglers").render()).splitlines()
        assert lines[0].startswith("straggler: rank 0 (node 0): the others waited 30.0 ms for it")


@pytest.mark.parametrize("metric", ["exposed", "wait"])
def test_the_heatmap_kept_column_by_column_equals_one_made_from_scratch(metric: str) -> None:
    """Columns are kept per step and remade only when their step gains a report: fed in two
    halves (step 6 half-reported at the first build), the grid equals one built whole."""
    world = 40
    hellos = {rank: replace(hello(rank, world_size=world), node_rank=rank // 8) for rank in range(world)}
    messages = session_messages(steps=8, world_size=world, hellos=hellos, edit=waiting_ranks(3.0))
    session = Session(None)
    builder = SnapshotBuilder(session)
    half = len(messages) * 2 // 3
    ingest(session, messages[:half])
    assert 0 < len(session.reports[6]) < world
    builder.build(now=100.0, heatmap_metric=metric, open_nodes={1})
    ingest(session, messages[half:])
    kept = builder.build(now=102.0, heatmap_metric=metric, open_nodes={1}).heatmap
    whole = SnapshotBuilder(session).build(now=102.0, heatmap_metric=metric, open_nodes={1}).heatmap
    assert kept == whole and len(kept.rows) == 4 + 8 and kept.steps == tuple(range(1, 9))


def test_a_device_series_taken_in_sample_by_sample_is_its_last_points() -> None:
    """A series is extended by the samples new since it was last made (at most once a second),
    and begun again when the rank's readings change kind (CPU, then a GPU)."""
    from ddpwatch.dashboard.views.snapshot_parts import TREND_POINTS
    from instrumented_ddp.wire.messages import DeviceSample

    session = Session(None)
    builder = SnapshotBuilder(session)
    seq = iter(range(10_000))

    def samples(first: int, count: int, kind: str = "gpu") -> list[bytes]:
        key = "gpu_util_pct" if kind == "gpu" else "process_cpu_pct"
        return [encode(DeviceSample(0, float(i), kind, {key: float(i % 97)}), next(seq), 0) for i in range(first, first + count)]

    ingest(session, [encode(hello(0, world_size=1), next(seq), 0), *samples(0, 30, "cpu")])
    (series,) = builder.build(now=10.0).devices
    assert series.label == "CPU % (no GPU)" and series.values == tuple(float(i % 97) for i in range(30))
    ingest(session, samples(30, 200, "cpu"))
    assert builder.build(now=10.5).devices == (series,)  # within the second: as it was
    (series,) = builder.build(now=11.0).devices
    assert series.label == "CPU % (no GPU)" and series.values == tuple(float(i % 97) for i in range(230 - TREND_POINTS, 230))
    ingest(session, samples(230, 5, "gpu"))
    (series,) = builder.build(now=12.0).devices
    assert series.label == "GPU util %" and series.values == tuple(float(i % 97) for i in range(230, 235))


async def test_the_advisor_tab_draws_the_sweep_and_b_switches_to_its_best_cap() -> None:
    """The advisor tests' run (``bucket_steps``) on two NCCL ranks, at 2.5 MiB: a cost model of
    12 ms + 2 ms/MiB from calls of 1 and 3 MiB; caps from 2 MiB up to 3 MiB pair the four 1 MiB
    gradients (16 ms exposed, the least), as fast as each other with as many calls, so the best is
    the smallest of them, 2 MiB (the largest, 2^21.5 bytes, before: ``bucket_sim.best``)."""
    from bucket_steps import LAYOUT, MIB, bucket_step

    hellos = [replace(hello(rank, strategy="bucket"), backend="nccl", parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]],
                      settings={"grad_accum": 1, "bucket_mb": 2.5}) for rank in (0, 1)]
    messages = [encode(h, seq=0) for h in hellos]
    for step in range(1, 7):
        for rank in (0, 1):
            report = bucket_step(rank, step)
            sizes = {"b0": (MIB, 0.014), "b1": (3 * MIB, 0.018)}
            spans = [s._replace(nbytes=sizes[s.tag][0], end=s.start + sizes[s.tag][1]) if s.kind == "all_reduce" else s
                     for s in report.spans]
            shift = step * 0.2
            report = replace(report, start=report.start + shift, end=report.end + shift, settings={"bucket_mb": 2.5, "grad_accum": 1},
                             spans=[s._replace(start=s.start + shift, end=s.end + shift) for s in spans])
            messages.append(encode(report, seq=step))
    feed = StaticFeed(messages)
    sent: list[SwitchCommand] = []
    feed.request_switch = sent.append  # type: ignore[method-assign, assignment]
    app = DashboardApp(feed, export_on_exit=False)
    async with app.run_test(size=(200, 36)) as pilot:
        await draw_every_message(app, pilot)
        app.side_tabs.active = "advisor-tab"
        await pilot.pause(0.4)
        shown = str(app.advisor_panel.render())
        assert "one exposed" in shown or "latency-bound" in shown, shown
        assert "best 2 MB" in shown and "b: switch to bucket at 2 MB" in shown
        assert "cost model: 12 ms + S /" in shown and "◆" in shown and "★" in shown
        # on a short terminal the side tabs are a few rows high: the key and the whole plot, axis included, are the rows in view
        rendered = app.advisor_panel.render()
        assert isinstance(rendered, Content)
        rows = [line.plain for line in rendered.wrap(app.advisor_panel.size.width)]
        in_view = app.query_one("#advisor-scroll").size.height
        assert 5 <= in_view < len(rows)
        assert any("b: switch to bucket at 2 MB" in row for row in rows[:in_view])
        assert any(row.lstrip().startswith("1K") for row in rows[:in_view]) and "★" in "".join(rows[:in_view])
        await pilot.press("b")
        (command,) = sent
        assert command.strategy == "bucket" and command.bucket_mb == pytest.approx(2.0)
        # a sweep remade between the frame and the key (its best a point from another cap's) is not what b applies
        app.builder.advice = lambda now: "remade since the frame"  # type: ignore[method-assign]
        app.action_apply_advice()  # at once: no frame between
        assert len(sent) == 2 and sent[1].bucket_mb == pytest.approx(2.0)


async def test_the_loss_and_step_time_grow_into_a_tall_tab() -> None:
    """Two trends in the side panel of a 160 x 48 screen: each bar is several rows, where it was a
    one-line strip at the top of an empty tab; the devices of two ranks the same."""
    app = DashboardApp(StaticFeed(session_messages()), export_on_exit=False)
    async with app.run_test(size=(160, 48)) as pilot:
        await draw_every_message(app, pilot)
        assert app.device_panel.bar_rows > 1
        await pilot.press("t")
        await pilot.pause(0.2)
        app.refresh_frame()
        await pilot.pause(0.1)
        panel = app.trends_panel
        assert panel.bar_rows > 1 and panel.virtual_size.height == 2 * (panel.bar_rows + 2)
        lines = [panel.render_line(y).text for y in range(panel.bar_rows + 2)]
        assert lines[0].startswith("loss (mean over ranks)") and lines[-1].strip() == ""
        assert all(line.strip() for line in lines[1:-1])  # every bar row draws something
