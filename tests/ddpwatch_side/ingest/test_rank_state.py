"""What one rank's record counts of its reports and keeps of its samples (``ddpwatch.ingest.rank_state``)."""

from __future__ import annotations

from msgspec.structs import replace

from ddpwatch.ingest.rank_state import DEVICE_SAMPLES_PER_RANK, MIN_DEVICE_SAMPLES, RankState
from instrumented_ddp.wire.messages import DeviceSample
from instrumented_ddp.wire.step_figures import summarize
from synthetic_session import step_report


def test_a_report_more_than_two_steps_behind_the_rank_or_of_a_folded_step_is_late() -> None:
    state = RankState()
    state.last_step = 6  # its heartbeat said so
    state.note_report(step_report(0, 4, "simple"), folded=False)  # 2 behind: reordered, not late
    state.note_report(step_report(0, 3, "simple"), folded=False)  # 3 behind
    state.note_report(step_report(0, 7, "simple"), folded=True)
    assert (state.late, state.late_unused) == (2, 1)
    assert (state.last_reported, state.last_step) == (7, 7)
    assert state.reported.ranges() == [(3, 4), (7, 7)]


def test_unresolved_reports_are_counted_with_the_newest_reason_said() -> None:
    state = RankState()
    state.note_report(replace(step_report(0, 1, "simple"), unresolved=True, unresolved_reason="marks waited 30 s"), folded=False)
    state.note_report(replace(step_report(0, 2, "simple"), unresolved=True), folded=False)  # says no reason
    assert (state.unresolved, state.unresolved_reason) == (2, "marks waited 30 s")


def test_the_memory_kept_is_the_newest_steps_that_measured_it() -> None:
    state = RankState()
    state.note_report(replace(step_report(0, 5, "simple"), memory={"peak": 500}), folded=False)
    state.note_report(replace(step_report(0, 3, "simple"), memory={"peak": 300}), folded=False)  # older, late
    state.note_report(step_report(0, 6, "simple"), folded=False)  # measured nothing
    assert (state.memory, state.memory_step) == ({"peak": 500}, 5)


def test_a_step_summarized_then_sent_whole_is_a_detail_once() -> None:
    state = RankState()
    state.note_report(summarize(step_report(0, 2, "bucket"), 2), folded=False)
    assert 2 in state.summarized and state.is_detail(step_report(0, 2, "bucket"))
    assert not state.is_detail(summarize(step_report(0, 2, "bucket"), 2))
    state.detailed.add(2)
    assert not state.is_detail(step_report(0, 2, "bucket"))


def test_device_samples_kept_are_a_share_of_the_budget_or_the_newest_six_hundred() -> None:
    def sample(i: int) -> DeviceSample:
        return DeviceSample(0, float(i), "cpu", {"process_cpu_pct": float(i)})

    budgeted, unbounded = RankState(), RankState()
    for i in range(30):
        budgeted.add_device_sample(sample(i), 100, 5)  # 100 over 5 ranks: 20 a rank
        unbounded.add_device_sample(sample(i), None, 5)
    assert [s.time for s in budgeted.devices] == [float(i) for i in range(10, 30)] and budgeted.devices_received == 30
    assert len(unbounded.devices) == 30 and unbounded.devices.maxlen == DEVICE_SAMPLES_PER_RANK
    crowded = RankState()
    for i in range(30):
        crowded.add_device_sample(sample(i), 100, 64)  # 1 a rank: at least the minimum
    assert len(crowded.devices) == MIN_DEVICE_SAMPLES
