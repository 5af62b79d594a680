"""The steps a note names, counted as their reports arrive (``ddpwatch.ingest.notable_steps``)."""

from __future__ import annotations

from msgspec.structs import replace

from ddpwatch.ingest.notable_steps import CountedSteps, NotableSteps
from synthetic_session import step_report


def test_each_kind_of_notable_step_is_kept_as_runs_of_steps_over_every_rank() -> None:
    notable = NotableSteps()
    for rank, step, edits in ((0, 3, {"update_skipped": True}), (1, 4, {"update_skipped": True}),
                              (0, 1, {"compiling": True, "excluded": True}), (1, 1, {"compiling": True, "excluded": True}),
                              (0, 6, {}), (1, 6, {"nograd_forwards": 2})):
        notable.note(replace(step_report(rank, step, "simple"), **edits))
    assert notable.skipped_updates.ranges() == [(3, 4)]
    assert notable.compiling_steps.ranges() == [(1, 1)]
    assert (notable.nograd_forwards.steps.ranges(), notable.nograd_forwards.most) == ([(6, 6)], 2)
    assert not notable.paused_steps and not notable.untimed_collectives.steps and not notable.early_reductions


def test_untimed_collectives_keep_their_steps_and_the_most_of_one_rank_in_one_step() -> None:
    notable = NotableSteps()
    for rank, step, untimed, in_data in ((0, 2, 3, 0), (1, 2, 5, 1), (0, 3, 0, 0), (0, 4, 1, 1)):
        notable.note(replace(step_report(rank, step, "simple"), untimed_collectives=untimed, untimed_in_data=in_data))
    assert (notable.untimed_collectives.steps.ranges(), notable.untimed_collectives.most) == ([(2, 2), (4, 4)], 5)
    assert (notable.untimed_in_data.steps.ranges(), notable.untimed_in_data.most) == ([(2, 2), (4, 4)], 1)


def test_pauses_keep_their_steps_what_they_were_for_in_the_order_first_heard_and_the_longest() -> None:
    notable = NotableSteps()
    for step, seconds, what in ((5, 2.5, "evaluate"), (10, 0.0, "save"), (15, 4.0, "evaluate, save"), (16, 0.0, "")):
        notable.note(replace(step_report(0, step, "simple"), paused_s=seconds, paused_for=what))
    assert notable.paused_steps.ranges() == [(5, 5), (10, 10), (15, 15)]  # a pause said without its length counts
    assert (list(notable.paused_for), notable.paused_longest_s) == (["evaluate", "save"], 4.0)


def test_counted_steps_leave_out_a_count_of_none() -> None:
    counted = CountedSteps()
    counted.note(7, 0)
    assert not counted.steps and counted.most == 0
    counted.note(8, 4)
    counted.note(9, 2)
    assert (counted.steps.ranges(), counted.most) == ([(8, 9)], 4)
