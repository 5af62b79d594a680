"""The dashboard driven through Textual's pilot: what the widgets hold, keys, switching, replays and
runs, the header, and how the panels share the screen. The tables: ``test_dashboard_tables.py``;
the side tabs: ``test_dashboard_tabs.py``; the warnings panel: ``test_warnings_panel.py``; what the
snapshot says without drawing it: ``test_dashboard_snapshot.py``."""
from __future__ import annotations

import gc
import json
import socket
import time

import pytest
from msgspec.structs import replace
from textual.geometry import Region
import zmq
from textual.widgets import Static, TabbedContent

from ddpwatch.export import exporters
from ddpwatch.dashboard.app import DashboardApp
from ddpwatch.dashboard.collector_tuning import FULL_COLLECTION_AFTER, LARGE_JOB_FULL_COLLECTION_AFTER
from ddpwatch.dashboard.frame_cycle import stack_the_ranks
from ddpwatch.dashboard.feeds import ReplayFeed, StaticFeed
from ddpwatch.dashboard.process_feed import ProcessFeed
from ddpwatch.dashboard.screens.help_screen import HelpScreen, help_text
from ddpwatch.dashboard.views.snapshot import SnapshotBuilder
from ddpwatch.dashboard.widgets.ranks_table import RanksTable
from ddpwatch.dashboard.widgets.segment_bars_view import SegmentBarsView
from ddpwatch.dashboard.widgets.segments_table import SegmentsTable
from ddpwatch.dashboard.widgets.timeline_view import TimelineView
from ddpwatch.ingest.receiver import ingest
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.session_file import SESSION_FILE_NAME, SessionWriter
from instrumented_ddp.wire.codec import decode, encode
from instrumented_ddp.wire.messages import NOT_SWITCHABLE, Ack, Goodbye, SpanRequest, StepReport, SwitchCommand
from instrumented_ddp.wire.endpoints import routing_id
from synthetic_session import (desync_at_3_4_and_a_straggler, hello, session_messages, snapshot_of, step_report,
                               waiting_ranks)
from dashboard_pilot import draw_every_message, draw_the_whole_replay


def free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


