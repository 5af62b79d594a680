"""Figures on hand-computed timelines.

Timelines are written in milliseconds (``ms()`` converts to the seconds the
model uses) so that each expected value can be checked with pencil and paper
from the comment next to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import pytest

from instrumented_ddp.wire.time_ranges import clip, intersect, merge, subtract, total_length, union
from instrumented_ddp.wire.step_figures import (
    algbw_gbps,
    bus_factor,
    busbw_gbps,
    call_times,
    counted,
    sharded_collectives,
    step_figures,
    step_times,
)
from ddpwatch.figures.cross_rank import (
    STRAGGLER_STEPS,
    Desync,
    DesyncRange,
    StepWaits,
    Straggler,
    all_reduce_ranks,
    calls_of,
    cross_rank_waits,
    find_desync,
    find_straggler,
    groups_of_the_world,
    shard_groups,
    shard_ranks,
    step_waits,
    straggler,
    transfers,
    waited_for,
    waiting_intervals,
    waits_both_ways,
)
from ddpwatch.figures.metrics import ClockAlignment, segment_figures
from ddpwatch.wording.figure_text import busbw_text, calls_text

approx = pytest.approx


def ms(x: float) -> float:
    return x / 1000.0


@dataclass(frozen=True)
class Span:
    kind: str
    start: float
    end: float
    blocking: bool = False
    nbytes: int = 0
    tag: str = ""


@dataclass(frozen=True)
class Record:
    rank: int
    step: int
    start: float
    end: float
    spans: tuple[Span, ...] = field(default_factory=tuple)
    samples: int = 0
    tokens: int = 0
    paused_s: float = 0.0


def span(kind: str, a: float, b: float, blocking: bool = False, nbytes: int = 0, tag: str = "") -> Span:
    """A span given in ms."""
    return Span(kind, ms(a), ms(b), blocking, nbytes, tag)


def record(a: float, b: float, *spans: Span, rank: int = 0, step: int = 0,
           samples: int = 0, tokens: int = 0) -> Record:
    """A step window given in ms."""
    return Record(rank, step, ms(a), ms(b), tuple(spans), samples, tokens)


def pcts(f) -> tuple[float, float, float, float, float]:
    return (f.compute_pct, f.non_compute_pct, f.idle_pct, f.overlap_pct, f.comm_overhead_pct)


# --- time-range helpers-----------------------------------------------------------------


def test_merge_joins_overlapping_nested_and_touching_and_sorts():
    # [5,6) nested in [4,8); [0,2) overlaps [1,3); [3,4) touches both neighbours
    assert merge([(4, 8), (1, 3), (5, 6), (0, 2), (3, 4)]) == [(0, 8)]
    assert merge([(2, 3), (0, 1)]) == [(0, 1), (2, 3)]


def test_merge_drops_zero_length_reversed_and_non_finite_intervals():
    assert merge([(1, 1), (3, 2), (math.nan, 1), (0, math.inf), (5, 6)]) == [(5, 6)]
    assert merge([]) == []


def test_total_length_counts_concurrent_time_once():
    # [0,4) ∪ [2,6) = [0,6) -> 6, not 4 + 4
    assert total_length([(0, 4), (2, 6)]) == approx(6)
    assert total_length([(3, 1)]) == 0.0
    assert total_length([]) == 0.0


def test_intersect_of_interleaved_lists():
    # [0,5)∩[3,4) = [3,4); [0,5)∩[4.5,7) = [4.5,5); [6,10)∩[4.5,7) = [6,7); [6,10)∩[9,12) = [9,10)
    got = intersect([(0, 5), (6, 10)], [(3, 4), (4.5, 7), (9, 12)])
    assert got == [(3, 4), (4.5, 5), (6, 7), (9, 10)]
    assert intersect([(0, 1)], [(1, 2)]) == []  # touching shares no time
    assert intersect([], [(0, 1)]) == []


def test_subtract_splits_trims_and_removes():
    # [0,10) minus [2,3) and [5,7) -> [0,2) [3,5) [7,10); [12,14) fully covered by [11,15)
    got = subtract([(0, 10), (12, 14)], [(2, 3), (5, 7), (11, 15)])
    assert got == [(0, 2), (3, 5), (7, 10)]
    assert subtract([(0, 4)], [(-1, 1), (3, 9)]) == [(1, 3)]  # trimmed at both ends
    assert subtract([(0, 4)], []) == [(0, 4)]
    assert subtract([], [(0, 4)]) == []


def test_clip_to_window_and_invalid_window():
    assert clip([(-5, 2), (3, 4), (8, 20), (30, 40)], 0, 10) == [(0, 2), (3, 4), (8, 10)]
    assert clip([(0, 5)], 5, 5) == []  # empty window
    assert clip([(0, 5)], 4, 1) == []  # reversed window
    assert clip([(0, 5)], -math.inf, math.inf) == [(0, 5)]
    assert union([(0, 1)], [(1, 2)], [(5, 6)]) == [(0, 2), (5, 6)]


# --- one step ---------------------------------------------------------------------------


def test_nested_sync_all_reduce_inside_backward_is_not_compute():
    # window [0,10); fwd [0,3) bwd [3,8) with a blocking all_reduce [5,7) inside; opt [8,9)
    # C = [0,5) ∪ [7,9) = 7; M = [5,7) = 2; M∪C = [0,9) = 9 -> 70 / 20 / 10
    # C∩M = ∅ -> overlap 0; comm overhead 2/10 = 20
    f = step_figures(record(0, 10,
                            span("forward", 0, 3), span("backward", 3, 8),
                            span("all_reduce", 5, 7, blocking=True), span("optimizer", 8, 9)))
    assert pcts(f) == approx((70, 20, 10, 0, 20))
    assert f.all_reduce_calls == 1
    assert f.all_reduce_ms == approx(2)
    assert f.step_ms == approx(10)


def test_blocking_wait_and_broadcast_are_subtracted_but_non_blocking_comm_is_not():
    # bwd [0,10); blocking wait [1,2) and blocking broadcast [3,4) cut it; a non-blocking
    # all_reduce [6,8) does not. C = 10 - 2 = 8; M = [3,4) ∪ [6,8) = 3
    # M∪C = [0,1) ∪ [2,10) = 9: the wait is not communication, so it counts as idle
    # -> compute 80, exposed 10 (the broadcast), idle 10; C∩M = [6,8) = 2 -> overlap 2/3
    f = step_figures(record(0, 10, span("backward", 0, 10), span("wait", 1, 2, blocking=True),
                            span("broadcast", 3, 4, blocking=True), span("all_reduce", 6, 8)))
    assert pcts(f) == approx((80, 10, 10, 100 * 2 / 3, 30))


def test_overlapping_async_all_reduce_buckets_give_hand_computed_overlap():
    # window [0,10); fwd [0,2) bwd [2,8); async buckets [5,7) and [6,9) (non-blocking);
    # main thread blocks in wait [8,9); opt [9,10)
    # C = [0,8) ∪ [9,10) = 9; M = [5,9) = 4 (merged); C∩M = [5,8) = 3 -> overlap 75
    # M∪C = [0,10) -> compute 90, exposed 10, idle 0; overhead 40
    # all_reduce_ms is unmerged: 2 + 3 = 5
    f = step_figures(record(0, 10,
                            span("forward", 0, 2), span("backward", 2, 8),
                            span("all_reduce", 5, 7), span("all_reduce", 6, 9),
                            span("wait", 8, 9, blocking=True), span("optimizer", 9, 10)))
    assert pcts(f) == approx((90, 10, 0, 75, 40))
    assert f.all_reduce_calls == 2
    assert f.all_reduce_ms == approx(5)


def test_disjoint_simple_ddp_has_zero_overlap_and_exposed_comm_equals_comm():
    # fwd [0,3) bwd [3,6) blocking all_reduce [6,8) opt [8,9) in [0,10); data [9,10) is idle
    # C = 7, M = 2 disjoint -> exposed 20 == overhead 20, idle 10, overlap 0
    f = step_figures(record(0, 10,
                            span("forward", 0, 3), span("backward", 3, 6),
                            span("all_reduce", 6, 8, blocking=True), span("optimizer", 8, 9),
                            span("data", 9, 10, blocking=True)))
    assert pcts(f) == approx((70, 20, 10, 0, 20))
    assert f.non_compute_pct == approx(f.comm_overhead_pct)


def test_empty_step_is_all_idle_with_no_comm():
    f = step_figures(record(0, 5), world_size=4)
    assert pcts(f) == approx((0, 0, 100, 0, 0))
    assert (f.all_reduce_calls, f.all_reduce_ms, f.step_ms) == (0, 0.0, approx(5))
    assert len(f.algbw_gbps) == 0 and f.busbw_gbps is None


def test_compute_only_step_has_zero_overlap_not_nan():
    f = step_figures(record(0, 4, span("forward", 0, 1), span("backward", 1, 3)))
    assert pcts(f) == approx((75, 0, 25, 0, 0))


def test_zero_length_or_reversed_window_gives_zeros_not_division_error():
    for a, b in [(5, 5), (5, 1), (0, math.nan)]:
        f = step_figures(record(a, b, span("forward", 0, 3), span("all_reduce", 1, 2)))
        assert pcts(f) == (0.0, 0.0, 0.0, 0.0, 0.0)
        assert f.step_ms == 0.0


@pytest.mark.parametrize("spans", [
    (span("forward", 0, 3), span("backward", 3, 8), span("all_reduce", 5, 7, blocking=True)),
    (span("backward", 1, 6), span("all_reduce", 4, 9), span("all_reduce", 2, 12)),
    (span("all_reduce", 0, 3, blocking=True), span("wait", 2, 4, blocking=True)),
    (span("optimizer", -3, 30),),
    (),
])
def test_three_percentages_sum_to_100(spans):
    f = step_figures(record(0, 10, *spans))
    assert f.compute_pct + f.non_compute_pct + f.idle_pct == approx(100)


def test_data_time_counts_as_a_wait_only_where_nothing_else_ran():
    # window [0,100): data [0,30) and [85,95); forward [20,60), backward [60,80), all-reduce [70,90)
    # busy = [20,90): data outside it [0,20) and [90,95) = 25 ms -> 25 %, within Idle% (0-20, 90-100: 30 %)
    f = step_figures(record(0, 100, span("data", 0, 30), span("forward", 20, 60), span("backward", 60, 80),
                            span("all_reduce", 70, 90), span("data", 85, 95)))
    assert f.data_wait_pct == approx(25) and f.idle_pct == approx(30)
    # a loader fetching while the device computes (CPU running ahead) waits for nothing
    assert step_figures(record(0, 50, span("forward", 0, 40), span("data", 10, 30))).data_wait_pct == 0
    # nor does a step without data spans, or a data span outside its window
    assert step_figures(record(0, 50, span("forward", 0, 40))).data_wait_pct == 0
    assert step_figures(record(0, 50, span("data", 60, 70))).data_wait_pct == 0


def test_a_wait_in_the_data_time_is_not_waiting_on_data():
    # window [0,100): data [0,40), then forward [40,100). A barrier (a blocking wait tagged
    # "barrier") [10,30) inside the data: the rank sat waiting for the others, not for its batch.
    # Data wait is [0,10) and [30,40) = 20 ms -> 20 % (it read 40 before the blocked time was left
    # out); Idle% keeps all 40, the barrier being neither compute nor a transfer.
    f = step_figures(record(0, 100, span("data", 0, 40), span("wait", 10, 30, blocking=True, tag="barrier"),
                            span("forward", 40, 100)))
    assert f.data_wait_pct == approx(20) and f.idle_pct == approx(40) and f.compute_pct == approx(60)


def test_a_segments_data_wait_is_the_mean_over_its_records():
    # rank 0: data [0,40) of [0,100) -> 40 %; rank 1: data [0,10) of [0,100) -> 10 %; mean 25
    seg = segment_figures([record(0, 100, span("data", 0, 40), span("forward", 40, 100), rank=0, step=1),
                           record(0, 100, span("data", 0, 10), span("forward", 10, 100), rank=1, step=1)], world_size=2)
    assert seg.data_wait_pct == approx(25)
    assert seg.per_rank[0].data_wait_pct == approx(40) and seg.per_rank[1].data_wait_pct == approx(10)


def test_spans_outside_the_window_are_clipped():
    # window [10,20); fwd [5,12) -> [10,12); bwd [12,18); async all_reduce [17,25) -> [17,20)
    # a forward at [30,40) is ignored. C = [10,18) = 8; M = [17,20) = 3; C∩M = [17,18) = 1
    # M∪C = [10,20) -> 80 / 20 / 0, overlap 1/3, overhead 30; all_reduce_ms raw = 8
    f = step_figures(record(10, 20,
                            span("forward", 5, 12), span("backward", 12, 18),
                            span("all_reduce", 17, 25), span("forward", 30, 40)))
    assert pcts(f) == approx((80, 20, 0, 100 / 3, 30))
    assert f.all_reduce_ms == approx(8)


# --- bandwidth ----------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes, time_us, n, algbw, busbw", [
    # rows of a published all_reduce_perf run on 16 H100s (out-of-place columns)
    (134217728, 1652.2, 16, 81.24, 152.32),
    (1073741824, 6759.0, 16, 158.86, 297.86),
    (8589934592, 47535, 16, 180.71, 338.82),
])
def test_busbw_matches_nccl_tests_numbers(nbytes, time_us, n, algbw, busbw):
    # nccl-tests prints 2 decimals and the time to 0.1 us, hence abs=0.01
    assert algbw_gbps(nbytes, time_us * 1e-6) == approx(algbw, abs=0.01)
    assert busbw_gbps(nbytes, time_us * 1e-6, n) == approx(busbw, abs=0.01)


def test_bus_factor_definitions_and_degenerate_inputs():
    assert bus_factor("all_reduce", 8) == approx(1.75)  # 2*7/8
    assert bus_factor("all_reduce", 2) == approx(1.0)
    assert bus_factor("all_reduce", 1) == 0.0  # one rank moves nothing over a bus
    assert bus_factor("broadcast", 8) == 1.0
    assert bus_factor("reduce", 8) == 1.0 and bus_factor("reduce", 1) == 1.0  # nccl-tests: a reduce's busbw is its algbw
    for kind in ("all_to_all", "gather", "scatter"):  # nccl-tests: over all a rank sends, or the root's whole list
        assert bus_factor(kind, 8) == approx(7 / 8) and bus_factor(kind, 1) == 0.0
    assert bus_factor("all_reduce", 0) is None and bus_factor("send_recv", 8) is None
    assert algbw_gbps(0, 1.0) is None and algbw_gbps(100, 0.0) is None


def test_step_busbw_is_median_over_collectives():
    # 4 MB in 2 ms -> 2 GB/s; 4 MB in 1 ms -> 4; 4 MB in 4 ms -> 1; median algbw = 2
    # n = 4 -> factor 2*3/4 = 1.5 -> busbw 3
    f = step_figures(record(0, 10, span("all_reduce", 0, 2, nbytes=4_000_000),
                            span("all_reduce", 2, 3, nbytes=4_000_000),
                            span("all_reduce", 3, 7, nbytes=4_000_000),
                            span("all_reduce", 7, 8, nbytes=0)), world_size=4)
    assert f.algbw_gbps == approx((2, 4, 1))  # the zero-byte call measures nothing
    assert f.busbw_gbps == approx(3)


def test_the_loops_own_all_reduces_count_as_calls_and_time_but_not_in_the_busbw_of_the_gradients():
    # a bucket of 4 MB in 2 ms -> 2 GB/s, x 1.0 on 2 ranks; the loop's loss, 4 bytes in 1 ms (l0):
    # in the median it would read (2 + 0.000004) / 2 = 1.0 GB/s
    f = step_figures(record(0, 10, span("all_reduce", 0, 2, nbytes=4_000_000, tag="b0"),
                            span("all_reduce", 4, 5, nbytes=4, tag="l0")), world_size=2)
    assert f.all_reduce_calls == 2 and f.all_reduce_ms == approx(3)
    assert f.algbw_gbps == approx((2,)) and f.busbw_gbps == approx(2)


@pytest.mark.parametrize("groups, n", [([[0, 2], [1, 3]], 2), (None, 4), ([[0, 1, 2], [3]], 4)])
def test_hsdp_all_reduces_count_their_bus_factor_over_their_group_not_the_world(groups: list | None, n: int) -> None:
    """HSDP all-reduces each shard across its replicas only (the groups the hellos name). 4 MB in
    2 ms is 2 GB/s of algbw on each of 4 ranks; as 2 replicas of 2 shards n = 2, factor 2*1/2 = 1,
    busbw 2; over the world n = 4, factor 2*3/4 = 1.5, busbw 3. Groups of unequal sizes have no
    one n: the world's."""
    steps = [record(0, 10, span("all_reduce", 0, 2, nbytes=4_000_000), rank=rank) for rank in range(4)]
    assert all_reduce_ranks(groups, 4) == n
    assert segment_figures(steps, world_size=4, groups=groups).busbw_gbps == approx({2: 2.0, 4: 3.0}[n])


