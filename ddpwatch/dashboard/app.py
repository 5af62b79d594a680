"""``ddpwatch``: the live dashboard (also ``replay`` and ``demo``).

A feed thread queues messages; a frame timer (10 fps) folds them into the session, builds one
snapshot and hands each widget its part. Widgets post messages up (a selected rank); keys and
the picker turn into switch commands the feed relays to rank 0 until acknowledged.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from pathlib import Path

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Footer, TabbedContent, TabPane

from instrumented_ddp.wire.messages import NOT_SWITCHABLE, Ack
from instrumented_ddp.wire.kinds import STRATEGY_NAMES

from ddpwatch.dashboard.views.heatmap import HEATMAP_METRICS
from ddpwatch.export.live_outputs import LiveOutputs
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.rank_state import DEVICE_SAMPLES_PER_RANK
from ddpwatch.control.span_requests import SpanWish
from ddpwatch.dashboard.collector_tuning import CollectorTuning
from ddpwatch.dashboard.frame_cycle import FrameCycle
from ddpwatch.dashboard.feeds import Arrival, Feed, ReplayFeed
from ddpwatch.dashboard.frame_ingest import FrameIngest
from ddpwatch.dashboard.session_exports import SessionExports
from ddpwatch.dashboard.span_wish import span_wish
from ddpwatch.dashboard.switch_requests import AskedSwitch, SwitchRequests
from ddpwatch.dashboard.screens.help_screen import HelpScreen
from ddpwatch.dashboard.screens.strategy_picker import StrategyPicker, SwitchChoice
from ddpwatch.dashboard.screens.stall_screen import StallScreen
from ddpwatch.dashboard.views.snapshot import SnapshotBuilder
from ddpwatch.dashboard.views.snapshot_parts import Snapshot
from ddpwatch.dashboard.widgets.advisor_panel import AdvisorPanel
from ddpwatch.dashboard.widgets.strategy_table import StrategyTable, fastest_fitting
from ddpwatch.dashboard.widgets.header_bar import HeaderBar
from ddpwatch.dashboard.widgets.rank_heatmap import RankHeatmap
from ddpwatch.dashboard.widgets.ranks_table import RanksTable
from ddpwatch.dashboard.widgets.segment_bars_view import SegmentBarsView
from ddpwatch.dashboard.widgets.segments_table import SegmentsTable
from ddpwatch.dashboard.widgets.sparkline_list import SparklineList
from ddpwatch.dashboard.widgets.stall_banner import StallBanner
from ddpwatch.dashboard.widgets.stragglers_panel import StragglersPanel
from ddpwatch.dashboard.widgets.timeline_view import TimelineView
from ddpwatch.dashboard.widgets.warnings_panel import WarningsPanel

FRAME_INTERVAL_S = 0.1
SHORT_SCREEN_ROWS = 36  # below it every panel fits only in the short layout (``VERTICAL_BREAKPOINTS``)
NARROW_SCREEN_COLUMNS = 120  # below it the header's two lines need the progress bar's columns
KEEP_STEPS = 120  # steps whose reports stay in memory (timeline, trends); older ones live on in the segment figures
DEVICE_SAMPLES = 64 * DEVICE_SAMPLES_PER_RANK  # device samples kept over all ranks: 600 each up to 64 ranks, 37 at 1,024
DETAIL_RANK_STEPS = 64 * KEEP_STEPS  # reports whose spans and all-reduce durations stay (see Session): all of 64 ranks'


#: The actions that ask the run to switch (keys hidden for a run that cannot).
SWITCH_ACTIONS = frozenset({"pick_strategy", "switch_to", "bucket", "accum", "apply_advice"})


def new_session() -> Session:
    """The dashboard's bounded session: recent steps' reports and details, device samples."""
    return Session(keep_steps=KEEP_STEPS, detail_rank_steps=DETAIL_RANK_STEPS, device_samples=DEVICE_SAMPLES)


class DashboardApp(App[None]):
    """The dashboard: lays out the widgets, keeps what the user looks at (a step, a rank, open
    nodes, a heatmap metric) and turns keys and clicks into it or into switch requests; the
    frame (``FrameCycle``), the switches (``SwitchRequests``), the exports (``SessionExports``)
    and the cycle collector's tuning (``CollectorTuning``) are its collaborators' jobs."""

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
        Binding("w", "stall_view", "stall", show=False),
        Binding("h", "heatmap_metric", "heatmap", show=False),
        # The side tabs from the keyboard: ← and → step through steps, so a focused tab bar cannot
        # move with them, and a terminal without the mouse (tmux without mouse mode) reaches the
        # heatmap, the stragglers and the advisor only so.
        Binding("t", "side_tab(1)", "next tab", show=False),
        Binding("T", "side_tab(-1)", "previous tab", show=False),
        Binding("b", "apply_advice", "best bucket", show=False),
        Binding("B", "apply_strategy", "best strategy", show=False),
        Binding("greater_than_sign", "speed(2.0)", "faster", show=False),
        Binding("less_than_sign", "speed(0.5)", "slower", show=False),
    ]

    def __init__(self, feed: Feed, out_dir: Path | None = None, frame_interval_s: float = FRAME_INTERVAL_S,
                 export_on_exit: bool = True, memory_budget_mib: float | None = None,
                 outputs: LiveOutputs | None = None) -> None:
        super().__init__()
        self.feed = feed
        self.outputs = outputs if outputs is not None else LiveOutputs([])  # fed each frame; the caller closes them
        self.frame_interval_s = frame_interval_s
        self.memory_budget_mib = memory_budget_mib  # the strategy table's budget (None: the device's memory)
        self.session = new_session()
        self.builder = SnapshotBuilder(self.session, memory_budget_mib=memory_budget_mib)
        self.selected_step: int | None = None  # None: follow the latest step
        self.selected_rank: int | None = None
        self.heatmap_metric = next(iter(HEATMAP_METRICS))
        self.open_nodes: set[int] = set()  # heatmap nodes shown a row per rank (a large job starts collapsed)
        self.snapshot: Snapshot | None = None
        self.switches = SwitchRequests(feed, self.notify_user)
        self.exports = SessionExports(out_dir, export_on_exit, self.notify_user, self.save_screenshot)
        self.arrived = FrameIngest(feed, lambda: self.session, self.begin_next_run, self._acknowledged)
        self.collector = CollectorTuning()
        self.frame = FrameCycle(self)
        self.run_is_switchable = True  # False for a run ddpwatch did not start (its hello says so)
        self.notices: deque[tuple[float, str]] = deque(maxlen=6)
        self.held_warnings: tuple[str, ...] = ()  # shown until the dashboard closes (``hold_warning``)

    def compose(self) -> ComposeResult:
        # Kept as attributes: the frame timer draws into them even while a modal screen is on top.
        self.header_bar, self.timeline_view = HeaderBar(id="header"), TimelineView(id="timeline")
        self.stall_banner = StallBanner(id="stall-banner")
        self.ranks_table, self.segments_table = RanksTable(id="ranks"), SegmentsTable(id="segments")
        self.device_panel, self.trends_panel = SparklineList(id="devices"), SparklineList(id="trends")
        self.segment_bars = SegmentBarsView(id="segment-bars")
        self.heatmap_view = RankHeatmap(id="heatmap")
        self.stragglers_panel = StragglersPanel(id="stragglers", markup=False)
        self.advisor_panel = AdvisorPanel(id="advisor", markup=False)
        self.strategy_table = StrategyTable(id="strategy-table", markup=False)
        self.side_tabs = TabbedContent(id="side")
        self.warnings_panel = WarningsPanel(id="warnings")
        self.timeline_box = VerticalScroll(id="timeline-box")
        self.middle = Horizontal(id="middle")  # the ranks and the side tabs: side by side, or stacked
        yield self.header_bar
        yield self.stall_banner
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
                    yield self.strategy_table
        with Horizontal(id="bottom"):
            yield self.segments_table
            yield self.segment_bars
        yield self.warnings_panel
        yield Footer()

    def on_mount(self) -> None:
        self.collector.start()
        self.feed.start()
        self.set_interval(self.frame_interval_s, self.refresh_frame)

    def on_unmount(self) -> None:
        self.collector.stop()
        self.feed.stop()
        self.ingest_arrived()  # what came since the last frame is in the session file: the exports match it
        self.exports.at_exit(self.session)
        self.outputs.finish(self.session, self.feed.heard_clock())

    # -- the frame ---------------------------------------------------------------------------------
    def ingest_arrived(self, budget_s: float | None = None) -> None:
        """Fold in what arrived; with ``budget_s``, only as much as that time allows, the rest
        at the next frames. A large job's sampled full step (every rank's spans at once) then
        slows the frames for a while instead of freezing the screen (``FrameIngest.fold``)."""
        self.arrived.fold(budget_s)

    def begin_next_run(self, session_id: str) -> None:
        """A new run said hello once the one on screen was over (every rank gone or said goodbye):
        it gets a session of its own, and the finished run's exports are written beside the
        recording, in a folder named after it: a script run again with the dashboard still open
        is watched as a run of its own, not refused as the old run's repeated steps."""
        finished = self.session
        where = self.exports.of_finished_run(finished)
        self.outputs.finish(finished, self.feed.heard_clock())
        self.session = new_session()
        self.builder = SnapshotBuilder(self.session, memory_budget_mib=self.memory_budget_mib)
        self.selected_step = self.selected_rank = None
        self.open_nodes.clear()
        self.switches.clear()
        self.frame.device_series.clear()
        self.notify_user(f"run {finished.session_id} is over; now watching run {session_id}{where}")

    def refresh_frame(self) -> None:
        """Draws one frame (``FrameCycle.refresh``)."""
        self.frame.refresh()

    @property
    def frames(self) -> int:
        """The frames drawn."""
        return self.frame.frames

    @property
    def frame_seconds(self) -> float:
        """Our code's time in frames (bench/dashboard_load.py reports it)."""
        return self.frame.seconds

    @property
    def frame_parts(self) -> defaultdict[str, float]:
        """Our code's time in frames by part: "ingest", "build", then each panel's show."""
        return self.frame.parts

    def span_wish(self) -> SpanWish:
        """The spans and device samples to ask the ranks for (``span_wish.span_wish``)."""
        return span_wish(self.session, self.builder, self.selected_step, self.selected_rank)

    def notify_user(self, text: str) -> None:
        self.notices.append((time.monotonic(), text))

    def hold_warning(self, text: str) -> None:
        """A warning the session's messages cannot carry, shown first until the dashboard closes:
        the demo's training run that died before its ranks said anything. Safe from any thread,
        before the app runs too: it only rebinds a tuple that each frame reads."""
        self.held_warnings = (*self.held_warnings, text)

    @property
    def pending_switches(self) -> dict[str, AskedSwitch]:
        """The switches this dashboard asked for that rank 0 has not answered, by command id."""
        return self.switches.pending

    def _acknowledged(self, ack: Ack) -> None:
        """Rank 0's answer to a switch, said once (``SwitchRequests.acknowledged``)."""
        self.switches.acknowledged(ack)

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

    def action_stall_view(self) -> None:
        snapshot = self.snapshot
        self.push_screen(StallScreen(snapshot.stall if snapshot else None, snapshot.stall_text if snapshot else ""))

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
        """Asks every rank to switch, unless switching is off here or the run is over (``SwitchRequests.request``)."""
        self.switches.request(self.session, strategy, bucket_mb, grad_accum, self.switching_off)

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

    def action_apply_strategy(self) -> None:
        """The strategy table's fastest choice that fits the memory budget, as the tab shows it."""
        shown = self.snapshot.strategies if self.snapshot is not None else None
        table = shown if shown is not None else self.builder.strategies(time.monotonic())
        if isinstance(table, str):
            self.notify_user(f"strategy table: {table}")
            return
        best = fastest_fitting(table)
        if best is None:
            self.notify_user(f"strategy table: {table.words}")
            return
        self.request_switch(best.strategy, grad_accum=best.grad_accum)

    def action_accum(self, delta: int) -> None:
        strategy, _, grad_accum = self.current_settings()
        if strategy and (grad_accum or 1) + delta >= 1:
            self.request_switch(strategy, grad_accum=(grad_accum or 1) + delta)

    def action_speed(self, factor: float) -> None:
        if isinstance(self.feed, ReplayFeed):
            self.feed.speed = min(max(self.feed.speed * factor, 0.125), 64.0)
            self.notify_user(f"replay speed ×{self.feed.speed:g}")

    def action_export(self) -> None:
        self.exports.on_request(self.session)

    @property
    def export_failure(self) -> str | None:
        """The last export that could not be written, for the command to print at exit."""
        return self.exports.export_failure

    @property
    def _arrivals(self) -> deque[Arrival]:
        """What the feed delivered that is not folded in yet."""
        return self.arrived.arrivals
