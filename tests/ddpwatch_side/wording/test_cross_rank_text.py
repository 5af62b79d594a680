"""The straggler's and the desync's sentences (``ddpwatch/wording/cross_rank_text.py``), hand-worked."""

from __future__ import annotations

from ddpwatch.wording.cross_rank_text import counts_text, desync_text, overlapping_groups_text, straggler_text


def test_a_straggler_is_said_with_its_steps_its_wait_a_step_and_its_share() -> None:
    # 12.345 ms a step rounds to 12.3; 40.6 % of the step to 41 %
    assert straggler_text(3, 10, 19, 12.345, 40.6) == (
        "rank 3 is a straggler: over steps 10-19 the others waited 12.3 ms a step for it (41% of step time)")


def test_one_desynchronised_step_names_its_counts_and_a_range_its_first_and_last() -> None:
    assert desync_text(7, 7, 1, "all_reduce", {1: 2, 0: 3}, {1: 2, 0: 3}) == (
        "DESYNC at step 7: the ranks issued different all-reduce counts (rank 0: 3, rank 1: 2)")
    assert desync_text(4, 9, 3, "reduce_scatter", {0: 1, 1: 2}, {0: 5, 1: 4}) == (
        "DESYNC at steps 4-9 (3 steps): the ranks issued different reduce-scatter counts "
        "(step 4: rank 0: 1, rank 1: 2; step 9: rank 0: 5, rank 1: 4)")
    assert counts_text({}) == ""


def test_groups_sharing_a_rank_are_said_with_the_rank_and_both_groups() -> None:
    assert overlapping_groups_text(1, [0, 1], (1, 2)) == (
        "the ranks' hellos name all-reduce groups that overlap (rank 1 in {0, 1} and {1, 2}): "
        "waits and busbw are figured over every rank")
