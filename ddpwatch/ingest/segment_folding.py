"""Steps placed in their segments and folded into each segment's running figures.

A step is folded as soon as every rank has reported it, or once it is ``FOLD_LAG`` steps behind
the newest (a rank that died), so a segment's figures cost O(ranks), not O(steps), and stay once
the step store forgets the step's reports.
"""

from __future__ import annotations

import bisect

from ddpwatch.figures.compact_steps import StepSet
from ddpwatch.figures.compute_slowdown import MEASURED_STRATEGIES, SlowdownMemory, backward_beside
from ddpwatch.figures.cost_model import TransferMemory
from ddpwatch.figures.cross_rank import DesyncRange
from ddpwatch.figures.metrics import SegmentAccumulator, SegmentFigures
from ddpwatch.ingest.all_reduce_groups import AllReduceGroups
from ddpwatch.ingest.rank_liveness import RankLiveness
from ddpwatch.ingest.segments import Segment
from ddpwatch.ingest.step_store import StepStore
from instrumented_ddp.wire.messages import StepReport
from instrumented_ddp.wire.step_figures import counted

FOLD_LAG = 20  # a step still missing a rank this far behind the newest is folded as it is
#: A segment extends across at most this many steps no report has come for yet (a rank's dropped
#: ones): further, the gap may hold another strategy's steps, whose reports are still to come.
SEGMENT_GAP_STEPS = 4