def test_the_named_groups_become_a_partition_of_the_world_or_are_not_used() -> None:
    """6 ranks. Ranks 0 and 1 name {0, 1}, rank 3 names {2, 3} (rank 2's hello not in yet): ranks 4
    and 5, named by nobody, are a group of their own rather than left out of every wait. A rank
    named in two groups ({0, 1} and {1, 2}) is a contradiction: the world, and why. Nothing named:
    the world, and nothing wrong."""
    assert groups_of_the_world([[1, 0], [0, 1], [3, 2]], 6) == ([[0, 1], [2, 3], [4, 5]], None)
    assert groups_of_the_world([[0, 1, 2], [3, 4, 5]], 6) == ([[0, 1, 2], [3, 4, 5]], None)  # whole: no rest
    groups, why = groups_of_the_world([[0, 1], [1, 2]], 6)
    assert groups is None and why == ("the ranks' hellos name all-reduce groups that overlap (rank 1 in {0, 1} and {1, 2}): "
                                      "waits and busbw are figured over every rank")
    assert groups_of_the_world([], 6) == groups_of_the_world([[], []], 6) == (None, None)


def test_hsdp_ranks_wait_only_for_the_replicas_they_all_reduce_with() -> None:
    """2 replicas x 2 shards (``init_device_mesh((2, 2))``: rank r = replica x 2 + shard), so
    shard 0's all-reduce joins ranks 0 and 2, shard 1's ranks 1 and 3, as their hellos say. One all-reduce u0: 5 ms on rank 0, 3 on rank 2 (rank 0
    waited 2 ms for rank 2); 9 on ranks 1 and 3 (their link is slower; neither waited). Paired
    over the world, the transfer was taken as 3 ms: ranks 1 and 3 read 6 ms of waiting each,
    put down to rank 2, which they never all-reduce with."""
    durations = {0: 5.0, 1: 9.0, 2: 3.0, 3: 9.0}
    records = {rank: record(0, 10, span("all_reduce", 0, ms_, tag="u0"), rank=rank) for rank, ms_ in durations.items()}
    calls = calls_of(records)
    groups = [[0, 2], [1, 3]]
    assert cross_rank_waits(calls, groups) == approx({0: 2.0, 1: 0.0, 2: 0.0, 3: 0.0})
    assert waited_for(calls, groups) == approx({0: 0.0, 1: 0.0, 2: 2.0, 3: 0.0})
    assert cross_rank_waits(calls) == approx({0: 2.0, 1: 6.0, 2: 0.0, 3: 6.0})  # over the world
    waiting = waiting_intervals(calls, records, groups)
    assert waiting[0] == [approx((0.0, ms(2.0)))] and waiting[1] == waiting[2] == waiting[3] == []
    segment = segment_figures(list(records.values()), world_size=4, groups=groups)
    assert segment.waited_for_others_ms == approx(2.0 / 4)  # one rank's 2 ms, over 4 ranks' steps
    assert segment.others_waited_ms == approx(2.0 / 4)  # ... all of it put down to rank 2: the totals agree
    assert {rank: f.others_waited_ms for rank, f in segment.per_rank.items()} == approx({0: 0.0, 1: 0.0, 2: 2.0, 3: 0.0})
    assert {rank: f.waited_for_others_ms for rank, f in segment.per_rank.items()} == approx({0: 2.0, 1: 0.0, 2: 0.0, 3: 0.0})
    # each group's all-reduce is a transfer of its own: 3 ms for {0, 2}, 9 for {1, 3}, 6 on average;
    # over the world the shortest was 3 ms, and the slow pair's 9 ms was lost
    assert transfers(calls, groups) == [(("u0", 0), approx(ms(6.0)))]
    assert transfers(calls) == [(("u0", 0), approx(ms(3.0)))]
    # a call one group did not make (u1 on 0 and 2 only) is the mean over the groups that made it
    records[0] = record(0, 10, span("all_reduce", 0, 5, tag="u0"), span("all_reduce", 5, 7, tag="u1"), rank=0)
    records[2] = record(0, 10, span("all_reduce", 0, 3, tag="u0"), span("all_reduce", 5, 8, tag="u1"), rank=2)
    assert transfers(calls_of(records), groups) == [(("u0", 0), approx(ms(6.0))), (("u1", 0), approx(ms(2.0)))]


