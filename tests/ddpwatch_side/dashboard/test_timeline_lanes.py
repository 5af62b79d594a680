"""The dashboard's timeline lanes of one step (``timeline_lanes.timeline_of``), hand-worked."""

from __future__ import annotations

from msgspec.structs import replace

from ddpwatch.dashboard.views.timeline_lanes import (barrier_text, data_collectives_text, loop_collectives_text, loop_compute_text, nograd_text,
                                               paused_text, pick_timeline_ranks, timeline_of)
from ddpwatch.figures.cross_rank import calls_of
from instrumented_ddp.wire.messages import Span, StepReport


def report(rank: int, spans: list[Span], end: float = 0.100) -> StepReport:
    return StepReport(rank=rank, step=4, strategy="simple", settings={}, start=0.0, end=end, spans=spans,
                      samples=1, tokens=1, loss=None)


def test_exposed_all_reduce_splits_into_waiting_for_the_other_rank_and_transfer() -> None:
    # Both ranks leave the blocking all-reduce together at 80 ms (the timeline aligns them there).
    # rank 0 enters at 50 ms, rank 1 at 70 ms: the transfer is rank 1's 10 ms (70-80), so rank 0
    # waited 50-70 for rank 1 to arrive. Nothing computes beside it: all of it is exposed.
    r0 = report(0, [Span("backward", 0.0, 0.050), Span("all_reduce", 0.050, 0.080, True, 400, "p0", "float32")])
    r1 = report(1, [Span("backward", 0.0, 0.070), Span("all_reduce", 0.070, 0.080, True, 400, "p0", "float32")])
    lanes = {lane.rank: lane for lane in timeline_of(4, {0: r0, 1: r1}, calls_of({0: r0, 1: r1})).ranks}
    assert lanes[0].exposed == ((0.050, 0.080),)
    assert len(lanes[0].exposed_waiting) == 1
    start, end = lanes[0].exposed_waiting[0]
    assert (round(start, 9), round(end, 9)) == (0.050, 0.070)
    assert lanes[1].exposed == ((0.070, 0.080),) and lanes[1].exposed_waiting == ()


def test_exposed_reduce_scatter_splits_into_waiting_and_transfer_as_an_all_reduce_does() -> None:
    # zero2's steps have no all-reduce: the ranks line up at their starts. rank 0 enters the
    # reduce-scatter at 50 ms, rank 1 at 70: rank 0 waited 50-70 (drawn orange). Before, all of
    # it read as transfer.
    from instrumented_ddp.wire.step_figures import step_figures

    r0 = report(0, [Span("backward", 0.0, 0.050), Span("reduce_scatter", 0.050, 0.080, True, 400, "b0", "float32")])
    r1 = report(1, [Span("backward", 0.0, 0.070), Span("reduce_scatter", 0.070, 0.080, True, 400, "b0", "float32")])
    reports = {0: r0, 1: r1}
    data = timeline_of(4, reports, calls_of(reports), sharded_calls={rank: step_figures(r).sharded_calls for rank, r in reports.items()})
    lanes = {lane.rank: lane for lane in data.ranks}
    assert [(round(a, 9), round(b, 9)) for a, b in lanes[0].exposed_waiting] == [(0.050, 0.070)]
    assert lanes[1].exposed_waiting == ()
    assert {lane.rank: lane.exposed_waiting for lane in timeline_of(4, reports, calls_of(reports)).ranks} == {0: (), 1: ()}


def test_waiting_hidden_behind_compute_is_not_exposed() -> None:
    # rank 0's asynchronous all-reduce 20-60 ms runs beside backward until 50: of its 20 ms of
    # waiting (rank 1 enters at 40 and transfers 40-60), 20-40 is hidden, so nothing exposed waits.
    r0 = report(0, [Span("backward", 0.0, 0.050), Span("all_reduce", 0.020, 0.060, False, 400, "b0", "float32")])
    r1 = report(1, [Span("backward", 0.0, 0.040), Span("all_reduce", 0.040, 0.060, False, 400, "b0", "float32")])
    lanes = {lane.rank: lane for lane in timeline_of(4, {0: r0, 1: r1}, calls_of({0: r0, 1: r1})).ranks}
    assert lanes[0].exposed == ((0.050, 0.060),)
    assert lanes[0].exposed_waiting == ()


def test_data_is_drawn_apart_and_never_hides_communication() -> None:
    # rank 0 loads its batch 0-30 ms while its all-reduce 20-40 ms runs; backward 30-50 ms: loading is
    # not compute, so 20-30 is exposed and 30-40 hidden. Painted, data shows where nothing computes.
    from ddpwatch.dashboard.widgets.timeline_view import TimelineView

    r0 = report(0, [Span("data", 0.0, 0.030), Span("backward", 0.030, 0.050),
                    Span("all_reduce", 0.020, 0.040, False, 400, "b0", "float32")], end=0.050)
    lane = timeline_of(4, {0: r0}, calls_of({0: r0})).ranks[0]
    assert [(b.kind, b.start, b.end) for b in lane.data] == [("data", 0.0, 0.030)]
    assert [b.kind for b in lane.compute] == ["backward"] and lane.exposed == ((0.020, 0.030),)
    view = TimelineView()
    view.data = timeline_of(4, {0: r0}, calls_of({0: r0}))
    cells = "".join(char for char, _style in view._paint_compute(lane, 10))  # 5 ms a column
    assert cells == "░" * 6 + "█" * 4


