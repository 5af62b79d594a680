"""The step reports a session keeps, and what was figured from each as it arrived: every rank's
figures, its collectives' times, its window, and each step's cross-rank waits.

Figured once a report (the fold, the ranks table and the exports all ask), kept while the step
is: with ``keep_steps`` (the dashboard) only that many recent steps, without it (the recorder)
every step. With ``detail_rank_steps`` as well, a folded step's details (its spans, each
all-reduce's duration, each call's bandwidth) are kept for only that many reports' worth of
recent steps (at least ``MIN_DETAIL_STEPS``); its figures, window and waits stay for all
``keep_steps``: a job of many ranks issuing many all-reduces a step would otherwise hold
gigabytes of them. A step pinned later gets its spans back from the ranks.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque
from collections.abc import Callable
from typing import NamedTuple

from msgspec.structs import replace

from ddpwatch.figures.compact_steps import NO_SPANS, PackedSpans, TagSequences
from ddpwatch.figures.cost_model import StepCollectives, call_sizes
from ddpwatch.figures.cross_rank import step_waits
from ddpwatch.ingest.all_reduce_groups import AllReduceGroups
from ddpwatch.ingest.rank_liveness import RankLiveness
from instrumented_ddp.wire.messages import StepReport, StepSummary
from instrumented_ddp.wire.step_figures import (
    NO_CALLS,
    CallTimes,
    StepFigures,
    StepTimes,
    call_times,
    counted,
    figures_and_calls,
    float_array,
    report_without_spans,
    summary_calls,
    summary_figures,
)

MIN_DETAIL_STEPS = 8  # steps whose details a store with ``detail_rank_steps`` keeps, however many ranks

NO_FLOATS = float_array(())


class PreparedReport(NamedTuple):
    """What the session figures from a step report before it folds it in: the rank's figures,
    its collectives' times, and the report as kept (spans packed; a summary's none). Pure, so a
    receiver process can figure it off the UI's core (``dashboard/process_feed.py``)."""

    figures: StepFigures
    calls: CallTimes
    report: StepReport
    world_size: int  # the world it was figured for: a session of another size figures again


def prepare_report(message: StepReport | StepSummary, world_size: int) -> PreparedReport:
    """A summary comes figured by its rank (the same ``step_figures`` code); a full report is
    figured here, while its spans are still ``Span`` objects (packed, each reading makes them again)."""
    if isinstance(message, StepSummary):
        calls = summary_calls(message)
        figures, report = summary_figures(message, calls), report_without_spans(message)
    else:
        (figures, calls), report = figures_and_calls(message, world_size), message
    spans = PackedSpans(report.spans) if len(report.spans) else NO_SPANS  # one object for every summary's none
    return PreparedReport(figures, calls, replace(report, spans=spans), world_size)


