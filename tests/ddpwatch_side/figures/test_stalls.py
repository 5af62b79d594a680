"""The stall verdict, hand-worked from the ranks' probes (``ddpwatch.figures.stalls``)."""

from __future__ import annotations

from ddpwatch.figures.stalls import RankView, classify, excused, stall_after_s
from instrumented_ddp.wire.stall_probe import InFlight, StallProbe

B0 = InFlight("all_reduce", "b0", 4_194_304, "", seq=41, step=20, waited_s=12.0)
SLEEPING = ["hang_probe.py:31 main: time.sleep(40)"]


def probe(*in_flight: InFlight, issued: int = 41, stack: list[str] | None = None, **others: int) -> StallProbe:
    return StallProbe(12.5, 20, list(in_flight), {"": issued, **others}, stack or [])


def test_the_threshold_is_three_p95_steps_and_never_under_three_seconds() -> None:
    assert stall_after_s(None) == 3.0
    assert stall_after_s(0.25) == 3.0  # 3 x 0.25 s = 0.75 s: the floor
    assert stall_after_s(2.0) == 6.0


def test_a_rank_that_has_not_issued_what_the_other_waits_in_is_behind() -> None:
    """Rank 0 waits 12 s in b0, the 41st all-reduce of the default group; rank 1 has issued 40
    and sleeps before its backward: rank 1 holds rank 0."""
    verdict = classify({0: RankView("backward", probe(B0)), 1: RankView("forward", probe(issued=40, stack=SLEEPING))})
    assert (verdict.kind, verdict.culprits, verdict.waiting, verdict.collective) == ("behind", (1,), (0,), B0)


def test_of_three_ranks_the_two_behind_are_named() -> None:
    verdict = classify({0: RankView("backward", probe(B0)), 1: RankView("data", probe(issued=40)),
                        2: RankView("forward", probe(issued=39))})
    assert (verdict.kind, verdict.culprits, verdict.waiting) == ("behind", (1, 2), (0,))


def test_every_rank_in_the_same_collective_is_in_collective() -> None:
    slow = B0._replace(waited_s=5.0)
    verdict = classify({0: RankView("backward", probe(B0)), 1: RankView("backward", probe(slow)), 2: RankView("backward", probe(B0))})
    assert (verdict.kind, verdict.culprits, verdict.waiting, verdict.collective) == ("in_collective", (), (0, 1, 2), B0)


def test_the_same_number_with_another_size_is_a_desync_naming_both_sides() -> None:
    """Rank 1 issued one extra all-reduce of a 4-byte loss as its 41st: rank 0's 41st is b0."""
    extra = InFlight("all_reduce", "l0", 4, "", seq=41, step=20, waited_s=11.0)
    verdict = classify({0: RankView("backward", probe(B0)), 1: RankView("data", probe(extra))})
    assert (verdict.kind, verdict.culprits, verdict.waiting) == ("desync", (0, 1), (0, 1))  # two ranks: no majority
    assert verdict.sides == {0: B0, 1: extra}


def test_a_desync_names_the_minority_where_there_is_one() -> None:
    extra = InFlight("all_reduce", "l0", 4, "", seq=41, step=20, waited_s=11.0)
    verdict = classify({0: RankView("backward", probe(B0)), 1: RankView("data", probe(extra)), 2: RankView("backward", probe(B0))})
    assert (verdict.kind, verdict.culprits) == ("desync", (1,))


def test_ranks_a_collective_apart_are_a_desync_when_neither_is_behind() -> None:
    """Rank 1 is in its 42nd all-reduce, rank 0 still in its 41st: rank 1 issued 42, so it is not
    behind on the 41st, and the two can never meet."""
    ahead = B0._replace(tag="b1", seq=42, waited_s=10.0)
    verdict = classify({0: RankView("backward", probe(B0)), 1: RankView("backward", probe(ahead, issued=42))})
    assert verdict.kind == "desync" and verdict.collective == B0


def test_a_rank_behind_that_waits_in_a_collective_of_its_own_is_a_desync() -> None:
    """Rank 1 issued an extra all-reduce on a group of its own ("side", its 1st there) before its
    backward, and has issued 40 on the default group; rank 0 waits 12 s in b0, the 41st. Rank 1
    is behind on b0, but it waits too, in a collective rank 0 never issues: each waits for the other."""
    extra = InFlight("all_reduce", "l0", 4, "side", seq=1, step=20, waited_s=11.5)
    verdict = classify({0: RankView("backward", probe(B0)), 1: RankView("after_forward", probe(extra, issued=40, side=1))})
    assert (verdict.kind, verdict.culprits, verdict.waiting) == ("desync", (0, 1), (0, 1))  # two ranks: no majority
    assert verdict.sides == {0: B0, 1: extra}


def test_a_rank_behind_that_waits_for_a_third_is_no_culprit_the_third_is() -> None:
    """Rank 0 waits in b0 (41st); rank 1 has issued 40 and waits 10 s in its 3rd all-reduce on
    the pair group "pp" it shares with rank 2, which has issued 2 there and sleeps: rank 2 holds
    rank 1, which holds rank 0."""
    pair = InFlight("all_reduce", "l0", 4096, "pp", seq=3, step=20, waited_s=10.0)
    verdict = classify({0: RankView("backward", probe(B0)), 1: RankView("forward", probe(pair, issued=40, pp=3)),
                        2: RankView("forward", probe(issued=40, pp=2, stack=SLEEPING))})
    assert (verdict.kind, verdict.culprits, verdict.waiting, verdict.collective) == ("behind", (2,), (0,), B0)


def test_a_silent_rank_is_lost_and_the_others_wait_for_it() -> None:
    verdict = classify({0: RankView("backward", probe(B0)), 1: RankView("forward", None, lost=True)})
    assert (verdict.kind, verdict.culprits, verdict.waiting, verdict.collective) == ("lost", (1,), (0,), B0)


def test_no_rank_in_a_collective_makes_every_rank_a_culprit() -> None:
    verdict = classify({0: RankView("data", probe()), 1: RankView("data", probe())})
    assert (verdict.kind, verdict.culprits, verdict.waiting, verdict.collective) == ("behind", (0, 1), (), None)


def test_a_rank_that_never_used_a_named_group_is_not_behind_on_it() -> None:
    """Rank 0 waits in the 7th all-reduce of a group named "replicas" that rank 2 has issued 6 of;
    rank 1 has never issued one on it (it is in no such group) and is not named."""
    replicas = InFlight("all_reduce", "u3", 1024, "replicas", seq=7, step=20, waited_s=9.0)
    verdict = classify({0: RankView("backward", probe(replicas, replicas=7)), 1: RankView("backward", probe()),
                        2: RankView("backward", probe(replicas=6))})
    assert (verdict.kind, verdict.culprits, verdict.waiting) == ("behind", (2,), (0,))


def test_a_marked_pause_or_a_compile_excuses_a_long_step_and_a_lost_rank_pausing_does_not() -> None:
    assert excused({0: RankView(pausing="evaluate"), 1: RankView()}) == "rank 0 is pausing training: evaluate"
    compiling = StallProbe(4.0, compiling=True)
    assert excused({0: RankView(), 1: RankView(probe=compiling)}) == "rank 1 is compiling"
    assert excused({0: RankView(pausing="evaluate", lost=True), 1: RankView()}) == ""