def test_a_phase_is_drawn_only_where_its_thread_was_not_blocked_in_a_collective() -> None:
    # hook: backward 0-100 ms sits in a blocking all-reduce 40-60 (a gradient hook's). Compute%
    # counts 80 ms of compute, so the lane draws backward 0-40 and 60-100 and the all-reduce is
    # exposed. Before, backward was drawn solid over the all-reduce it was blocked in (an FSDP2
    # CPU rank read 16.5 % Compute beside a compute lane full from end to end).
    from ddpwatch.dashboard.widgets.timeline_view import TimelineView
    from instrumented_ddp.wire.step_figures import step_figures

    r0 = report(0, [Span("backward", 0.0, 0.100), Span("all_reduce", 0.040, 0.060, True, 400, "p0", "float32"),
                    Span("all_reduce", 0.070, 0.090, False, 400, "p1", "float32")])  # not blocking: hidden
    data = timeline_of(4, {0: r0}, calls_of({0: r0}))
    lane = data.ranks[0]
    assert [(b.kind, b.start, b.end) for b in lane.compute] == [("backward", 0.0, 0.040), ("backward", 0.060, 0.100)]
    assert lane.exposed == ((0.040, 0.060),)
    assert round(step_figures(r0).compute_pct, 9) == 80.0
    view = TimelineView()
    view.data = data
    assert "".join(char for char, _style in view._paint_compute(lane, 10)) == "████  ████"  # 10 ms a column


def test_a_large_job_draws_the_slowest_fastest_and_selected_ranks_judged_against_all() -> None:
    from instrumented_ddp.wire.step_figures import step_figures

    # 20 ranks, rank r's step lasting 100 + r ms except rank 7 (150 ms, the slowest); rank 12
    # enters the all-reduce at 70 ms, the last, so its 10 ms are the transfer everyone shares.
    def rank_report(rank: int) -> StepReport:
        enter = 0.070 if rank == 12 else 0.050
        end = 0.150 if rank == 7 else 0.100 + rank / 1000
        return report(rank, [Span("backward", 0.0, enter), Span("all_reduce", enter, 0.080, True, 400, "p0", "float32")], end)

    reports = {rank: rank_report(rank) for rank in range(20)}
    figures = {rank: step_figures(r) for rank, r in reports.items()}
    roles = pick_timeline_ranks(figures, selected=3)
    assert roles == ((0, "fastest"), (3, "selected"), (7, "slowest"))
    data = timeline_of(4, reports, calls_of(reports), None, roles)
    assert [lane.rank for lane in data.ranks] == [0, 3, 7] and data.reported == 20 and data.roles == roles
    start, end = data.ranks[0].exposed_waiting[0]  # waited 50-70 ms for rank 12, which is not drawn
    assert (round(start, 9), round(end, 9)) == (0.050, 0.070)
    assert pick_timeline_ranks({}, None) == ()


def test_a_step_the_loop_paused_before_is_drawn_without_the_pause_and_titled_with_the_longest() -> None:
    """Ranks pause together (an evaluation): the window drawn is the step's, 0-100 ms, and the
    title says the longest pause of the drawn ranks and what it was for."""
    reports = {rank: replace(report(rank, [Span("forward", 0.0, 0.050)]), paused_s=1.25 + 0.5 * rank, paused_for="evaluate")
               for rank in (0, 1)}
    data = timeline_of(4, reports, calls_of(reports))
    assert data.notes == "after 1.75 s paused: evaluate" and data.span_s == 0.100
    assert paused_text([report(0, [])]) == ""
    assert paused_text([replace(report(0, []), paused_for="checkpoint")]) == "paused inside: checkpoint"


def test_a_step_whose_data_held_forwards_without_gradients_is_titled_with_the_most_of_a_drawn_rank() -> None:
    reports = {rank: replace(report(rank, [Span("forward", 0.0, 0.050)]), nograd_forwards=7 + rank) for rank in (0, 1)}
    assert timeline_of(4, reports, calls_of(reports)).notes == "data held 8 forwards without gradients"
    paused = {rank: replace(r, paused_s=1.0, paused_for="evaluate") for rank, r in reports.items()}
    assert timeline_of(4, paused, calls_of(paused)).notes == ("after 1.00 s paused: evaluate · "
                                                              "data held 8 forwards without gradients")
    assert nograd_text([replace(report(0, []), nograd_forwards=1)]) == "data held 1 forward without gradients"
    assert nograd_text([report(0, [])]) == ""


