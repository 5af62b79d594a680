"""What a session keeps of each step and figured from it as it arrived (``ddpwatch.ingest.step_store``)."""

from __future__ import annotations

from msgspec.structs import replace

import pytest

from ddpwatch.figures.compact_steps import PackedSpans
from ddpwatch.ingest.all_reduce_groups import AllReduceGroups
from ddpwatch.ingest.rank_liveness import RankLiveness
from ddpwatch.ingest.step_store import MIN_DETAIL_STEPS, StepStore, prepare_report
from instrumented_ddp.wire.step_figures import call_times, summarize
from synthetic_session import hello, step_report, waiting_ranks


def two_rank_store(keep_steps: int | None = None, detail_rank_steps: int | None = None) -> tuple[StepStore, RankLiveness]:
    liveness = RankLiveness()
    for rank in (0, 1):
        liveness.note_hello(liveness.ranks[rank], hello(rank))
    return StepStore(liveness, AllReduceGroups(liveness), keep_steps, detail_rank_steps), liveness


def test_a_kept_report_holds_its_spans_packed_and_its_figures_for_this_world() -> None:
    store, _ = two_rank_store()
    report = step_report(0, 1, "simple")
    kept = store.keep(report, prepare_report(report, 8))  # figured for another world: figured again
    assert isinstance(kept.spans, PackedSpans) and kept.spans == report.spans
    assert store.reports[1][0] is kept
    assert store.step_figures(1)[0] == prepare_report(report, 2).figures
    assert store.step_calls(1)[0] == call_times(report) and store.step_times(1)[0] == prepare_report(report, 2).figures.times


def test_an_unresolved_report_keeps_its_calls_for_the_timeline_but_enters_no_figure() -> None:
    store, _ = two_rank_store()
    store.keep(step_report(0, 1, "simple"))
    store.keep(replace(step_report(1, 1, "simple"), unresolved=True))
    assert sorted(store.step_calls(1)) == [0, 1]
    assert sorted(store.step_figures(1)) == [0] and sorted(store.counted_calls(1)) == [0]


def test_the_waits_of_a_step_say_who_waited_for_whom() -> None:
    """Rank 1 joins each step's first all-reduce 30 ms before rank 0: it waits 30 ms for rank 0."""
    store, _ = two_rank_store()
    late_first = waiting_ranks(30.0)
    for rank in (0, 1):
        store.keep(late_first(step_report(rank, 1, "simple")))
    waited, waited_for = store.step_waits(1)
    assert waited == pytest.approx({0: 0.0, 1: 30.0}) and waited_for == pytest.approx({0: 30.0, 1: 0.0})


def test_past_keep_steps_the_oldest_step_is_handed_out_to_be_forgotten_whole() -> None:
    store, _ = two_rank_store(keep_steps=2)
    for step in (1, 2):
        store.keep(step_report(0, step, "simple"))
    assert store.step_past_keeping() is None
    store.keep(step_report(0, 3, "simple"))
    assert store.step_past_keeping() == 1
    store.forget_step(1)
    assert store.step_past_keeping() is None and sorted(store.reports) == [2, 3]
    assert not store.step_figures(1) and not store.step_calls(1) and not store.step_times(1)


def test_a_folded_steps_details_are_forgotten_past_the_window_its_figures_and_waits_kept() -> None:
    """Two ranks, one report's worth of details: the minimum of 8 steps keep theirs, the oldest 2
    of 10 lose spans, durations and bandwidths; their waits, made first, stay."""
    store, _ = two_rank_store(detail_rank_steps=1)
    for step in range(1, MIN_DETAIL_STEPS + 3):
        for rank in (0, 1):
            store.keep(step_report(rank, step, "simple"))
    waits = store.step_waits(1)
    store.forget_old_details(lambda step: step != 10)  # every step but the newest folded
    assert [store.has_spans(step, 0) for step in (1, 2, 3)] == [False, False, True]
    assert not store.step_calls(2) and store.step_calls(3)
    assert store.step_waits(1) == waits
    assert len(store.step_figures(1)[0].algbw_gbps) == 0 and len(store.step_figures(3)[0].algbw_gbps) == 4


def test_spans_sent_after_their_summary_fill_the_kept_report_unless_its_step_was_forgotten() -> None:
    store, liveness = two_rank_store(keep_steps=1)
    for step in (1, 2):
        summary = summarize(step_report(0, step, "bucket"), 2)
        liveness.ranks[0].note_report(summary, folded=False)
        store.keep(summary)
        if store.step_past_keeping() is not None:
            store.forget_step(1)
    assert not store.has_spans(2, 0)
    assert store.keep_spans(step_report(0, 2, "bucket"))
    liveness.ranks[0].detailed.add(2)
    assert store.has_spans(2, 0) and store.reports[2][0].spans == step_report(0, 2, "bucket").spans
    assert not store.keep_spans(step_report(0, 1, "bucket"))  # forgotten: nothing to fill


def test_the_latest_complete_step_is_the_newest_every_rank_reported() -> None:
    store, _ = two_rank_store()
    assert store.latest_complete_step() is None
    for rank, step in ((0, 1), (1, 1), (0, 2), (1, 2), (0, 3)):
        store.keep(step_report(rank, step, "simple"))
    assert store.latest_complete_step() == 2
