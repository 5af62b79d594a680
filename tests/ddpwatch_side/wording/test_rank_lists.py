"""Many ranks said in one line (``ddpwatch.wording.rank_lists``)."""

from __future__ import annotations

from ddpwatch.wording.rank_lists import detached_ranks_lines, failed_ranks_lines, heard_until_text, interrupted_ranks_lines, rank_runs, ranks_text, step_range_text


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
    peers = {rank: (40, "RuntimeError: Connection reset by peer") for rank in (0, 1, 2, 4, 5)}
    assert failed_ranks_lines({**peers, 3: (41, "RuntimeError: CUDA out of memory")}) == [
        "6 ranks failed after steps 40-41: ranks 0-5; most often: RuntimeError: Connection reset by peer"]
    assert failed_ranks_lines(peers) == ["5 ranks failed after step 40: ranks 0-2, 4-5; most often: RuntimeError: Connection reset by peer"]


def test_the_rank_that_failed_first_is_named_first_as_the_cause_of_its_peers_failures() -> None:
    """One rank ran out of memory, and its peers' next collectives met a dead peer: the commonest
    reason is the consequence. Before, six ranks read only *most often: … Connection reset by peer*."""
    peers = {rank: (40, "RuntimeError: Connection reset by peer") for rank in (0, 1, 2, 4, 5)}
    oom = {3: (41, "RuntimeError: CUDA out of memory")}
    assert failed_ranks_lines({**peers, **oom}, first=3) == [
        "6 ranks failed after steps 40-41: ranks 0-5; first rank 3, after step 41: RuntimeError: CUDA out of memory; "
        "then most often: RuntimeError: Connection reset by peer"]
    assert failed_ranks_lines(peers, first=4) == [  # the first's reason is the commonest: said once
        "5 ranks failed after step 40: ranks 0-2, 4-5; first rank 4, after step 40: RuntimeError: Connection reset by peer"]
    assert failed_ranks_lines({0: peers[0], **oom}, first=3) == [
        "rank 3 failed first, after step 41: RuntimeError: CUDA out of memory",
        "rank 0 failed after step 40: RuntimeError: Connection reset by peer"]
    assert failed_ranks_lines(oom, first=3) == ["rank 3 failed after step 41: RuntimeError: CUDA out of memory"]
    assert failed_ranks_lines(peers, first=3) == failed_ranks_lines(peers)  # a first that is not among them: none


def test_interrupted_ranks_are_said_in_a_line_per_signal_naming_no_first() -> None:
    """Ctrl-C at torchrun stops every rank at once: one line, no rank named as a cause."""
    assert interrupted_ranks_lines({}) == []
    ctrl_c = "SIGINT (KeyboardInterrupt, Ctrl-C)"
    assert interrupted_ranks_lines({1: (372, ctrl_c)}) == [f"rank 1 interrupted after step 372: {ctrl_c}"]
    assert interrupted_ranks_lines({rank: (372 + rank % 2, ctrl_c) for rank in range(6)}) == [
        f"ranks 0-5 interrupted after steps 372-373: {ctrl_c}"]
    assert interrupted_ranks_lines({0: (9, "SIGTERM"), 1: (10, "SIGTERM"), 3: (9, "SIGTERM"), 2: (9, ctrl_c)}) == [
        f"rank 2 interrupted after step 9: {ctrl_c}", "ranks 0-1, 3 interrupted after steps 9-10: SIGTERM"]


def test_ranks_a_record_ends_without_are_said_with_the_steps_they_were_last_heard_at() -> None:
    assert (step_range_text(6, 6), step_range_text(5, 6)) == ("step 6", "steps 5-6")
    assert heard_until_text({3: 6}) == "rank 3 (last heard at step 6)"
    assert heard_until_text({rank: 5 + (rank == 7) for rank in range(8)}) == "8 ranks (0-7; last heard at steps 5-6)"
    assert heard_until_text({0: 6, 2: 6}) == "2 ranks (0, 2; last heard at step 6)"


def test_detached_ranks_are_said_in_a_line_per_reason() -> None:
    assert detached_ranks_lines({}) == []
    assert detached_ranks_lines({0: (7, "RuntimeError: x"), 1: (8, "RuntimeError: x"), 3: (2, "the optimizer stepped")}) == [
        "ranks 0-1 no longer watched after steps 7-8, training on unwatched: RuntimeError: x",
        "rank 3 no longer watched after step 2, training on unwatched: the optimizer stepped"]
