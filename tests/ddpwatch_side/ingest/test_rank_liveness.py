"""How the ranks' messages say whether each still trains (``ddpwatch.ingest.rank_liveness``), hand-worked."""

from __future__ import annotations

from ddpwatch.ingest.rank_liveness import LOST_AFTER_S, STOPPED_AFTER_S, RankLiveness
from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import DETACHED, FAILED, INTERRUPTED, Goodbye, Heartbeat
from synthetic_session import hello


def heard(liveness: RankLiveness, rank: int, seq: int, at: float, dropped: int = 0) -> None:
    liveness.hear(Envelope(Heartbeat(rank, at, 0), rank, seq, dropped), at)


def test_a_gap_in_a_ranks_sequence_numbers_is_that_many_messages_lost_and_the_senders_drops_its_newest_count() -> None:
    liveness = RankLiveness()
    heard(liveness, 0, 0, 1.0)
    heard(liveness, 0, 1, 1.1)
    heard(liveness, 0, 5, 1.2, dropped=3)  # 2, 3, 4 never came
    heard(liveness, 0, 4, 1.3, dropped=2)  # one of them after all, out of order: not a gap
    state = liveness.ranks[0]
    assert (state.lost_messages, state.last_seq, state.sender_dropped, state.last_seen) == (3, 5, 3, 1.3)


def test_the_world_is_the_hellos_largest_until_then_the_ranks_heard() -> None:
    liveness = RankLiveness()
    heard(liveness, 0, 0, 0.0)
    heard(liveness, 3, 0, 0.0)
    assert liveness.world_size == 2  # no hello yet: the ranks heard
    for rank, world in ((0, 8), (1, 4)):
        liveness.note_hello(liveness.ranks[rank], hello(rank, world_size=world))
    assert (liveness.declared_world, liveness.world_size) == (8, 8)
    liveness.note_hello(liveness.ranks[0], hello(0, world_size=4))  # rank 0's hello said 8 before: 4 now stands
    assert liveness.world_size == 4


def test_a_rank_is_live_until_nothing_was_heard_for_the_lost_time_and_cut_where_the_recording_ended() -> None:
    liveness = RankLiveness()
    heard(liveness, 0, 0, 10.0)
    assert liveness.status(0, 10.0 + LOST_AFTER_S) == "live"
    assert liveness.status(0, 10.0 + LOST_AFTER_S, recording_ended=True) == "cut"
    assert liveness.status(0, 10.1 + LOST_AFTER_S) == "lost"


def test_a_goodbye_says_how_the_rank_ended_and_the_first_to_fail_is_kept() -> None:
    liveness = RankLiveness()
    goodbyes = {0: Goodbye(0, 7), 1: Goodbye(1, 5, FAILED + "RuntimeError: NCCL timeout"),
                2: Goodbye(2, 6, FAILED + "RuntimeError: peer gone"), 3: Goodbye(3, 6, INTERRUPTED + "SIGTERM"),
                4: Goodbye(4, 9, DETACHED + "the loop stepped twice")}
    for rank, goodbye in goodbyes.items():
        liveness.note_goodbye(liveness.ranks[rank], goodbye)
    assert [liveness.status(rank, 0.0) for rank in range(5)] == ["finished", "failed", "failed", "interrupted", "detached"]
    assert liveness.first_failed_rank == 1
    assert liveness.failed_ranks == {1: (5, "RuntimeError: NCCL timeout"), 2: (6, "RuntimeError: peer gone")}
    assert liveness.interrupted_ranks == {3: (6, "SIGTERM")}
    assert liveness.detached_ranks == {4: (9, "the loop stepped twice")}
    assert liveness.finished and not liveness.trains_again


def test_the_run_is_over_once_every_rank_of_the_world_said_goodbye_or_is_lost() -> None:
    liveness = RankLiveness()
    assert not liveness.run_is_over(0.0)  # no rank yet: no run to be over
    for rank in (0, 1):
        liveness.note_hello(liveness.ranks[rank], hello(rank))
        heard(liveness, rank, 0, 0.0)
    liveness.note_goodbye(liveness.ranks[0], Goodbye(0, 4))
    assert not liveness.run_is_over(1.0)  # rank 1 heard 1 s ago
    assert liveness.run_is_over(1.0 + LOST_AFTER_S)  # ... and lost since
    assert not liveness.finished


def test_a_rank_five_steps_behind_and_unmoved_for_three_seconds_has_stopped_unless_lost() -> None:
    liveness = RankLiveness()
    for rank, step in ((0, 10), (1, 5), (2, 6)):
        heard(liveness, rank, 0, 100.0)
        state = liveness.ranks[rank]
        state.last_step, state.last_step_at = step, 98.0
    assert liveness.stopped_ranks(100.0) == {}  # rank 1 moved 2 s ago
    assert liveness.stopped_ranks(101.0) == {1: 5}  # 3 s: rank 2, 4 behind, still within the drift
    assert liveness.stopped_ranks(98.0 + STOPPED_AFTER_S + LOST_AFTER_S + 1) == {}  # every rank lost by then


def test_live_ranks_stuck_since_a_lost_peer_went_silent_are_held_by_it() -> None:
    """Rank 2 last heard at 10 s (so dead by 12.5 s); rank 0 passed its last step at 11 s, before
    then, rank 1 at 13 s, after (training without it), rank 3 passed none (still starting)."""
    liveness = RankLiveness()
    for rank, seen, step, moved in ((0, 19.0, 4, 11.0), (1, 19.0, 9, 13.0), (2, 10.0, 4, 9.0), (3, 19.0, 0, 0.0)):
        heard(liveness, rank, 0, seen)
        state = liveness.ranks[rank]
        state.last_step, state.last_step_at = step, moved
    held, lost = liveness.ranks_held_by_lost(20.0)
    assert (held, lost) == ({0: 4}, {2: 10.0})
    assert liveness.ranks_held_by_lost(11.0) == ({}, {})  # nobody lost yet


def test_a_heartbeat_moves_the_rank_on_and_says_since_when_it_pauses() -> None:
    liveness = RankLiveness()
    state = liveness.ranks[0]
    liveness.note_heartbeat(state, Heartbeat(0, 0.0, 3), 5.0)
    liveness.note_heartbeat(state, Heartbeat(0, 0.0, 2, "evaluate"), 6.0)  # a late one does not move it back
    liveness.note_heartbeat(state, Heartbeat(0, 0.0, 3, "evaluate"), 7.0)
    assert (state.last_step, state.pausing, state.pausing_since) == (3, "evaluate", 6.0)
