"""What the dashboard shows, computed from a ``Session`` without any UI.

The app folds messages into the session and, ten times a second, asks ``SnapshotBuilder`` for a
``Snapshot``; widgets only draw it. Segment figures of finished segments are cached and the
running one is recomputed at most once a second, so a long run does not slow the frame rate.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any

from ddpwatch.figures import metrics
from ddpwatch.advisor.advice import Advice, advice_for_session, keep_shown_best
from ddpwatch.wording.data_wait import data_wait_text
from ddpwatch.ingest.evaluations import MetricSeries
from ddpwatch.dashboard.views.heatmap import Heatmap, RowLayout, assemble_heatmap, heat_column, row_layout
from ddpwatch.wording.loop_compute import loop_compute_text
from ddpwatch.dashboard.views.rank_rows import RankRow, rows_by_node
from ddpwatch.ingest.session import Segment, Session
from instrumented_ddp.wire.protocol import StepReport

from ddpwatch.dashboard.views.timeline_lanes import TimelineData, pick_timeline_ranks, timeline_of
from ddpwatch.dashboard.views.warning_lines import lost_rank_lines, note_lines, reporting_fault_lines

SEGMENT_REFRESH_S = 1.0
HEATMAP_REFRESH_S = 1.0
ADVICE_REFRESH_S = 1.0  # the advisor's sweep is remade at most this often
TREND_POINTS = 120
DEVICE_REFRESH_S = 1.0  # a rank's device series is remade at most this often
#: Above ``EVERY_RANK_IN_THE_TIMELINE_UP_TO`` ranks the per-rank parts (ranks table, device
#: series) are remade at most this often, and at once when the step shown or the opened nodes
#: change: at 1,024 ranks, walking every rank each frame to find what changed was 30 ms of it.
LARGE_JOB_ROWS_REFRESH_S = 0.5
HEATMAP_STEPS = 60  # recent steps the heatmap holds; it draws as many as fit
EVERY_RANK_A_ROW_UP_TO = 32  # ranks; a larger job's heatmap starts one row per node
TOP_STRAGGLERS = 8  # ranks listed in the stragglers tab
EVERY_RANK_IN_THE_TIMELINE_UP_TO = 64  # ranks (it scrolls); above, the timeline draws the slowest, fastest and selected
RATE_STEPS = 20  # the header's samples/s is over this many recent complete steps


@dataclass(frozen=True)
class HeaderData:
    session: str
    world_size: int
    strategy: str
    settings: str
    step: int
    total_steps: int
    eta_s: float | None
    samples_per_s: float | None  # None until two complete steps give a rate
    following: bool  # the latest step, or a step the user chose
    switchable: bool = True  # False: a run ddpwatch did not start (``attach``), whose loop cannot re-wrap
    finished: bool = False  # every rank said goodbye: the run is over, whatever step is shown
    failed: bool = False  # a rank's goodbye said its training raised (``Session.failed_ranks``)
    interrupted: bool = False  # ... or that a signal stopped it (``Session.interrupted_ranks``)


@dataclass(frozen=True)
class DeviceSeries:
    rank: int
    label: str  # says what was measured: "GPU util %" (NVML) or "CPU % (no GPU)"
    values: tuple[float, ...]


@dataclass(frozen=True)
class SegmentRow:
    label: str  # ``session.strategy_label``: the strategy and its settings, in full
    short_label: str  # ``session.short_strategy_label``: the same, as the segments table's column has room for
    steps: str  # the segment's step range
    #: Its steps that count in the figures (``Figures.steps``): none yet in a segment a switch has
    #: just opened, or whose steps were all excluded; its figures are then no measurement at all.
    counted_steps: int
    compute_pct: float
    non_compute_pct: float
    idle_pct: float
    overlap_pct: float
    comm_overhead_pct: float
    all_reduce_calls: float
    all_reduce_ms: float
    step_ms_p50: float
    samples_per_s: float
    hidden_comm_pct: float = 0.0  # the part of Compute% that communication ran beside (the bars)
    other_calls: str = "—"  # reduce-scatters, all-gathers, broadcasts per rank per step (``metrics.kinds_text``)
    held: str = "—"  # the most a rank held, parameters/gradients/optimizer state (``metrics.held_text``)
    busbw: str = "—"  # each collective kind's busbw (``metrics.busbw_text``)
    data_wait_pct: float = 0.0  # the part of Idle% spent waiting for the next batch (``data_wait``)
    #: The most collectives of its own a rank's loop issued in a step's data time, of the whole
    #: session (``Session.untimed_in_data``), where any of the segment's steps had some, else 0:
    #: the data wait holds them (``StepReport.untimed_in_data``).
    untimed_in_data_most: int = 0
    #: The loop's own compute it marked, ms a step (mean), and what it said it was (``loop_compute``).
    loop_compute_ms: float = 0.0
    loop_computed: tuple[str, ...] = ()
    #: Each rank's Data wait%, where they are known (``Session.segment_data_wait_by_rank``): the line
    #: names the rank that waited most where the ranks are uneven (``data_wait.uneven_text``).
    data_wait_by_rank: tuple[tuple[int, float], ...] = ()  # (rank, %), rank order


def segment_notes(rows: tuple[SegmentRow, ...]) -> tuple[str, ...]:
    """``data_wait.data_wait_text`` of each segment whose counted steps waited on their data,
    and ``loop_compute.loop_compute_text`` of each whose loop marked compute of its own."""
    lines = (data_wait_text(f"{row.short_label} (steps {row.steps})", row.data_wait_pct, row.idle_pct, row.step_ms_p50,
                            row.untimed_in_data_most, dict(row.data_wait_by_rank))
             for row in rows if row.counted_steps)
    marked = (loop_compute_text(f"{row.short_label} (steps {row.steps})", row.loop_compute_ms, row.loop_computed,
                                row.step_ms_p50) for row in rows if row.counted_steps)
    return tuple(line for line in (*lines, *marked) if line is not None)


@dataclass(frozen=True)
class StragglerRow:
    rank: int
    node: int
    waited_for_ms: float  # by the other ranks together, per step, over first_step..last_step
    share_pct: float  # of those steps' wall time
    first_step: int
    last_step: int
    waited_ms: float = 0.0  # the rank itself, for the others, per step: ranks that wait by turns show both
    named: bool = False  # the straggler rule names it (the warning's rank)


@dataclass(frozen=True)
class Snapshot:
    header: HeaderData
    timeline: TimelineData | None
    ranks: tuple[RankRow, ...]
    devices: tuple[DeviceSeries, ...]
    loss: tuple[float, ...]
    step_ms: tuple[float, ...]
    segments: tuple[SegmentRow, ...]
    warnings: tuple[str, ...]  # errors and warnings: a desync first
    notes: tuple[str, ...] = ()  # worth knowing, not wrong: late reports, why a device is read as it is
    heatmap: Heatmap | None = None  # ranks (or nodes) x recent steps
    stragglers: tuple[StragglerRow, ...] = ()  # the ranks the others waited for longest, recently
    advice: Advice | str | None = None  # the bucket advisor's sweep, or what it still needs
    #: What the run's evaluations measured: (metric, the steps each followed, values) per metric
    #: (``evaluations.Evaluations.series``), drawn under the loss.
    evaluations: tuple[MetricSeries, ...] = ()


@dataclass(frozen=True)
class StepSummary:
    """What the trends, the header and the straggler rule need from one step, so a frame reads
    120 of these rather than 120 steps x 64 ranks of reports. Only reports that are
    ``metrics.counted`` enter it."""

    step: int
    seen: int  # reports the step had when this was made (counted or not): the cache key
    ranks: int  # counted reports it was computed from
    loss: float | None  # mean over ranks that reported one (NaN left out)
    step_ms: float  # mean over ranks
    wall_s: float  # the slowest rank's window: the step took that long for everyone
    samples: int
    times: dict[int, metrics.StepTimes]  # per rank, to put the ranks on one clock


def summarize(step: int, reports: dict[int, StepReport], figures: dict[int, metrics.StepFigures]) -> StepSummary:
    """``figures``: the session's step figures, which exist for counted reports only."""
    counted = [(r, figures[rank]) for rank, r in reports.items() if rank in figures and metrics.counted(r)]
    losses = [r.loss for r, _ in counted if r.loss is not None and r.loss == r.loss]
    windows = [f.step_ms for _, f in counted]
    return StepSummary(step, len(reports), len(counted), sum(losses) / len(losses) if losses else None,
                       sum(windows) / len(windows) if windows else 0.0, max(windows, default=0.0) / 1000,
                       sum(f.samples for _, f in counted), {f.rank: f.times for _, f in counted})