# --- across ranks ---------------------------------------------------------------------------


def three_ranks_two_calls() -> dict[int, Record]:
    """i-th all_reduce durations (ms): rank0 [5,2], rank1 [1,4], rank2 [3,3]; transfer = min -> [1,2]."""
    return {
        0: record(0, 20, span("all_reduce", 0, 5), span("all_reduce", 10, 12), rank=0),
        # listed out of order: calls are matched by start time
        1: record(0, 20, span("all_reduce", 10, 14), span("all_reduce", 4, 5), rank=1),
        2: record(0, 20, span("all_reduce", 2, 5), span("all_reduce", 9, 12), rank=2),
    }


def test_cross_rank_wait_splits_duration_into_transfer_and_wait_and_names_straggler():
    # waits: rank0 4+0 = 4, rank1 0+2 = 2, rank2 2+1 = 3
    # rank1 waited least -> it is the one the others wait for
    waits = cross_rank_waits(calls_of(three_ranks_two_calls()))
    assert waits == approx({0: 4, 1: 2, 2: 3})
    assert straggler(waits) == 1


def test_waiting_is_the_leading_part_of_each_call_before_the_shared_transfer():
    # transfers [1, 2] ms end each call, the rest before them is waiting.
    # rank0 [0,5) waits [0,4), [10,12) none; rank1 [4,5) none, [10,14) waits [10,12);
    # rank2 [2,5) waits [2,4), [9,12) waits [9,10)
    recs = three_ranks_two_calls()
    waiting = waiting_intervals(calls_of(recs), recs)
    assert waiting[0] == [(ms(0), approx(ms(4)))]
    assert waiting[1] == [(ms(10), approx(ms(12)))]
    assert waiting[2] == [(ms(2), approx(ms(4))), (ms(9), approx(ms(10)))]
    assert waiting_intervals(calls_of({3: recs[0]}), {3: recs[0]}) == {3: []}  # alone, nobody to wait for


def test_waits_are_put_down_to_the_rank_that_arrived_last_in_each_call():
    # call 0: rank1 is shortest (1 ms): rank0 waited 4, rank2 2 -> 6 ms for rank1;
    # call 1: rank0 is shortest (2 ms): rank1 waited 2, rank2 1 -> 3 ms for rank0
    waited = waited_for(calls_of(three_ranks_two_calls()))
    assert waited == approx({0: 3, 1: 6, 2: 0})
    assert sum(waited.values()) == approx(sum(cross_rank_waits(calls_of(three_ranks_two_calls())).values()))
    # equal durations: the lowest rank is named, and nobody waited anyway
    even = {r: record(0, 5, span("all_reduce", 0, 2), rank=r) for r in (4, 2)}
    assert waited_for(calls_of(even)) == {4: 0.0, 2: 0.0}
    assert waited_for(calls_of({1: even[2]})) == {1: 0.0}


def test_calls_that_wait_at_once_for_one_late_rank_count_their_waiting_once():
    """Rank 1 is 30 ms late; rank 0 issues b0 at 0 and b1 at 10 ms, rank 1 at 30 and 40, each
    transfer 5 ms, both calls running at once (gloo's two workers). Rank 0's b0 runs 0-35 and b1
    10-45: it waits 0-30 and 10-40, 60 ms summed, but 0-40 is the 40 ms it lost. Rank 1 waited
    for nobody, and the 40 ms are put down to it (each call's 30 scaled by 40/60). Without the
    starts (an older sender's summary) the sum."""
    recs = {0: record(0, 50, span("all_reduce", 0, 35, tag="b0"), span("all_reduce", 10, 45, tag="b1"), rank=0),
            1: record(0, 50, span("all_reduce", 30, 35, tag="b0"), span("all_reduce", 40, 45, tag="b1"), rank=1)}
    calls = calls_of(recs)
    assert calls[0].starts is not None and calls[1].starts is None  # kept only where calls overlap
    waited, waited_on = waits_both_ways(calls)
    assert waited == approx({0: 40.0, 1: 0.0}) and waited_on == approx({0: 0.0, 1: 40.0})
    assert cross_rank_waits({rank: c._replace(starts=None) for rank, c in calls.items()}) == approx({0: 60.0, 1: 0.0})
    # calls back to back (a blocking strategy, or NCCL's one stream) never overlap: the sum, 2 + 3 ms
    apart = {0: record(0, 50, span("all_reduce", 0, 3, tag="p0"), span("all_reduce", 3, 7, tag="p1"), rank=0),
             1: record(0, 50, span("all_reduce", 2, 3, tag="p0"), span("all_reduce", 6, 7, tag="p1"), rank=1)}
    assert calls_of(apart)[0].starts is None and cross_rank_waits(calls_of(apart)) == approx({0: 5.0, 1: 0.0})


def test_single_rank_or_balanced_ranks_have_no_straggler():
    assert cross_rank_waits(calls_of({3: record(0, 5, span("all_reduce", 0, 5), rank=3)})) == {3: 0.0}
    assert cross_rank_waits(calls_of({})) == {}
    assert straggler({0: 0.0, 1: 0.0}) is None
    assert straggler({0: 1.0, 1: 1.2}, tolerance_ms=0.5) is None
    assert straggler({0: 1.0}) is None


