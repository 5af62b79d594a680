"""What watching costs, from the unwatched steps against the watched ones around them: figures
worked out in the comments."""

from __future__ import annotations

import pytest

from ddpwatch.figures.watch_overhead import NEIGHBOURS, WatchOverhead, WatchOverheadPairing, segment_key, watch_overhead_from

KEY = segment_key("bucket", {"bucket_mb": 1.0, "grad_accum": 1})
OTHER = segment_key("zero1", {"bucket_mb": 1.0, "grad_accum": 1})


def feed(pairing: WatchOverheadPairing, rank: int, walls: list[tuple[int, float, bool]], key: object = KEY) -> None:
    for step, wall, watched in walls:
        (pairing.add_watched if watched else pairing.add_unwatched)(rank, step, wall, key)  # type: ignore[arg-type]


BEFORE = [(1, 0.100, True), (2, 0.102, True), (3, 0.098, True), (4, 0.100, True)]
AFTER = [(7, 0.100, True), (8, 0.100, True), (9, 0.104, True), (10, 0.096, True)]


def test_each_unwatched_step_is_held_against_the_median_of_the_watched_steps_around_its_block() -> None:
    pairing = WatchOverheadPairing()
    # rank 0: reference = median(0.096, 0.098, 0.100 x4, 0.102, 0.104) = 0.100
    #   step 5: 0.100 / 0.095 - 1 = 5.263 %; step 6: 0.100 / 0.096 - 1 = 4.167 %
    feed(pairing, 0, BEFORE + [(5, 0.095, False), (6, 0.096, False)] + AFTER)
    # rank 1, the same reference: step 5: 5 %; step 6: 3 %
    feed(pairing, 1, BEFORE + [(5, 0.100 / 1.05, False), (6, 0.100 / 1.03, False)] + AFTER)
    cost = pairing.overhead(1, 10)
    assert cost is not None and cost.unwatched_steps == 2
    # one value a step, the mean of its ranks': step 5 (5.263 + 5) / 2 = 5.132; step 6 (4.167 + 3) / 2 = 3.583
    step5, step6 = (100 / 0.95 - 100 + 5.0) / 2, (100 / 0.96 - 100 + 3.0) / 2
    assert cost.pct == pytest.approx((step5 + step6) / 2)  # the median of two: their mean, 4.357
    # two values: k = max(1, floor(1 - 1.645 * sqrt(2) / 2)) = 1, so the interval is their whole range
    assert cost.interval_pct == pytest.approx((step6, step5))


def test_a_block_still_waiting_for_the_steps_after_it_is_counted_with_the_steps_before_it() -> None:
    pairing = WatchOverheadPairing()
    feed(pairing, 0, BEFORE + [(5, 0.080, False)])
    # reference = median(0.100, 0.102, 0.098, 0.100) = 0.100; 0.100 / 0.080 - 1 = 25 %
    cost = pairing.overhead(1, 5)
    assert cost == WatchOverhead(pytest.approx(25.0), (pytest.approx(25.0), pytest.approx(25.0)), 1)  # type: ignore[arg-type]
    version = pairing.version
    feed(pairing, 0, [(6, 0.120, True)])  # now median(0.098, 0.100, 0.100, 0.102, 0.120) = 0.100: the same
    assert pairing.version != version and pairing.overhead(1, 6).pct == pytest.approx(25.0)


def test_only_the_block_s_own_strategy_is_its_reference_and_a_block_with_none_gives_nothing() -> None:
    pairing = WatchOverheadPairing()
    feed(pairing, 0, BEFORE, key=OTHER)  # another strategy's steps before the block: not its reference
    feed(pairing, 0, [(5, 0.050, False)])
    assert pairing.overhead(1, 100) is None
    feed(pairing, 0, [(6, 0.100, True), (7, 0.100, True)])
    assert pairing.overhead(1, 100).pct == pytest.approx(100.0)  # 0.100 / 0.050 - 1
    feed(pairing, 0, [(8, 0.200, True)], key=OTHER)  # a switch closes the block: its reference stays 0.100
    assert pairing.overhead(1, 100).pct == pytest.approx(100.0)


def test_the_steps_after_a_block_are_the_next_block_s_steps_before() -> None:
    pairing = WatchOverheadPairing()
    feed(pairing, 0, BEFORE + [(5, 0.100, False)] + [(s, 0.120, True) for s in range(6, 6 + NEIGHBOURS)])
    feed(pairing, 0, [(10, 0.100, False)])
    # block 1: median(0.098, 0.100, 0.100, 0.102, 0.120 x4) = (0.102 + 0.120) / 2 = 0.111 -> 11 %;
    # block 2 (open): median(0.120 x4) -> 20 %
    assert pairing.overhead(5, 5).pct == pytest.approx(11.0)
    assert pairing.overhead(10, 10).pct == pytest.approx(20.0)
    assert pairing.overhead(1, 10).unwatched_steps == 2
    assert pairing.overhead(11, 20) is None  # a segment's range: none of its steps was unwatched


def test_the_figure_says_itself_and_reads_back_from_its_json() -> None:
    cost = WatchOverhead(0.64, (-0.21, 1.44), 40)
    assert cost.sentence() == "ddpwatch costs this run 0.6 % (90 % interval -0.2 to 1.4 %), from 40 unwatched steps"
    assert cost.short() == "ddpwatch costs 0.6 % (-0.2 to 1.4, 40 unwatched steps)"
    assert cost.as_json() == {"pct": 0.64, "interval_pct": [-0.21, 1.44], "unwatched_steps": 40}
    assert watch_overhead_from(cost.as_json()) == cost
