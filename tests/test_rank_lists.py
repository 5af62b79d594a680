"""Many ranks said in one line (``ddpwatch.rank_lists``)."""

from __future__ import annotations

from ddpwatch.rank_lists import failed_ranks_lines, rank_runs, ranks_text


def test_consecutive_ranks_collapse_to_runs_whatever_their_order_or_repeats() -> None:
    assert rank_runs([5, 0, 1, 2, 9, 6, 2]) == [(0, 2), (5, 6), (9, 9)]
    assert rank_runs([]) == []


def test_ranks_text_names_runs_up_to_its_limit_then_counts_the_rest() -> None:
    assert ranks_text([0, 1, 2, 3, 17, 45, 46, 47]) == "0-3, 17, 45-47"
    assert ranks_text([0, 2, 4, 6, 7, 8, 10], limit=2) == "0, 2, … (+5 more)"
    assert ranks_text(range(1024)) == "0-1023"


def test_failed_ranks_are_said_one_by_one_for_a_few_and_in_one_line_with_the_commonest_reason_for_many() -> None:
    assert failed_ranks_lines({}) == []
    assert failed_ranks_lines({3: (41, "RuntimeError: CUDA out of memory"), 0: (40, "RuntimeError: Connection reset by peer")}) == [
        "rank 0 failed after step 40: RuntimeError: Connection reset by peer",
        "rank 3 failed after step 41: RuntimeError: CUDA out of memory"]
    # one rank ran out of memory, and its peers' next collectives met a dead peer
    peers = {rank: (40, "RuntimeError: Connection reset by peer") for rank in (0, 1, 2, 4, 5)}
    assert failed_ranks_lines({**peers, 3: (41, "RuntimeError: CUDA out of memory")}) == [
        "6 ranks failed after steps 40-41: ranks 0-5; most often: RuntimeError: Connection reset by peer"]
    assert failed_ranks_lines(peers) == ["5 ranks failed after step 40: ranks 0-2, 4-5; most often: RuntimeError: Connection reset by peer"]