def test_desync_reports_step_and_counts_per_rank():
    recs = {
        1: record(0, 9, span("all_reduce", 0, 1), span("all_reduce", 1, 2),
                  span("all_reduce", 2, 3), rank=1, step=7),
        0: record(0, 9, span("all_reduce", 0, 1), span("all_reduce", 1, 2), rank=0, step=7),
    }
    assert find_desync(calls_of(recs), 7) == Desync(step=7, calls_per_rank={0: 2, 1: 3})
    # waits are only matched over the common prefix of 2 calls (equal durations -> 0)
    assert cross_rank_waits(calls_of(recs)) == approx({0: 0, 1: 0})


def test_equal_call_counts_or_no_records_is_not_a_desync():
    recs = {r: record(0, 9, span("all_reduce", 0, 1), span("broadcast", 1, 2), rank=r)
            for r in range(3)}
    assert find_desync(calls_of(recs), 0) is None
    assert find_desync({}, 0) is None


def test_a_users_hooks_all_reduces_seen_in_different_numbers_are_not_a_desync():
    """PowerSGD on gloo: rank 0 saw its bucket's three all-reduces, rank 1 only the first (the other
    two ran from callbacks on gloo's thread); both issued three. A bucket all-reduce missing is still one."""
    hooked = {0: record(0, 9, span("all_reduce", 0, 1, tag="h0"), span("all_reduce", 1, 2, tag="h1"),
                        span("all_reduce", 2, 3, tag="h2"), rank=0, step=4),
              1: record(0, 9, span("all_reduce", 0, 1, tag="h0"), rank=1, step=4)}
    assert find_desync(calls_of(hooked), 4) is None
    buckets = {0: record(0, 9, span("all_reduce", 0, 1, tag="b0"), span("all_reduce", 1, 2, tag="b1"), rank=0, step=4),
               1: record(0, 9, span("all_reduce", 0, 1, tag="b0"), rank=1, step=4)}
    assert find_desync(calls_of(buckets), 4) == Desync(step=4, calls_per_rank={0: 2, 1: 1})


def test_a_reduce_scatter_count_that_differs_is_a_desync_of_that_kind():
    """ZeRO-2 and FSDP issue no all-reduce: a rank skipping a reduce-scatter is as fatal."""
    recs = [record(0, 9, span("reduce_scatter", 0, 1), span("all_gather", 1, 2), rank=0, step=3),
            record(0, 9, span("reduce_scatter", 0, 1), span("reduce_scatter", 1, 2), span("all_gather", 2, 3),
                   rank=1, step=3)]
    s = segment_figures(recs, world_size=2)
    assert s.desyncs == (Desync(3, {0: 1, 1: 2}, kind="reduce_scatter"),)
    assert "different reduce-scatter counts (rank 0: 1, rank 1: 2)" in s.desync.describe()
    assert s.calls_by_kind == {"all_gather": 1.0, "reduce_scatter": 1.5}  # per rank per step
    assert s.all_reduce_calls == 0


def test_every_collective_kind_counts_as_communication_with_its_bus_factor():
    f = step_figures(record(0, 10, span("all_gather", 0, 4, nbytes=4_000_000), span("forward", 0, 10), rank=0))
    assert f.comm_overhead_pct == approx(40.0) and f.overlap_pct == approx(100.0)
    assert f.calls_by_kind == {"all_gather": 1}
    assert bus_factor("reduce_scatter", 4) == bus_factor("all_gather", 4) == approx(0.75)
    assert bus_factor("all_gather", 1) == 0.0


def test_a_sharded_segments_reduce_scatters_and_all_gathers_have_a_busbw_each_over_the_ranks_they_span():
    """Four ranks, each step one reduce-scatter of the whole 8,000,000-byte bucket in 4 ms
    (algbw 2 GB/s) and two all-gathers of it, in 2 and 8 ms (4 and 1 GB/s), no all-reduce.
    Over the world (n = 4, factor 3/4): RS 2 * 0.75 = 1.5; AG the median of 4 and 1 (2.5) * 0.75
    = 1.875. Named as HSDP's replicas {0, 2} and {1, 3}, each shard group spans one rank of each
    (n = 2, factor 1/2): RS 1.0, AG 1.25. busbw, the all-reduces', stays None."""
    records = [record(100 * step, 100 * step + 20, span("reduce_scatter", 100 * step, 100 * step + 4, nbytes=8_000_000),
                      span("all_gather", 100 * step + 5, 100 * step + 7, nbytes=8_000_000),
                      span("all_gather", 100 * step + 10, 100 * step + 18, nbytes=8_000_000), rank=rank, step=step)
               for step in range(3) for rank in range(4)]
    over_the_world = segment_figures(records, world_size=4)
    assert over_the_world.other_busbw_gbps == approx({"all_gather": 1.875, "reduce_scatter": 1.5})
    assert over_the_world.busbw_gbps is None
    within_replicas = segment_figures(records, world_size=4, groups=[[0, 2], [1, 3]])
    assert within_replicas.other_busbw_gbps == approx({"all_gather": 1.25, "reduce_scatter": 1.0})
    assert segment_figures(records[:0], world_size=4).other_busbw_gbps == {}


def test_busbw_reads_each_kind_the_all_reduces_first():
    assert busbw_text(3.125, {"reduce_scatter": 0.16, "all_gather": 0.32}) == "AR 3.12 AG 0.32 RS 0.16"
    assert busbw_text(None, {"all_gather": 1.25}) == "AG 1.25"  # a sharded segment: no all-reduce
    assert busbw_text(None, {}) == "—"
    assert busbw_text(0.65, {"broadcast": 0.000123}) == "AR 0.65 BC 0.00012"  # a few bytes of buffers: was "BC 0.00"


def test_the_shard_group_of_a_2d_mesh_holds_one_rank_of_each_replica_group():
    # 2 replicas x 4 shards on 8 ranks: replica groups {0, 4}, {1, 5}, {2, 6}, {3, 7}; shard groups of 4
    assert shard_ranks([[0, 4], [1, 5], [2, 6], [3, 7]], 8) == 4
    assert shard_ranks(None, 8) == 8
    assert shard_ranks([[0, 1], [2, 3, 4]], 5) == 5  # not one size: not a mesh, the world


# --- a segment --------------------------------------------------------------------------------


def two_rank_segment() -> list[Record]:
    """4 steps x 2 ranks, each record a 10 MB all_reduce and 8 samples / 1024 tokens.

    rank0, window L: fwd [0, L/2), blocking all_reduce [L/2, 3L/4)
        -> compute 50, exposed 25, idle 25, overlap 0, overhead 25; all_reduce L/4
    rank1, window L: fwd [0, 3L/4), async all_reduce [L/2, L)
        -> compute 75, exposed 25, idle 0, overlap 50, overhead 50; all_reduce L/2
    """
    recs = []
    lengths = {0: [10, 20, 30, 40], 1: [5, 20, 30, 30]}
    starts = [0, 100, 200, 300]
    for rank, ls in lengths.items():
        for step, (t, L) in enumerate(zip(starts, ls, strict=True)):
            if rank == 0:
                spans = (span("forward", t, t + L / 2),
                         span("all_reduce", t + L / 2, t + 3 * L / 4, True, 10_000_000))
            else:
                spans = (span("forward", t, t + 3 * L / 4),
                         span("all_reduce", t + L / 2, t + L, False, 10_000_000))
            recs.append(record(t, t + L, *spans, rank=rank, step=step, samples=8, tokens=1024))
    return recs


def test_segment_means_percentiles_throughput_and_waits():
    s = segment_figures(two_rank_segment(), world_size=2)
    # percentages: mean of rank0 (50,25,25,0,25) and rank1 (75,25,0,50,50)
    assert pcts(s) == approx((62.5, 25, 12.5, 25, 37.5))
    assert s.steps == 4
    assert s.all_reduce_calls == approx(1.0)
    assert s.all_reduce_calls_total == 8
    # all_reduce ms: rank0 2.5+5+7.5+10 = 25, rank1 2.5+10+15+15 = 42.5 -> 67.5 / 8
    assert s.all_reduce_ms == approx(8.4375)
    # step wall = max over ranks = [10,20,30,40]; p50 = 25; p95 at index 2.85 -> 30 + .85*10
    assert (s.step_ms_p50, s.step_ms_p95) == approx((25, 38.5))
    # 4 walls: k = max(1, floor(2 - 1.645 * 2 / 2)) = 1, so the interval is the 1st and 4th: their range
    assert s.step_ms_p50_interval == approx((10, 40))
    # wall time, ranks aligned by the end of each step's last all-reduce (rank0 at t+3L/4, rank1 at t+L):
    # rank0 - rank1 per step 7.5-5 = 2.5, 115-120 = -5, 222.5-230 = -7.5, 330-330 = 0 -> median -2.5 ms
    # rank0 [0, 340), rank1 [0, 330) - 2.5 -> from -2.5 to 340 = 342.5 ms (the sum of windows was 100)
    assert s.wall_s == approx(ms(342.5))
    # 2 ranks * 4 steps * 8 samples = 64 over 342.5 ms
    assert s.samples_per_s == approx(64 / ms(342.5))
    assert s.tokens_per_s == approx(8192 / ms(342.5))
    # algbw = 10 MB / t: rank0 4, 2, 1.333, 1; rank1 4, 1, .667, .667
    # median of 8 = (1 + 1.333) / 2; n = 2 -> bus factor 1
    assert s.busbw_gbps == approx((1 + 4 / 3) / 2)
    # waits per step: rank1 waits 0, 5, 7.5, 5 = 17.5 ms; rank0 never -> mean 17.5 / 8
    assert s.waited_for_others_ms == approx(2.1875)
    assert s.straggler_rank == 0
    assert s.desyncs == ()


