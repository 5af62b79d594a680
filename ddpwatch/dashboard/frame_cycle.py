"""The dashboard's frame: what arrived folded in, one snapshot built, each widget handed its part."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING

from ddpwatch.dashboard.device_series import DeviceSeriesCache
from ddpwatch.dashboard.widgets.sparkline_list import Series
from ddpwatch.ingest.evaluations import series_label

if TYPE_CHECKING:
    from ddpwatch.dashboard.app import DashboardApp

INGEST_BUDGET_S = 0.06  # a frame folds in messages for at most this long (see DashboardApp.ingest_arrived)
NOTICE_S = 10.0
#: The side tabs' rows (their tab bar's two included) kept under a ranks table that is stacked
#: above them (``stack_the_ranks``): ten to show, what a short terminal's tabs have and the
#: advisor tab is laid out for.
SIDE_ROWS_UNDER_STACKED_RANKS = 12


def stack_the_ranks(rows: int, middle_rows: int) -> bool:
    """Whether the ranks table goes above the side tabs, full width, rather than beside them.

    Beside them it is as tall as they are: with few ranks on a tall terminal, a few rows of
    figures over many blank ones, and the device sparklines beside them in two fifths of the
    width. Stacked, it takes its rows (a header and two border lines besides) and the tabs the
    rest, at full width; a job with more ranks than leave the tabs
    ``SIDE_ROWS_UNDER_STACKED_RANKS`` keeps them side by side, the table scrolling, and so does a
    large job's table of node rows (the caller's rule), so that opening a node does not move the
    panels under the user's click."""
    return middle_rows > 0 and rows + 3 + SIDE_ROWS_UNDER_STACKED_RANKS <= middle_rows


class FrameCycle:
    """One frame of ``app``: folds in what arrived (within ``INGEST_BUDGET_S``), builds the
    snapshot of what the user looks at, hands each widget its part (a hidden side tab's none),
    asks the ranks for the spans it draws, and says the notices of the last ``NOTICE_S``. Counts
    the frames and the time each part of them takes."""

    def __init__(self, app: DashboardApp) -> None:
        self.app = app
        self.device_series = DeviceSeriesCache()
        self.frames = 0
        self.seconds = 0.0  # our code's time in frames (bench/dashboard_load.py reports it) ...
        self.parts: defaultdict[str, float] = defaultdict(float)  # ... by part: "ingest", "build", then each panel's show

    def refresh(self) -> None:
        """Draws one frame."""
        app = self.app
        started = clock = time.perf_counter()
        parts = self.parts

        def timed(part: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            parts[part] += now - clock
            clock = now

        app.ingest_arrived(INGEST_BUDGET_S)
        app.collector.note_ranks(len(app.session.ranks))
        timed("ingest")
        if app.outputs:
            app.outputs.look(app.session, app.feed.heard_clock())  # --prometheus and the like, on the session's clock
            timed("outputs")
        side_tab = app.side_tabs.active.removesuffix("-tab")
        app.snapshot = snapshot = app.builder.build(app.selected_step, heatmap_metric=app.heatmap_metric,
                                                    open_nodes=app.open_nodes, selected_rank=app.selected_rank,
                                                    side_tab=side_tab, heard_now=app.feed.heard_clock(),
                                                    recording_ended=app.feed.ended)
        timed("build")
        app.header_bar.show(snapshot.header, app.feed.description, app.feed.ended)
        app.stall_banner.show(snapshot.stall_text)
        if snapshot.header.switchable != app.run_is_switchable:
            app.run_is_switchable = snapshot.header.switchable
            app.refresh_bindings()  # the switch keys are offered, or not (check_action)
        timed("header")
        app.timeline_view.show(snapshot.timeline, app.selected_rank)
        if app.timeline_box.border_title != app.timeline_view.title:
            app.timeline_box.border_title = app.timeline_view.title
        timed("timeline")
        app.ranks_table.show(snapshot.ranks)
        app.middle.set_class(not app.ranks_table.has_node_rows
                             and stack_the_ranks(app.ranks_table.row_count, app.middle.size.height), "-stacked")
        timed("ranks table")
        if side_tab == "devices":  # the side panel's hidden tabs are drawn when they are shown
            app.device_panel.show(self.device_series.series(snapshot.devices))
        elif side_tab == "trends":
            app.trends_panel.show((Series("loss (mean over ranks)", snapshot.loss), Series("step time", snapshot.step_ms, " ms"),
                                   *(Series(series_label(name, steps), values) for name, steps, values in snapshot.evaluations)))
        elif side_tab == "heatmap":
            app.heatmap_view.show(snapshot.heatmap)
        elif side_tab == "stragglers":
            app.stragglers_panel.show(snapshot.stragglers)
        elif side_tab == "advisor":
            app.advisor_panel.show(snapshot.advice, app.run_is_switchable, replay=not app.feed.can_switch)
            app.strategy_table.show(snapshot.strategies, app.run_is_switchable and app.feed.can_switch)
        timed(side_tab)
        app.segments_table.show(snapshot.segments)
        app.segment_bars.show(snapshot.segments)
        timed("segments")
        app.feed.want_spans(app.span_wish())
        now = time.monotonic()
        app.switches.say_unanswered(now)
        notices = tuple(text for at, text in app.notices if now - at < NOTICE_S)
        app.warnings_panel.show(app.held_warnings + snapshot.warnings, snapshot.notes + notices)
        timed("requests, warnings")
        self.frames += 1
        self.seconds += time.perf_counter() - started