def test_a_step_whose_data_held_the_loops_own_collectives_is_titled_with_the_most_of_a_drawn_rank() -> None:
    """A loss all-reduced for logging, a Trainer's label-count gather: the data bars hold their
    time, and the title says so beside an unmarked evaluation's forwards."""
    reports = {rank: replace(report(rank, [Span("forward", 0.0, 0.050)]), untimed_collectives=3, untimed_in_data=1 + rank)
               for rank in (0, 1)}
    assert timeline_of(4, reports, calls_of(reports)).notes == "data held 2 untimed collectives"
    evaluating = {rank: replace(r, nograd_forwards=8) for rank, r in reports.items()}
    assert timeline_of(4, evaluating, calls_of(evaluating)).notes == ("data held 8 forwards without gradients · "
                                                                      "data held 2 untimed collectives")
    assert data_collectives_text([replace(report(0, []), untimed_collectives=1, untimed_in_data=1)]) == (
        "data held 1 untimed collective")
    assert data_collectives_text([replace(report(0, []), untimed_collectives=1)]) == ""  # issued in a phase: compute


def test_a_step_holding_the_loops_own_timed_collectives_is_titled_with_their_count_kinds_and_longest_rank() -> None:
    """The Trainer's gathers before a forward, timed as the loop's (``l<k>``): rank 0 waited 40 ms
    in its gather for rank 1 (1 ms), and also all-reduced a loss (2 ms); DDP's bucket (``b0``) is
    not the loop's. Worked by hand: the most of one rank 2, kinds all_gather and all_reduce,
    rank 0's 40 + 2 = 42 ms the longest."""
    spans = {0: [Span("all_gather", 0.000, 0.040, True, 16, "l0"), Span("all_reduce", 0.040, 0.042, True, 4, "l1")],
             1: [Span("all_gather", 0.039, 0.040, True, 16, "l0")]}
    reports = {rank: report(rank, [*spans[rank], Span("forward", 0.042, 0.060), Span("all_reduce", 0.060, 0.070, False, 400, "b0")])
               for rank in (0, 1)}
    assert loop_collectives_text(reports) == "the loop's own collectives: 2 (all_gather, all_reduce), 42.0 ms on rank 0"
    assert timeline_of(4, reports, calls_of(reports)).notes == loop_collectives_text(reports)
    assert loop_collectives_text({0: report(0, [Span("all_reduce", 0.0, 0.01, False, 400, "b0")])}) == ""


def test_the_title_names_the_rank_a_barrier_held_longest() -> None:
    """After the update every rank meets at ``dist.barrier()``: rank 0 sat in it 60-90 ms and
    again 92-94 (two barriers, 32 ms), rank 1 88-90 and 92-94 (4 ms). The ``wait`` bars in the
    communication lane are named: rank 0, in 2, 30 + 2 = 32.0 ms. A wait for the loop's own
    collective (untagged) is not a barrier."""
    def barriers(*stays: tuple[float, float]) -> list[Span]:
        return [Span("wait", a, b, True, 0, "barrier") for a, b in stays]

    reports = {0: report(0, [Span("forward", 0.0, 0.040), *barriers((0.060, 0.090), (0.092, 0.094))]),
               1: report(1, [Span("forward", 0.0, 0.040), Span("wait", 0.050, 0.058, True), *barriers((0.088, 0.090), (0.092, 0.094))])}
    assert barrier_text(reports) == "2 barriers held rank 0 32.0 ms"
    assert timeline_of(4, reports, calls_of(reports)).notes == "2 barriers held rank 0 32.0 ms"
    assert barrier_text({1: reports[1]}) == "2 barriers held rank 1 4.0 ms"
    assert barrier_text({0: report(0, barriers((0.060, 0.090)))}) == "a barrier held rank 0 30.0 ms"
    assert barrier_text({1: report(1, [Span("wait", 0.050, 0.058, True)])}) == ""


def test_the_title_names_the_loops_marked_compute_and_the_rank_longest_in_it() -> None:
    """Rank 0 averaged its weights for 10 ms; rank 1 for 6 ms, then ran its teacher for 3 + 5 ms
    (overlapping by 1: 7 merged), 13 in all: the longest. Each name once, in rank order."""
    r0 = report(0, [Span("loop", 0.0, 0.010, tag="ema"), Span("forward", 0.010, 0.030)])
    r1 = report(1, [Span("loop", 0.0, 0.006, tag="ema"), Span("loop", 0.006, 0.009, tag="teacher forward"),
                    Span("loop", 0.008, 0.013, tag="teacher forward"), Span("forward", 0.013, 0.030)])
    assert loop_compute_text({0: r0, 1: r1}) == "the loop's own compute (ema, teacher forward): 13.0 ms on rank 1"
    assert loop_compute_text({0: report(0, [Span("forward", 0.0, 0.03)])}) == ""
    assert "the loop's own compute (ema): 10.0 ms on rank 0" in timeline_of(4, {0: r0}, calls_of({0: r0})).notes