def test_segment_per_rank_figures():
    s = segment_figures(two_rank_segment(), world_size=2)
    r0, r1 = s.per_rank[0], s.per_rank[1]
    assert sorted(s.per_rank) == [0, 1]
    assert pcts(r0) == approx((50, 25, 25, 0, 25))
    assert pcts(r1) == approx((75, 25, 0, 50, 50))
    assert (r0.all_reduce_calls, r0.all_reduce_calls_total) == (approx(1.0), 4)
    assert (r0.all_reduce_ms, r1.all_reduce_ms) == approx((6.25, 10.625))
    # rank1 windows [5,20,30,30]: p50 25, p95 at index 2.85 between 30 and 30 -> 30
    assert (r0.step_ms_p50, r0.step_ms_p95) == approx((25, 38.5))
    assert (r1.step_ms_p50, r1.step_ms_p95) == approx((25, 30))
    # 32 samples over each rank's own first start to last end: 340 ms / 330 ms
    assert (r0.samples_per_s, r1.samples_per_s) == approx((32 / ms(340), 32 / ms(330)))
    # rank0 algbw [1, 1.333, 2, 4] -> median 1.667; rank1 [.667, .667, 1, 4] -> .833
    assert (r0.busbw_gbps, r1.busbw_gbps) == approx((5 / 3, 5 / 6))
    assert (r0.waited_for_others_ms, r1.waited_for_others_ms) == approx((0, 4.375))


def test_segment_as_dict_keys():
    d = segment_figures(two_rank_segment(), world_size=2).as_dict()
    required = {"compute_pct", "non_compute_pct", "idle_pct", "overlap_pct", "comm_overhead_pct",
                "all_reduce_calls", "all_reduce_ms", "step_ms_p50", "step_ms_p95",
                "samples_per_s", "tokens_per_s", "busbw_gbps", "waited_for_others_ms", "per_rank"}
    assert required <= d.keys()
    assert required - {"per_rank"} <= d["per_rank"][1].keys()
    assert d["per_rank"][1]["compute_pct"] == approx(75)
    assert d["desyncs"] == []


def test_segment_collects_desyncs_and_replaces_repeated_records():
    recs = [
        record(0, 10, span("all_reduce", 0, 1), rank=0, step=0),
        record(0, 10, span("all_reduce", 0, 1), rank=1, step=0),
        record(10, 20, span("all_reduce", 10, 11), rank=0, step=1),
        record(10, 20, rank=1, step=1),
        # a re-sent step 0 of rank 1 replaces the first one: now 2 calls vs rank0's 1
        record(0, 10, span("all_reduce", 0, 1), span("all_reduce", 2, 3), rank=1, step=0),
    ]
    s = segment_figures(recs, world_size=2)
    assert s.desyncs == (Desync(0, {0: 1, 1: 2}), Desync(1, {0: 1, 1: 0}))
    assert s.all_reduce_calls_total == 4  # 1 + 2 + 1 + 0
    assert s.as_dict()["desyncs"][1] == {"step": 1, "calls_per_rank": {0: 1, 1: 0}, "kind": "all_reduce"}


def test_segment_overlap_mean_skips_steps_without_comm_and_zero_windows_skip_percentages():
    # step0: bwd [0,4) with async all_reduce [2,4) -> overlap 100; step1: compute only;
    # step2: zero-length window. Overlap mean over step0 only = 100.
    # compute means over steps 0,1 only: (100 + 50) / 2 = 75
    recs = [
        record(0, 4, span("backward", 0, 4), span("all_reduce", 2, 4), step=0),
        record(10, 14, span("forward", 10, 12), step=1),
        record(20, 20, step=2),
    ]
    s = segment_figures(recs, world_size=1)
    assert s.overlap_pct == approx(100)
    assert s.compute_pct == approx(75)
    assert s.steps == 3
    assert s.busbw_gbps is None  # no bytes recorded


def test_empty_segment_is_zeros_and_none():
    s = segment_figures([], world_size=4)
    assert pcts(s) == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert (s.steps, s.all_reduce_calls, s.all_reduce_ms) == (0, 0.0, 0.0)
    assert (s.step_ms_p50, s.step_ms_p95, s.samples_per_s, s.tokens_per_s) == (0.0, 0.0, 0.0, 0.0)
    assert s.busbw_gbps is None and s.straggler_rank is None
    assert s.per_rank == {} and s.desyncs == ()
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in s.as_dict().values())


# --- throughput over wall time -------------------------------------------------------------


def test_samples_per_s_divides_by_wall_time_from_first_start_to_last_end_with_ranks_aligned():
    # 3 steps of 10 ms starting every 50 ms: 40 ms between steps (data loading, logging) is still time.
    # rank1's clock is 100 s ahead and its steps start 2 ms earlier; both leave the all-reduce at t+8.
    # rank0 [0, 110); rank1 [100 s - 2, 100 s + 110) - 100 s = [-2, 110) -> wall 112 ms
    # 2 ranks x 3 steps x 4 samples = 24 -> 24 / 0.112 s; the sum of step windows (3 x 12 ms) gave 666.7
    recs = []
    for step, t in enumerate((0, 50, 100)):
        recs.append(record(t, t + 10, span("all_reduce", t + 5, t + 8), rank=0, step=step, samples=4, tokens=40))
        u = t + 100_000
        recs.append(record(u - 2, u + 10, span("all_reduce", u + 4, u + 8), rank=1, step=step, samples=4, tokens=40))
    s = segment_figures(recs, world_size=2)
    assert s.wall_s == approx(ms(112))
    assert s.samples_per_s == approx(24 / ms(112))
    assert s.tokens_per_s == approx(240 / ms(112))
    assert s.per_rank[1].samples_per_s == approx(12 / ms(112))  # its own clock: -2 to 110


def test_wall_time_leaves_out_the_loops_pauses_within_it_the_least_any_rank_paused():
    # 3 steps of 10 ms at 0, 50 and 300 ms on both ranks (one clock); before step 2 the loop
    # evaluated: rank0 paused 230 ms (70-300, ending where step 2 begins), rank1 220 ms; before step 0
    # both paused 500 ms, which is before the wall begins. Wall 0-310 = 310 ms, less the least
    # pause within it (220 ms) = 90 ms: 2 ranks x 3 steps x 4 samples = 24 -> 24 / 0.090 s.
    # Each rank's own wall takes its own pauses: rank0 310 - 230 = 80 ms, 12 samples.
    recs = []
    for step, t in enumerate((0, 50, 300)):
        for rank, paused in ((0, {0: 500, 2: 230}), (1, {0: 500, 2: 220})):
            recs.append(replace(record(t, t + 10, span("all_reduce", t + 5, t + 8), rank=rank, step=step, samples=4),
                                paused_s=ms(paused.get(step, 0))))
    s = segment_figures(recs, world_size=2)
    assert s.wall_s == approx(ms(90))
    assert s.samples_per_s == approx(24 / ms(90))
    assert s.per_rank[0].samples_per_s == approx(12 / ms(80))
    assert s.step_ms_p50 == approx(10)  # the windows themselves hold no pause


def test_clock_alignment_takes_the_median_anchor_offset_and_falls_back_to_step_starts():
    clocks = ClockAlignment()
    # anchors (ms): rank1 - rank0 = +100, +100, +130 (a late completion stamp) -> median 100
    for step, late in enumerate((0, 0, 30)):
        t = 50 * step
        clocks.add_step({0: step_times(record(t, t + 10, span("all_reduce", t, t + 8))),
                         1: step_times(record(t + 100, t + 110, span("all_reduce", t + 100, t + 108 + late))),
                         2: step_times(record(t - 7, t + 3, rank=2))})  # no all-reduce: by step starts
    assert clocks.offsets() == approx({0: 0.0, 1: ms(-100), 2: ms(7)})
    assert clocks.wall_s() == approx(ms(110))  # every rank from 0 to 110 on rank0's clock


# --- what enters a figure ----------------------------------------------------------------------