async def test_widgets_hold_the_fed_session() -> None:
    app = DashboardApp(StaticFeed(session_messages()), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        assert app.query_one(RanksTable).row_count == 2
        assert app.query_one(SegmentsTable).row_count == 2  # simple, then bucket
        timeline = app.query_one(TimelineView).data
        assert timeline is not None and timeline.step == 10 and len(timeline.ranks) == 2
        assert timeline.strategy == "bucket"
        segments = app.snapshot.segments
        assert [s.label.split()[0] for s in segments] == ["simple", "bucket"]
        assert segments[0].overlap_pct == 0.0 and segments[1].overlap_pct > 0
        assert segments[0].all_reduce_calls == 4 and segments[1].all_reduce_calls == 2
        assert {row.status for row in app.snapshot.ranks} == {"finished"}
        # beside the table, one bar per segment: bucket's compute is partly beside its all-reduces
        view = app.query_one(SegmentBarsView)
        bars = str(view.render()).splitlines()
        assert all(len(bar) <= view.content_region.width for bar in bars[1:])  # one line each: a wrap hid the next
        assert bars[1].startswith("simple 1-5") and "▓" not in bars[1] and bars[1].endswith("ov   0%")
        assert bars[2].startswith("bucket 6-10") and "▓" in bars[2]
        assert bars[2].endswith(f"ov {segments[1].overlap_pct:3.0f}%")
        assert segments[1].hidden_comm_pct > 0


async def test_arrow_keys_walk_back_through_steps_and_end_follows_again() -> None:
    app = DashboardApp(StaticFeed(session_messages()), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        await pilot.press("left", "left")
        await pilot.pause(0.2)
        assert app.query_one(TimelineView).data.step == 8
        assert app.snapshot.header.following is False
        await pilot.press("end")
        await pilot.pause(0.2)
        assert app.query_one(TimelineView).data.step == 10


async def test_t_steps_through_the_side_tabs_from_the_keyboard() -> None:
    """← and → belong to the steps, so a focused tab bar could not move: without a mouse the
    heatmap, stragglers and advisor tabs were out of reach. ``t`` and ``T`` go round them."""
    app = DashboardApp(StaticFeed(session_messages()), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        seen = [app.side_tabs.active]
        for _ in range(5):
            await pilot.press("t")
            await pilot.pause(0.15)
            seen.append(app.side_tabs.active)
        assert seen == ["devices-tab", "trends-tab", "heatmap-tab", "stragglers-tab", "advisor-tab", "devices-tab"]
        await pilot.press("T")
        await pilot.pause(0.15)
        assert app.side_tabs.active == "advisor-tab"
        assert str(app.advisor_panel.render()).strip()  # the tab's panel is drawn once shown


async def test_help_screen_lists_the_keys() -> None:
    app = DashboardApp(StaticFeed(session_messages()), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause(0.1)
        assert isinstance(app.screen, HelpScreen)
        shown = app.screen.query_one("#help-text", Static).render()
        lines = str(shown).splitlines()
        assert "      ] / [  grad_accum + 1 / - 1 (switches)" in lines
        assert "      + / -  double / halve bucket_mb (switches)" in lines
        assert "      1 … 9  switch to simple, ga, hook, async, bucket, ddp, zero1, zero2," in lines
        assert "             fsdp" in lines  # under its description, where the box wrapped it to its left edge
        assert "shift ← / →  ranks table: a column left / right (the rank stays in view)" in lines
        assert "[/b]" not in str(shown) and "[dim]" not in str(shown)
        box = app.screen.query_one("#help-text", Static)
        assert all(len(line) <= box.content_region.width for line in lines)  # none wrapped by the box
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        assert not any("Not offered" in line for line in lines)
    # where the switch keys are not offered, the list still names them: it says so first
    assert str(help_text(NOT_SWITCHABLE)).splitlines()[2:4] == [
        "Not offered here (this run was not started by ddpwatch: switching is off):", "s, 1 … 9, + -, ] [ and b."]


async def test_malformed_messages_are_counted_and_shown() -> None:
    app = DashboardApp(StaticFeed([b"\xc1garbage", *session_messages(steps=4)]), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        assert app.session.rejected["garbage"] == 1
        assert any("rejected 1 malformed" in w for w in app.snapshot.warnings)


@pytest.mark.timeout(60)
async def test_key_press_sends_the_switch_to_rank_0_and_reports_its_ack(tmp_path) -> None:  # noqa: ANN001
    address = free_address()
    feed = ProcessFeed(address, tmp_path / "session.ddpwatch")  # the live feed `ddpwatch` runs
    context = zmq.Context()
    rank0 = context.socket(zmq.DEALER)
    rank0.setsockopt(zmq.ROUTING_ID, routing_id("fixed-session", 0))
    rank0.setsockopt(zmq.LINGER, 0)
    rank0.connect(address)
    app = DashboardApp(feed, tmp_path, export_on_exit=False)
    try:
        async with app.run_test(size=(160, 50)) as pilot:
            rank0.send(encode(hello(0)))
            deadline = time.monotonic() + 10
            while 0 not in app.session.ranks and time.monotonic() < deadline:  # heard before the key (was: a 0.5 s pause)
                await pilot.pause(0.05)
            await pilot.press("5")  # bucket
            command, span_requests = None, []
            deadline = time.monotonic() + 10
            while command is None and time.monotonic() < deadline:
                if rank0.poll(100):
                    message = decode(rank0.recv()).message
                    if isinstance(message, SpanRequest):
                        span_requests.append(message)
                    else:
                        command = message
                await pilot.pause(0.05)
            assert isinstance(command, SwitchCommand) and command.strategy == "bucket"
            assert span_requests[0] == SpanRequest(full=True)  # two ranks: every span, as before summaries
            rank0.send(encode(Ack(0, command.command_id, True, 7), seq=1))
            deadline = time.monotonic() + 10
            while app.pending_switches and time.monotonic() < deadline:
                await pilot.pause(0.05)
            assert any("switched to bucket at step 7" in text for _, text in app.notices)
            assert not app.pending_switches
    finally:
        context.destroy(linger=0)
    assert (tmp_path / "session.ddpwatch").stat().st_size > 0  # the live session was recorded


def test_dashboard_main_screen_snapshot(snap_compare) -> None:  # noqa: ANN001
    async def settle(pilot) -> None:  # noqa: ANN001
        # the feed delivers from its own thread and the app drains it on its frame timer: a fixed
        # pause let a loaded machine take the snapshot before every message was drawn
        app.feed.stop()  # joins the thread: every message has been queued
        app.ingest_arrived()  # ... and folded: a frame folds for at most 60 ms, too little on a loaded machine
        app.refresh_frame()
        await pilot.pause(0.5)

    app = DashboardApp(StaticFeed(session_messages()), export_on_exit=False)
    assert snap_compare(app, terminal_size=(160, 48), run_before=settle)


@pytest.mark.parametrize("world", [64, 1024])
def test_heatmap_tab_snapshot_of_a_large_job(snap_compare, world: int) -> None:  # noqa: ANN001
    """One row per node of 8; every fifth rank's all-reduces start 3 ms later, so the nodes holding
    one read hotter in "waited"; the timeline draws picked ranks at 1,024."""
    def late(report: StepReport) -> StepReport:
        if report.rank % 5:
            return report
        return replace(report, spans=[s._replace(start=s.start + 0.003) if s.kind == "all_reduce" else s
                                      for s in report.spans])

    async def settle(pilot) -> None:  # noqa: ANN001
        app.feed.stop()  # every message queued
        app.ingest_arrived()  # ... and folded: at 1,024 ranks the frames' 60 ms each fell short under load
        app.query_one("#side", TabbedContent).active = "heatmap-tab"
        await pilot.press("h", "h")  # exposed -> step -> wait: the next frame makes the heatmap whole
        await pilot.pause(1.1)  # past the large job's twice-a-second rows
        app.refresh_frame()
        await pilot.pause(0.3)

    hellos = {rank: replace(hello(rank, world_size=world), node_rank=rank // 8) for rank in range(world)}
    app = DashboardApp(StaticFeed(session_messages(steps=4, world_size=world, hellos=hellos, edit=late)), export_on_exit=False)
    assert snap_compare(app, terminal_size=(160, 48), run_before=settle)


async def test_the_screen_fits_the_terminal_with_a_large_job_and_every_segment_bar_shows() -> None:
    """A screen taller than the terminal scrolled (by a line, when a focus moved: a flaky snapshot)
    and hid the warnings below the fold; the ranks take what the timeline and segments leave."""
    world = 64
    hellos = {rank: replace(hello(rank, world_size=world), node_rank=rank // 8) for rank in range(world)}
    app = DashboardApp(StaticFeed(session_messages(steps=4, world_size=world, hellos=hellos)), export_on_exit=False)
    async with app.run_test(size=(160, 40)) as pilot:
        await draw_every_message(app, pilot)
        assert app.screen.max_scroll_y == 0
        warnings = app.query_one("#warnings")
        assert warnings.region.bottom <= app.screen.size.height - 1  # above the footer
        bars = app.query_one(SegmentBarsView)  # its legend wraps to two lines at this width ...
        assert bars.content_region.height >= 2 + len(app.snapshot.segments)  # ... and every bar still shows


def test_the_ranks_stack_above_the_side_tabs_only_where_the_tabs_keep_twelve_rows() -> None:
    # 2 ranks in a 25-row middle (160 x 45): the box is 2 + 3 = 5 rows and leaves the tabs 20
    assert stack_the_ranks(2, 25)
    # 8 ranks in 23 rows: 11 + 12 = 23, just; in 22 the tabs would get 11: side by side
    assert stack_the_ranks(8, 23) and not stack_the_ranks(8, 22)
    assert not stack_the_ranks(2, 0)  # before the first layout the middle has no height


@pytest.mark.parametrize(("world", "size", "stacked"), [(2, (160, 50), True), (2, (80, 24), False), (64, (160, 50), False),
                                                       (80, (160, 60), False)])
async def test_few_ranks_on_a_tall_terminal_get_the_full_width_and_leave_the_side_tabs_the_rest(
        world: int, size: tuple[int, int], stacked: bool) -> None:
    """Two ranks beside the side tabs were two rows of figures over twenty blank ones, the host
    and device columns cut off, and the device sparklines squeezed into two fifths of the width.
    80 ranks are 10 node rows, which would fit, but opening a node adds 8: they stay beside."""
    hellos = {rank: replace(hello(rank, world_size=world), node_rank=rank // 8) for rank in range(world)}
    app = DashboardApp(StaticFeed(session_messages(steps=4, world_size=world, hellos=hellos)), export_on_exit=False)
    async with app.run_test(size=size) as pilot:
        await draw_every_message(app, pilot)
        await pilot.pause(0.1)
        ranks, side = app.query_one("#ranks").region, app.query_one("#side").region
        assert app.middle.has_class("-stacked") == stacked
        if stacked:
            assert ranks.height == world + 3 and ranks.width == side.width == size[0]  # header, rows, border
            assert side.y == ranks.bottom and side.bottom == app.middle.region.bottom  # the tabs take the rest
        else:
            assert ranks.y == side.y and ranks.right <= side.x  # side by side, as tall as each other
        assert app.screen.max_scroll_y == 0


@pytest.mark.parametrize("columns", [80, 119, 120])
async def test_a_narrow_terminal_shows_the_runs_live_figures_in_the_header(columns: int) -> None:
    """At 80 columns the first line was cut after the session's name and "2 ranks": the
    strategy, step, ETA and samples/s, the figures that move, were never seen; and before that it
    wrapped into the second row and pushed "live · <source>" out. The run's identity and source
    are one line, what it does now the other, each cut at its end; under 120 columns the progress
    bar gives the text its 40 columns, and the panels its row."""

    app = DashboardApp(StaticFeed(session_messages()), export_on_exit=False)
    async with app.run_test(size=(columns, 40)) as pilot:
        await draw_every_message(app, pilot)
        text = app.query_one("#header-text")
        lines = [strip.text.rstrip() for strip in text.render_lines(Region(0, 0, text.size.width, text.size.height))]
        assert lines[0] == "ddpwatch fixed-session · 2 ranks · finished · fixed data"  # every rank said goodbye
        assert lines[1] == "bucket · step 10/10 · ETA 0:00 · 40.6 samples/s · bucket_mb=1.0, grad_accum=1"
        assert app.query_one("#header-progress").display == (columns >= 120)
        assert app.query_one("#header").region.height == (3 if columns >= 120 else 2)  # the bar's row to the panels


@pytest.mark.parametrize("columns", [100, 120])
async def test_long_settings_are_cut_after_the_live_figures_not_before_them(columns: int) -> None:
    """An attached DDP with its own hook reads ``bucket_mb=1.0, comm_hook=fp16_compress_hook,
    grad_accum=1``: between the strategy and the step it pushed the step, ETA and samples/s out of
    the header under about 115 columns. The settings now come last on the line, cut there."""
    hooked = {"bucket_mb": 1.0, "comm_hook": "fp16_compress_hook", "grad_accum": 1}
    app = DashboardApp(StaticFeed(session_messages(edit=lambda report: replace(report, settings=hooked))), export_on_exit=False)
    async with app.run_test(size=(columns, 40)) as pilot:
        await draw_every_message(app, pilot)
        text = app.query_one("#header-text")
        second = text.render_lines(Region(0, 1, text.size.width, 1))[0].text.rstrip()
    assert second.startswith("bucket · step 10/10 · ETA 0:00 · 40.6 samples/s · bucket_mb=1.0, comm_hook="), second


async def test_a_replay_at_its_end_says_ended_and_gives_no_eta_where_the_run_never_said_goodbye(tmp_path) -> None:  # noqa: ANN001
    """A recording stopped at step 6 of 10 without goodbyes (a demo quit, a job killed): at the end
    of its replay the header read "live" and "ETA 0:04", as if the run still trained, and then its
    ranks did."""
    path = tmp_path / SESSION_FILE_NAME
    writer = SessionWriter(path)
    for index, data in enumerate(session_messages(steps=6, goodbye=False)):
        writer.append(data, 1_800_000_000.0 + index * 0.01)
    writer.close()
    app = DashboardApp(ReplayFeed(path, speed=0), export_on_exit=False)
    async with app.run_test(size=(300, 40)) as pilot:
        await draw_the_whole_replay(app, pilot, within_s=30)
        text = app.query_one("#header-text")
        lines = [strip.text.rstrip() for strip in text.render_lines(Region(0, 0, text.size.width, text.size.height))]
        assert lines[0].endswith(f"2 ranks · ended · replayed {path} to its end")
        assert " · step 6/10 · ETA — · " in lines[1]
        # and its ranks, heard to the end, "cut", not "live": the recording does not hold how the run went on
        assert [row.status for row in app.snapshot.ranks] == ["cut", "cut"]
        assert app.snapshot.notes[0].startswith("the recording ends before 2 ranks (0-1; last heard at step 6) said goodbye")


async def test_exports_that_cannot_be_written_are_said_and_the_dashboard_stays(tmp_path) -> None:  # noqa: ANN001
    """The session folder replaced by a file while the dashboard ran: `e` ended the app in a
    traceback (the live view of a run still training with it), and so did the exports at exit.
    Now the reason is a notice, kept for the command to print at exit (exit 1)."""
    out = tmp_path / "session"
    out.mkdir()
    app = DashboardApp(StaticFeed(session_messages()), out)  # exports at exit too
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        out.rmdir()
        out.write_text("a file where the session folder was")
        await pilot.press("e")
        await pilot.pause(0.1)
        said = f"the exports could not be written to {out}: {out} is a file, not a directory"
        assert app.notices[-1][1] == said and app.export_failure == said
        assert app.is_running
    assert app.export_failure == said  # the exports at exit failed the same way, unraised (run_test re-raises what the app raised)


async def test_a_replay_offers_no_switch_keys(tmp_path) -> None:  # noqa: ANN001
    """A replay cannot switch: its footer showed "s switch", and the picker opened, was filled in,
    and only then said "this is a replay". Now no switch key is offered, and `s` opens nothing."""
    from ddpwatch.dashboard.screens.strategy_picker import StrategyPicker

    path = tmp_path / SESSION_FILE_NAME
    writer = SessionWriter(path)
    for index, data in enumerate(session_messages(steps=3)):
        writer.append(data, 1_800_000_000.0 + index * 0.01)
    writer.close()
    app = DashboardApp(ReplayFeed(path, speed=0), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await pilot.pause(0.3)
        assert app.run_is_switchable  # the run itself could: train.py's
        assert app.check_action("pick_strategy", ()) is False and app.check_action("apply_advice", ()) is False
        assert "switch" not in {active.binding.description for active in app.screen.active_bindings.values()}
        await pilot.press("s", "5")
        await pilot.pause(0.1)
        assert not isinstance(app.screen, StrategyPicker) and not app.pending_switches
        await pilot.press("question_mark")
        await pilot.pause(0.1)
        assert "Not offered here (a replay cannot switch): s, 1 … 9, + -, ] [ and b." in str(app.screen.query_one("#help-text", Static).render())


async def test_a_run_started_again_after_the_last_one_ended_gets_a_session_of_its_own(tmp_path) -> None:  # noqa: ANN001
    """The same script run twice with the dashboard open: the second run was dropped whole as
    "rejected 80 malformed message(s): 80 step_repeated" under the first run's figures (seen by
    hand). Once every rank of the first said goodbye, the second's hello begins a session of its
    own, and the first run's exports are written in a folder named after it."""
    second = {rank: replace(hello(rank), session="second-session") for rank in (0, 1)}
    feed = StaticFeed(session_messages(steps=10) + session_messages(steps=4, goodbye=False, hellos=second))
    app = DashboardApp(feed, out_dir=tmp_path, export_on_exit=True)
    async with app.run_test(size=(160, 40)) as pilot:
        await draw_every_message(app, pilot)
        assert app.session.session_id == "second-session" and not app.session.rejected
        assert [(s.first_step, s.last_step) for s in app.session.segments] == [(1, 2), (3, 4)]
        assert not any("malformed" in line for line in app.snapshot.warnings)
        assert any("run fixed-session is over; now watching run second-session" in text for _, text in app.notices)
    first = json.loads((tmp_path / "fixed-session" / "summary.json").read_text())
    assert first["session"] == "fixed-session" and sum(seg["steps"] for seg in first["segments"]) > 0


def test_another_run_sending_while_this_one_goes_on_is_named_not_taken_for_malformed_messages() -> None:
    """Its hello is not applied (the header kept the first run's name; before, it took the second's)."""
    second = [encode(replace(hello(rank), session="second-session"), seq=50) for rank in (0, 1)]
    session, snapshot = snapshot_of(session_messages(steps=4, goodbye=False) + second)
    assert session.session_id == "fixed-session" and session.other_runs == {"second-session": 2}
    assert not session.rejected
    assert ("another run (second-session) is sending here while run fixed-session goes on: its reports are mixed in with "
            "this run's or rejected; give each run its own address (ddpwatch --listen, train.py --watch)") in snapshot.warnings


def test_another_runs_reports_are_left_out_where_the_sender_names_its_run_and_a_finished_run_gives_way_to_them() -> None:
    """Two scripts sending to one address at once, each message with the run its rank's routing id
    names (``endpoints.run_of_sender``): the second run's reports, for the same step numbers, were
    mixed in or rejected as repeated steps; now none enters this run's figures, each is counted,
    and once this run is over a report of the other (before its next hello) begins its session."""
    first = [decode(data) for data in session_messages(steps=6)]
    second = [decode(data) for data in session_messages(steps=4, goodbye=False, edit=waiting_ranks(40.0),
                                                        hellos={rank: replace(hello(rank), session="second-session") for rank in (0, 1)})]
    alone = Session()
    ingest(alone, session_messages(steps=6))
    session, now = Session(), 100.0
    running, goodbyes = first[:-2], first[-2:]
    for index in range(max(len(running), len(second))):  # interleaved, as two jobs' ranks send
        for envelopes, run in ((running, "fixed-session"), (second, "second-session")):
            if index < len(envelopes):
                assert session.next_run(envelopes[index].message, now, run) == ""
                session.ingest(envelopes[index], now, run=run)
    for envelope in goodbyes:
        session.ingest(envelope, now, run="fixed-session")
    assert not session.rejected and session.other_runs == {"second-session": len(second)}
    assert all(session.step_figures(step) == alone.step_figures(step) for step in range(1, 7))
    warnings = SnapshotBuilder(session).build().warnings
    assert (f"another run (second-session) is sending here while run fixed-session goes on: its {len(second)} messages so far "
            "left out, none mixed into this run's figures; give each run its own address (ddpwatch --listen, train.py --watch)"
            ) in warnings
    report = step_report(0, 5, "bucket")
    assert session.next_run(report, now, "second-session") == "second-session"  # every rank of this run said goodbye
    assert session.next_run(report, now, "fixed-session") == ""


async def test_the_header_counts_its_ranks_in_words() -> None:
    """"2 rank(s)" read as a form to fill in: 2 ranks, 1 rank."""
    app = DashboardApp(StaticFeed(session_messages(world_size=1)), export_on_exit=False)
    async with app.run_test(size=(160, 40)) as pilot:
        await draw_every_message(app, pilot)
        text = app.query_one("#header-text")
        first = text.render_lines(Region(0, 0, text.size.width, 1))[0].text.rstrip()
    assert first == "ddpwatch fixed-session · 1 rank · finished · fixed data"


def test_the_header_says_a_run_is_finished_once_every_rank_said_goodbye() -> None:
    """It said "live" on a run that had ended; only the ranks table's status said "finished"."""
    for goodbye in (False, True):
        _, snapshot = snapshot_of(session_messages(steps=3, goodbye=goodbye))
        assert snapshot.header.finished is goodbye and snapshot.header.following


async def test_the_timeline_is_titled_with_its_step_and_its_whole_strategy_and_settings() -> None:
    """The step and strategy sat in the axis's 11-character label column: "step 10 · bu". The
    box's border title holds them whole, settings too, and follows a step picked with the arrows."""
    app = DashboardApp(StaticFeed(session_messages()), export_on_exit=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await draw_every_message(app, pilot)
        box = app.query_one("#timeline-box")
        assert box.border_title == "step 10 · bucket (bucket_mb=1.0, grad_accum=1)"
        assert app.timeline_view.render_line(0).text.startswith(" " * 12 + "|0ms")
        for _ in range(6):  # back to step 4, under simple
            await pilot.press("left")
        app.refresh_frame()
        await pilot.pause()
        assert box.border_title == "step 4 · simple (grad_accum=1)"


@pytest.mark.parametrize("rows", [24, 35, 36])
async def test_every_panel_shows_without_scrolling_on_a_default_terminal_with_warnings(rows: int) -> None:
    """At 80 x 24 (most terminals' default) the panels were 5 rows taller than the screen: it
    scrolled, and the warnings and the segments table sat below the fold. Under 36 rows the
    segment bars step aside and the rest shrink; the table scrolls to its newest segment."""
    def desync_and_straggler(report: StepReport) -> StepReport:
        report = desync_at_3_4_and_a_straggler(report)
        if report.step >= 9:  # a third segment: bucket at 2 MB
            return replace(report, settings={**report.settings, "bucket_mb": 2.0})
        return report

    app = DashboardApp(StaticFeed(session_messages(edit=desync_and_straggler)), export_on_exit=False)
    async with app.run_test(size=(80, rows)) as pilot:
        await draw_every_message(app, pilot)
        await pilot.pause()  # the segments table scrolls after the refresh that laid its rows out
        assert len(app.snapshot.warnings) >= 2 and len(app.snapshot.segments) == 3
        assert app.screen.max_scroll_y == 0
        footer_row = app.screen.size.height - 1
        for panel in ("#header", "#timeline-box", "#ranks", "#side", "#segments", "#warnings"):
            region = app.query_one(panel).region
            assert region.height >= 1 and region.bottom <= footer_row, (panel, region)
        assert app.query_one("#warnings").region.height >= 2  # the desync, then the straggler
        assert app.query_one("#segment-bars").display == (rows >= 36)
        assert app.query_one("#timeline-box").max_scroll_y == 0
        drawn = " ".join(app.timeline_view.render_line(y).text for y in range(app.timeline_view.size.height))
        assert "exposed: transfer" in drawn and "exposed: waiting for other ranks" in drawn  # the legend whole
        segments = app.query_one(SegmentsTable)
        newest = segments.get_row_index("2")
        assert segments.scroll_y + segments.scrollable_content_region.height - 1 > newest  # bucket at 2 MB in view, under the column names


def test_impossible_values_are_rejected_by_kind_and_the_valid_stream_is_kept() -> None:
    from msgspec.structs import replace

    from ddpwatch.ingest.receiver import ingest
    from ddpwatch.ingest.session import Session
    from synthetic_session import step_report

    session = Session()
    valid = session_messages(steps=4, goodbye=False)
    hostile = [
        encode(step_report(0, 2, "simple"), seq=99),  # rank 0 reports step 2 a second time
        encode(replace(step_report(0, 1, "simple"), rank=7), seq=1),  # rank 7 of a 2-rank world
        encode(step_report(1, 0, "simple"), seq=98),  # rank 1 goes back from step 4 to step 0
    ]
    accepted = ingest(session, valid + hostile)
    assert session.rejected == {"step_repeated": 1, "unknown_rank": 1, "step_backwards": 1}
    assert sorted(session.reports) == [1, 2, 3, 4] and all(len(r) == 2 for r in session.reports.values())
    assert len(accepted) == len(valid)


async def test_sixty_four_ranks_fit_the_timeline_and_the_ranks_table_scrolls() -> None:
    app = DashboardApp(StaticFeed(session_messages(steps=20, world_size=64)), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        assert app.ranks_table.row_count == 64
        assert len(app.timeline_view.data.ranks) == 64
        timeline_box = app.query_one("#timeline-box")
        assert timeline_box.size.height < 50 and timeline_box.max_scroll_y > 0  # it scrolls, the rest stays visible
        assert app.ranks_table.max_scroll_y > 0
        assert len(app.device_panel.series) == 64 and app.device_panel.max_scroll_y > 0
        assert not app.trends_panel.series  # a hidden tab is not drawn ...
        app.side_tabs.active = "trends-tab"
        await pilot.pause(0.3)  # ... until it is shown
        assert [s.label for s in app.trends_panel.series] == ["loss (mean over ranks)", "step time"]
        assert app.frames > 0


def test_a_bounded_session_keeps_recent_steps_and_exact_segment_figures() -> None:
    from ddpwatch.ingest.receiver import ingest
    from ddpwatch.ingest.session import Session

    messages = session_messages(steps=60)
    everything, bounded = Session(), Session(keep_steps=7)
    ingest(everything, messages)
    ingest(bounded, messages)
    assert len(bounded.reports) == 7 and sorted(bounded.reports)[0] == 54
    for full, kept in zip(everything.segments, bounded.segments, strict=True):
        a, b = everything.segment_figures(full).as_dict(), bounded.segment_figures(kept).as_dict()
        for key in ("compute_pct", "non_compute_pct", "overlap_pct", "all_reduce_calls_total", "samples_per_s", "step_ms_p50"):
            assert a[key] == pytest.approx(b[key]), key


async def test_the_header_gives_no_rate_before_two_complete_steps() -> None:
    """Before any step (the demo's first seconds, while the ranks import torch) and after one, the
    header read "0.0 samples/s", as if measured; two steps give a rate."""
    assert snapshot_of(session_messages(steps=0, goodbye=False))[1].header.samples_per_s is None
    assert snapshot_of(session_messages(steps=1, goodbye=False))[1].header.samples_per_s is None
    rate = snapshot_of(session_messages(steps=2, goodbye=False))[1].header.samples_per_s
    assert rate is not None and rate > 0
    app = DashboardApp(StaticFeed(session_messages(steps=1, goodbye=False)), export_on_exit=False)
    async with app.run_test(size=(100, 30)) as pilot:
        await draw_every_message(app, pilot)
        text = app.query_one("#header-text")
        second = text.render_lines(Region(0, 1, text.size.width, 1))[0].text.rstrip()
    assert " · ETA — · — samples/s · " in second


async def test_a_device_note_is_shown_per_rank_as_sent_even_with_brackets_in_it() -> None:
    note = "NVML unavailable: libnvidia-ml.so not found; sending CPU readings"
    hellos = {0: hello(0, device="cuda:0", device_note=note), 1: hello(1, device="cuda:1", device_note="[/] [b]odd")}
    app = DashboardApp(StaticFeed(session_messages(steps=4, hellos=hellos)), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        assert app.snapshot.notes == (f"rank 0 (cuda:0): {note}", "rank 1 (cuda:1): [/] [b]odd")
        shown = str(app.warnings_panel.render())
        assert f"rank 0 (cuda:0): {note}" in shown and "rank 1 (cuda:1): [/] [b]odd" in shown


def test_the_dashboard_dates_a_message_by_its_arrival_not_by_the_frame_that_folds_it() -> None:
    """A rank is lost after 2.5 s of silence: a slow frame must not make it look alive longer."""
    feed = StaticFeed(session_messages(steps=2))
    app = DashboardApp(feed, export_on_exit=False)
    feed._run()  # the feed's thread receives everything now
    arrived_by = time.monotonic()
    time.sleep(0.3)  # ... and the next frame folds it in late
    app.ingest_arrived()
    assert app.session.ranks and max(state.last_seen for state in app.session.ranks.values()) <= arrived_by


def test_a_frame_folds_in_what_its_budget_allows_and_the_next_frames_the_rest() -> None:
    feed = StaticFeed(session_messages(steps=20))
    app = DashboardApp(feed, export_on_exit=False)
    feed._run()
    app.ingest_arrived(budget_s=0.0)  # the first message always goes in: a frame never folds nothing
    assert app.session.messages == 1
    while app._arrivals or feed._items:
        app.ingest_arrived(budget_s=0.001)
    everything = DashboardApp(StaticFeed(session_messages(steps=20)), export_on_exit=False)
    everything.feed._run()
    everything.ingest_arrived()
    assert app.session.messages == everything.session.messages == len(session_messages(steps=20))
    assert app.session.step_figures(20) == everything.session.step_figures(20)


async def header_first_line(messages: list[bytes]) -> str:
    """The header's first line once every message is drawn (the run's state is in it)."""
    app = DashboardApp(StaticFeed(messages), export_on_exit=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await draw_every_message(app, pilot)
        text = app.query_one("#header-text")
        return text.render_lines(Region(0, 0, text.size.width, 1))[0].text


async def test_a_rank_whose_training_failed_reads_failed_and_the_warnings_and_exports_say_why() -> None:
    """Its goodbye names the failure (``Watch.sends_failure``): the ranks table and the header read
    *finished*, and nothing on screen or in the files said it."""
    messages = [*session_messages(steps=4, goodbye=False),
                encode(Goodbye(0, 4), 90, 0), encode(Goodbye(1, 3, "failed: RuntimeError: Connection reset by peer"), 90, 0)]
    session = Session()
    ingest(session, messages)
    snapshot = SnapshotBuilder(session).build(now=max(state.last_seen for state in session.ranks.values()))
    assert [(row.rank, row.status) for row in snapshot.ranks] == [(0, "finished"), (1, "failed")]
    assert "rank 1 failed after step 3: RuntimeError: Connection reset by peer" in snapshot.warnings
    data = exporters.summary(session)
    assert exporters.failed_ranks(json.loads(json.dumps(data))) == {1: (3, "RuntimeError: Connection reset by peer")}
    assert data["first_failed_rank"] == 1
    assert "**ERROR: rank 1 failed after step 3: RuntimeError: Connection reset by peer**" in exporters.summary_markdown(data)
    assert (await header_first_line(messages)).startswith("ddpwatch fixed-session · 2 ranks · failed · fixed data")


async def test_ranks_a_signal_stopped_read_interrupted_not_failed_on_screen_and_in_the_exports() -> None:
    """Ctrl-C at torchrun: every rank's goodbye says SIGINT. Before, the run read *failed* and the
    warnings *ERROR: rank 1 failed first … KeyboardInterrupt*, naming a cause where there was none."""
    ctrl_c = "interrupted: SIGINT (KeyboardInterrupt, Ctrl-C)"
    messages = [*session_messages(steps=4, goodbye=False), encode(Goodbye(1, 4, ctrl_c), 90, 0), encode(Goodbye(0, 4, ctrl_c), 90, 0)]
    session = Session()
    ingest(session, messages)
    snapshot = SnapshotBuilder(session).build(now=max(state.last_seen for state in session.ranks.values()))
    assert [(row.rank, row.status) for row in snapshot.ranks] == [(0, "interrupted"), (1, "interrupted")]
    line = "ranks 0-1 interrupted after step 4: SIGINT (KeyboardInterrupt, Ctrl-C)"
    assert line in snapshot.notes  # a note (cyan), not a fault (red)
    assert not any("interrupted" in warning or "failed" in warning for warning in snapshot.warnings)
    data = json.loads(json.dumps(exporters.summary(session)))
    assert exporters.failed_ranks(data) == {} and data["first_failed_rank"] is None
    assert exporters.interrupted_ranks(data) == {0: (4, "SIGINT (KeyboardInterrupt, Ctrl-C)"), 1: (4, "SIGINT (KeyboardInterrupt, Ctrl-C)")}
    markdown = exporters.summary_markdown(data)
    assert "**Ranks 0-1 interrupted after step 4: SIGINT (KeyboardInterrupt, Ctrl-C)**" in markdown and "ERROR" not in markdown
    assert (await header_first_line(messages)).startswith("ddpwatch fixed-session · 2 ranks · interrupted · fixed data")


def test_a_rank_ddpwatch_stopped_watching_reads_detached_not_finished_on_screen_and_in_the_exports() -> None:
    """``attach`` detaches where it cannot read the loop (the optimizer stepping inside the model's
    forward) or where its own code raised, and the rank trains on: it read *finished*, its later
    steps silently missing."""
    why = "the optimizer stepped inside the model's forward"
    messages = [*session_messages(steps=4, goodbye=False), encode(Goodbye(1, 2, f"detached: {why}"), 90, 0),
                encode(Goodbye(0, 4), 90, 0)]
    session = Session()
    ingest(session, messages)
    snapshot = SnapshotBuilder(session).build(now=max(state.last_seen for state in session.ranks.values()))
    assert [(row.rank, row.status) for row in snapshot.ranks] == [(0, "finished"), (1, "detached")]
    assert f"rank 1 no longer watched after step 2, training on unwatched: {why}" in snapshot.notes
    data = json.loads(json.dumps(exporters.summary(session)))
    assert exporters.detached_ranks(data) == {1: (2, why)} and exporters.failed_ranks(data) == {}
    assert f"**Rank 1 no longer watched after step 2, training on unwatched: {why}**" in exporters.summary_markdown(data)


async def test_a_large_job_makes_full_cycle_collections_rarer_and_the_app_restores_them() -> None:
    """Above 64 ranks a full pass over what the session keeps takes ~1 s at 1,024 ranks."""
    before = gc.get_threshold()
    small = DashboardApp(StaticFeed(session_messages(steps=2)), export_on_exit=False)
    async with small.run_test(size=(120, 40)) as pilot:
        await draw_every_message(small, pilot)
        assert gc.get_threshold()[2] == FULL_COLLECTION_AFTER
    hellos = {rank: replace(hello(rank, world_size=80), node_rank=rank // 8) for rank in range(80)}
    large = DashboardApp(StaticFeed(session_messages(steps=2, world_size=80, hellos=hellos)), export_on_exit=False)
    async with large.run_test(size=(120, 40)) as pilot:
        await draw_every_message(large, pilot)
        assert gc.get_threshold()[2] == LARGE_JOB_FULL_COLLECTION_AFTER
    assert gc.get_threshold() == before


def app_keeping_switches(messages: list[bytes]) -> tuple[DashboardApp, list[SwitchCommand]]:
    """A dashboard over fixed messages whose switch requests are kept in the list, not sent."""
    feed = StaticFeed(messages)
    sent: list[SwitchCommand] = []
    feed.request_switch = sent.append  # type: ignore[method-assign, assignment]
    return DashboardApp(feed, export_on_exit=False), sent


async def test_a_run_ddpwatch_did_not_start_offers_no_switch_and_says_why() -> None:
    """An attached run's hello says it cannot switch: no switch keys in the footer, the header
    says why, and a switch asked for anyway (the picker was open) is not sent."""
    hellos = {rank: replace(hello(rank), switchable=False) for rank in (0, 1)}
    app, sent = app_keeping_switches(session_messages(steps=4, hellos=hellos))
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        assert not app.snapshot.header.switchable
        # Whole and in view on every width a user has: at the end of the second line it was cut at
        # 160 columns, after the session's name on the first at 120-151 and under 112.
        for columns in (160, 130, 100, 64):
            await pilot.resize_terminal(columns, 50)
            await pilot.pause(0.2)
            text = app.header_bar.query_one("#header-text")
            lines = [strip.text for strip in text.render_lines(Region(0, 0, text.size.width, text.size.height))]
            assert len(lines) == 3 and lines[2].strip() == NOT_SWITCHABLE, (columns, lines)
            assert app.header_bar.region.height == 3
        assert app.check_action("pick_strategy", ()) is False and app.check_action("help", ()) is True
        assert "switch" not in {active.binding.description for active in app.screen.active_bindings.values()}
        await pilot.press("s", "5", "plus")
        app.request_switch("bucket", bucket_mb=5.0)
        assert not sent and any(NOT_SWITCHABLE in text for _, text in app.notices)


@pytest.mark.parametrize(("size", "all_in_view"), [((160, 50), True), ((80, 24), False)])
async def test_the_strategy_picker_shows_every_strategy_where_the_terminal_has_room(size: tuple[int, int], all_in_view: bool) -> None:
    """Its list was 8 rows, six strategies: zero1, zero2 and fsdp were below its fold at any size.
    On a short terminal the list keeps 8 rows and scrolls, so the picker still fits the screen."""
    from textual.widgets import OptionList

    from ddpwatch.dashboard.screens.strategy_picker import StrategyPicker

    app = DashboardApp(StaticFeed(session_messages()), export_on_exit=False)
    async with app.run_test(size=size) as pilot:
        await draw_every_message(app, pilot)
        await pilot.press("s")
        await pilot.pause(0.2)
        assert isinstance(app.screen, StrategyPicker)
        options = app.screen.query_one(OptionList)
        assert (options.max_scroll_y == 0) == all_in_view
        box = app.screen.query_one("#picker-box").region
        assert box.y >= 0 and box.bottom <= size[1]  # the whole picker on screen


async def test_the_strategy_picker_refuses_a_cap_no_rank_could_take() -> None:
    """"1e400" passes the number input and reads as inf: before, it was sent and rank 0 dropped the
    command as invalid, the dashboard waiting on an acknowledgement that never came."""
    from textual.widgets import Input, Label

    from ddpwatch.dashboard.screens.strategy_picker import StrategyPicker

    app = DashboardApp(StaticFeed(session_messages()), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        await pilot.press("s")
        await pilot.pause(0.2)
        picker = app.screen
        assert isinstance(picker, StrategyPicker)
        picker.query_one("#picker-bucket", Input).value = "1e400"
        picker._submit()
        await pilot.pause(0.1)
        assert app.screen is picker  # still open, nothing asked of the ranks
        assert "finite number > 0" in str(picker.query_one("#picker-error", Label).render())
        assert not app.pending_switches


async def test_a_switch_rank_0_never_answers_is_said_unanswered_once_and_still_announced_if_it_lands() -> None:
    """The relay stops resending a key press's command after ``GIVE_UP_AFTER_S`` and tells no one
    (the dashboard asked it itself): *waiting for rank 0* was all the screen said."""
    from ddpwatch.control.relay import GIVE_UP_AFTER_S

    app, sent = app_keeping_switches(session_messages(steps=4, goodbye=False))  # the run goes on
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        app.request_switch("zero2")
        (command,) = sent
        await pilot.pause(0.3)
        assert not any("no answer from rank 0" in text for _, text in app.notices)
        app.pending_switches[command.command_id].at -= GIVE_UP_AFTER_S + 1  # asked 31 s ago
        await pilot.pause(0.3)
        said = [text for _, text in app.notices if "no answer from rank 0" in text]
        assert said == ["no answer from rank 0 to the switch to zero2 in 30 s: no longer resent (it lands if rank 0 "
                        "heard it and a long step or a pause holds it)"]
        app._acknowledged(Ack(0, command.command_id, True, 9))  # rank 0 had heard it: it lands
        assert app.notices[-1][1] == "every rank switched to zero2 at step 9" and not app.pending_switches


async def test_a_switch_asked_once_rank_0_said_goodbye_is_not_sent_and_says_why() -> None:
    app, sent = app_keeping_switches(session_messages(steps=4))  # every rank said goodbye
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        app.request_switch("ddp")
        assert not sent and not app.pending_switches
        assert app.notices[-1][1] == "switch to ddp not sent: the run is over (its rank 0 said goodbye)"


async def test_a_switch_asked_from_elsewhere_is_said_once_whether_applied_or_refused() -> None:
    """``ddpwatch switch`` or ``tune`` asking through this dashboard's relay: a refusal showed
    nowhere here (the dashboard said only its own switches' answers). Rank 0 answers each resend
    again: one notice each. An ack from a rank that does not name the strategy is not said."""
    app, sent = app_keeping_switches(session_messages(steps=4, goodbye=False))
    async with app.run_test(size=(160, 50)) as pilot:
        await draw_every_message(app, pilot)
        before = len(app.notices)
        for _ in range(2):
            app._acknowledged(Ack(0, "elsewhere-1", False, 7, "unknown strategy 'zero9'", "zero9"))
            app._acknowledged(Ack(1, "elsewhere-2", True, 9, "", "ddp"))  # rank 1's: rank 0 speaks for the run
            app._acknowledged(Ack(0, "elsewhere-2", True, 9, "", "ddp"))
            app._acknowledged(Ack(0, "older-rank", False, 9, "why"))
        app.request_switch("bucket")
        (command,) = sent
        for _ in range(2):
            app._acknowledged(Ack(0, command.command_id, True, 11, "", "bucket"))
        assert [text for _, text in list(app.notices)[before:]] == [
            "switch to zero9 (asked from elsewhere) refused: unknown strategy 'zero9'",
            "every rank switched to ddp at step 9 (asked from elsewhere)",
            "asked every rank to switch to bucket; waiting for rank 0",
            "every rank switched to bucket at step 11"]