class StepStore:
    """Kept steps' reports (``reports``: step -> rank -> report) and their figures, by step."""

    def __init__(self, liveness: RankLiveness, groups: AllReduceGroups, keep_steps: int | None = None,
                 detail_rank_steps: int | None = None) -> None:
        self._liveness = liveness
        self._groups = groups
        self.keep_steps = keep_steps
        self.detail_rank_steps = detail_rank_steps
        self.reports: dict[int, dict[int, StepReport]] = defaultdict(dict)
        self._figures: dict[int, dict[int, StepFigures]] = {}  # step -> rank -> figures
        self._calls: dict[int, dict[int, CallTimes]] = {}  # step -> rank -> all-reduces
        self._times: dict[int, dict[int, StepTimes]] = {}  # step -> rank -> window and anchor
        self._waits: dict[int, tuple[int, dict[int, float], dict[int, float]]] = {}  # step -> (reports, waited, waited for)
        self._detail_steps: deque[int] = deque()  # kept steps whose details are kept, in arrival order
        self._details_forgotten: set[int] = set()
        self._tag_sequences = TagSequences()

    # -- keeping ---------------------------------------------------------------------------------
    def keep(self, message: StepReport | StepSummary, prepared: PreparedReport | None = None) -> StepReport:
        """Keep a report and its figures (``prepared``, where figured for this world size), and
        return the report as kept. A report that enters no figure keeps none: the ranks table
        shows a dash for it. A full report is figured for a world size (bandwidths); a summary
        came figured by its rank."""
        world = self._liveness.world_size
        if prepared is None or (prepared.world_size != world and isinstance(message, StepReport)):
            prepared = prepare_report(message, world)
        figures, calls, report = prepared.figures, prepared.calls, prepared.report
        if counted(message):
            self._figures.setdefault(message.step, {})[message.rank] = figures
        if report.step not in self._calls and self.detail_rank_steps is not None:
            self._detail_steps.append(report.step)
        self._calls.setdefault(report.step, {})[report.rank] = calls._replace(tags=self._tag_sequences.shared(calls.tags))
        self._times.setdefault(report.step, {})[report.rank] = figures.times
        self.reports[report.step][report.rank] = report
        return report

    def keep_spans(self, report: StepReport, prepared: PreparedReport | None = None) -> bool:
        """Put a summarized step's spans in its kept report; its figures stay as the summary gave
        them (equal by construction: one ``step_figures``). False where the store forgot the step."""
        kept = self.reports.get(report.step, {})
        if report.rank not in kept:
            return False
        kept[report.rank] = prepared.report if prepared is not None else replace(report, spans=PackedSpans(report.spans))
        if report.step in self._details_forgotten:  # pinned after its details were forgotten
            self._calls.setdefault(report.step, {})[report.rank] = call_times(report)
        return True

    def step_past_keeping(self) -> int | None:
        """The oldest step, while the store holds more than ``keep_steps``; else None."""
        return min(self.reports) if self.keep_steps is not None and len(self.reports) > self.keep_steps else None

    def forget_step(self, step: int) -> None:
        self.reports.pop(step, None)
        self._figures.pop(step, None)
        self._calls.pop(step, None)
        self._times.pop(step, None)
        self._waits.pop(step, None)
        self._details_forgotten.discard(step)

    def forget_old_details(self, is_folded: Callable[[int], bool]) -> None:
        """Forget the details of the oldest folded steps past ``detail_rank_steps`` reports' worth."""
        if self.detail_rank_steps is None:  # then nothing is queued in ``_detail_steps``
            return
        keep = max(MIN_DETAIL_STEPS, self.detail_rank_steps // max(self._liveness.world_size, 1))
        while len(self._detail_steps) > keep and is_folded(self._detail_steps[0]):
            self._forget_details(self._detail_steps.popleft())

    def _forget_details(self, step: int) -> None:
        """Drop a folded step's spans, durations and bandwidths; its waits are made first."""
        if step not in self.reports:  # forgotten whole already (``keep_steps``)
            return
        self.step_waits(step)
        self._calls.pop(step, None)
        self._details_forgotten.add(step)
        kept = self.reports[step]
        for rank, report in kept.items():
            if len(report.spans):
                kept[rank] = replace(report, spans=NO_SPANS)
        figures = self._figures.get(step, {})
        for rank, f in figures.items():
            if len(f.algbw_gbps) or f.other_algbw_gbps or f.sharded_calls.tags:
                figures[rank] = dataclasses.replace(f, algbw_gbps=NO_FLOATS, other_algbw_gbps={}, sharded_calls=NO_CALLS)

    # -- reading ---------------------------------------------------------------------------------
    def step_figures(self, step: int) -> dict[int, StepFigures]:
        """Each rank's figures for a kept step, computed once as its report arrived; reports that
        are not ``step_figures.counted`` have none."""
        return self._figures.get(step, {})

    def step_times(self, step: int) -> dict[int, StepTimes]:
        """A kept step's windows and alignment anchors of every report, by rank (a summary's too)."""
        return self._times.get(step, {})

    def step_calls(self, step: int) -> dict[int, CallTimes]:
        """A kept step's all-reduces of every report, counted or not (the timeline draws both)."""
        return self._calls.get(step, {})

    def counted_calls(self, step: int) -> dict[int, CallTimes]:
        """A kept step's all-reduces (``step_figures.call_times``) of the reports that may enter a
        figure, by rank: what waits, the straggler and a desync are judged from."""
        figured, calls = self._figures.get(step, {}), self._calls.get(step, {})
        return {rank: calls[rank] for rank in figured if rank in calls}

    def step_waits(self, step: int) -> tuple[dict[int, float], dict[int, float]]:
        """``cross_rank.step_waits`` of a kept step's counted calls: how long each rank waited
        for others, and how long the others waited for it. Made once per set of reports (a pass
        over every rank's calls), and kept after the step's calls are forgotten."""
        seen = len(self.reports.get(step, {}))
        cached = self._waits.get(step)
        if cached is None or (cached[0] != seen and step in self._calls):
            counted = self.counted_calls(step)
            cached = (seen, *step_waits(counted, self.step_figures(step), self._groups.groups()))
            if step in self.reports:
                self._waits[step] = cached
        return cached[1], cached[2]

    def step_collectives(self, step: int) -> StepCollectives:
        """A kept step's all-reduces as the cost model reads them: the durations figured as each
        report or summary arrived (``counted_calls``: no span read again), and the sizes from the
        first counted report held in full. Above 64 ranks the dashboard asks most ranks for
        summaries only: durations read from spans would count only the steps every rank sent whole."""
        calls = self.counted_calls(step)
        sized = next((report for rank, report in self.reports.get(step, {}).items() if rank in calls and len(report.spans)), None)
        return StepCollectives(calls, call_sizes(sized) if sized is not None else {})

    def has_spans(self, step: int, rank: int) -> bool:
        """Whether the kept report holds its spans (sent in full, or asked for after its summary,
        and not forgotten since)."""
        report = self.reports.get(step, {}).get(rank)
        if report is None or (step in self._details_forgotten and not len(report.spans)):
            return False
        ranks = self._liveness.ranks
        return rank not in ranks or step not in ranks[rank].summarized or step in ranks[rank].detailed

    def latest_complete_step(self) -> int | None:
        """The newest step every live rank has reported."""
        expected = self._liveness.world_size
        for step in sorted(self.reports, reverse=True):
            if len(self.reports[step]) >= expected:
                return step
        return None
