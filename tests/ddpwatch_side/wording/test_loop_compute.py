"""The line for a segment's compute the loop marked itself (``ddpwatch/wording/loop_compute.py``), hand-worked."""

from __future__ import annotations

from ddpwatch.wording.loop_compute import loop_compute_text


def test_a_segment_whose_loop_marked_compute_is_said_with_its_ms_beside_the_step() -> None:
    # 9.04 ms a step of a 109.86 ms p50: said as 9.0 and 110
    assert loop_compute_text("segment 0", 9.04, ["ema", "teacher forward"], 109.86) == (
        "segment 0: the loop's own compute, marked with watch.computing (ema, teacher forward): 9.0 ms a step "
        "(mean of ranks) of a 110 ms step (p50), in Compute%, not data loading")
    assert loop_compute_text("segment 0", 9.04, [], 109.86).startswith(
        "segment 0: the loop's own compute, marked with watch.computing: 9.0 ms")


def test_a_segment_that_marked_nothing_has_no_line() -> None:
    assert loop_compute_text("segment 0", 0.0, [], 100.0) is None
