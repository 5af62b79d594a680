"""What the dashboard shows, computed from a ``Session`` without any UI.

The app folds messages into the session and, ten times a second, asks ``SnapshotBuilder`` for a
``Snapshot`` (``snapshot_parts``); widgets only draw it. Segment figures of finished segments are
cached and the running one is recomputed at most once a second, so a long run does not slow the
frame rate. The header's part is made by ``header_builder``, the per-rank parts by ``rank_parts``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from ddpwatch.advisor.advice import Advice, advice_for_session, keep_shown_best
from ddpwatch.advisor.strategy_advice import StrategyAdvice, strategy_advice
from ddpwatch.dashboard.views.header_builder import HeaderBuilder
from ddpwatch.dashboard.views.heatmap import Heatmap, RowLayout, assemble_heatmap, heat_column, row_layout
from ddpwatch.dashboard.views.rank_parts import RankPartsBuilder
from ddpwatch.dashboard.views.snapshot_parts import (ADVICE_REFRESH_S, STRATEGIES_REFRESH_S, HEATMAP_RANK_ROWS_MAX, HEATMAP_REFRESH_S, HEATMAP_STEPS,
                                                     LARGE_JOB_ROWS_REFRESH_S, SEGMENT_REFRESH_S, SMALL_JOB_MAX_RANKS,
                                                     TOP_STRAGGLERS, TREND_POINTS, SegmentRow, Snapshot, StragglerRow,
                                                     segment_notes)
from ddpwatch.dashboard.views.step_digest import StepDigest, digest_of
from ddpwatch.dashboard.views.timeline_lanes import TimelineData, pick_timeline_ranks, timeline_of
from ddpwatch.dashboard.views.warning_lines import lost_rank_lines, note_lines, reporting_fault_lines
from ddpwatch.figures.cross_rank import STRAGGLER_STEPS, Desync, DesyncRange, StepWaits, Straggler, find_desync, find_straggler
from ddpwatch.wording.figure_text import busbw_text, held_text, kinds_text
from ddpwatch.wording.stall_text import stall_line
from ddpwatch.ingest.evaluations import MetricSeries
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.segments import Segment
from instrumented_ddp.wire.messages import StepReport


@dataclass
class SnapshotBuilder:
    """Turns the session into a snapshot; keeps the caches that make that cheap.

    Each cache is keyed by a step and the number of reports it had, so a frame recomputes only
    what a new report changed: at 64 ranks a report arrives between almost every two frames.
    """

    session: Session
    memory_budget_mib: float | None = None  # the strategy table's budget a rank (None: the device's memory)
    _segment_rows: dict[int, tuple[float, tuple[Any, ...], SegmentRow]] = field(default_factory=dict)
    _digests: dict[int, StepDigest] = field(default_factory=dict)
    _shown_step: tuple[Any, ...] = ()  # (step, reports, ranks drawn) the timeline and desync below were made from
    _timeline: TimelineData | None = None
    _heatmap_made: tuple[float, Any, Heatmap | None] = (0.0, None, None)  # (made at, (metric, open nodes), grid)
    _heat_layout: tuple[Any, tuple[RowLayout, ...]] = (None, ())  # ((nodes, open nodes), rows)
    _heat_columns: dict[tuple[str, int], tuple[int, tuple[float | None, ...]]] = field(default_factory=dict)  # (metric, step) -> (reports, column)
    _desync: Desync | None = None
    _straggler_made: tuple[Any, Straggler | None] = (None, None)  # (steps it was found over, straggler)
    _advice_made: tuple[float, Any, Advice | str | None] = (-1.0, None, None)  # (made at, (steps, segments), advice)
    _strategies_made: tuple[float, Any, StrategyAdvice | str | None] = (-1.0, None, None)  # the same, for the strategy table
    _timeline_roles: tuple[Any, tuple[tuple[int, str], ...]] = (None, ())  # ((step, figures, selected), timeline ranks)
    _warnings_made: tuple[float, int | None, tuple[tuple[str, ...], tuple[str, ...]]] = (-math.inf, None, ((), ()))  # (made at, step, (warnings, notes))
    _evaluations_made: tuple[int, tuple[MetricSeries, ...]] = (0, ())  # (changes, series)
    _header: HeaderBuilder = field(init=False)
    _rank_parts: RankPartsBuilder = field(init=False)

    def __post_init__(self) -> None:
        self._header = HeaderBuilder(self.session)
        self._rank_parts = RankPartsBuilder(self.session)

    def waits_of(self, step: int | None) -> dict[int, float]:
        """Cross-rank waits of a step's counted reports (the straggler check looks at the last
        ten steps every frame): see ``Session.step_waits``."""
        return self._waits_both_ways(step)[0]

    def _waits_both_ways(self, step: int | None) -> tuple[dict[int, float], dict[int, float]]:
        return self.session.step_waits(step) if step is not None else ({}, {})

    def _with_spans(self, step: int, reports: dict[int, StepReport]) -> dict[int, StepReport]:
        """The step's reports that hold spans: a rank that sent only its summary has none to draw."""
        return {rank: report for rank, report in reports.items() if self.session.has_spans(step, rank)}

    def digest(self, step: int) -> StepDigest:
        """One kept step's digest, remade only when the step got another report."""
        reports = self.session.reports[step]
        cached = self._digests.get(step)
        if cached is None or cached.seen != len(reports):
            cached = self._digests[step] = digest_of(step, reports, self.session.step_figures(step))
        return cached

    def digests(self, steps: list[int]) -> list[StepDigest]:
        """Of the given kept steps, in order; forgets steps the session no longer keeps."""
        out = [self.digest(step) for step in steps]
        if len(self._digests) > len(self.session.reports):
            for old in [s for s in self._digests if s not in self.session.reports]:
                del self._digests[old]
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
        ``HEATMAP_RANK_ROWS_MAX`` ranks starts with one row per node); ``selected_rank``: drawn in
        the timeline of a job too large to draw every rank; ``side_tab``: the side
        panel's tab on screen ("devices", "trends", "heatmap", "stragglers" or "advisor"), the
        others' parts left empty (None: all made). In a large job the device series and the
        heatmap cost more than the rest of the snapshot together: what is not on screen is not
        made."""
        now = time.monotonic() if now is None else now
        heard = now if heard_now is None else heard_now
        session = self.session
        latest = session.latest_complete_step()
        step = selected_step if selected_step in session.reports else latest
        reports = session.reports.get(step, {}) if step is not None else {}
        waits = self.waits_of(step)
        figures = session.step_figures(step) if step is not None else {}
        roles = self.timeline_ranks(step, selected_rank) if len(reports) > SMALL_JOB_MAX_RANKS else None
        if (step, len(reports), roles, session.details) != self._shown_step:
            self._shown_step = (step, len(reports), roles, session.details)
            self._timeline = timeline_of(step, self._with_spans(step, reports), session.step_calls(step),
                                         session.step_times(step), roles, session.all_reduce_groups(),
                                         {rank: f.sharded_calls for rank, f in figures.items()}) if step is not None and reports else None
            self._desync = find_desync(session.counted_calls(step), step,  # type: ignore[arg-type]
                                       {rank: f.calls_by_kind for rank, f in figures.items()}) if reports else None
        trend = self.digests(sorted(session.reports)[-TREND_POINTS:])
        warnings, notes = self._warnings_and_notes(step, now, heard, recording_ended)
        segments = tuple(self._segment_row(segment, now) for segment in session.segments)
        if not recording_ended:  # a run heard to its end is over: its last stall is what the recording holds
            session.stall_watch.look(heard)
        stall = session.stall_watch.current
        stalled_s = stall.duration_s(heard) if stall is not None else None
        header = self._header.header(step, selected_step is None or selected_step == latest, trend, now)
        return Snapshot(
            header=replace(header, stalled_s=stalled_s) if stalled_s is not None else header,
            timeline=self._timeline,
            ranks=self._rank_parts.rows(step, figures, waits, open_nodes, now, heard, recording_ended),
            devices=self._rank_parts.device_series(now) if side_tab in (None, "devices") else (),
            loss=tuple(s.loss for s in trend if s.loss is not None),
            step_ms=tuple(s.step_ms for s in trend if s.ranks),
            segments=segments,
            warnings=warnings,
            notes=notes + segment_notes(segments),
            heatmap=self._heatmap(heatmap_metric, open_nodes, now) if side_tab in (None, "heatmap") else None,
            stragglers=self._top_stragglers(step) if side_tab in (None, "stragglers") else (),
            advice=self.advice(now) if side_tab in (None, "advisor") else None,
            strategies=self.strategies(now) if side_tab in (None, "advisor") else None,
            evaluations=self._evaluation_series() if side_tab in (None, "trends") else (),
            stall=stall.as_dict() if stall is not None else None,
            stall_text=stall_line(stall.as_dict(), stalled_s) if stall is not None and stalled_s is not None else "",
        )

    def _evaluation_series(self) -> tuple[MetricSeries, ...]:
        """Made again only when an evaluation was kept (a run evaluates every few hundred steps)."""
        evaluations = self.session.evaluations
        if self._evaluations_made[0] != evaluations.changes:
            self._evaluations_made = (evaluations.changes, tuple(evaluations.series()))
        return self._evaluations_made[1]

    def timeline_ranks(self, step: int | None, selected_rank: int | None) -> tuple[tuple[int, str], ...]:
        """``pick_timeline_ranks`` of a kept step, made again when the step gains a figure or
        the selection changes (the frame and the span wish both ask, and a pass reads every rank)."""
        figures = self.session.step_figures(step) if step is not None else {}
        key = (step, len(figures), selected_rank)
        if self._timeline_roles[0] != key:
            self._timeline_roles = (key, pick_timeline_ranks(figures, selected_rank))
        return self._timeline_roles[1]

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

    def strategies(self, now: float) -> StrategyAdvice | str:
        """The strategy table at the run's K, remade at most every ``STRATEGIES_REFRESH_S`` and only
        when a step or segment came since."""
        made_at, made_from, table = self._strategies_made
        wanted = (self.session.latest_complete_step(), len(self.session.segments))
        if table is None or (wanted != made_from and now - made_at >= STRATEGIES_REFRESH_S):
            segment = self.session.segments[-1] if self.session.segments else None
            k = int(segment.settings.get("grad_accum") or 1) if segment is not None else 1
            earlier = table.costs if isinstance(table, StrategyAdvice) else None
            try:
                table = strategy_advice(self.session, grad_accums=(k,), budget_mib=self.memory_budget_mib, earlier_costs=earlier)
            except (ValueError, ZeroDivisionError) as error:  # a figure the model cannot take: said, never a crash
                table = f"no strategy table: {error}"
            self._strategies_made = (now, wanted, table)
        return table

    # -- parts -------------------------------------------------------------------------------------
    def _heatmap(self, metric: str, open_nodes: Collection[int], now: float) -> Heatmap | None:
        """Remade at most once a second, at once when the user switches the metric or opens or
        closes a node. A step's column is kept until that step gains a report or the rows
        change: a column is a cell per row, the whole grid ``HEATMAP_STEPS`` times that."""
        session = self.session
        if not session.ranks:
            return None
        made_at, made_for, grid = self._heatmap_made
        wanted = (metric, frozenset(open_nodes))
        if grid is not None and made_for == wanted and now - made_at < HEATMAP_REFRESH_S:
            return grid
        steps = sorted(session.reports)[-HEATMAP_STEPS:]
        node_of = self._node_of()
        expanded = None if len(node_of) <= HEATMAP_RANK_ROWS_MAX else open_nodes
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
                         kinds_text(f.calls_by_kind), held_text(f.memory),
                         busbw_text(f.busbw_gbps, f.other_busbw_gbps), f.data_wait_pct,
                         self._untimed_in_data_most(segment), f.loop_compute_ms, f.loop_computed,
                         tuple(self.session.segment_data_wait_by_rank(segment).items()))
        self._segment_rows[segment.index] = (now, key, row)
        return row

    def _warnings_and_notes(self, step: int | None, now: float, heard: float,
                            recording_ended: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """A large job's made at most every ``LARGE_JOB_ROWS_REFRESH_S`` (and at once for another
        step): each is a few passes over every rank, and a large job's change seldom."""
        made_at, made_for, kept = self._warnings_made
        if made_for == step and now - made_at < LARGE_JOB_ROWS_REFRESH_S and len(self.session.ranks) > SMALL_JOB_MAX_RANKS:
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

    def _desync_range(self, step: int | None) -> DesyncRange | None:
        """Every desynchronised step folded so far, plus the shown step's if it is not folded yet:
        the error stays on screen until the run ends, wherever the timeline is."""
        pending = self._desync if self._desync is not None and step is not None and not self.session.is_folded(step) else None
        return DesyncRange.combine([self.session.desync_range(),
                                    DesyncRange.of(pending) if pending is not None else None])

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
            if (step is None or s <= step) and self.digest(s).ranks >= world:
                complete.append(s)
                if len(complete) == STRAGGLER_STEPS:
                    break
        return complete

    def _straggler(self, step: int | None) -> Straggler | None:
        """``metrics.find_straggler`` over the last complete steps up to the shown one: the rule
        the exports' straggler_rank follows too. Found once per set of steps: a complete step's
        waits are final."""
        steps = tuple(self._recent_complete_steps(step))
        if self._straggler_made[0] != steps:
            found = find_straggler((StepWaits(s, self.waits_of(s), 1000 * self.digest(s).wall_s) for s in steps),
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
        wall_ms = sum(1000 * self.digest(s).wall_s for s in steps)
        top = sorted((rank for rank, waited in totals.items() if waited > 0), key=lambda r: (-totals[r], r))[:count]
        nodes = self._node_of()
        named = self._straggler(step)
        return tuple(StragglerRow(rank, nodes.get(rank, 0), totals[rank] / len(steps),
                                  100 * totals[rank] / wall_ms if wall_ms > 0 else 0.0, min(steps), max(steps),
                                  own.get(rank, 0.0) / len(steps), named is not None and named.rank == rank)
                     for rank in top)

