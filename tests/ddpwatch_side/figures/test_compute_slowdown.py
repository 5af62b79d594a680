"""How the all-reduces beside backward slow it, worked by hand: the time they ran beside it, a
step's point, the time a gradient would have had alone, the slowed clock, and the robust line
over the caps run."""

from __future__ import annotations

from msgspec.structs import replace

import pytest

from ddpwatch.advisor.bucket_sim import SlowedBackward
from ddpwatch.figures.compute_slowdown import (
    MAX_LOST_SHARE,
    BackwardBeside,
    CommunicationClock,
    SlowdownMemory,
    backward_beside,
    communicating_s,
    fit_slowdown,
    quiet_time,
)
from instrumented_ddp.wire.messages import Span
from bucket_steps import MIB, two_bucket_step


def test_the_communication_beside_a_window_is_the_union_of_the_all_reduces_inside_it() -> None:
    """b0's 16 ms span, 8 ms of it inside 128-200 ms, and b1's 16 inside: 24 ms; inside backward
    (100-146 ms) b0's alone, 16 ms; before both, none. A third call over 130-150 ms runs while
    b0 and b1 do: over 100-200 ms the union is 120-162, 42 ms, not 16 + 16 + 20."""
    report = two_bucket_step()
    assert communicating_s(report.spans, 0.128, 0.200) == pytest.approx(0.024)
    assert communicating_s(report.spans, 0.100, 0.146) == pytest.approx(0.016)
    assert communicating_s(report.spans, 0.0, 0.100) == 0
    third = replace(report, spans=[*report.spans, Span("all_reduce", 0.130, 0.150, False, MIB, "b9", "float32")])
    assert communicating_s(third.spans, 0.100, 0.200) == pytest.approx(0.042)


def test_a_steps_point_is_its_forward_its_backward_to_the_last_mark_and_the_communication_beside_that() -> None:
    assert backward_beside(two_bucket_step()) == BackwardBeside(pytest.approx(0.090), pytest.approx(0.046),  # type: ignore[arg-type]
                                                                pytest.approx(0.016))  # type: ignore[arg-type]
    step = two_bucket_step()
    assert backward_beside(replace(step, spans=[s for s in step.spans if s.kind != "ready"])) is None
    assert backward_beside(replace(step, spans=[s for s in step.spans if s.kind != "forward"])) is None


def test_a_gradients_quiet_time_takes_out_the_compute_lost_while_the_all_reduces_before_it_ran() -> None:
    """With 0.375 of compute lost while an all-reduce runs: b1's mark at 46 ms had b0's 16 ms
    all-reduce before it, 6 ms lost: alone it would have come at 40. A mark at 28 ms, halfway
    through b0's, had 8 ms of it, 3 lost: 25. The simulator's clock says the same the other way
    round: b0's transfer (20-36 ms) runs compute at 0.625, so 25 ms are done at wall 28 and 40
    at wall 46."""
    clock, origin = CommunicationClock(two_bucket_step().spans), 0.100
    assert quiet_time(0.046, clock, origin, 0.375) == pytest.approx(0.040)
    assert quiet_time(0.028, clock, origin, 0.375) == pytest.approx(0.025)
    assert quiet_time(0.020, clock, origin, 0.375) == pytest.approx(0.020)
    assert quiet_time(0.046, clock, origin, 0.0) == 0.046
    assert clock.busy_until(0.0) == 0 and clock.busy_until(0.2) == pytest.approx(0.032)  # both all-reduces
    backward = SlowedBackward(0.375)
    backward.reach(0.020)
    backward.transfer(0.020, 0.036)
    assert backward.reach(0.025) == pytest.approx(0.028) and backward.reach(0.040) == pytest.approx(0.046)


def test_compute_goes_at_the_slowed_rate_while_any_transfer_runs_and_at_full_speed_between() -> None:
    """Half the compute lost; transfers over 0-10 and 5-15 ms (together 5-10), then a gap, then
    one over 20-30. By 15 ms, 7.5 ms of compute are done; at full speed 20 ms by 27.5 - no: by
    20 ms, 12.5 are done; 20-30 at half speed makes 17.5 by 30; the last 2.5 by 32.5."""
    clock = SlowedBackward(0.5)
    for start, end in ((0.0, 0.010), (0.005, 0.015), (0.020, 0.030)):
        clock.transfer(start, end)
    assert clock.reach(0.0075) == pytest.approx(0.015)
    assert clock.reach(0.0125) == pytest.approx(0.020)
    assert clock.reach(0.020) == pytest.approx(0.0325)
    assert SlowedBackward(0.0).reach(0.020) == 0.020


def segment(ratio: float, beside: float, forward_s: float = 0.090, steps: int = 3) -> list[BackwardBeside]:
    """``steps`` points of backward ``ratio`` forwards long, ``beside`` forwards of it communicating."""
    return [BackwardBeside(forward_s, ratio * forward_s, beside * forward_s)] * steps


def test_the_lost_share_is_the_median_of_the_slopes_between_caps_far_enough_apart() -> None:
    """Backward 0.8 forward with nothing beside it, 1.1 with 0.6 forward of communication, 1.2
    with 0.8: half the compute lost while an all-reduce runs, between 0 and either (0.6 and 0.8
    are 0.2 apart, under half of 0.8: too close to count). A fourth segment the box ran slow
    through (ratio 0.4 at 0.7) gives one slope of -0.571 against 0: the median keeps 0.5, where
    least squares would give 0.11. The intercept is the median one, 0.8."""
    caps = [segment(0.8, 0), segment(1.1, 0.6), segment(1.2, 0.8)]
    fit = fit_slowdown(caps)
    assert fit is not None and fit.lost_share == pytest.approx(0.5) and fit.quiet_ratio == pytest.approx(0.8) and fit.segments == 3
    robust = fit_slowdown([*caps, segment(0.4, 0.7)])
    assert robust is not None and robust.lost_share == pytest.approx(0.5)


def test_no_slope_from_one_cap_or_caps_communicating_alike_none_below_zero_and_never_all_compute() -> None:
    """One segment, or 0.05 and 0.1 MB communicating through 1.5 and 1.6 forwards of backward:
    no line to read. A ratio falling as communication grows is noise: none lost. A slope of 2
    would stop compute: it is held at 0.95."""
    assert fit_slowdown([segment(0.8, 0)]) is None
    assert fit_slowdown([segment(1.5, 1.5), segment(1.6, 1.6)]) is None
    assert fit_slowdown([]) is None
    falling = fit_slowdown([segment(1.0, 0), segment(0.9, 0.6)])
    assert falling is not None and falling.lost_share == 0
    steep = fit_slowdown([segment(1.0, 0), segment(2.2, 0.6)])
    assert steep is not None and steep.lost_share == MAX_LOST_SHARE


def test_the_memory_keeps_the_newest_points_of_the_newest_segments() -> None:
    memory = SlowdownMemory(per_segment=2, segments=2)
    for index, forward in enumerate((0.1, 0.2, 0.3)):
        memory.add(0, BackwardBeside(forward, 0.1, 0))
    memory.add(1, BackwardBeside(0.5, 0.1, 0))
    assert [p.forward_s for p in memory.points(0)] == [0.2, 0.3]
    memory.add(2, BackwardBeside(0.7, 0.1, 0))
    assert memory.points(0) == [] and len(memory.by_segment()) == 2