class SegmentFolding:
    """The run's segments, in step order, and which kept steps are folded into their figures."""

    def __init__(self, store: StepStore, liveness: RankLiveness, groups: AllReduceGroups) -> None:
        self._store = store
        self._liveness = liveness
        self._groups = groups
        self.segments: list[Segment] = []
        self._unfolded: list[int] = []  # kept steps not folded yet, oldest first
        self._folded_steps = StepSet()  # in runs: a set of every step grew with the run
        self.transfer_memory = TransferMemory()  # the advisor's transfers of sizes its recent steps lack
        self.slowdown_memory = SlowdownMemory()  # each bucketed segment's backward beside its all-reduces

    # -- folding ---------------------------------------------------------------------------------
    def add(self, report: StepReport) -> None:
        """A report just kept, of a step not folded yet: its step waits for its fold, the report
        is placed in its segment, and every step now finished is folded."""
        index = bisect.bisect_left(self._unfolded, report.step)
        if index == len(self._unfolded) or self._unfolded[index] != report.step:  # the step's first report
            self._unfolded.insert(index, report.step)
        self._place_unless_placed(report)
        self._fold_finished_steps(report.step)

    def add_unwatched(self, report: StepReport) -> None:
        """An unwatched step's report, in no figure: its step is placed in its segment all the
        same, so that the segment spans the steps its strategy ran, and a counted one's samples
        are the segment's (``SegmentAccumulator.add_unwatched``)."""
        self._place_unless_placed(report)
        segment = self.segment_of(report.step)
        if segment is None or not counted(report):
            return
        if segment.folded is None:
            segment.folded = SegmentAccumulator(self._liveness.world_size, self._groups.groups())
        segment.folded.add_unwatched(report.rank, report.samples, report.tokens)

    def _place_unless_placed(self, report: StepReport) -> None:
        if not any(segment.holds(report.step) and segment.runs(report) for segment in self.segments):
            self._place_in_segment(report)

    def _place_in_segment(self, report: StepReport) -> None:
        """Extend the neighbouring segment with the same settings, or start a new one. The one
        before the step extends across steps no report has come for yet, where no segment lies
        between, up to ``SEGMENT_GAP_STEPS``: a rank's report dropped (its sender's queue full) or
        still on its way while another rank's next one came leaves the segment whole, figured
        from all of its steps (one row of the strategy in summary.md)."""
        step = report.step
        before = max((s for s in self.segments if s.last_step < step), key=lambda s: s.last_step, default=None)
        holding = any(s.holds(step) for s in self.segments)
        if before is not None and before.runs(report) and not holding and step - before.last_step <= SEGMENT_GAP_STEPS + 1:
            before.last_step = step
            return
        for segment in self.segments:
            if segment.runs(report) and step == segment.first_step - 1:
                segment.first_step = step
                return
        self.segments.append(Segment(0, report.strategy, dict(report.settings), step, step))
        self.segments.sort(key=lambda s: s.first_step)
        for index, segment in enumerate(self.segments):
            segment.index = index

    def _fold_finished_steps(self, newest: int) -> None:
        world = self._liveness.declared_world or 10**9  # before any hello, only age folds a step
        while self._unfolded:
            step = self._unfolded[0]
            if len(self._store.reports.get(step, {})) < world and step > newest - FOLD_LAG:
                return
            self.fold(step)

    def fold(self, step: int) -> None:
        """Fold a kept step into its segment's running figures (once), its transfers into the
        advisor's memory, and, under a measured strategy, its backward beside its all-reduces."""
        if step in self._folded_steps:
            return
        if self._unfolded and self._unfolded[0] == step:
            self._unfolded.pop(0)
        elif step in self._unfolded:
            self._unfolded.remove(step)
        self._folded_steps.add(step)
        store, world, groups = self._store, self._liveness.world_size, self._groups.groups()
        figures = store.step_figures(step)
        segment = self.segment_of(step)
        if segment is not None and figures:
            if segment.folded is None:
                segment.folded = SegmentAccumulator(world, groups)
            else:
                segment.folded.regroup(world, groups)
            segment.folded.add_step(figures, store.counted_calls(step), store.step_waits(step))
        self.transfer_memory.add_step(store.step_collectives(step), world, groups)
        if segment is not None and segment.strategy in MEASURED_STRATEGIES:
            self._remember_backward_beside(step, segment.index)

    def _remember_backward_beside(self, step: int, segment: int) -> None:
        """The step's first rank's forward, backward and how long an all-reduce ran beside that
        backward, for the advisor's compute slowdown (``compute_slowdown``): a few passes over that
        one report's spans, whatever the number of ranks."""
        reports = self._store.reports.get(step, {})
        first = min(reports, default=None)
        if first is None or not counted(reports[first]):
            return
        if (point := backward_beside(reports[first])) is not None:
            self.slowdown_memory.add(segment, point)

    # -- reading ---------------------------------------------------------------------------------
    def is_folded(self, step: int) -> bool:
        """Whether the step is already in its segment's running figures."""
        return step in self._folded_steps

    def segment_of(self, step: int) -> Segment | None:
        return next((s for s in self.segments if s.holds(step)), None)

    def desync_range(self) -> DesyncRange | None:
        """Every desynchronised step folded so far, over all segments: kept until the run ends,
        however long ago the step left the screen."""
        return DesyncRange.combine(s.folded.desync for s in self.segments if s.folded is not None)

    def segment_reports(self, segment: Segment, include_excluded: bool = False) -> list[StepReport]:
        """Kept reports of the segment; ``include_excluded=False``: only those ``step_figures.counted``
        (neither excluded nor unresolved)."""
        reports = self._store.reports
        return [
            report
            for step in range(segment.first_step, segment.last_step + 1)
            for report in reports.get(step, {}).values()
            if include_excluded or counted(report)
        ]

    def segment_figures(self, segment: Segment, include_pending: bool = True,
                        per_rank: bool = True) -> SegmentFigures:
        """Folded steps plus the few still waiting for a rank; the live dashboard leaves those out
        (``include_pending=False``): at 64 ranks there is always one, and adding it costs a copy.
        ``per_rank=False`` leaves ``per_rank`` empty, for a caller that shows only the totals."""
        store = self._store
        pending = [step for step in self._unfolded if segment.holds(step) and store.step_figures(step)] if include_pending else []
        if segment.folded is not None and not pending:
            return segment.folded.figures(per_rank)
        accumulator = (segment.folded.copy() if segment.folded is not None
                       else SegmentAccumulator(self._liveness.world_size, self._groups.groups()))
        for step in pending:
            accumulator.add_step(store.step_figures(step), store.counted_calls(step))
        return accumulator.figures(per_rank)

    def segment_data_wait_by_rank(self, segment: Segment) -> dict[int, float]:
        """Each rank's Data wait% over the segment's folded steps (``segment_figures`` with
        ``include_pending=False``, as the dashboard's rows are made), without the per-rank figures."""
        return segment.folded.data_wait_by_rank() if segment.folded is not None else {}