@dataclass
class _KeptSeries:
    """A rank's device series as last made, and how many samples it had taken in."""
    key: str  # the reading drawn: GPU utilization, or process CPU where there is no GPU
    values: deque[float]
    received: int = 0
    made_at: float = -math.inf
    series: DeviceSeries | None = None


@dataclass
class SnapshotBuilder:
    """Turns the session into a snapshot; keeps the caches that make that cheap.

    Each cache is keyed by a step and the number of reports it had, so a frame recomputes only
    what a new report changed: at 64 ranks a report arrives between almost every two frames.
    """

    session: Session
    _segment_rows: dict[int, tuple[float, tuple[Any, ...], SegmentRow]] = field(default_factory=dict)
    _summaries: dict[int, StepSummary] = field(default_factory=dict)
    _shown_step: tuple[Any, ...] = ()  # (step, reports, ranks drawn) the timeline and desync below were made from
    _timeline: TimelineData | None = None
    _heatmap_made: tuple[float, Any, Heatmap | None] = (0.0, None, None)  # (made at, (metric, open nodes), grid)
    _heat_layout: tuple[Any, tuple[RowLayout, ...]] = (None, ())  # ((nodes, open nodes), rows)
    _heat_columns: dict[tuple[str, int], tuple[int, tuple[float | None, ...]]] = field(default_factory=dict)  # (metric, step) -> (reports, column)
    _desync: metrics.Desync | None = None
    _devices: dict[int, _KeptSeries] = field(default_factory=dict)
    _rank_rows: dict[int, tuple[tuple[Any, ...], RankRow]] = field(default_factory=dict)  # rank -> (what it showed, row)
    _rate: tuple[float, tuple[StepSummary, ...], tuple[float | None, float | None]] = (0.0, (), (None, None))  # (made at, from, result)
    _rate_clocks: tuple[int, metrics.ClockAlignment, set[int]] | None = None  # (window, its alignment, steps in it)
    _ranks_made: tuple[float, Any, tuple[RankRow, ...]] = (0.0, None, ())  # (made at, (step, nodes opened), rows)
    _devices_made: tuple[float, tuple[DeviceSeries, ...]] = (0.0, ())  # (made at, series): large jobs
    _straggler_made: tuple[Any, metrics.Straggler | None] = (None, None)  # (steps it was found over, straggler)
    _advice_made: tuple[float, Any, Advice | str | None] = (-1.0, None, None)  # (made at, (steps, segments), advice)
    _roles: tuple[Any, tuple[tuple[int, str], ...]] = (None, ())  # ((step, figures, selected), timeline ranks)
    _warnings_made: tuple[float, int | None, tuple[tuple[str, ...], tuple[str, ...]]] = (-math.inf, None, ((), ()))  # (made at, step, (warnings, notes))
    _evaluations_made: tuple[int, tuple[MetricSeries, ...]] = (0, ())  # (changes, series)

    def waits_of(self, step: int | None) -> dict[int, float]:
        """Cross-rank waits of a step's counted reports (the straggler check looks at the last
        ten steps every frame): see ``Session.step_waits``."""
        return self._waits_both_ways(step)[0]

    def _waits_both_ways(self, step: int | None) -> tuple[dict[int, float], dict[int, float]]:
        return self.session.step_waits(step) if step is not None else ({}, {})

    def _with_spans(self, step: int, reports: dict[int, StepReport]) -> dict[int, StepReport]:
        """The step's reports that hold spans: a rank that sent only its summary has none to draw."""
        return {rank: report for rank, report in reports.items() if self.session.has_spans(step, rank)}

    def summary_of(self, step: int) -> StepSummary:
        """One kept step's summary, remade only when the step got another report."""
        reports = self.session.reports[step]
        cached = self._summaries.get(step)
        if cached is None or cached.seen != len(reports):
            cached = self._summaries[step] = summarize(step, reports, self.session.step_figures(step))
        return cached

    def summaries(self, steps: list[int]) -> list[StepSummary]:
        """Of the given kept steps, in order; forgets steps the session no longer keeps."""
        out = [self.summary_of(step) for step in steps]
        if len(self._summaries) > len(self.session.reports):
            for old in [s for s in self._summaries if s not in self.session.reports]:
                del self._summaries[old]
        return out

    def build(self, selected_step: int | None = None, now: float | None = None, heatmap_metric: str = "exposed",
              open_nodes: Collection[int] = (), selected_rank: int | None = None, side_tab: str | None = None,
              heard_now: float | None = None, recording_ended: bool = False) -> Snapshot:
        """``heard_now``: the time on the clock the messages were stamped with on arrival, by which a
        rank's silence is judged lost or stopped (``Feed.heard_clock``: a replay's is the recording's,
        still at its end once played); None: ``now``, the clock that paces what is remade.
        ``recording_ended``: nothing more will come (``Feed.ended``: a replay at its end): a rank
        heard to the end without a goodbye reads ``cut``, not ``live``, and a note says so.
        ``open_nodes``: nodes whose heatmap rows the user opened (a job above
        ``EVERY_RANK_A_ROW_UP_TO`` ranks starts with one row per node); ``selected_rank``: drawn in
        the timeline of a job too large to draw every rank; ``side_tab``: the side
        panel's tab on screen ("devices", "trends", "heatmap", "stragglers" or "advisor"), the
        others' parts left empty (None: all made). At 1,024 ranks the
        device series and the heatmap cost more than the rest of a frame's snapshot together:
        what is not on screen is not made."""
        now = time.monotonic() if now is None else now
        heard = now if heard_now is None else heard_now
        session = self.session
        latest = session.latest_complete_step()
        step = selected_step if selected_step in session.reports else latest
        reports = session.reports.get(step, {}) if step is not None else {}
        waits = self.waits_of(step)
        figures = session.step_figures(step) if step is not None else {}
        roles = self.timeline_ranks(step, selected_rank) if len(reports) > EVERY_RANK_IN_THE_TIMELINE_UP_TO else None
        if (step, len(reports), roles, session.details) != self._shown_step:
            self._shown_step = (step, len(reports), roles, session.details)
            self._timeline = timeline_of(step, self._with_spans(step, reports), session.step_calls(step),
                                         session.step_times(step), roles, session.all_reduce_groups(),
                                         {rank: f.sharded_calls for rank, f in figures.items()}) if step is not None and reports else None
            self._desync = metrics.find_desync(session.counted_calls(step), step,  # type: ignore[arg-type]
                                               {rank: f.calls_by_kind for rank, f in figures.items()}) if reports else None
        trend = self.summaries(sorted(session.reports)[-TREND_POINTS:])
        warnings, notes = self._warnings_and_notes(step, now, heard, recording_ended)
        segments = tuple(self._segment_row(segment, now) for segment in session.segments)
        return Snapshot(
            header=self._header(step, selected_step is None or selected_step == latest, trend, now),
            timeline=self._timeline,
            ranks=self._ranks(step, figures, waits, open_nodes, now, heard, recording_ended),
            devices=self._all_device_series(now) if side_tab in (None, "devices") else (),
            loss=tuple(s.loss for s in trend if s.loss is not None),
            step_ms=tuple(s.step_ms for s in trend if s.ranks),
            segments=segments,
            warnings=warnings,
            notes=notes + segment_notes(segments),
            heatmap=self._heatmap(heatmap_metric, open_nodes, now) if side_tab in (None, "heatmap") else None,
            stragglers=self._top_stragglers(step) if side_tab in (None, "stragglers") else (),
            advice=self.advice(now) if side_tab in (None, "advisor") else None,
            evaluations=self._evaluation_series() if side_tab in (None, "trends") else (),
        )

    def _evaluation_series(self) -> tuple[MetricSeries, ...]:
        """Made again only when an evaluation was kept (a run evaluates every few hundred steps)."""
        evaluations = self.session.evaluations
        if self._evaluations_made[0] != evaluations.changes:
            self._evaluations_made = (evaluations.changes, tuple(evaluations.series()))
        return self._evaluations_made[1]

    def timeline_ranks(self, step: int | None, selected_rank: int | None) -> tuple[tuple[int, str], ...]:
        """``pick_timeline_ranks`` of a kept step, made again when the step gains a figure or
        the selection changes (the frame and the span wish both ask; 1,024 ranks a pass)."""
        figures = self.session.step_figures(step) if step is not None else {}
        key = (step, len(figures), selected_rank)
        if self._roles[0] != key:
            self._roles = (key, pick_timeline_ranks(figures, selected_rank))
        return self._roles[1]

    def advice(self, now: float) -> Advice | str:
        """Remade at most once a second, and only when a step or segment came since; the best
        cap shown stays while it is predicted within 1 % of the fastest (``keep_shown_best``)."""
        made_at, made_from, advice = self._advice_made
        wanted = (self.session.latest_complete_step(), len(self.session.segments))
        if advice is None or (wanted != made_from and now - made_at >= ADVICE_REFRESH_S):
            shown = advice.best.cap_bytes if isinstance(advice, Advice) else None
            advice = advice_for_session(self.session)
            if isinstance(advice, Advice):
                advice = keep_shown_best(advice, shown)
            self._advice_made = (now, wanted, advice)
        return advice

    # -- parts -------------------------------------------------------------------------------------
    def _heatmap(self, metric: str, open_nodes: Collection[int], now: float) -> Heatmap | None:
        """Remade at most once a second, at once when the user switches the metric or opens or
        closes a node. A step's column is kept until that step gains a report or the rows
        change: at 1,024 ranks a new column is 1,024 cells, the whole grid 60 times that
        (114 ms when every column was remade)."""
        session = self.session
        if not session.ranks:
            return None
        made_at, made_for, grid = self._heatmap_made
        wanted = (metric, frozenset(open_nodes))
        if grid is not None and made_for == wanted and now - made_at < HEATMAP_REFRESH_S:
            return grid
        steps = sorted(session.reports)[-HEATMAP_STEPS:]
        node_of = self._node_of()
        expanded = None if len(node_of) <= EVERY_RANK_A_ROW_UP_TO else open_nodes
        layout_key = (tuple(node_of.items()), wanted[1] if expanded is not None else None)
        if self._heat_layout[0] != layout_key:
            self._heat_layout = (layout_key, row_layout(node_of, expanded))
            self._heat_columns.clear()
        layout = self._heat_layout[1]
        kept = set(steps)
        for key in [key for key in self._heat_columns if key[1] not in kept]:
            del self._heat_columns[key]
        columns = []
        for step in steps:
            reports = len(session.reports[step])
            cached = self._heat_columns.get((metric, step))
            if cached is None or cached[0] != reports:
                waits = self.waits_of(step) if metric == "wait" else {}
                cached = self._heat_columns[(metric, step)] = (reports, heat_column(metric, layout, session.step_figures(step), waits))
            columns.append(cached[1])
        grid = assemble_heatmap(metric, steps, layout, columns, collapsible=expanded is not None)
        self._heatmap_made = (now, wanted, grid)
        return grid

    def _header(self, step: int | None, following: bool, trend: list[StepSummary], now: float) -> HeaderData:
        session = self.session
        hello = next((s.hello for _, s in sorted(session.ranks.items()) if s.hello), None)
        current = session.segments[-1] if session.segments else None
        strategy = current.strategy if current else (hello.strategy if hello else "—")
        settings = current.label.removeprefix(strategy).strip(" ()") if current else ""
        rate, step_s = self._recent_rate(trend, now)
        total = hello.total_steps if hello else 0
        done = max((s.last_step for s in session.ranks.values()), default=0)
        eta = (total - done) * step_s if step_s and total else None
        return HeaderData(session.session_id or "waiting for a run…", session.world_size, strategy, settings,
                          step or 0, total, eta, rate, following, hello.switchable if hello else True, session.finished,
                          bool(session.failed_ranks), bool(session.interrupted_ranks))

    def _recent_rate(self, trend: list[StepSummary], now: float, window: int = RATE_STEPS) -> tuple[float | None, float | None]:
        """Global samples/s and seconds per step over the last ``window`` complete steps (None and
        None before two of them: the header read "0.0 samples/s" as if measured), the
        samples over the wall time from the first one's start to the last one's end, ranks on one
        clock (``metrics.ClockAlignment``, as the segments' samples/s, offsets over the last
        ``window`` steps), so the time between steps counts but the loop's pauses of training in
        it (an evaluation) do not, the least any rank paused, as there; the seconds per step, for
        the ETA, keep them (they will recur). Remade when those steps changed, at
        most once a second (like the running segment's figures); each step is aligned once, when
        it first enters the window (aligning 20 steps of 1,024 ranks afresh took ~100 ms)."""
        complete = tuple(s for s in trend[-window:] if s.ranks >= self.session.world_size)
        made_at, made_from, result = self._rate
        same = len(made_from) == len(complete) and all(a is b for a, b in zip(made_from, complete, strict=True))
        if same or (result[1] is not None and now - made_at < SEGMENT_REFRESH_S):
            return result
        result = (None, None)
        if len(complete) >= 2:
            if self._rate_clocks is None or self._rate_clocks[0] != window:
                self._rate_clocks = (window, metrics.ClockAlignment(keep=window), set())
            _, clocks, aligned = self._rate_clocks
            for summary in complete:
                if summary.step not in aligned:
                    clocks.add_step(summary.times)
                    aligned.add(summary.step)
            aligned.intersection_update(range(complete[0].step, complete[-1].step + 1))
            offsets = clocks.offsets()
            starts = [t.start + offsets[r] for r, t in complete[0].times.items() if r in offsets and math.isfinite(t.start)]
            ends = [t.end + offsets[r] for r, t in complete[-1].times.items() if r in offsets and math.isfinite(t.end)]
            wall = max(ends) - min(starts) if starts and ends else 0.0
            paused = min((sum(s.times[r].paused for s in complete[1:] if r in s.times) for r in offsets), default=0.0)
            if wall - paused > 0:
                result = (sum(s.samples for s in complete) / (wall - paused), wall / len(complete))
        self._rate = (now, complete, result)
        return result

    def _ranks(self, step: int | None, figures: dict[int, metrics.StepFigures], waits: dict[int, float],
               open_nodes: Collection[int], now: float, heard: float, recording_ended: bool) -> tuple[RankRow, ...]:
        """A row per rank up to ``EVERY_RANK_IN_THE_TIMELINE_UP_TO`` ranks; above, a row per node,
        its ranks' rows below it where the user opened it (``rank_rows.rows_by_node``), remade at
        most every ``LARGE_JOB_ROWS_REFRESH_S``."""
        large = len(self.session.ranks) > EVERY_RANK_IN_THE_TIMELINE_UP_TO
        made_at, made_for, kept = self._ranks_made
        view = (step, frozenset(open_nodes))
        if large and made_for == view and now - made_at < LARGE_JOB_ROWS_REFRESH_S:
            return kept
        rows = tuple(self._rank_row(rank, figures.get(rank), waits.get(rank), heard, recording_ended)
                     for rank in sorted(self.session.ranks))
        if not large:
            return rows
        grouped = rows_by_node(rows, open_nodes)
        self._ranks_made = (now, view, grouped)
        return grouped

    def _rank_row(self, rank: int, figures: metrics.StepFigures | None, waited_s: float | None, heard: float,
                  recording_ended: bool) -> RankRow:
        """Kept while nothing it shows changed: at 1,024 ranks most rows are the same from one
        frame to the next, and making each anew was 8 ms a frame. Its figures and hello are
        compared by identity (a new step's figures, a repeated hello: made anew), since
        comparing them field by field cost more than making the row."""
        state = self.session.ranks[rank]
        hello = state.hello
        status = self.session.status(rank, heard, recording_ended)
        key = (figures, hello, (waited_s, status, state.devices_received, state.last_step,
                                state.sender_dropped + state.lost_messages, state.memory_step))
        kept = self._rank_rows.get(rank)
        if kept is not None and kept[0][0] is figures and kept[0][1] is hello and kept[0][2] == key[2]:
            return kept[1]
        sample = state.devices[-1] if state.devices else None
        utilization, memory = describe_device(sample.readings if sample else {}, sample.kind if sample else "")
        row = RankRow(
            rank=rank, node=hello.node_rank if hello else None, host=hello.host if hello else "?", device=hello.device if hello else "?",
            status=status, step=state.last_step,
            step_ms=figures.step_ms if figures else None, compute_pct=figures.compute_pct if figures else None,
            non_compute_pct=figures.non_compute_pct if figures else None, overlap_pct=figures.overlap_pct if figures else None,
            waited_ms=waited_s, utilization=utilization, memory=memory,
            dropped=state.sender_dropped + state.lost_messages, held=metrics.held_text(state.memory),
        )
        self._rank_rows[rank] = (key, row)
        return row

    def _all_device_series(self, now: float) -> tuple[DeviceSeries, ...]:
        """Every rank's series; a large job's remade at most every ``LARGE_JOB_ROWS_REFRESH_S``."""
        ranks = sorted(self.session.ranks)
        made_at, kept = self._devices_made
        if len(ranks) > EVERY_RANK_IN_THE_TIMELINE_UP_TO and len(kept) == len(ranks) and now - made_at < LARGE_JOB_ROWS_REFRESH_S:
            return kept
        series = tuple(self._device_series(rank, now) for rank in ranks)
        self._devices_made = (now, series)
        return series

    def _device_series(self, rank: int, now: float) -> DeviceSeries:
        """Remade when the rank sent a new sample, at most once a second, from the samples new
        since the last time (a rank samples at 5 Hz: at 1,024 ranks, rebuilding every series
        every frame took 40 ms of it, and from all its points once a second 6 % of the
        dashboard's time)."""
        state = self.session.ranks[rank]
        kept = self._devices.get(rank)
        if kept is not None and kept.series is not None and (kept.received == state.devices_received
                                                             or now - kept.made_at < DEVICE_REFRESH_S):
            return kept.series
        devices = state.devices
        gpu = bool(devices) and devices[-1].kind == "gpu"
        key = "gpu_util_pct" if gpu else "process_cpu_pct"
        if kept is None or kept.key != key:
            kept = self._devices[rank] = _KeptSeries(key, deque(maxlen=TREND_POINTS))
        new = min(state.devices_received - kept.received, TREND_POINTS, len(devices))
        for sample in list(islice(reversed(devices), new))[::-1]:
            if key in sample.readings:
                kept.values.append(sample.readings[key])
        kept.received, kept.made_at = state.devices_received, now
        series = kept.series = DeviceSeries(rank, "GPU util %" if gpu else "CPU % (no GPU)", tuple(kept.values))
        return series

    def _untimed_in_data_most(self, segment: Segment) -> int:
        in_data = self.session.untimed_in_data
        overlaps = any(first <= segment.last_step and last >= segment.first_step for first, last in in_data.steps.ranges())
        return in_data.most if overlaps else 0

    def _segment_row(self, segment: Segment, now: float) -> SegmentRow:
        """Figures of the running segment are recomputed at most once a second (its step range
        every frame); a closed segment's only when a late step is folded into it."""
        steps = f"{segment.first_step}-{segment.last_step}"
        running = segment is self.session.segments[-1]
        key = (segment.label, segment.first_step, segment.folded_records)
        cached = self._segment_rows.get(segment.index)
        if cached is not None:
            made_at, made_for, row = cached
            same_segment = made_for[:2] == key[:2]
            if made_for == key or (running and same_segment and now - made_at < SEGMENT_REFRESH_S):
                return row if row.steps == steps else replace(row, steps=steps)
        f = self.session.segment_figures(segment, include_pending=False, per_rank=False)
        row = SegmentRow(segment.label, segment.short_label, steps, f.steps, f.compute_pct, f.non_compute_pct,
                         f.idle_pct, f.overlap_pct, f.comm_overhead_pct, f.all_reduce_calls, f.all_reduce_ms,
                         f.step_ms_p50, f.samples_per_s, f.hidden_comm_pct,
                         metrics.kinds_text(f.calls_by_kind), metrics.held_text(f.memory),
                         metrics.busbw_text(f.busbw_gbps, f.other_busbw_gbps), f.data_wait_pct,
                         self._untimed_in_data_most(segment), f.loop_compute_ms, f.loop_computed,
                         tuple(self.session.segment_data_wait_by_rank(segment).items()))
        self._segment_rows[segment.index] = (now, key, row)
        return row

    def _warnings_and_notes(self, step: int | None, now: float, heard: float,
                            recording_ended: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """A large job's made at most every ``LARGE_JOB_ROWS_REFRESH_S`` (and at once for another
        step): each is a few passes over every rank, and at 1,024 ranks they changed seldom."""
        made_at, made_for, kept = self._warnings_made
        if made_for == step and now - made_at < LARGE_JOB_ROWS_REFRESH_S and len(self.session.ranks) > EVERY_RANK_IN_THE_TIMELINE_UP_TO:
            return kept
        made = (tuple(self._warnings(step, heard)), tuple(note_lines(self.session, heard, recording_ended)))
        self._warnings_made = (now, step, made)
        return made

    def _warnings(self, step: int | None, heard: float) -> list[str]:
        """The desync first (the run's one error), lost ranks, the straggler, then what went wrong
        in what the ranks reported (``warning_lines``)."""
        desync = self._desync_range(step)
        lines = [desync.describe()] if desync is not None else []
        lines += lost_rank_lines(self.session, heard)
        straggler = self._straggler(step)
        if straggler is not None:
            lines.append(straggler.describe())
        return lines + reporting_fault_lines(self.session)

    def _desync_range(self, step: int | None) -> metrics.DesyncRange | None:
        """Every desynchronised step folded so far, plus the shown step's if it is not folded yet:
        the error stays on screen until the run ends, wherever the timeline is."""
        pending = self._desync if self._desync is not None and step is not None and not self.session.is_folded(step) else None
        return metrics.DesyncRange.combine([self.session.desync_range(),
                                            metrics.DesyncRange.of(pending) if pending is not None else None])

    def _node_of(self) -> dict[int, int]:
        """Each rank's node as its hello said (0 until the hello came): the heatmap's and the
        stragglers tab's grouping."""
        return {rank: state.hello.node_rank if state.hello else 0 for rank, state in self.session.ranks.items()}

    def _recent_complete_steps(self, step: int | None) -> list[int]:
        """The last ``metrics.STRAGGLER_STEPS`` kept steps up to the shown one that every rank
        reported, newest first: the window both straggler views judge over."""
        world = self.session.world_size
        complete: list[int] = []
        if world < 2:
            return complete
        for s in sorted(self.session.reports, reverse=True):
            if (step is None or s <= step) and self.summary_of(s).ranks >= world:
                complete.append(s)
                if len(complete) == metrics.STRAGGLER_STEPS:
                    break
        return complete

    def _straggler(self, step: int | None) -> metrics.Straggler | None:
        """``metrics.find_straggler`` over the last complete steps up to the shown one: the rule
        the exports' straggler_rank follows too. Found once per set of steps (a complete step's
        waits are final; at 1,024 ranks a search is ~7 ms)."""
        steps = tuple(self._recent_complete_steps(step))
        if self._straggler_made[0] != steps:
            found = metrics.find_straggler((metrics.StepWaits(s, self.waits_of(s), 1000 * self.summary_of(s).wall_s) for s in steps),
                                           self.session.all_reduce_groups())
            self._straggler_made = (steps, found)
        return self._straggler_made[1]

    def _top_stragglers(self, step: int | None, count: int = TOP_STRAGGLERS) -> tuple[StragglerRow, ...]:
        """The ranks the others waited for longest over the same window (``metrics.waited_for``),
        whether or not one of them crosses the straggler rule's threshold."""
        steps = self._recent_complete_steps(step)
        if not steps:
            return ()
        totals: dict[int, float] = {}
        own: dict[int, float] = {}
        for s in steps:
            waits, waited_for = self._waits_both_ways(s)  # one lookup of the step's cached waits for both
            for rank, waited in waited_for.items():
                totals[rank] = totals.get(rank, 0.0) + waited
            for rank, waited in waits.items():
                own[rank] = own.get(rank, 0.0) + waited
        wall_ms = sum(1000 * self.summary_of(s).wall_s for s in steps)
        top = sorted((rank for rank, waited in totals.items() if waited > 0), key=lambda r: (-totals[r], r))[:count]
        nodes = self._node_of()
        named = self._straggler(step)
        return tuple(StragglerRow(rank, nodes.get(rank, 0), totals[rank] / len(steps),
                                  100 * totals[rank] / wall_ms if wall_ms > 0 else 0.0, min(steps), max(steps),
                                  own.get(rank, 0.0) / len(steps), named is not None and named.rank == rank)
                     for rank in top)


def describe_device(readings: dict[str, float], kind: str) -> tuple[str, str]:
    """(utilization, memory) as the ranks table shows them; what was not measured is '—'."""
    if kind == "gpu":
        util = f"GPU {readings['gpu_util_pct']:.0f}%" if "gpu_util_pct" in readings else "GPU —"
        if "mem_used_bytes" in readings and "mem_total_bytes" in readings:
            return util, f"{readings['mem_used_bytes'] / 2**30:.1f}/{readings['mem_total_bytes'] / 2**30:.0f} GiB"
        return util, "—"
    if not readings:
        return "—", "—"
    util = f"CPU {readings['process_cpu_pct']:.0f}%" if "process_cpu_pct" in readings else "CPU —"
    memory = f"RSS {readings['rss_bytes'] / 2**20:.0f} MiB" if "rss_bytes" in readings else "—"
    return util, memory
