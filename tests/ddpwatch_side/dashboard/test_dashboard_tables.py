"""The dashboard's two tables driven through Textual's pilot: the ranks table (rows, the cursor,
a large job's row per node) and the segments table with its bars."""
from __future__ import annotations

import dataclasses

from msgspec.structs import replace


from ddpwatch.dashboard.app import DashboardApp
from ddpwatch.dashboard.feeds import StaticFeed
from ddpwatch.dashboard.views.snapshot import SnapshotBuilder
from ddpwatch.dashboard.widgets.ranks_table import COLUMNS, RanksTable
from ddpwatch.dashboard.widgets.segment_bars_view import SegmentBarsView
from ddpwatch.dashboard.widgets.segments_table import SegmentsTable
from ddpwatch.ingest.receiver import ingest
from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.messages import StepReport
from synthetic_session import (hello, session_messages, snapshot_of, waiting_ranks)
from dashboard_pilot import draw_every_message


async def test_a_click_or_enter_on_a_rank_row_highlights_that_rank_and_the_cursor_scrolls() -> None:
    app = DashboardApp(StaticFeed(session_messages(steps=6, world_size=64)), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        table = app.ranks_table
        await pilot.click(RanksTable, offset=(2, 3))  # below the border: the header, rank 0, rank 1
        await pilot.pause(0.1)
        assert app.selected_rank == 1 and table.cursor_row == 1
        await pilot.click(RanksTable, offset=(2, 3))
        await pilot.pause(0.1)
        assert app.selected_rank is None  # a second click on the same rank clears the highlight
        table.focus()
        await pilot.press(*["down"] * 20, "enter")  # past the 14 rows in view (each press ~90 ms at 64 ranks)
        await pilot.pause(0.1)
        assert table.cursor_row == 21 and app.selected_rank == 21
        visible_rows = table.size.height - 1
        assert visible_rows < 21 and table.scroll_y <= 21 < table.scroll_y + visible_rows  # the cursor never leaves the view


def visible_text(table: RanksTable, y: int) -> str:
    return table.render_line(y).text


async def test_a_narrow_ranks_table_shows_each_ranks_figures_and_keeps_the_rank_when_scrolled() -> None:
    """At 80 x 24 the ranks table's panel is 46 columns: it shows the rank, its status, step, step
    ms and Compute% (before, the rank then node, host, device and status, and not one figure),
    for more than one rank (before, its horizontal scrollbar took the second rank's row).
    Shift and the arrows scroll it a column at a time (the arrows alone still walk the steps);
    at its far end it shows where each rank runs, each row still led by its rank."""
    messages = session_messages(steps=4, world_size=8, edit=waiting_ranks(40.0))
    app = DashboardApp(StaticFeed(messages), export_on_exit=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await draw_every_message(app, pilot)
        table = app.ranks_table
        assert table.size.width < 50 and table.max_scroll_x > 0
        assert table.scrollable_content_region.height - 1 >= 2  # rank rows in view, under the header line
        assert visible_text(table, 0).split()[:5] == ["rank", "status", "step", "step", "ms"]
        assert "Compute%" in visible_text(table, 0)
        first_row = visible_text(table, 1).split()
        assert first_row[:3] == ["0", "finished", "4"] and float(first_row[3]) > 0
        table.focus()
        await pilot.press("shift+right")  # a column to the right: status scrolls out, the rank stays
        await pilot.pause(0.1)
        assert visible_text(table, 0).split()[:3] == ["rank", "step", "step"] and app.timeline_view.data.step == 4
        await pilot.press(*["shift+right"] * len(COLUMNS))  # as far as it goes: the device column in view
        await pilot.pause(0.1)
        assert table.scroll_x == table.max_scroll_x
        header, first_line = visible_text(table, 0), visible_text(table, 1)
        assert header.startswith("rank  ") and header.rstrip().endswith("device")
        assert first_line.startswith("0     ") and first_line.rstrip().endswith("cpu")


async def test_the_segments_table_widens_a_column_when_a_running_segment_grows() -> None:
    from textual.app import App

    from ddpwatch.dashboard.views.snapshot_parts import SegmentRow

    def row(steps: str) -> SegmentRow:
        return SegmentRow("async", "async", steps, 10, 80.0, 15.0, 5.0, 70.0, 50.0, 57.0, 300.0, 280.0, 50.0)

    class OneTable(App[None]):
        def compose(self):  # noqa: ANN202
            yield SegmentsTable()

    app = OneTable()
    async with app.run_test() as pilot:
        table = app.query_one(SegmentsTable)
        table.show((row("69-69"),))
        await pilot.pause()
        table.show((row("69-148"),))  # the running segment reached step 148
        await pilot.pause()
        steps_column = list(table.columns.values())[1]
        assert steps_column.content_width >= len("69-148")


async def test_at_160_columns_the_segments_table_shows_step_time_and_throughput_beside_the_bars() -> None:
    """Every figure up to Comm_overhead% in view, step ms and samples/s first after the steps, with
    the bars beside the table. Before, at 160 columns the table showed "bucket (bucket_mb=1.0,
    grad_accum=1)" and four percentages: step ms and samples/s were past its edge."""
    app = DashboardApp(StaticFeed(session_messages()), export_on_exit=False)
    async with app.run_test(size=(160, 48)) as pilot:
        await draw_every_message(app, pilot)
        table = app.query_one(SegmentsTable)
        assert app.query_one(SegmentBarsView).region.width > 0
        names = [str(column.label) for column in table.columns.values()]
        widths = [column.get_render_width(table) for column in table.columns.values()]
        cells = [str(cell) for cell in table.get_row_at(1)]
        in_view = table.scrollable_content_region.width
    shown = names[:names.index("Comm_overhead%") + 1]
    assert shown[:4] == ["segment", "steps", "step ms p50", "samples/s"]
    assert sum(widths[:len(shown)]) <= in_view
    assert cells[0] == "bucket 1 MB"  # the synthetic session's bucket segment, its cap in words


async def test_a_segment_without_a_counted_step_shows_dashes_and_says_so_in_its_bar() -> None:
    """A "bucket" segment whose two steps were both excluded (as a switch's first steps are, live,
    before one is folded): its figures are dashes, where they read 0.00 Compute%, 0.0 step ms."""
    from textual.app import App

    def excluded_if_bucket(report: StepReport) -> StepReport:
        return replace(report, excluded=True) if report.strategy == "bucket" else report

    _, snapshot = snapshot_of(session_messages(steps=4, edit=excluded_if_bucket))
    simple, bucket = snapshot.segments
    assert (simple.counted_steps, bucket.counted_steps) == (2, 0)

    class OneTable(App[None]):
        def compose(self):  # noqa: ANN202
            yield SegmentsTable()
            yield SegmentBarsView()

    app = OneTable()
    async with app.run_test(size=(120, 20)) as pilot:
        table = app.query_one(SegmentsTable)
        table.show(snapshot.segments)
        bars = app.query_one(SegmentBarsView)
        bars.show(snapshot.segments)
        await pilot.pause()
        shown = [[str(cell) for cell in table.get_row_at(index)] for index in (0, 1)]
        bar_lines = str(bars.render()).splitlines()[-2:]
    assert shown[1][:2] == [bucket.short_label, "3-4"] and set(shown[1][2:]) == {"—"}
    assert bar_lines[0].startswith("simple 1-2") and bar_lines[0].endswith("ov   0%")
    assert bar_lines[1].startswith("bucket 3-4") and bar_lines[1].endswith("no counted step")  # was "ov   0%"
    assert shown[0][2:5] == [f"{simple.step_ms_p50:.1f}", f"{simple.samples_per_s:.1f}", f"{simple.compute_pct:.2f}"]
    assert "—" not in shown[0][2:9]


async def test_a_segment_bar_is_as_long_as_its_time_per_sample_and_its_overlap_stays_in_column() -> None:
    """Two segments, the second at twice the samples/s: its bar is half as long (time per sample,
    the slowest full length), and both "ov" figures stand in one column. Full-length bars of
    segments 50 % apart in speed looked alike in length."""
    from textual.app import App

    _, snapshot = snapshot_of(session_messages(steps=4))
    slow, fast = snapshot.segments
    rows = (dataclasses.replace(slow, samples_per_s=50.0), dataclasses.replace(fast, samples_per_s=100.0))

    class Bars(App[None]):
        def compose(self):  # noqa: ANN202
            yield SegmentBarsView()

    app = Bars()
    async with app.run_test(size=(80, 10)) as pilot:
        view = app.query_one(SegmentBarsView)
        view.show(rows)
        await pilot.pause()
        lines = str(view.render()).splitlines()[-2:]
        full = view.content_region.width - 16 - 8  # less the label and " ov  77%"
    drawn = [sum(line.count(glyph) for glyph in "█▓░") for line in lines]
    assert drawn[0] == full and abs(2 * drawn[1] - drawn[0]) <= 1
    assert lines[0].index(" ov ") == lines[1].index(" ov ")


def test_the_segments_table_gives_each_collective_kinds_busbw() -> None:
    """Each "bucket" step also all-gathers 4 MB in 2 ms: 2 GB/s of algbw, times (2-1)/2 over two
    ranks, AG 1.00, after the all-reduces' own. Before, the dashboard showed no bandwidth at all."""
    from instrumented_ddp.wire.messages import Span

    def gathering(report: StepReport) -> StepReport:
        if report.strategy != "bucket":
            return report
        return replace(report, spans=[*report.spans, Span("all_gather", report.start, report.start + 0.002, nbytes=4_000_000)])

    _, snapshot = snapshot_of(session_messages(steps=4, edit=gathering))
    simple, bucket = (row.busbw for row in snapshot.segments)
    assert simple.startswith("AR ") and " " not in simple.removeprefix("AR ")
    assert bucket.startswith("AR ") and bucket.endswith(" AG 1.00")


def test_a_ranks_table_row_is_kept_until_what_it_shows_changes() -> None:
    session = Session(None)
    ingest(session, session_messages(steps=3, goodbye=False))
    builder = SnapshotBuilder(session)
    arrived = max(state.last_seen for state in session.ranks.values())
    first = builder.build(now=arrived + 0.1).ranks
    again = builder.build(now=arrived + 0.2).ranks
    assert all(a is b for a, b in zip(first, again, strict=True))
    later = builder.build(now=arrived + 10.0).ranks  # silent for 10 s: lost, and the row says so
    assert [row.status for row in later] == ["lost", "lost"] and later[0] is not first[0]


async def test_a_large_jobs_ranks_table_has_a_row_per_node_opened_by_enter() -> None:
    world = 80  # above 64 ranks: a row per node of 8
    hellos = {rank: replace(hello(rank, world_size=world), node_rank=rank // 8) for rank in range(world)}
    app = DashboardApp(StaticFeed(session_messages(steps=4, world_size=world, hellos=hellos)), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        table = app.ranks_table
        assert table.row_count == 10 and table.rows[1][0] == "▸ node 1: 8 ranks" and table.rows[1][-3] == "1"
        table.focus()
        table.cursor_row = 1
        await pilot.press("enter")  # opens node 1: its row, then its 8 ranks
        await pilot.pause(0.3)
        assert table.row_count == 18 and table.rows[1][0] == "▾ node 1: 8 ranks"
        assert [cells[0] for cells in table.rows[2:10]] == [str(rank) for rank in range(8, 16)]
        assert app.open_nodes == {1}  # the heatmap's open nodes too
        table.cursor_row = 3
        await pilot.press("enter")  # a rank's row selects the rank
        await pilot.pause(0.1)
        assert app.selected_rank == 9
        table.cursor_row = 1
        await pilot.press("enter")  # the node's row again closes it
        await pilot.pause(0.3)
        assert table.row_count == 10 and app.open_nodes == set()
