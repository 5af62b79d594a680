"""Steps placed in their segments and folded into the segments' figures (``ddpwatch.ingest.segment_folding``)."""

from __future__ import annotations

from msgspec.structs import replace

import pytest

from ddpwatch.figures.compute_slowdown import BackwardBeside
from ddpwatch.ingest.all_reduce_groups import AllReduceGroups
from ddpwatch.ingest.rank_liveness import RankLiveness
from ddpwatch.ingest.segment_folding import FOLD_LAG, SEGMENT_GAP_STEPS, SegmentFolding
from ddpwatch.ingest.step_store import StepStore
from instrumented_ddp.wire.messages import Span, StepReport
from synthetic_session import hello, step_report


class Folding:
    """A step store and its folding over ranks 0 and 1, heard from (their hellos too, unless ``hellos=False``)."""

    def __init__(self, hellos: bool = True) -> None:
        self.liveness = RankLiveness()
        for rank in (0, 1):
            state = self.liveness.ranks[rank]  # heard from
            if hellos:
                self.liveness.note_hello(state, hello(rank))
        groups = AllReduceGroups(self.liveness)
        self.store = StepStore(self.liveness, groups)
        self.folding = SegmentFolding(self.store, self.liveness, groups)

    def add(self, report: StepReport) -> None:
        self.folding.add(self.store.keep(report))

    def spans(self) -> list[tuple[str, int, int]]:
        return [(s.strategy, s.first_step, s.last_step) for s in self.folding.segments]


def test_a_step_is_folded_once_every_rank_reported_it_and_pending_until_then() -> None:
    run = Folding()
    run.add(step_report(0, 1, "simple"))
    (segment,) = run.folding.segments
    assert not run.folding.is_folded(1) and segment.folded is None
    assert run.folding.segment_figures(segment).per_rank.keys() == {0}  # pending steps counted by default
    run.add(step_report(1, 1, "simple"))
    assert run.folding.is_folded(1) and segment.folded_records == 2
    assert run.folding.segment_figures(segment, include_pending=False).steps == 1


def test_a_step_still_missing_a_rank_is_folded_once_it_is_the_fold_lag_behind_the_newest() -> None:
    run = Folding()
    for step in range(1, FOLD_LAG + 2):
        run.add(step_report(0, step, "simple"))  # rank 1 never reports
    assert run.folding.is_folded(1) and not run.folding.is_folded(2)  # step 1 is FOLD_LAG behind the newest


def test_before_any_hello_only_age_folds_a_step() -> None:
    run = Folding(hellos=False)
    for rank in (0, 1):
        run.add(step_report(rank, 1, "simple"))
    assert not run.folding.is_folded(1)  # every rank heard may not be every rank
    run.add(step_report(0, 1 + FOLD_LAG, "simple"))
    assert run.folding.is_folded(1)


def test_a_segment_grows_over_a_few_missing_steps_and_back_by_one_and_another_strategy_splits_it() -> None:
    run = Folding()
    run.add(step_report(0, 3, "simple"))
    run.add(step_report(0, 4 + SEGMENT_GAP_STEPS, "simple"))  # steps 4 to 7 missing: the same segment
    run.add(step_report(0, 2, "simple"))  # the step before its first
    assert run.spans() == [("simple", 2, 4 + SEGMENT_GAP_STEPS)]
    run.add(step_report(0, 6 + 2 * SEGMENT_GAP_STEPS, "simple"))  # 5 steps missing: another segment may lie there
    run.add(step_report(1, 5, "bucket"))  # another strategy's step inside the first
    assert run.spans() == [("simple", 2, 8), ("bucket", 5, 5), ("simple", 14, 14)]
    assert [s.index for s in run.folding.segments] == [0, 1, 2] and run.folding.segment_of(5) is run.folding.segments[0]


def test_the_same_strategy_under_other_settings_is_another_segment() -> None:
    run = Folding()
    run.add(step_report(0, 1, "bucket"))
    run.add(replace(step_report(0, 2, "bucket"), settings={"bucket_mb": 4.0, "grad_accum": 1}))
    assert [s.label for s in run.folding.segments] == ["bucket (bucket_mb=1.0, grad_accum=1)", "bucket (bucket_mb=4.0, grad_accum=1)"]


def test_a_folded_bucketed_step_is_remembered_for_the_advisor_a_simple_one_is_not() -> None:
    """Rank 0's bucket step: forward 40 ms, backward from its start to the last gradient-ready
    mark 65 ms (45 to 110 ms into the step), bucket b0's all-reduce 30 ms of it (80 to 110 ms)."""
    def with_ready_marks(report: StepReport) -> StepReport:
        t0 = report.start
        return replace(report, spans=[*report.spans, Span("ready", t0 + 0.07, t0 + 0.07), Span("ready", t0 + 0.11, t0 + 0.11)])

    run = Folding()
    for strategy, step in (("simple", 1), ("bucket", 2)):
        for rank in (0, 1):
            run.add(with_ready_marks(step_report(rank, step, strategy)))
    (points,) = run.folding.slowdown_memory.by_segment()  # the bucket segment's, index 1
    assert points == [BackwardBeside(pytest.approx(0.040), pytest.approx(0.065), pytest.approx(0.030))]  # type: ignore[arg-type]
    assert run.folding.segment_reports(run.folding.segments[1]) == [run.store.reports[2][0], run.store.reports[2][1]]
