"""``ddpwatch``: the live dashboard (also ``replay`` and ``demo``).

A feed thread queues messages; a frame timer (10 fps) folds them into the session, builds one
snapshot and hands each widget its part. Widgets post messages up (a selected rank); keys and
the picker turn into switch commands the feed relays to rank 0 until acknowledged.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Footer, TabbedContent, TabPane

from instrumented_ddp.wire.output_paths import file_in_the_way
from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import NOT_SWITCHABLE, Ack
from instrumented_ddp.wire.kinds import STRATEGY_NAMES

from ddpwatch.control.relay import GIVE_UP_AFTER_S, new_command
from ddpwatch.ingest.evaluations import series_label
from ddpwatch.export.exporters import write_exports
from ddpwatch.dashboard.views.heatmap import HEATMAP_METRICS
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.rank_state import DEVICE_SAMPLES_PER_RANK
from ddpwatch.control.span_requests import LARGE_JOB_DEVICE_EVERY_S, SAMPLE_EVERY_STEPS, SpanWish
from ddpwatch.dashboard.feeds import Arrival, Feed, ReplayFeed
from ddpwatch.dashboard.screens.help_screen import HelpScreen
from ddpwatch.dashboard.screens.strategy_picker import StrategyPicker, SwitchChoice
from ddpwatch.dashboard.views.snapshot import SnapshotBuilder
from ddpwatch.dashboard.views.snapshot_parts import SMALL_JOB_MAX_RANKS, DeviceSeries, Snapshot
from ddpwatch.dashboard.widgets.advisor_panel import AdvisorPanel
from ddpwatch.dashboard.widgets.header_bar import HeaderBar
from ddpwatch.dashboard.widgets.rank_heatmap import RankHeatmap
from ddpwatch.dashboard.widgets.ranks_table import RanksTable
from ddpwatch.dashboard.widgets.segment_bars_view import SegmentBarsView
from ddpwatch.dashboard.widgets.segments_table import SegmentsTable
from ddpwatch.dashboard.widgets.sparkline_list import Series, SparklineList
from ddpwatch.dashboard.widgets.stragglers_panel import StragglersPanel
from ddpwatch.dashboard.widgets.timeline_view import TimelineView
from ddpwatch.dashboard.widgets.warnings_panel import WarningsPanel

FRAME_INTERVAL_S = 0.1
INGEST_BUDGET_S = 0.06  # a frame folds in messages for at most this long (see ingest_arrived)
NOTICE_S = 10.0
SHORT_SCREEN_ROWS = 36  # below it every panel fits only in the short layout (``VERTICAL_BREAKPOINTS``)
NARROW_SCREEN_COLUMNS = 120  # below it the header's two lines need the progress bar's columns
#: The side tabs' rows (their tab bar's two included) kept under a ranks table that is stacked
#: above them (``stack_the_ranks``): ten to show, what a short terminal's tabs have and the
#: advisor tab is laid out for.
SIDE_ROWS_UNDER_STACKED_RANKS = 12
KEEP_STEPS = 120  # steps whose reports stay in memory (timeline, trends); older ones live on in the segment figures
DEVICE_SAMPLES = 64 * DEVICE_SAMPLES_PER_RANK  # device samples kept over all ranks: 600 each up to 64 ranks, 37 at 1,024
DETAIL_RANK_STEPS = 64 * KEEP_STEPS  # reports whose spans and all-reduce durations stay (see Session): all of 64 ranks'
#: Younger collections between two full passes of Python's cycle collector (its default: 10). A
#: full pass scans every tracked object, and at the default it comes often enough to drop frames;
#: objects made before the first frame (imports, widgets) are frozen out of it. Textual's strips
#: form reference cycles, so a much longer wait lets their garbage pile up.
FULL_COLLECTION_AFTER = 100  # a full pass about every 6 s at 64 ranks
#: The same above ``SMALL_JOB_MAX_RANKS`` ranks: the session then holds hundreds of thousands of
#: objects (ranks x kept steps), a full pass freezes the screen, and it must come seldom; a large
#: job's fewer frames a second make fewer strips, so their garbage does not pile up meanwhile.
LARGE_JOB_FULL_COLLECTION_AFTER = 1000  # a full pass about every 75 s at 1,024 ranks


#: The actions that ask the run to switch (keys hidden for a run that cannot).
SWITCH_ACTIONS = frozenset({"pick_strategy", "switch_to", "bucket", "accum", "apply_advice"})


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


@dataclass
class AskedSwitch:
    """A switch this dashboard asked for, until rank 0 answers it."""

    strategy: str
    at: float  # time.monotonic() when asked
    said_unanswered: bool = False  # said once, when the relay stopped resending it


def new_session() -> Session:
    """The dashboard's bounded session: recent steps' reports and details, device samples."""
    return Session(keep_steps=KEEP_STEPS, detail_rank_steps=DETAIL_RANK_STEPS, device_samples=DEVICE_SAMPLES)


class DashboardApp(App[None]):
    CSS_PATH = "dashboard.tcss"
    TITLE = "ddpwatch"
    #: Under ``SHORT_SCREEN_ROWS`` rows (80 x 24, most terminals' default) the screen is ``-short``:
    #: its panels shrink and the segment bars step aside (``dashboard.tcss``), so every panel shows.
    VERTICAL_BREAKPOINTS = [(0, "-short"), (SHORT_SCREEN_ROWS, "-tall")]
    #: Under ``NARROW_SCREEN_COLUMNS`` the header's progress bar gives its 40 columns to the text.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (NARROW_SCREEN_COLUMNS, "-wide")]
    BINDINGS = [
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
        Binding("space", "toggle_pause", "pause", priority=True),
        Binding("left", "step(-1)", "prev step", priority=True),
        Binding("right", "step(1)", "next step", priority=True),
        Binding("end", "follow", "latest"),
        Binding("s", "pick_strategy", "switch"),
        *(Binding(str(i + 1), f"switch_to('{name}')", name, show=False) for i, name in enumerate(STRATEGY_NAMES)),
        Binding("plus", "bucket(2.0)", "bucket×2", show=False),
        Binding("minus", "bucket(0.5)", "bucket÷2", show=False),
        Binding("right_square_bracket", "accum(1)", "accum+1", show=False),
        Binding("left_square_bracket", "accum(-1)", "accum-1", show=False),
        Binding("e", "export", "export"),
        Binding("h", "heatmap_metric", "heatmap", show=False),
        # The side tabs from the keyboard: ← and → step through steps, so a focused tab bar cannot
        # move with them, and a terminal without the mouse (tmux without mouse mode) reaches the
        # heatmap, the stragglers and the advisor only so.
        Binding("t", "side_tab(1)", "next tab", show=False),
        Binding("T", "side_tab(-1)", "previous tab", show=False),
        Binding("b", "apply_advice", "best bucket", show=False),
        Binding("greater_than_sign", "speed(2.0)", "faster", show=False),
        Binding("less_than_sign", "speed(0.5)", "slower", show=False),
    ]

    def __init__(self, feed: Feed, out_dir: Path | None = None, frame_interval_s: float = FRAME_INTERVAL_S,
                 export_on_exit: bool = True) -> None:
        super().__init__()
        self.feed = feed
        self.out_dir = out_dir
        self.frame_interval_s = frame_interval_s
        self.export_on_exit = export_on_exit
        self.session = new_session()
        self.builder = SnapshotBuilder(self.session)
        self.selected_step: int | None = None  # None: follow the latest step
        self.selected_rank: int | None = None
        self.heatmap_metric = next(iter(HEATMAP_METRICS))
        self.open_nodes: set[int] = set()  # heatmap nodes shown a row per rank (a large job starts collapsed)
        self.snapshot: Snapshot | None = None
        self.pending_switches: dict[str, AskedSwitch] = {}  # by command id, until rank 0 answers
        self.answered_switches: set[str] = set()  # command ids whose answer was said: rank 0 answers each resend again
        self.run_is_switchable = True  # False for a run ddpwatch did not start (its hello says so)
        self.notices: deque[tuple[float, str]] = deque(maxlen=6)
        self.held_warnings: tuple[str, ...] = ()  # shown until the dashboard closes (``hold_warning``)
        self.export_failure: str | None = None  # the last export that could not be written, said at exit
        self.frames = 0
        self.frame_seconds = 0.0  # our code's time in frames (bench/dashboard_load.py reports it) ...
        self.frame_parts: defaultdict[str, float] = defaultdict(float)  # ... by part: "ingest", "build", then each panel's show
        self._arrivals: deque[Arrival] = deque()  # drained from the feed, not folded in yet
        self._devices_shown: tuple[tuple[DeviceSeries, ...] | None, tuple[Series, ...]] = (None, ())
        self._series_made: dict[int, tuple[DeviceSeries, Series]] = {}  # rank -> (its series, as drawn)
        self._full_collection_after = 0  # set at mount (see FULL_COLLECTION_AFTER)

    def compose(self) -> ComposeResult:
        # Kept as attributes: the frame timer draws into them even while a modal screen is on top.
        self.header_bar, self.timeline_view = HeaderBar(id="header"), TimelineView(id="timeline")
        self.ranks_table, self.segments_table = RanksTable(id="ranks"), SegmentsTable(id="segments")
        self.device_panel, self.trends_panel = SparklineList(id="devices"), SparklineList(id="trends")
        self.segment_bars = SegmentBarsView(id="segment-bars")
        self.heatmap_view = RankHeatmap(id="heatmap")
        self.stragglers_panel = StragglersPanel(id="stragglers", markup=False)
        self.advisor_panel = AdvisorPanel(id="advisor", markup=False)
        self.side_tabs = TabbedContent(id="side")
        self.warnings_panel = WarningsPanel(id="warnings")
        self.timeline_box = VerticalScroll(id="timeline-box")
        self.middle = Horizontal(id="middle")  # the ranks and the side tabs: side by side, or stacked
        yield self.header_bar
        with self.timeline_box:
            yield self.timeline_view
        with self.middle:
            yield self.ranks_table
            with self.side_tabs:
                with TabPane("Devices", id="devices-tab"):
                    yield self.device_panel
                with TabPane("Loss & step time", id="trends-tab"):
                    yield self.trends_panel
                with TabPane("Heatmap", id="heatmap-tab"), VerticalScroll():
                    yield self.heatmap_view
                with TabPane("Stragglers", id="stragglers-tab"):
                    yield self.stragglers_panel
                with TabPane("Advisor", id="advisor-tab"), VerticalScroll(id="advisor-scroll"):
                    yield self.advisor_panel
        with Horizontal(id="bottom"):
            yield self.segments_table
            yield self.segment_bars
        yield self.warnings_panel
        yield Footer()

    def on_mount(self) -> None:
        self._gc_thresholds = gc.get_threshold()
        gc.collect()
        gc.freeze()
        self._full_collection_after = FULL_COLLECTION_AFTER  # a large job's, once it shows itself
        gc.set_threshold(*self._gc_thresholds[:2], self._full_collection_after)
        self.feed.start()
        self.set_interval(self.frame_interval_s, self.refresh_frame)

    def on_unmount(self) -> None:
        gc.unfreeze()
        gc.set_threshold(*self._gc_thresholds)
        self.feed.stop()
        self.ingest_arrived()  # what came since the last frame is in the session file: the exports match it
        if self.export_on_exit and self.out_dir is not None and self.session.reports:
            self.export_to(self.session, self.out_dir)

    # -- the frame ---------------------------------------------------------------------------------
    def ingest_arrived(self, budget_s: float | None = None) -> None:
        """Fold in what arrived; with ``budget_s``, only as much as that time allows, the rest
        at the next frames. A large job's sampled full step (every rank's spans at once) then
        slows the frames for a while instead of freezing the screen; each message is dated by its
        arrival, so a late fold does not make a rank look alive longer."""
        self._arrivals.extend(self.feed.drain())
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        while self._arrivals:  # at least one a frame, however small the budget
            arrived_at, item, prepared, run = self._arrivals.popleft()
            if isinstance(item, Envelope):
                if next_run := self.session.next_run(item.message, arrived_at, run):
                    self.begin_next_run(next_run)
                if self.session.ingest(item, arrived_at, prepared, run) is None and isinstance(item.message, Ack):
                    self._acknowledged(item.message)
            else:
                self.session.reject(item.category)
            if deadline is not None and time.perf_counter() >= deadline:
                return

    def begin_next_run(self, session_id: str) -> None:
        """A new run said hello once the one on screen was over (every rank gone or said goodbye):
        it gets a session of its own, and the finished run's exports are written beside the
        recording, in a folder named after it: a script run again with the dashboard still open
        is watched as a run of its own, not refused as the old run's repeated steps."""
        finished = self.session
        where = ""
        if self.export_on_exit and self.out_dir is not None and finished.reports:
            folder = self.out_dir / (finished.session_id or "run")
            if self.export_to(finished, folder) is not None:
                where = f"; its exports are in {folder}"
        self.session = new_session()
        self.builder = SnapshotBuilder(self.session)
        self.selected_step = self.selected_rank = None
        self.open_nodes.clear()
        self.pending_switches.clear()
        self.answered_switches.clear()
        self._series_made.clear()
        self._devices_shown = (None, ())
        self.notify_user(f"run {finished.session_id} is over; now watching run {session_id}{where}")

    def refresh_frame(self) -> None:
        started = clock = time.perf_counter()
        parts = self.frame_parts

        def timed(part: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            parts[part] += now - clock
            clock = now

        self.ingest_arrived(INGEST_BUDGET_S)
        if self._full_collection_after == FULL_COLLECTION_AFTER and len(self.session.ranks) > SMALL_JOB_MAX_RANKS:
            self._full_collection_after = LARGE_JOB_FULL_COLLECTION_AFTER
            gc.set_threshold(*self._gc_thresholds[:2], self._full_collection_after)
        timed("ingest")
        side_tab = self.side_tabs.active.removesuffix("-tab")
        self.snapshot = snapshot = self.builder.build(self.selected_step, heatmap_metric=self.heatmap_metric,
                                                      open_nodes=self.open_nodes, selected_rank=self.selected_rank,
                                                      side_tab=side_tab, heard_now=self.feed.heard_clock(),
                                                      recording_ended=self.feed.ended)
        timed("build")
        self.header_bar.show(snapshot.header, self.feed.description, self.feed.ended)
        if snapshot.header.switchable != self.run_is_switchable:
            self.run_is_switchable = snapshot.header.switchable
            self.refresh_bindings()  # the switch keys are offered, or not (check_action)
        timed("header")
        self.timeline_view.show(snapshot.timeline, self.selected_rank)
        if self.timeline_box.border_title != self.timeline_view.title:
            self.timeline_box.border_title = self.timeline_view.title
        timed("timeline")
        self.ranks_table.show(snapshot.ranks)
        self.middle.set_class(not self.ranks_table.has_node_rows
                              and stack_the_ranks(self.ranks_table.row_count, self.middle.size.height), "-stacked")
        timed("ranks table")
        if side_tab == "devices":  # the side panel's hidden tabs are drawn when they are shown
            self.device_panel.show(self._device_series(snapshot.devices))
        elif side_tab == "trends":
            self.trends_panel.show((Series("loss (mean over ranks)", snapshot.loss), Series("step time", snapshot.step_ms, " ms"),
                                    *(Series(series_label(name, steps), values) for name, steps, values in snapshot.evaluations)))
        elif side_tab == "heatmap":
            self.heatmap_view.show(snapshot.heatmap)
        elif side_tab == "stragglers":
            self.stragglers_panel.show(snapshot.stragglers)
        elif side_tab == "advisor":
            self.advisor_panel.show(snapshot.advice, self.run_is_switchable, replay=not self.feed.can_switch)
        timed(side_tab)
        self.segments_table.show(snapshot.segments)
        self.segment_bars.show(snapshot.segments)
        timed("segments")
        self.feed.want_spans(self.span_wish())
        now = time.monotonic()
        self._say_unanswered_switches(now)
        notices = tuple(text for at, text in self.notices if now - at < NOTICE_S)
        self.warnings_panel.show(self.held_warnings + snapshot.warnings, snapshot.notes + notices)
        timed("requests, warnings")
        self.frames += 1
        self.frame_seconds += time.perf_counter() - started

    def _device_series(self, devices: tuple[DeviceSeries, ...]) -> tuple[Series, ...]:
        """The devices tab's series, made again only when the snapshot's are new (a large job's
        are kept for ``LARGE_JOB_ROWS_REFRESH_S``): a series per rank made and compared every
        frame costs more than drawing them."""
        if self._devices_shown[0] is not devices:
            self._devices_shown = (devices, tuple(self._series_of(d) for d in devices))
        return self._devices_shown[1]

    def _series_of(self, device: DeviceSeries) -> Series:
        """One rank's series, the same object while its ``DeviceSeries`` is (the sparklines then
        compare it by identity, and no garbage is made for a rank that sent nothing new)."""
        kept = self._series_made.get(device.rank)
        if kept is None or kept[0] is not device:
            kept = self._series_made[device.rank] = (device, Series(f"rank {device.rank} {device.label}", device.values, "%"))
        return kept[1]

    def span_wish(self) -> SpanWish:
        """Every span of a job small enough to draw every rank (``SMALL_JOB_MAX_RANKS``).
        Above that: every step of the ranks the timeline draws, their spans of the step on
        screen (held by the ranks: a rank just become the slowest still sends it), a whole step
        every ``SAMPLE_EVERY_STEPS``, every rank's spans of a step the user paused on, and a
        device sample a second. The first rank's every step too: the advisor reads backward on
        its clock, from its gradient-ready marks (``advisor.recent_profile_steps``), which would
        otherwise come one step in ``SAMPLE_EVERY_STEPS``, a profile of one step where it takes
        the median of 20."""
        if self.session.world_size <= SMALL_JOB_MAX_RANKS:
            return SpanWish.everything()
        step = self.selected_step if self.selected_step is not None else self.session.latest_complete_step()
        drawn = {rank for rank, _ in self.builder.timeline_ranks(step, self.selected_rank)}
        first = {min(self.session.ranks)} if self.session.ranks else set()
        return SpanWish.sampled(SAMPLE_EVERY_STEPS, drawn | first, () if step is None else (step,),
                                None if self.selected_step is not None else drawn, LARGE_JOB_DEVICE_EVERY_S)

    def notify_user(self, text: str) -> None:
        self.notices.append((time.monotonic(), text))

    def hold_warning(self, text: str) -> None:
        """A warning the session's messages cannot carry, shown first until the dashboard closes:
        the demo's training run that died before its ranks said anything. Safe from any thread,
        before the app runs too: it only rebinds a tuple that each frame reads."""
        self.held_warnings = (*self.held_warnings, text)

    def _say_unanswered_switches(self, now: float) -> None:
        """A switch rank 0 has not answered once the relay stopped resending it is said so, once,
        beyond the notice *waiting for rank 0*. It is still announced if it lands (rank 0 heard
        it and a long step or a pause holds it)."""
        for asked in self.pending_switches.values():
            if not asked.said_unanswered and now - asked.at > GIVE_UP_AFTER_S:
                asked.said_unanswered = True
                self.notify_user(f"no answer from rank 0 to the switch to {asked.strategy} in {GIVE_UP_AFTER_S:g} s: no longer "
                                 "resent (it lands if rank 0 heard it and a long step or a pause holds it)")

    def _acknowledged(self, ack: Ack) -> None:
        """Rank 0's answer, said once: to this dashboard's own switch, and to one asked from
        elsewhere (``ddpwatch switch``, ``tune``, another dashboard), which rank 0's ack names
        (``Ack.strategy``; an older rank's names none, and is not said: an applied switch still
        shows as a segment), so that a switch asked elsewhere and refused shows here too."""
        if ack.rank != 0 or ack.command_id in self.answered_switches:
            return
        asked = self.pending_switches.pop(ack.command_id, None)
        strategy = asked.strategy if asked is not None else ack.strategy
        if not strategy:
            return
        self.answered_switches.add(ack.command_id)
        elsewhere = "" if asked is not None else " (asked from elsewhere)"
        if ack.applied:
            self.notify_user(f"every rank switched to {strategy} at step {ack.step}{elsewhere}")
        else:
            self.notify_user(f"switch to {strategy}{elsewhere} refused: {ack.detail}")

    # -- actions -----------------------------------------------------------------------------------
    def on_ranks_table_rank_selected(self, message: RanksTable.RankSelected) -> None:
        self.selected_rank = None if self.selected_rank == message.rank else message.rank

    def on_ranks_table_node_toggled(self, message: RanksTable.NodeToggled) -> None:
        """A node opened in the ranks table is opened in the heatmap too: one set of open nodes."""
        self.open_nodes.symmetric_difference_update({message.node})

    def on_rank_heatmap_row_clicked(self, message: RankHeatmap.RowClicked) -> None:
        """In a job shown a row per node, a click opens that node (or closes it from one of its
        ranks); where every rank has a row, it selects the rank, as the ranks table does."""
        if self.snapshot is not None and self.snapshot.heatmap is not None and self.snapshot.heatmap.collapsible:
            self.open_nodes.symmetric_difference_update({message.row.node})
        else:
            rank = message.row.ranks[0]
            self.selected_rank = None if self.selected_rank == rank else rank

    def action_heatmap_metric(self) -> None:
        metrics = list(HEATMAP_METRICS)
        self.heatmap_metric = metrics[(metrics.index(self.heatmap_metric) + 1) % len(metrics)]

    def action_side_tab(self, delta: int) -> None:
        tabs = [pane.id for pane in self.side_tabs.query(TabPane) if pane.id]
        self.side_tabs.active = tabs[(tabs.index(self.side_tabs.active) + delta) % len(tabs)]

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.switching_off))

    def action_toggle_pause(self) -> None:
        if self.selected_step is None:
            self.selected_step = self.session.latest_complete_step()
        else:
            self.selected_step = None

    def action_follow(self) -> None:
        self.selected_step = None

    def action_step(self, delta: int) -> None:
        steps = sorted(self.session.reports)
        if not steps:
            return
        current = self.selected_step if self.selected_step is not None else self.session.latest_complete_step() or steps[-1]
        index = min(max(steps.index(current) + delta if current in steps else len(steps) - 1, 0), len(steps) - 1)
        self.selected_step = steps[index]

    def current_settings(self) -> tuple[str, float | None, int | None]:
        hello = self.session.ranks[0].hello if 0 in self.session.ranks else None
        if hello is None:
            return "", None, None
        return hello.strategy, hello.settings.get("bucket_mb"), hello.settings.get("grad_accum")

    @property
    def switching_off(self) -> str | None:
        """Why this run cannot be switched from here, or None: a replay, or a run ddpwatch did not
        start (its hello says so). The switch keys, the help and a switch asked for all read it."""
        if not self.feed.can_switch:
            return "a replay cannot switch"
        return None if self.run_is_switchable else NOT_SWITCHABLE

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Where switching is off, the switch keys are not offered, so no picker is filled in
        only to be refused."""
        return self.switching_off is None or action not in SWITCH_ACTIONS

    def request_switch(self, strategy: str, bucket_mb: float | None = None, grad_accum: int | None = None) -> None:
        if (off := self.switching_off) is not None:
            self.notify_user(off)
            return
        if (rank0 := self.session.ranks.get(0)) is not None and rank0.goodbye is not None:
            # the relay would refuse it at once, to no one, and the screen would say, GIVE_UP_AFTER_S on, that it might still land
            self.notify_user(f"switch to {strategy} not sent: the run is over (its rank 0 said goodbye)")
            return
        command = new_command(strategy, bucket_mb, grad_accum)
        self.pending_switches[command.command_id] = AskedSwitch(strategy, time.monotonic())
        self.feed.request_switch(command)
        settings = ", ".join(f"{k}={v:g}" for k, v in (("bucket_mb", bucket_mb), ("grad_accum", grad_accum)) if v is not None)
        self.notify_user(f"asked every rank to switch to {strategy}{f' ({settings})' if settings else ''}; waiting for rank 0")

    def action_switch_to(self, strategy: str) -> None:
        self.request_switch(strategy)

    def action_pick_strategy(self) -> None:
        strategy, bucket_mb, grad_accum = self.current_settings()

        def chosen(choice: SwitchChoice | None) -> None:
            if choice is not None:
                self.request_switch(choice.strategy, choice.bucket_mb, choice.grad_accum)

        self.push_screen(StrategyPicker(strategy, bucket_mb, grad_accum), chosen)

    def action_bucket(self, factor: float) -> None:
        strategy, bucket_mb, _ = self.current_settings()
        if strategy:
            self.request_switch(strategy, bucket_mb=max((bucket_mb or 25.0) * factor, 0.001))

    def action_apply_advice(self) -> None:
        """The advisor's predicted best cap, applied live (a switch to the segment's strategy): the
        one the tab shows, not one remade at the key press, since a sweep's best can flip between
        two caps predicted a point apart."""
        shown = self.snapshot.advice if self.snapshot is not None else None
        advice = shown if shown is not None else self.builder.advice(time.monotonic())
        if isinstance(advice, str):
            self.notify_user(f"bucket advisor: {advice}")
            return
        self.request_switch(advice.strategy, bucket_mb=advice.best.cap_bytes / 2**20)

    def action_accum(self, delta: int) -> None:
        strategy, _, grad_accum = self.current_settings()
        if strategy and (grad_accum or 1) + delta >= 1:
            self.request_switch(strategy, grad_accum=(grad_accum or 1) + delta)

    def action_speed(self, factor: float) -> None:
        if isinstance(self.feed, ReplayFeed):
            self.feed.speed = min(max(self.feed.speed * factor, 0.125), 64.0)
            self.notify_user(f"replay speed ×{self.feed.speed:g}")

    def action_export(self) -> None:
        if self.out_dir is None:
            self.notify_user("no output directory: replay with --out DIR to export (ddpwatch replay SESSION --out DIR)")
            return
        paths = self.export_to(self.session, self.out_dir, screenshot=True)
        if paths is not None:
            self.notify_user(f"exported {', '.join(p.name for p in paths.values())} to {self.out_dir}")

    def export_to(self, session: Session, folder: Path, screenshot: bool = False) -> dict[str, Path] | None:
        """``session``'s exports in ``folder`` (and this screen, ``screenshot``), or None, the
        reason said and kept for the command to print at exit: a folder removed, replaced or
        full costs the exports, never the dashboard, the live view of a run still training."""
        try:
            paths = write_exports(session, folder)
            if screenshot:
                paths["screenshot"] = Path(self.save_screenshot("dashboard.svg", str(folder)))
        except OSError as error:
            why = file_in_the_way(folder) or error.strerror or str(error)
            self.export_failure = f"the exports could not be written to {folder}: {why}"
            self.notify_user(self.export_failure)
            return None
        return paths