def test_excluded_and_unresolved_reports_are_not_counted() -> None:
    @dataclass(frozen=True)
    class Flagged:
        excluded: bool = False
        unresolved: bool = False

    assert counted(Flagged()) and not counted(Flagged(excluded=True)) and not counted(Flagged(unresolved=True))


def test_calls_per_rank_per_step_are_written_as_whole_numbers_when_whole():
    assert [calls_text(v) for v in (57.0, 56.5, 12.25, 0.0, 2 / 3)] == ["57", "56.5", "12.25", "0", "0.67"]


# --- pairing collectives across ranks ------------------------------------------------------


def test_waits_pair_calls_by_tag_so_a_missing_call_does_not_shift_the_later_pairs():
    # rank0: p0 2 ms, p1 3 ms, p2 1 ms; rank1 skipped p1: p0 3 ms, p2 2 ms
    # by tag: p0 transfer 2 -> rank1 waits 1; p2 transfer 1 -> rank1 waits 1; p1 has no pair -> {0: 0, 1: 2}
    # by position it was p0/p0 (rank1 +1) and p1/p2 (3 vs 2: rank0 +1) -> {0: 1, 1: 1}
    recs = {
        0: record(0, 20, span("all_reduce", 0, 2, tag="p0"), span("all_reduce", 2, 5, tag="p1"),
                  span("all_reduce", 5, 6, tag="p2"), rank=0),
        1: record(0, 20, span("all_reduce", 0, 3, tag="p0"), span("all_reduce", 5, 7, tag="p2"), rank=1),
    }
    assert cross_rank_waits(calls_of(recs)) == approx({0: 0, 1: 2})


def test_a_tag_repeated_in_a_step_pairs_its_kth_call_and_untagged_calls_pair_by_position():
    # two micro-steps each reduce p0: the 1st p0 pairs with the 1st, the 2nd with the 2nd
    # rank0 p0 [1, 4], untagged [2]; rank1 p0 [2, 1], untagged [5] (rank1 issued an extra "b0" too)
    # p0#0: min 1 -> rank1 +1; p0#1: min 1 -> rank0 +3; untagged#0: min 2 -> rank1 +3
    recs = {
        0: record(0, 50, span("all_reduce", 0, 1, tag="p0"), span("all_reduce", 10, 14, tag="p0"),
                  span("all_reduce", 20, 22), rank=0),
        1: record(0, 50, span("all_reduce", 0, 2, tag="p0"), span("all_reduce", 5, 6, tag="b0"),
                  span("all_reduce", 10, 11, tag="p0"), span("all_reduce", 20, 25), rank=1),
    }
    assert cross_rank_waits(calls_of(recs)) == approx({0: 3, 1: 4})


# --- the straggler rule ------------------------------------------------------------------------


def waiting_segment(steps: int, rank1_ms: float, rank0_ms: float = 5.0) -> list[Record]:
    """Steps of 100 ms; rank0's all-reduce takes ``rank0_ms``, rank1's ``rank1_ms``: rank1 waits the difference."""
    recs = []
    for step in range(steps):
        t = 200 * step
        recs.append(record(t, t + 100, span("all_reduce", t + 90 - rank0_ms, t + 90, tag="b0"), rank=0, step=step))
        recs.append(record(t, t + 100, span("all_reduce", t + 90 - rank1_ms, t + 90, tag="b0"), rank=1, step=step))
    return recs


def test_straggler_rank_is_none_when_the_others_waited_under_ten_percent_of_step_time():
    # rank1 waits 0.5 ms of each 100 ms step (0.5 %): noise, not a straggler (it used to name rank 0)
    s = segment_figures(waiting_segment(12, rank1_ms=5.5), world_size=2)
    assert s.straggler_rank is None and s.straggler is None


def test_straggler_rank_is_named_when_the_others_waited_over_ten_percent_over_the_last_ten_steps():
    # rank1 waits 20 - 5 = 15 ms of each 100 ms step over steps 2-11 (the last ten): 15 % > 10 %
    s = segment_figures(waiting_segment(12, rank1_ms=20.0), world_size=2)
    assert s.straggler_rank == 0
    assert s.straggler == Straggler(0, 2, 11, 10, approx(15.0), approx(15.0))
    assert s.straggler.describe() == ("rank 0 is a straggler: over steps 2-11 the others waited 15.0 ms a step for it "
                                      "(15% of step time)")
    assert Straggler.from_dict(s.as_dict()["straggler"]) == s.straggler


def test_find_straggler_looks_only_at_the_last_ten_steps():
    # steps 0-1: rank1 waited 90 ms of 100; steps 2-11: 1 ms each. The last ten (2-11): 10 of 1000 ms = 1 %
    # -> no straggler; steps 0-9 alone: 2 x 90 + 8 x 1 = 188 of 1000 ms = 18.8 % -> rank 0
    steps = [StepWaits(s, {0: 0.0, 1: 90.0 if s < 2 else 1.0}, 100.0) for s in range(12)]
    assert find_straggler(steps) is None
    assert find_straggler(steps[:STRAGGLER_STEPS]) == Straggler(0, 0, 9, 10, approx(18.8), approx(18.8))
    assert find_straggler([]) is None
    # steps of no length (a rank's hostile reports: valid on the wire): no share of them to name,
    # where the share's division raised ZeroDivisionError and no export was written
    assert find_straggler([StepWaits(s, {0: 0.0, 1: 90.0}, 0.0) for s in range(3)]) is None


def test_ranks_that_wait_for_each_other_by_turns_name_no_straggler():
    # 2 ranks, 150 ms steps: rank 0 waited 40 ms a step, rank 1 50. Rank 1 waited more than 10 %
    # (15 ms) but only 10 ms a step more than rank 0 did, 6.7 %: both were kept waiting, neither
    # is late. With rank 0 waiting 2 ms a step, rank 1's 48 more (32 %) name it.
    by_turns = [StepWaits(s, {0: 40.0, 1: 50.0}, 150.0) for s in range(10)]
    assert find_straggler(by_turns) is None
    late = [StepWaits(s, {0: 2.0, 1: 50.0}, 150.0) for s in range(10)]
    assert find_straggler(late) == Straggler(0, 0, 9, 10, approx(48.0), approx(32.0))


def test_the_straggler_is_found_within_the_groups_that_all_reduce_together():
    # Two DDPs on {0, 1} and {2, 3} (the by-hand run in the README, rank 3 sleeping 30 ms a
    # step), 214 ms steps, waited a step: 0: 82, 1: 97, 2: 135, 3: 66 ms. Within {2, 3} rank 3
    # waited least, and rank 2 69 ms a step more (32 %): rank 3. Within {0, 1}, 15 ms (7 %):
    # nobody. Over the world rank 3 was named with 82 ms, "waited for it" by ranks 0 and 1,
    # which never all-reduce with it.
    steps = [StepWaits(s, {0: 82.0, 1: 97.0, 2: 135.0, 3: 66.0}, 214.0) for s in range(10)]
    assert find_straggler(steps, [[0, 1], [2, 3]]) == Straggler(3, 0, 9, 10, approx(69.0), approx(100 * 69 / 214))
    assert find_straggler(steps, [[0, 1], [2, 3]]).describe().endswith("waited 69.0 ms a step for it (32% of step time)")
    assert find_straggler([StepWaits(s, {0: 82.0, 1: 97.0, 2: 84.0, 3: 96.0}, 214.0) for s in range(10)], [[0, 1], [2, 3]]) is None


def sharded_steps(late: int, world: int = 2, steps: int = 10) -> list[Record]:
    """``zero2``-like steps of 100 ms, no all-reduce: each a reduce-scatter tagged b0 from 40 ms and
    an all-gather tagged b0 from 60 ms, 4 and 2 ms where nobody waits; rank ``late`` reaches the
    reduce-scatter 30 ms after the others, who sit in it from 40 to 74 ms (34 ms: 30 of waiting)."""
    records = []
    for step in range(steps):
        t = 1000 * step
        for rank in range(world):
            scatter = span("reduce_scatter", t + 70, t + 74, tag="b0") if rank == late else span("reduce_scatter", t + 40, t + 74, tag="b0")
            records.append(record(t, t + 100, span("backward", t, t + 40), scatter, span("all_gather", t + 80, t + 82, tag="b0"),
                                  rank=rank, step=step))
    return records


def test_ranks_of_a_sharded_strategy_wait_for_a_late_one_in_its_reduce_scatters():
    """Two ranks, rank 1 late: rank 0 waits 30 ms a step in the reduce-scatter (34 less the
    shortest, 4), 30 % of the 100 ms step: rank 1 is named. Before, with no all-reduce to pair,
    both ranks read 0 ms waited and nobody was named."""
    s = segment_figures(sharded_steps(late=1), world_size=2)
    assert s.per_rank[0].waited_for_others_ms == approx(30.0) and s.per_rank[1].waited_for_others_ms == 0.0
    assert s.straggler_rank == 1 and s.straggler.waited_ms_per_step == approx(30.0)


