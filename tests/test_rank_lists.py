"""Many ranks said in one line (``ddpwatch.rank_lists``)."""

from __future__ import annotations

from ddpwatch.rank_lists import rank_runs, ranks_text


def test_consecutive_ranks_collapse_to_runs_whatever_their_order_or_repeats() -> None:
    assert rank_runs([5, 0, 1, 2, 9, 6, 2]) == [(0, 2), (5, 6), (9, 9)]
    assert rank_runs([]) == []


def test_ranks_text_names_runs_up_to_its_limit_then_counts_the_rest() -> None:
    assert ranks_text([0, 1, 2, 3, 17, 45, 46, 47]) == "0-3, 17, 45-47"
    assert ranks_text([0, 2, 4, 6, 7, 8, 10], limit=2) == "0, 2, … (+5 more)"
    assert ranks_text(range(1024)) == "0-1023"