def test_on_hsdps_mesh_reduce_scatters_are_paired_within_the_shard_groups():
    """2 replicas x 2 shards: replica groups {0, 2} and {1, 3}, shard groups {0, 1} and {2, 3}.
    Rank 1 late in the reduce-scatter: rank 0, in its shard group, waits 30 ms; ranks 2 and 3,
    which never reduce-scatter with it, wait for nobody (over the world each read 30)."""
    assert shard_groups([[0, 2], [1, 3]]) == [[0, 1], [2, 3]]
    assert shard_groups(None) is None and shard_groups([[0, 1], [2, 3, 4]]) is None
    records = sharded_steps(late=1, world=4, steps=1)
    figures = {rec.rank: step_figures(rec) for rec in records}
    waited, waited_for = step_waits({rank: call_times(rec) for rank, rec in enumerate(records)}, figures, [[0, 2], [1, 3]])
    assert waited == approx({0: 30.0, 1: 0.0, 2: 0.0, 3: 0.0}) and waited_for == approx({0: 0.0, 1: 30.0, 2: 0.0, 3: 0.0})
    assert step_waits({rank: call_times(rec) for rank, rec in enumerate(records)}, figures)[0] == approx({0: 30.0, 1: 0.0, 2: 30.0, 3: 30.0})


def test_ranks_sitting_in_a_barrier_for_a_late_one_name_it_as_a_reduce_scatter_would():
    """A loop that meets at ``dist.barrier()`` after its update, rank 1 late by its own work:
    each step, one 4 ms all-reduce together (no one waits there), then rank 0 sits in the
    barrier 60-94 ms and rank 1 90-94. The barrier's shortest stay, 4 ms, is the barrier
    itself; rank 0 waited the other 30 ms for rank 1, 30 % of the 100 ms step: rank 1 is
    named. Before, the barrier's wait was paired with nothing: 0 ms waited, nobody named. The
    ranks' summaries carry the barrier among the sharded calls (``wait:barrier``), so the
    figures from them are the same."""
    from instrumented_ddp.wire.messages import StepReport
    from instrumented_ddp.wire.step_figures import summarize, summary_calls, summary_figures

    records = []
    for step in range(10):
        t = 1000 * step
        for rank, sits_from in ((0, 60), (1, 90)):
            records.append(record(t, t + 100, span("backward", t, t + 40), span("all_reduce", t + 40, t + 44, True, 8, "b0"),
                                  span("wait", t + sits_from, t + 94, blocking=True, tag="barrier"), rank=rank, step=step))
    assert [s.tag for s in sharded_collectives(records[0])] == ["barrier"]
    assert step_figures(records[0]).sharded_calls.tags == ("wait:barrier",)
    s = segment_figures(records, world_size=2)
    assert s.per_rank[0].waited_for_others_ms == approx(30.0) and s.per_rank[1].waited_for_others_ms == 0.0
    assert s.straggler_rank == 1 and s.straggler.waited_ms_per_step == approx(30.0)
    assert s.straggler.share_pct == approx(30.0)
    first = {rec.rank: rec for rec in records[:2]}
    summaries = {rank: summarize(StepReport(rank, 0, "ddp", {}, rec.start, rec.end, list(rec.spans), 0, 0, None), world_size=2)
                 for rank, rec in first.items()}
    from_spans = step_waits({rank: call_times(rec) for rank, rec in first.items()}, {rank: step_figures(rec) for rank, rec in first.items()})
    assert from_spans == (approx({0: 30.0, 1: 0.0}), approx({0: 0.0, 1: 30.0}))
    assert step_waits({r: summary_calls(m) for r, m in summaries.items()}, {r: summary_figures(m) for r, m in summaries.items()}) == from_spans


def test_on_hsdps_mesh_a_barrier_is_paired_over_the_world_and_its_reduce_scatters_within_the_shard_groups():
    """2 replicas x 2 shards (replica groups {0, 2} and {1, 3}, shard groups {0, 1} and {2, 3}).
    Each rank reduce-scatters 40-44 ms (no one waits there), then meets every other at a barrier:
    ranks 0, 1 and 2 sit in it 60-94 ms, rank 3 arrives at 90 and leaves at 94. Over the world
    the barrier itself is rank 3's 4 ms, and each of the three others waited 30 ms for rank 3
    (90 put down to it). Paired within the shard groups, as the reduce-scatters are, ranks 0 and
    1 met only each other, both 34 ms, and read 0 waited: only rank 2 waited, 30."""
    from ddpwatch.figures.cross_rank import sharded_pairings

    records = [record(0, 100, span("backward", 0, 40), span("reduce_scatter", 40, 44, True, 8, "u0"),
                      span("wait", 90 if rank == 3 else 60, 94, blocking=True, tag="barrier"), rank=rank) for rank in range(4)]
    figures = {rec.rank: step_figures(rec) for rec in records}
    calls = {rec.rank: call_times(rec) for rec in records}
    waited, waited_for = step_waits(calls, figures, [[0, 2], [1, 3]])
    assert waited == approx({0: 30.0, 1: 30.0, 2: 30.0, 3: 0.0}) and waited_for == approx({0: 0.0, 1: 0.0, 2: 0.0, 3: 90.0})
    pairings = sharded_pairings({rank: f.sharded_calls for rank, f in figures.items()}, [[0, 2], [1, 3]])
    assert [(sorted(c), among, [s.kind for s in spans(records[0])]) for c, among, spans in pairings] == [
        ([0, 1, 2, 3], [[0, 1], [2, 3]], ["reduce_scatter"]), ([0, 1, 2, 3], None, ["wait"])]
    by_pairing = [waiting_intervals(c, {rec.rank: rec for rec in records}, among, collectives=spans) for c, among, spans in pairings]
    assert by_pairing[1][0] == [(approx(0.060), approx(0.090))] and by_pairing[0][0] == []
    # Over the world (no groups named) everything is one pairing, as before.
    assert len(sharded_pairings({rank: f.sharded_calls for rank, f in figures.items()}, None)) == 1
    assert step_waits(calls, figures)[0] == approx(waited)
    # A barrier of a group of the loop's own stays with the reduce-scatters (paired within the shard
    # groups), and their spans line up with their calls: rank 1 sits in it 95-99 for rank 0 (98-99).
    records = [replace(rec, spans=(*rec.spans, span("wait", 98 if rec.rank in (0, 3) else 95, 99, blocking=True, tag="barrier@7")))
               for rec in records]
    figures = {rec.rank: step_figures(rec) for rec in records}
    pairings = sharded_pairings({rank: f.sharded_calls for rank, f in figures.items()}, [[0, 2], [1, 3]])
    assert [c[0].tags for c, *_ in pairings] == [("reduce_scatter:u0", "wait:barrier@7"), ("wait:barrier",)]
    rest, among, spans = pairings[0]
    assert [s.tag for s in spans(records[1])] == ["u0", "barrier@7"]
    assert waiting_intervals(rest, {rec.rank: rec for rec in records}, among, collectives=spans)[1] == [(approx(0.095), approx(0.098))]


def test_barriers_of_two_groups_meet_only_their_own_groups_ranks():
    """Ranks 0 and 1 meet at a barrier of their group (``barrier@1``), ranks 2 and 3 at their
    own (``barrier@2``), at once: rank 1 sits 60-94 ms for rank 0 (90-94), rank 3 60-94 for
    rank 2. Tagged alike, the four read as one world barrier, whose last arrival (ties: the lowest
    rank) rank 0 had kept both waiting: rank 3's 30 ms put down to rank 0, with which it never met.
    With their groups' names in the tags no call is common to the world, and nobody is blamed
    (ddpwatch does not know a group's ranks from its name: paired only where every rank of a
    pairing made the call)."""
    from instrumented_ddp.wire.kinds import barrier_tag, is_barrier_wait

    assert barrier_tag() == "barrier" and barrier_tag("1") == "barrier@1"
    assert is_barrier_wait(span("wait", 0, 1, True, tag="barrier@1")) and not is_barrier_wait(span("wait", 0, 1, True, tag="b0"))
    sits = {0: (90, "1"), 1: (60, "1"), 2: (90, "2"), 3: (60, "2")}
    records = {rank: record(0, 100, span("wait", at, 94, blocking=True, tag=barrier_tag(group)), rank=rank)
               for rank, (at, group) in sits.items()}
    figures = {rank: step_figures(rec) for rank, rec in records.items()}
    assert step_waits(calls_of(records), figures)[0] == approx({0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0})
    alike = {rank: record(0, 100, span("wait", at, 94, blocking=True, tag="barrier"), rank=rank) for rank, (at, _) in sits.items()}
    assert step_waits(calls_of(alike), {rank: step_figures(rec) for rank, rec in alike.items()}) == (
        approx({0: 0.0, 1: 30.0, 2: 0.0, 3: 30.0}), approx({0: 60.0, 1: 0.0, 2: 0.0, 3: 0.0}))


def test_an_all_reduce_and_a_reduce_scatter_waiting_at_once_count_that_waiting_once():
    """HSDP on a GPU: a unit's all-reduce across replicas (FSDP2's own stream) beside the next
    unit's reduce-scatter. Rank 0's all-reduce runs 0-40 ms and its reduce-scatter 10-50; rank 1
    enters them at 30 and 40, so each call's transfer is 10 ms and rank 0 waited 30 ms in each:
    0-30 and 10-40, which cover 0-40, 40 ms, not 60. Each kind's 30 is scaled by 40/60 (20 + 20),
    so the 40 ms put down to rank 1 still equals what rank 0 waited. Before, 60 and 60."""
    from instrumented_ddp.wire.messages import StepReport
    from instrumented_ddp.wire.step_figures import summarize, summary_calls, summary_figures

    r0 = record(0, 100, span("all_reduce", 0, 40, tag="b0", nbytes=8), span("reduce_scatter", 10, 50, tag="u0", nbytes=8), rank=0)
    r1 = record(0, 100, span("all_reduce", 30, 40, tag="b0", nbytes=8), span("reduce_scatter", 40, 50, tag="u0", nbytes=8), rank=1)
    figures = {0: step_figures(r0), 1: step_figures(r1)}
    # Neither rank's calls of one kind overlap each other; rank 0's of the two kinds do, so its
    # starts travel for both kinds (rank 1's, which overlap nothing, do not).
    calls = {0: call_times(r0), 1: call_times(r1)}
    assert calls[0].starts is not None and figures[0].sharded_calls.starts is not None
    assert calls[1].starts is None and figures[1].sharded_calls.starts is None
    waited, waited_for = step_waits(calls, figures)
    assert waited == approx({0: 40.0, 1: 0.0}) and waited_for == approx({0: 0.0, 1: 40.0})
    # ... and from the ranks' summaries, the same, bit for bit
    summaries = {rec.rank: summarize(StepReport(rec.rank, rec.step, "fsdp", {}, rec.start, rec.end, list(rec.spans), 0, 0, None),
                                     world_size=2) for rec in (r0, r1)}
    assert step_waits({r: summary_calls(s) for r, s in summaries.items()},
                      {r: summary_figures(s) for r, s in summaries.items()}) == (waited, waited_for)


# --- a desync stays --------------------------------------------------------------------------


def test_desync_range_covers_first_to_last_affected_step_and_counts_them():
    recs = []
    for step in range(6):
        calls = 3 if step in (2, 5) else 2  # rank1 issued an extra call at steps 2 and 5
        recs.append(record(10 * step, 10 * step + 9, *(span("all_reduce", 10 * step + i, 10 * step + i + 1)
                                                       for i in range(2)), rank=0, step=step))
        recs.append(record(10 * step, 10 * step + 9, *(span("all_reduce", 10 * step + i, 10 * step + i + 1)
                                                       for i in range(calls)), rank=1, step=step))
    s = segment_figures(recs, world_size=2)
    assert s.desync == DesyncRange(2, 5, 2, Desync(2, {0: 2, 1: 3}), Desync(5, {0: 2, 1: 3}))
    assert s.desync.describe() == ("DESYNC at steps 2-5 (2 steps): the ranks issued different all-reduce counts "
                                   "(step 2: rank 0: 2, rank 1: 3; step 5: rank 0: 2, rank 1: 3)")
    import json
    assert DesyncRange.from_dict(json.loads(json.dumps(s.as_dict()["desync"]))) == s.desync
    one = DesyncRange.of(Desync(9, {0: 1, 1: 0}))
    assert one.describe() == "DESYNC at step 9: the ranks issued different all-reduce counts (rank 0: 1, rank 1: 0)"
    assert DesyncRange.combine([s.desync, None, one]) == DesyncRange(2, 9, 3, s.desync.first, one.last)
    assert DesyncRange.combine([None]) is None


def test_segment_hidden_communication_is_the_mean_share_of_the_window_compute_ran_beside():
    # step0 (10 ms): backward [0,8), all_reduce [6,10): |C∩M| = 2 ms -> 20 % of the window
    #   (Overlap 50 % of M = 4 ms, Comm_overhead 40 %: 50 * 40 / 100 = 20).
    # step1 (10 ms): forward [10,15), all_reduce [15,20): nothing hidden -> 0 %.
    # step2 (0 ms) carries no time and is left out. Mean over steps 0,1: 10 %.
    recs = [
        record(0, 10, span("backward", 0, 8), span("all_reduce", 6, 10), step=0),
        record(10, 20, span("forward", 10, 15), span("all_reduce", 15, 20), step=1),
        record(30, 30, step=2),
    ]
    s = segment_figures(recs, world_size=1)
    assert s.hidden_comm_pct == approx(10)
    assert s.overlap_pct == approx(25)  # (50 + 0) / 2
    assert s.compute_pct == approx(65)  # (80 + 50) / 2


def test_both_ways_is_the_waits_and_the_waited_for_from_one_pass():
    recs = three_ranks_two_calls()
    assert waits_both_ways(calls_of(recs)) == (approx(cross_rank_waits(calls_of(recs))), approx({0: 3, 1: 6, 2: 0}))
    assert waits_both_ways(calls_of({})) == ({}, {})


def test_a_float_reservoir_holds_every_value_in_order_until_full_then_a_uniform_sample_of_all() -> None:
    from ddpwatch.figures.float_reservoir import FloatReservoir

    ring = FloatReservoir(size=5)
    assert len(ring) == 0 and list(ring.values()) == []
    ring.extend([1.0, 2.0])
    ring.append(3.0)
    assert list(ring.values()) == [1.0, 2.0, 3.0]
    ring.extend([4.0, 5.0, 6.0, 7.0])  # past the size: 5 of the 7, each one of them
    assert len(ring) == 5 and set(ring.values()) <= {1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0}
    big = FloatReservoir(size=200)
    big.extend(float(v) for v in range(150))  # grows from its first small buffer
    big.extend(float(v) for v in range(150, 200))
    assert list(big.values()) == [float(v) for v in range(200)]


def test_a_full_float_reservoirs_median_is_every_values_not_the_last_ones() -> None:
    """The helper's case at 64 ranks, 128 calls a rank, added rank by rank as a step folds:
    ranks 0-39 at 1 GB/s, 40-63 at 3. The median of all 8,192 is 1 (5,120 of them are); the last
    4,096 held were ranks 32-63's, 24 of 32 at 3: a median of 3. Kept uniformly, a sample of 4,096
    holds 62.5 % ones, give or take 0.8 % (one standard deviation): its median is 1."""
    from array import array

    from ddpwatch.figures.float_reservoir import FloatReservoir
    from ddpwatch.figures.order_statistics import median_of

    ring = FloatReservoir(size=4096)
    for rank in range(64):
        ring.extend(array("d", [1.0 if rank < 40 else 3.0] * 128))
    assert len(ring) == 4096 and float(median_of(ring.values())) == 1.0
    again = FloatReservoir(size=4096)
    for rank in range(64):
        again.extend(array("d", [1.0 if rank < 40 else 3.0] * 128))
    assert list(again.values()) == list(ring.values())  # seeded: the same values, the same figures


def test_a_float_reservoir_takes_values_one_by_one_and_as_c_doubles_as_it_takes_any_iterable() -> None:
    """The fast paths (a value written in place; an ``array('d')`` read as a buffer) keep the
    same values through growing and sampling."""
    from array import array

    from ddpwatch.figures.float_reservoir import FloatReservoir

    one_by_one, as_arrays, as_lists = FloatReservoir(size=100), FloatReservoir(size=100), FloatReservoir(size=100)
    for start in range(0, 250, 7):
        chunk = [float(v) for v in range(start, start + 7)]
        as_arrays.extend(array("d", chunk))
        as_lists.extend(chunk)
    for value in range(100):  # to full, one at a time
        one_by_one.append(float(value))
    assert list(as_arrays.values()) == list(as_lists.values())
    assert list(one_by_one.values()) == [float(v) for v in range(100)]
    as_arrays.extend(array("d"))  # nothing to add
    assert list(as_arrays.values()) == list(as_lists.values())


def test_a_segments_median_step_interval_narrows_with_its_steps() -> None:
    """Nine steps of walls 10, 20, ... 90 ms (both ranks alike): k = floor(4.5 - 1.645 * 3 / 2) =
    floor(2.03) = 2, so the 2nd and 8th: 20 and 80 ms, around the median 50."""
    records = [record(100 * step, 100 * step + 10 * (step + 1), rank=rank, step=step) for step in range(9) for rank in (0, 1)]
    s = segment_figures(records, world_size=2)
    assert s.step_ms_p50 == approx(50) and s.step_ms_p50_interval == approx((20, 80))
